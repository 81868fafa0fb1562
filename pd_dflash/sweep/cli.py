"""``pd-dflash run``: argument checks, then the driver (local mode or an existing cluster)."""

from __future__ import annotations

import argparse
import math
import sys

from pd_dflash.cli import LIMITS
from pd_dflash.engine.registry import load_spec_here
from pd_dflash.errors import InputError
from pd_dflash.sweep.resume import Mode


def options_from_args(args: argparse.Namespace):
    from pd_dflash.sweep.options import RunOptions

    # The numbers were bounded at parse (``pd_dflash.cli.LIMITS``); a Namespace built by hand is checked again.
    for flag, value in (
        ("--max-attempts", args.max_attempts),
        ("--cell-timeout", args.cell_timeout),
        ("--connect-timeout", args.connect_timeout),
    ):
        low, high = LIMITS[flag]
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise InputError(f"must be between {low:g} and {high:g}, got {value}", where=flag)
    timeout, connect = args.cell_timeout, args.connect_timeout
    mode = Mode.RESTART if args.restart else Mode.RETRY_ERRORS if args.retry_errors else Mode.RESUME
    options = RunOptions(out_dir=args.out, mode=mode, max_attempts=args.max_attempts)
    options.connect_timeout_s = connect
    if timeout is not None:
        options.cell_timeout_s = timeout
    if args.no_progress:
        options.progress = False
    options.insecure = args.insecure
    return options


def run_main(args: argparse.Namespace) -> int:
    spec = load_spec_here(args.spec)  # a bad spec is reported before Ray is even imported
    from pd_dflash.sweep.cluster import run_sweep

    options = options_from_args(args)
    outcome = run_sweep(spec, options, address=args.address)
    if outcome.outcome == "storage_failed":
        print(
            f"pd-dflash run: error: {outcome.stopped}; the sweep stopped (rerun to resume)", file=sys.stderr
        )
    elif outcome.outcome == "stopped":
        print(f"pd-dflash run: stopped by {outcome.stopped}", file=sys.stderr)
    return outcome.exit_code
