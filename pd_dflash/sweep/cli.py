"""``pd-dflash run``: argument checks, then the driver (local mode or an existing cluster)."""

from __future__ import annotations

import argparse
import math

from pd_dflash.engine.registry import load_checked_spec
from pd_dflash.errors import InputError
from pd_dflash.sweep.store import Mode


def options_from_args(args: argparse.Namespace):
    from pd_dflash.sweep.driver import RunOptions

    if args.max_attempts < 1:
        raise InputError(f"must be at least 1, got {args.max_attempts}", where="--max-attempts")
    timeout = args.cell_timeout
    if timeout is not None and (not math.isfinite(timeout) or timeout <= 0):
        raise InputError(f"must be a positive number of seconds, got {timeout}", where="--cell-timeout")
    mode = Mode.RESTART if args.restart else Mode.RETRY_ERRORS if args.retry_errors else Mode.RESUME
    options = RunOptions(out_dir=args.out, mode=mode, max_attempts=args.max_attempts)
    if timeout is not None:
        options.cell_timeout_s = timeout
    if args.no_progress:
        options.progress = False
    return options


def run_main(args: argparse.Namespace) -> int:
    spec = load_checked_spec(args.spec)  # a bad spec is reported before Ray is even imported
    from pd_dflash.sweep.driver import run_sweep

    options = options_from_args(args)
    outcome = run_sweep(spec, options, address=args.address)
    return outcome.exit_code
