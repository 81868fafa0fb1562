"""`pd-dflash report` at scale: time and peak memory on a large rows.jsonl (issue 12: 200 MB in < 1 min, < 1 GB).

Generates a rows file of about ``--mb`` megabytes in a temporary directory (Phase-A cells, as many repeats as
it takes, each row shaped like a real sweep row: about 10 KB with its engine facts, environment, runner and
latency distributions; the numbers are synthetic), runs ``python -m pd_dflash report`` on it in a subprocess,
and prints rows/s and the report's peak RSS divided by the input size.

    python benchmarks/report_scale.py            # 200 MB
    python benchmarks/report_scale.py --mb 20    # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pd_dflash.rows import encode_row  # noqa: E402
from pd_dflash.schema import EngineResult, LatencyStats, Row  # noqa: E402
from pd_dflash.spec import iter_cells, load_spec, parse_spec  # noqa: E402


def _engine_facts(rng: random.Random) -> dict:
    """Engine facts of the size a reference-engine row carries (model card, prediction per layer, cache)."""
    per_layer = {
        str(i): {k: rng.randint(1, 3000) for k in ("predicted", "actual", "covered")}
        | {"recall": rng.random()}
        for i in range(48)
    }
    return {
        "name": "reference",
        "version": "0.1.0",
        "model_card": {"code_version": "eec03e9fb4b3", "train": {"steps": 200, "loss": rng.random()}},
        "prediction": {"recall": rng.random(), "per_layer": per_layer},
        "expert_cache": {k: rng.randint(0, 10**9) for k in ("capacity_bytes", "hits", "misses", "accesses")},
        "batch": {"requests_per_forward_histogram": {str(i): rng.randint(0, 512) for i in range(1, 33)}},
        "overlap": {"per_round_seconds": [rng.random() / 100 for _ in range(64)]},
    }


def synthetic_row(cell, rng: random.Random) -> Row:
    tokens = rng.uniform(10, 300)
    lat = LatencyStats.from_samples([rng.uniform(0.001, 0.2) for _ in range(16)])
    result = EngineResult(
        output_tokens_per_second=tokens,
        acceptance_length_a=1.0
        if cell.baseline in ("B0", "B3")
        else rng.uniform(1.0, min(4.0, cell.block_size)),
        ttft_seconds=rng.uniform(0.1, 0.3),
        per_round_latency_seconds=rng.uniform(0.01, 0.02),
        goodput_at_slo=tokens,
        expert_cache_hit_rate=rng.random(),
        route_ahead_prefetch_coverage=rng.random(),
        wasted_prefetch_bytes=rng.randint(0, 10**9),
        expert_occupancy_bytes=18_000_000_000,
        kv_occupancy_bytes=rng.randint(0, 10**8),
        t_verify_seconds=rng.uniform(1, 5),
        latency={k: lat for k in ("ttft_seconds", "tpot_seconds", "e2e_seconds", "round_seconds")},
        acceptance_histogram={1: 512},
        engine=_engine_facts(rng),
        timings={"load": 17.4, "warmup": 1.2, "timed": 5.2},
    )
    env = {
        "host": "box-1",
        "python": "3.11.7",
        "packages": {"torch": "2.13.0", "pandas": "3.1.1", "ray": "2.60.0"},
    }
    runner = {"box": "192.0.2.2", "node_id": "214c8cf04c0ca8ce" * 3, "gpu_ids": ["1"], "pid": 2558}
    return Row.from_result(cell, result, sweep="scale", environment=env, runner=runner)


def generate(path: Path, megabytes: float, seed: int = 1408) -> int:
    base = load_spec(REPO / "jobs" / "phase_a.yaml").model_dump(mode="json")
    rng = random.Random(seed)
    per_repeat = sum(1 for c in iter_cells(parse_spec({**base, "repeats": 1})))
    row_bytes = len(encode_row(synthetic_row(next(iter_cells(parse_spec(base))), rng)))
    repeats = max(1, int(megabytes * 1e6 / row_bytes / per_repeat) + 1)
    spec = parse_spec({**base, "repeats": repeats, "max_cells": max(100_000, per_repeat * repeats)})
    target = int(megabytes * 1e6)
    written = rows = 0
    with open(path, "wb") as fh:
        for cell in iter_cells(spec):
            line = encode_row(synthetic_row(cell, rng))
            fh.write(line)
            written += len(line)
            rows += 1
            if written >= target:
                break
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="size of the generated rows.jsonl (MB)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pd-dflash-report-scale-") as tmp:
        rows_file = Path(tmp) / "rows.jsonl"
        started = time.perf_counter()
        n = generate(rows_file, args.mb)
        size = rows_file.stat().st_size
        print(f"generated {n} rows, {size / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        command = [
            sys.executable,
            "-m",
            "pd_dflash",
            "report",
            str(rows_file),
            "--out",
            str(Path(tmp) / "out"),
        ]
        started = time.perf_counter()
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
        if done.returncode not in (0, 1):
            print(done.stderr, file=sys.stderr)
            return done.returncode
        matrix = (Path(tmp) / "out" / "result_matrix.json").stat().st_size
        print(
            f"report: {n} rows in {seconds:.1f} s = {n / seconds:.0f} rows/s, {size / 1e6 / seconds:.1f} MB/s"
        )
        print(f"peak RSS {peak / 1e6:.0f} MB = {peak / size:.2f} x input ({size / 1e6:.1f} MB)")
        print(f"result_matrix.json {matrix / 1e6:.1f} MB; exit code {done.returncode}")
        print(json.dumps({"rows": n, "input_mb": size / 1e6, "seconds": seconds, "peak_rss_mb": peak / 1e6}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
