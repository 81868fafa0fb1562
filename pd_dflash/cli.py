"""The ``pd-dflash`` command line. Thin: parse arguments, call the owning module, map errors to exit codes.

Each subcommand imports its implementation lazily, so ``plan``, ``report`` and ``validate`` never import torch
or Ray, and ``run`` imports Ray only once it is asked to run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pd_dflash import __version__
from pd_dflash.errors import InputError


def _plan(args: argparse.Namespace) -> int:
    from pd_dflash.engine import registry
    from pd_dflash.plan import plan_summary, render_plan, write_plan_json

    spec = registry.load_spec_here(args.spec)
    blocked = registry.plan_blocked_reason(spec.engine)
    notes = registry.plan_notes(spec)
    if args.json:
        write_plan_json(spec, sys.stdout, blocked, notes)
    else:
        print(render_plan(spec, plan_summary(spec, blocked), notes))
    return 0


def _report(args: argparse.Namespace) -> int:
    from pd_dflash.engine.registry import load_checked_spec
    from pd_dflash.report import effective_gates, open_inputs, write_outputs
    from pd_dflash.report.design import design_beside

    spec = load_checked_spec(args.spec) if args.spec else None
    design = None if spec is not None else design_beside(args.inputs)
    if design is not None and design.spec is not None:  # an adaptive sweep's rows: judged by its looks
        spec = design.spec
        print(f"adaptive repeats design read from {design.why}", file=sys.stderr)
    gates = effective_gates(spec, args.allow_blocked or (), args.allow_unmeasured or ())
    with open_inputs(args.inputs) as (rows, sources):
        try:
            verdict = write_outputs(
                rows, args.out, gates, plots=bool(args.plots), spec=spec, sources=sources, design=design
            )
        except OSError as exc:
            raise InputError(
                f"cannot write outputs: {exc.strerror or exc}", where=exc.filename or args.out
            ) from None
    print(json.dumps(verdict["groups"], indent=2, sort_keys=True, allow_nan=False))
    print(verdict["overall"]["line"])
    if verdict["confidence"].get("design_warning"):
        print(verdict["confidence"]["design_warning"], file=sys.stderr)
    print(f"wrote {Path(args.out) / 'result_matrix.{json,csv,md}'} ({len(rows)} rows)", file=sys.stderr)
    return verdict["exit_code"]


def _validate(args: argparse.Namespace) -> int:
    from pd_dflash.report.validate import validate_matrix_file

    results = validate_matrix_file(Path(args.matrix))
    print(json.dumps(results, indent=2, sort_keys=True, allow_nan=False))
    good = sum(r["valid"] for r in results.values())
    print(f"validate: {good}/{len(results)} groups valid")
    return 0 if results and good == len(results) else 1


#: Every number the command line takes, with its bounds (inclusive): a value outside is refused at parse (exit 2)
#: with the bound named, so no 1e308 reaches a timer or a socket. Seconds are capped at a week, attempts at 100.
LIMITS: dict[str, tuple[float, float]] = {
    "--connect-timeout": (0.1, 3600.0),
    "--cell-timeout": (1.0, 7 * 86400.0),
    "--max-attempts": (1, 100),
    "--h2d-gbps": (1e-3, 1e4),
}


def _number(flag: str, kind: type = float) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` within ``LIMITS[flag]``, else an error naming the bounds."""
    low, high = LIMITS[flag]

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _path(value: str) -> str:
    """A path argument that this locale can write as it was typed: under a non-UTF-8 locale (LC_ALL=C with
    PYTHONUTF8=0) a non-ASCII name arrives as undecodable bytes, which Ray and the JSON records cannot carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"{os.fsencode(value)!r} is not valid in this locale's filesystem encoding "
            f"({sys.getfilesystemencoding()}); run under a UTF-8 locale (LC_ALL=C.UTF-8 or PYTHONUTF8=1) or choose "
            "an ASCII path"
        ) from None
    return value


def _directory(value: str) -> str:
    """``--out``: a path, never the empty string (which would silently mean the working directory)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must name a directory, got an empty string")
    return _path(value)


def _lazy(target: str) -> Callable[[argparse.Namespace], int]:
    """A handler that imports ``module:function`` only when its subcommand runs."""

    def handler(args: argparse.Namespace) -> int:
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(args)

    return handler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-dflash",
        description="Sweep orchestrator for the PD-DFlash Phase-A matrix (offloaded MoE, DFlash, route-ahead).",
    )
    parser.add_argument("--version", action="version", version=f"pd-dflash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="expand a sweep spec into cells and print the plan (no torch, no Ray)")
    p.add_argument("spec", type=_path, help="sweep spec (YAML)")
    p.add_argument("--json", action="store_true", help='print {"cells": [...], "counts": {...}} as JSON')
    p.set_defaults(func=_plan)

    p = sub.add_parser("report", help="turn row files into result matrices, gates and a go/no-go verdict")
    p.add_argument(
        "inputs", nargs="+", type=_path, metavar="INPUT", help="rows.jsonl files or upstream raw row files"
    )
    p.add_argument("--out", required=True, type=_directory, help="directory for result_matrix.json/.csv/.md")
    p.add_argument(
        "--spec", type=_path, help="sweep spec whose gates to apply (default: built-in gate thresholds)"
    )
    p.add_argument(
        "--allow-blocked",
        nargs="*",
        default=None,
        metavar="BASELINE",
        help="baselines whose blocked rows do not make a group incomplete (e.g. B2)",
    )
    p.add_argument(
        "--allow-unmeasured",
        nargs="*",
        default=None,
        metavar="METRIC",
        help="metrics an engine cannot observe (PARTIAL rows) that do not make a group incomplete",
    )
    p.add_argument("--plots", action="store_true", help="also write PNG plots")
    p.set_defaults(func=_report)

    p = sub.add_parser("validate", help="check a result_matrix.json as upstream's validate_result_matrix")
    p.add_argument("matrix", type=_path, help="result_matrix.json")
    p.set_defaults(func=_validate)

    p = sub.add_parser(
        "run", help="run a sweep on a Ray cluster (local single-node cluster without --address)"
    )
    p.add_argument("spec", type=_path, help="sweep spec (YAML)")
    p.add_argument(
        "--out", required=True, type=_directory, help="results directory (absolute on a cluster's head box)"
    )
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local cluster)")
    p.add_argument(
        "--connect-timeout",
        type=_number("--connect-timeout"),
        default=30.0,
        help="seconds the cluster address may take to answer before the run is refused (default 30, at most "
        "3600)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="skip cells already stored in OUT (default)")
    mode.add_argument(
        "--restart",
        action="store_true",
        help="archive OUT's rows and start over (also accepts a changed spec)",
    )
    mode.add_argument("--retry-errors", action="store_true", help="rerun only ERROR/TIMEOUT cells")
    p.add_argument(
        "--max-attempts",
        type=_number("--max-attempts", int),
        default=3,
        help="attempts per cell after runner deaths (1 to 100)",
    )
    p.add_argument(
        "--cell-timeout",
        type=_number("--cell-timeout"),
        default=None,
        help="seconds before a cell is killed (1 s to a week)",
    )
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="run on a cluster without token authentication (a warning instead of a refusal)",
    )
    p.set_defaults(func=_lazy("pd_dflash.sweep.cli:run_main"))

    p = sub.add_parser("probe", help="device identity (NVML) and measured host-to-device bandwidth")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("pd_dflash.engine.probe:probe_main"))

    p = sub.add_parser("overlap", help="BM4 H2D/compute overlap from nsys stats CSV exports")
    p.add_argument(
        "--rep", type=_path, help="an .nsys-rep: export both CSV reports with `nsys stats` (nsys on PATH)"
    )
    p.add_argument(
        "--gpu-trace", type=_path, help="nsys stats --report cuda_gpu_trace CSV (instead of --rep)"
    )
    p.add_argument(
        "--nvtx-trace", type=_path, help="nsys stats --report nvtx_pushpop_trace CSV (instead of --rep)"
    )
    p.add_argument(
        "--compute-range",
        nargs="+",
        default=None,
        help="NVTX ranges that hide transfers (default: dflash_draft route_ahead_router target_verify)",
    )
    p.add_argument(
        "--h2d-gbps",
        type=_number("--h2d-gbps"),
        default=None,
        help="measured H2D bandwidth (GB/s, 0.001 to 10000) to convert overlapped bytes into seconds",
    )
    p.add_argument("--output", type=_path, help="write the BM4 JSON here as well as to stdout")
    p.set_defaults(func=_lazy("pd_dflash.overlap:overlap_main"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"pd-dflash {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"pd-dflash {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
