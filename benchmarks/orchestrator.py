"""Orchestrator benchmark: dispatch overhead, makespan against the ideal bound, model loads, and the upstream way.

A simulated cluster (``ray.cluster_utils.Cluster``: a head and 3 boxes x 2 fake GPUs) runs a Phase-A-shaped sweep
(2 models x 5 baselines x B in {8, 16} x 6 concurrency levels x 3 repeats = 288 cells) with the fixed-duration
engine of tests/sweep/engines.py (cells and model loads sleep; durations differ per baseline, concurrency, block
size and model). Printed:

- dispatch overhead per cell: the idle gap a runner sees between the end of one cell and the start of the next
  (runner-side clock; model loads excluded), median and p99. Target: <= 20 ms.
- makespan of the scheduling loop against the ideal lower bound max(sum of cell times / GPUs, longest cell),
  and against that bound plus one runner start + model load (unavoidable: every GPU loads once). Target: 5%.
- model loads against the minimum (one per GPU used) and McNaughton's bound (runners + load keys - 1).
- the same sweep run the upstream way: one GPU, sequential, a model load per cell (in process, so without the
  per-cell process start the upstream bash loop also pays: a lower bound on upstream's time).

    .venv/bin/python benchmarks/orchestrator.py            # ~8 minutes, most of it the upstream way
    .venv/bin/python benchmarks/orchestrator.py --quick    # 1 repeat, no upstream run

Run from the repository root (runners import the test engine from the working directory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from pd_dflash.engine.interface import EngineContext  # noqa: E402
from pd_dflash.schema import Row, percentile  # noqa: E402
from pd_dflash.spec import expand, parse_spec  # noqa: E402
from pd_dflash.sweep.cluster import run_sweep  # noqa: E402
from pd_dflash.sweep.driver import RunOptions  # noqa: E402
from tests.sweep.engines import FixedDurationEngine, FixedDurationOptions  # noqa: E402

MiB = 2**20
BASELINE_FACTOR = {"B0": 1.5, "B1": 1.0, "B2": 0.9, "B3": 0.6, "OURS": 0.8}


def benchmark_spec(repeats: int, seconds: float, load_seconds: float) -> dict:
    def options(scale: float) -> dict:
        return {
            "seconds": seconds * scale,
            "load_seconds": load_seconds,
            "baseline_factor": BASELINE_FACTOR,
            "concurrency_exponent": -0.25,
            "block_exponent": 0.3,
        }

    return {
        "name": "orchestrator-benchmark",
        "engine": "tests.sweep.engines:FixedDurationEngine",
        "models": [
            {"id": "model-a", "engine_options": options(1.0)},
            {"id": "model-b", "engine_options": options(1.3)},
        ],
        "baselines": ["B0", "B1", "B2", "B3", "OURS"],
        "block_sizes": [8, 16],
        "concurrency": [1, 2, 4, 8, 16, 32],
        "repeats": repeats,
        "workload": {"requests": 8},
        "hardware": {"accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 0},
    }


def run_distributed(spec, boxes: int, gpus_per_box: int, out: Path):
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 * MiB},
    )
    for _ in range(boxes):
        cluster.add_node(
            num_cpus=1,
            num_gpus=gpus_per_box,
            object_store_memory=100 * MiB,
            resources={"accelerator_type:RTX-PRO-6000": 1},
        )
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        return run_sweep(spec, RunOptions(out_dir=str(out), progress=False, plots=False))
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_upstream_way(spec) -> float:
    """One GPU, one cell after another, the model loaded again for every cell (upstream's bash loop)."""
    started = time.perf_counter()
    for cell in expand(spec):
        ctx = EngineContext.for_model(spec, cell.model, device="cpu")
        engine = FixedDurationEngine(ctx)
        Row.from_result(cell, engine.run_cell(cell), sweep=spec.name)
        engine.close()
    return time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--boxes", type=int, default=3)
    p.add_argument("--gpus-per-box", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="base cell duration before the factors")
    p.add_argument("--load-seconds", type=float, default=0.5, help="engine construction time per model load")
    p.add_argument("--quick", action="store_true", help="1 repeat and no upstream run")
    p.add_argument(
        "--no-upstream", action="store_true", help="skip the upstream-way run (~6 minutes of sleeps)"
    )
    args = p.parse_args()
    repeats = 1 if args.quick else args.repeats
    spec = parse_spec(benchmark_spec(repeats, args.seconds, args.load_seconds))
    cells = expand(spec)
    durations = [
        FixedDurationOptions.model_validate(spec.model(c.model).engine_options).duration(c) for c in cells
    ]
    gpus = args.boxes * args.gpus_per_box
    keys = len({c.model for c in cells})

    with tempfile.TemporaryDirectory(prefix="pd-orch-") as tmp:
        outcome = run_distributed(spec, args.boxes, args.gpus_per_box, Path(tmp) / "out")
    stats = outcome.stats
    assert outcome.counts["stored"] == len(cells), outcome.counts

    gaps_ms = sorted(g * 1000 for g in stats["gaps_s"])
    measured = stats["cell_seconds"]
    makespan = stats["loop_finished"] - stats["loop_started"]
    bound = max(sum(measured) / gpus, max(measured))
    load = statistics.median(stats["load_seconds"])
    used = min(gpus, len(cells))
    print(
        f"orchestrator benchmark: {len(cells)} cells over {keys} models, {args.boxes} boxes x {args.gpus_per_box} "
        f"fake GPUs, fixed-duration engine (cells {min(durations):.2f}-{max(durations):.2f} s, "
        f"sum {sum(durations):.1f} s; engine load {args.load_seconds} s)"
    )
    print(
        f"dispatch overhead per cell (runner idle gap between consecutive cells, n={len(gaps_ms)}): "
        f"median {percentile(gaps_ms, 50):.1f} ms, p99 {percentile(gaps_ms, 99):.1f} ms, "
        f"max {gaps_ms[-1]:.1f} ms (target <= 20 ms)"
    )
    for queued, what in (
        (True, "queued behind the previous cell"),
        (False, "sent after the previous finished"),
    ):
        part = sorted(
            g * 1000 for g, q in zip(stats["gaps_s"], stats["gap_queued"], strict=True) if q == queued
        )
        if part:
            print(
                f"  {what}: n={len(part)}, median {percentile(part, 50):.1f} ms, p99 {percentile(part, 99):.1f} ms"
            )
    print(
        f"makespan {makespan:.1f} s; ideal bound max(sum of cell times / {gpus} GPUs, longest cell) = {bound:.1f} s "
        f"-> {makespan / bound:.3f} x bound; with one runner start + model load per GPU "
        f"(median {load:.1f} s measured) the bound is {bound + load:.1f} s -> {makespan / (bound + load):.3f} x "
        f"(target <= 1.05)"
    )
    print(
        f"model loads: {outcome.loads} (minimum {used}: one per GPU; McNaughton bound runners + keys - 1 = "
        f"{used + keys - 1}); end to end incl. preflight and final matrix: {outcome.wall_s:.1f} s"
    )
    if not (args.quick or args.no_upstream):
        upstream = run_upstream_way(spec)
        print(
            f"upstream way (one GPU, sequential, a model load per cell, in process): {upstream:.1f} s "
            f"-> pd-dflash makespan is {upstream / makespan:.1f}x shorter "
            f"({len(cells)} loads vs {outcome.loads})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
