"""`ray job submit` entrypoint of a sweep: runs the driver on the job's cluster (``ray.init()`` picks up the
job's RAY_ADDRESS) and writes the results to an absolute directory on the head box.

    ray job submit --working-dir . --submission-id phase-a-1 -- \\
        python jobs/phase_a.py --spec jobs/phase_a.yaml --out /abs/results/phase-a

Other flags are `pd-dflash run`'s (--resume, --restart, --retry-errors, --max-attempts, --cell-timeout,
--no-progress, --address, --insecure for a cluster without token auth); see docs/running-on-a-cluster.md.
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


def main_job(argv: list[str]) -> int:
    """``--spec`` and an absolute ``--out``; every other flag is `pd-dflash run`'s, checked by its parser."""
    p = argparse.ArgumentParser(prog="jobs/phase_a.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="sweep spec (YAML), e.g. jobs/phase_a.yaml")
    p.add_argument("--out", required=True, help="ABSOLUTE results directory on the head box")
    args, run_flags = p.parse_known_args(argv)
    if not os.path.isabs(args.out):
        print(
            f"jobs/phase_a.py: error: --out: must be an absolute path on the head box, got {args.out!r} "
            "(a job's working directory is a temporary copy that Ray deletes)",
            file=sys.stderr,
        )
        return 2
    return main(["run", args.spec, "--out", args.out, *run_flags])


if __name__ == "__main__":
    sys.exit(main_job(sys.argv[1:]))
