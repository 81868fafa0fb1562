"""Orchestrator benchmark: dispatch overhead, makespan against the ideal bound, model loads, and the upstream way;
with ``--scale``, dispatch and the driver's own cost at 1,000+ cells on 8 boxes x 4 fake GPUs.

Default: a simulated cluster (``ray.cluster_utils.Cluster``: a head and 3 boxes x 2 fake GPUs) runs a
Phase-A-shaped sweep (2 models x 5 baselines x B in {8, 16} x 6 concurrency levels x 3 repeats = 324 cells; 288 before B3
was measured per block size) with
the fixed-duration engine of tests/sweep/engines.py (cells and model loads sleep; durations differ per baseline,
concurrency, block size and model). Printed:

- dispatch overhead per cell: the idle gap a runner sees between the end of one cell and the start of the next
  (runner-side clock; model loads excluded), median and p99. Target: <= 20 ms.
- makespan of the scheduling loop against the ideal lower bound max(sum of cell times / GPUs, longest cell),
  and against that bound plus one runner start + model load (unavoidable: every GPU loads once). Target: 5%.
- model loads against the minimum (one per GPU used) and McNaughton's bound (runners + load keys - 1).
- the same sweep run the upstream way: one GPU, sequential, a model load per cell (in process, so without the
  per-cell process start the upstream bash loop also pays: a lower bound on upstream's time).

``--scale``: one ``Cluster`` of 8 boxes x 4 fake GPUs (32 runners; a real multi-node cluster, because the driver
treats each Ray node as a box: survey, pinning and circuit breaker are per node), and for each size (default
1,000 and 4,000 cells, the Phase-A shape with more repeats) a fresh driver process that runs the sweep with a fast
fixed-duration engine. Printed per size: dispatch gap p50/p99 (target p99 <= 5 ms), the driver process's CPU
seconds per cell and peak RSS, and the ratios between the sizes (target: flat).

    .venv/bin/python benchmarks/orchestrator.py            # ~8 minutes, most of it the upstream way
    .venv/bin/python benchmarks/orchestrator.py --quick    # 1 repeat, no upstream run
    .venv/bin/python benchmarks/orchestrator.py --scale    # 1,000 and 4,000 cells on 8 x 4 fake GPUs

Run from the repository root (runners import the test engine from the working directory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
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
from pd_dflash.sweep.options import RunOptions  # noqa: E402
from tests.sweep.engines import FixedDurationEngine, FixedDurationOptions  # noqa: E402

MiB = 2**20
BASELINE_FACTOR = {"B0": 1.5, "B1": 1.0, "B2": 0.9, "B3": 0.6, "OURS": 0.8}
#: Cells per repeat of the Phase-A shape (B0 and B3 do not depend on the block size): 2 x (6 + 6 + 3 x 2 x 6).
CELLS_PER_REPEAT = 96


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
        "workload": {"requests": 32},  # at least the highest concurrency (registry.check)
        "hardware": {"accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 0},
    }


def start_cluster(boxes: int, gpus_per_box: int) -> Cluster:
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
    return cluster


def run_distributed(spec, boxes: int, gpus_per_box: int, out: Path):
    cluster = start_cluster(boxes, gpus_per_box)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        return run_sweep(spec, RunOptions(out_dir=str(out), progress=False, plots=False, insecure=True))
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


def gap_line(gaps_s: list[float], target: str) -> str:
    gaps_ms = sorted(g * 1000 for g in gaps_s)
    return (
        f"median {percentile(gaps_ms, 50):.1f} ms, p99 {percentile(gaps_ms, 99):.1f} ms, "
        f"max {gaps_ms[-1]:.1f} ms (target {target})"
    )


def report_default(args, spec, outcome) -> None:
    cells = expand(spec)
    durations = [
        FixedDurationOptions.model_validate(spec.model(c.model).engine_options).duration(c) for c in cells
    ]
    stats = outcome.stats
    gpus = args.boxes * args.gpus_per_box
    keys = len({c.model for c in cells})
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
        f"dispatch overhead per cell (runner idle gap between consecutive cells, n={len(stats['gaps_s'])}): "
        + gap_line(stats["gaps_s"], "<= 20 ms")
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


def main_default(args) -> int:
    repeats = 1 if args.quick else args.repeats
    spec = parse_spec(benchmark_spec(repeats, args.seconds, args.load_seconds))
    with tempfile.TemporaryDirectory(prefix="pd-orch-") as tmp:
        outcome = run_distributed(spec, args.boxes, args.gpus_per_box, Path(tmp) / "out")
    assert outcome.counts["stored"] == len(expand(spec)), outcome.counts
    report_default(args, spec, outcome)
    if not (args.quick or args.no_upstream):
        upstream = run_upstream_way(spec)
        makespan = outcome.stats["loop_finished"] - outcome.stats["loop_started"]
        print(
            f"upstream way (one GPU, sequential, a model load per cell, in process): {upstream:.1f} s "
            f"-> pd-dflash makespan is {upstream / makespan:.1f}x shorter "
            f"({len(expand(spec))} loads vs {outcome.loads})"
        )
    return 0


# -- --scale ------------------------------------------------------------------------------------------------
def drive(address: str, cells: int, seconds: float, result: Path) -> int:
    """One driver process (``--drive``): join the cluster, run ``cells`` cells, write its own cost as JSON."""
    repeats = math.ceil(cells / CELLS_PER_REPEAT)
    spec = parse_spec(benchmark_spec(repeats, seconds, 0.0))
    ray.init(address=address, log_to_driver=False)
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu0 = time.process_time()
    with tempfile.TemporaryDirectory(prefix="pd-scale-") as tmp:
        options = RunOptions(out_dir=str(Path(tmp) / "out"), progress=False, plots=False, insecure=True)
        outcome = run_sweep(spec, options)
    cpu = time.process_time() - cpu0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    ray.shutdown()
    figures = {
        "cells": len(expand(spec)),
        "stored": outcome.counts.get("stored"),
        "runners": outcome.stats["runners"],
        "loads": outcome.loads,
        "wall_s": outcome.wall_s,
        "loop_s": outcome.stats["loop_finished"] - outcome.stats["loop_started"],
        "gaps_s": outcome.stats["gaps_s"],
        "gap_queued": outcome.stats["gap_queued"],
        "react_s": outcome.stats["react_s"],
        "cpu_s": cpu,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "rss_before_mib": rss_before_kib / 1024,
    }
    result.write_text(json.dumps(figures))
    return 0 if outcome.exit_code == 0 else 1


def main_scale(args) -> int:
    cluster = start_cluster(args.boxes, args.gpus_per_box)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="pd-scale-") as tmp:
            for cells in args.sizes:
                out = Path(tmp) / f"{cells}.json"
                cmd = [sys.executable, __file__, "--drive", cluster.address, "--cells", str(cells)]
                cmd += ["--seconds", str(args.seconds), "--result", str(out)]
                subprocess.run(cmd, check=True)
                results.append(json.loads(out.read_text()))
    finally:
        cluster.shutdown()
    print(
        f"orchestrator at scale: {args.boxes} boxes x {args.gpus_per_box} fake GPUs (ray.cluster_utils.Cluster), "
        f"fixed-duration engine, cells {args.seconds} s x factors, a fresh driver process per size"
    )
    for r in results:
        assert r["stored"] == r["cells"], r
        sent_after = [g for g, q in zip(r["gaps_s"], r["gap_queued"], strict=True) if not q]
        print(
            f"{r['cells']} cells, {r['runners']} runners, {r['loads']} loads, loop {r['loop_s']:.1f} s "
            f"({r['cells'] / r['loop_s']:.0f} cells/s)\n"
            f"  dispatch gap, runner idle between consecutive cells (n={len(r['gaps_s'])}): "
            + gap_line(r["gaps_s"], "p99 <= 5 ms")
            + (f"; of which sent after the previous finished (n={len(sent_after)}): " if sent_after else "")
            + (gap_line(sent_after, "-") if sent_after else "")
            + f"\n  driver reaction, results noticed -> next cells submitted (n={len(r['react_s'])}): "
            + gap_line(r["react_s"], "p99 <= 5 ms")
            + f"\n  driver CPU {r['cpu_s']:.1f} s = {1000 * r['cpu_s'] / r['cells']:.2f} ms/cell; "
            f"driver peak RSS {r['peak_rss_mib']:.0f} MiB ({r['rss_before_mib']:.0f} MiB before the sweep)"
        )
    small, large = results[0], results[-1]
    per_cell = [r["cpu_s"] / r["cells"] for r in (small, large)]
    marginal = (large["cpu_s"] - small["cpu_s"]) / (large["cells"] - small["cells"])
    growth = [r["peak_rss_mib"] - r["rss_before_mib"] for r in (small, large)]
    print(
        f"{large['cells'] / small['cells']:.1f}x the cells: driver CPU per cell x{per_cell[1] / per_cell[0]:.2f} "
        f"(marginal {1000 * marginal:.2f} ms/cell), peak RSS x{large['peak_rss_mib'] / small['peak_rss_mib']:.2f} "
        f"(growth during the sweep {growth[0]:.0f} -> {growth[1]:.0f} MiB) (target: flat)"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--boxes", type=int, default=None, help="default 3 (8 with --scale)")
    p.add_argument("--gpus-per-box", type=int, default=None, help="default 2 (4 with --scale)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--seconds", type=float, default=None, help="base cell duration (default 1.0; 0.5 with --scale)"
    )
    p.add_argument("--load-seconds", type=float, default=0.5, help="engine construction time per model load")
    p.add_argument("--quick", action="store_true", help="1 repeat and no upstream run")
    p.add_argument(
        "--no-upstream", action="store_true", help="skip the upstream-way run (~6 minutes of sleeps)"
    )
    p.add_argument(
        "--scale", action="store_true", help="1,000+ cells on 8 boxes x 4 GPUs: dispatch and driver cost"
    )
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 4000])
    p.add_argument("--drive", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("--cells", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    scale = args.scale or args.drive
    args.boxes = args.boxes or (8 if scale else 3)
    args.gpus_per_box = args.gpus_per_box or (4 if scale else 2)
    args.seconds = args.seconds if args.seconds is not None else (0.5 if scale else 1.0)
    if args.drive:
        return drive(args.drive, args.cells, args.seconds, args.result)
    return main_scale(args) if args.scale else main_default(args)


if __name__ == "__main__":
    sys.exit(main())
