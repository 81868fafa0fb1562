"""`ray job submit` entrypoint of a sweep: runs the driver on the job's cluster (``ray.init()`` picks up the
job's RAY_ADDRESS) and writes the results to an absolute directory on the head box.

    ray job submit --working-dir . --submission-id phase-a-1 -- \\
        python jobs/phase_a.py --spec jobs/phase_a.yaml --out /abs/results/phase-a

Same flags as `pd-dflash run`; see docs/running-on-a-cluster.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The uploaded working directory (this file's parent's parent) is what the runners import too: prefer it over
# an installed copy of the package so driver and runners run the same code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_dflash.cli import main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jobs/phase_a.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="sweep spec (YAML), e.g. jobs/phase_a.yaml")
    p.add_argument("--out", required=True, help="ABSOLUTE results directory on the head box")
    p.add_argument("--address", help="Ray address (default: the job's cluster)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true")
    mode.add_argument("--restart", action="store_true")
    mode.add_argument("--retry-errors", action="store_true")
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--cell-timeout", type=float, default=None)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run_argv(args: argparse.Namespace) -> list[str]:
    argv = ["run", args.spec, "--out", args.out, "--max-attempts", str(args.max_attempts)]
    if args.address:
        argv += ["--address", args.address]
    for flag in ("resume", "restart", "retry_errors", "no_progress"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    if args.cell_timeout is not None:
        argv += ["--cell-timeout", str(args.cell_timeout)]
    return argv


if __name__ == "__main__":
    args = parse()
    if not os.path.isabs(args.out):
        print(
            f"jobs/phase_a.py: error: --out: must be an absolute path on the head box, got {args.out!r} "
            "(a job's working directory is a temporary copy that Ray deletes)",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(main(run_argv(args)))
