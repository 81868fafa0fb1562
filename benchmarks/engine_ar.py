"""B0 (AR, offloaded, AR prefetcher) vs B3 (speculative, every expert resident) on a mini preset, CPU, emulated
link.

Prints, per concurrency: tokens/s of B0 and B3 and their ratio, B0's expert-cache hit rate, exposed fetch
fraction (time compute waited for a transfer / timed wall time) and the AR prefetcher's coverage (on the
route-ahead scale: Σ|predicted ∩ used| / Σ|used|). Everything runs through the Engine interface, exactly as a
runner does. Optional: the training time of each mini preset (fresh, in a temporary cache) and the time of one
cell of a sweep spec (default jobs/cpu_reference.yaml).

    .venv/bin/python benchmarks/engine_ar.py --preset mini-gpt-oss --gbps 1.0 --fraction 0.25
    .venv/bin/python benchmarks/engine_ar.py --measure-training --time-spec jobs/cpu_reference.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PD_DFLASH_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "pd-dflash"))


def engine_for(spec, device="cpu"):
    from pd_dflash.engine.interface import EngineContext
    from pd_dflash.engine.registry import engine_class

    ctx = EngineContext.for_model(spec, device=device)
    return engine_class(spec.engine)(ctx)


def compare(args) -> dict:
    """B0 and B3 of every (concurrency, repeat), interleaved; one row per pair and medians per concurrency."""
    from pd_dflash.spec import expand

    spec = bench_spec(args)
    start = time.perf_counter()
    engine = engine_for(spec)
    load = time.perf_counter() - start
    rows = run_interleaved(engine, expand(spec), args)
    facts = engine.describe()
    engine.close()
    table = [pair_row(rows, c, rep) for c in args.concurrency for rep in range(args.repeats)]
    return {
        "summary_medians": [median_row(table, c) for c in args.concurrency],
        "preset": args.preset,
        "engine_load_seconds": load,
        "expert_nbytes": facts["expert_nbytes"],
        "total_expert_bytes": facts["total_expert_bytes"],
        "cache_fraction": args.fraction,
        "emulated_h2d_gbps": args.gbps,
        "emulated_latency_us": args.latency_us,
        "threads": args.threads,
        "model_card": facts.get("model_card"),
        "rows": table,
    }


def bench_spec(args):
    from pd_dflash.spec import parse_spec

    options = {
        "emulated_h2d_gbps": args.gbps,
        "emulated_latency_us": args.latency_us,
        "eviction": args.eviction,
    }
    return parse_spec(
        {
            "name": "engine-ar-bench",
            "models": [{"id": args.preset, "preset": args.preset, "engine_options": options}],
            "baselines": ["B0", "B3"],
            "block_sizes": [8],
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "workload": {
                "requests": args.requests,
                "warmup_rounds": args.warmup,
                "max_new_tokens": args.max_new,
                "prompt_tokens": args.prompt_tokens,
                "seed": 1408,
            },
            "memory": {"expert_cache_fraction": args.fraction},
            "hardware": {"device": "cpu", "cpus_per_runner": args.threads},
        }
    )


def run_interleaved(engine, cells, args) -> dict[tuple[str, int, int], tuple]:
    """{(baseline, c, repeat): (row, cell seconds)}. B0 and B3 of the same (c, repeat) run back to back: a
    shared machine's load drifts over minutes."""
    from pd_dflash.schema import Row

    by_key = {(c.baseline, c.concurrency, c.repeat): c for c in cells}
    rows = {}
    for rep in range(args.repeats):
        for conc in args.concurrency:
            for baseline in ("B0", "B3"):
                cell = by_key[(baseline, conc, rep)]
                t0 = time.perf_counter()
                row = Row.from_result(cell, engine.run_cell(cell))
                rows[(baseline, conc, rep)] = (row, time.perf_counter() - t0)
    return rows


def pair_row(rows: dict, c: int, rep: int) -> dict:
    """B0 against B3 at one (c, repeat)."""
    (b0, b0_seconds), (b3, b3_seconds) = rows[("B0", c, rep)], rows[("B3", c, rep)]
    bandwidth = b0.cost_terms.measured_h2d_bytes_per_second if b0.cost_terms else None
    return {
        "concurrency": c,
        "repeat": rep,
        "b0_tokens_per_second": b0.output_tokens_per_second,
        "b3_tokens_per_second": b3.output_tokens_per_second,
        "b0_over_b3": b0.output_tokens_per_second / b3.output_tokens_per_second,
        "b0_hit_rate": b0.expert_cache_hit_rate,
        "b0_exposed_fetch_fraction": b0.engine["expert_cache"]["exposed_fetch_fraction"],
        "b0_prefetch_coverage": b0.route_ahead_prefetch_coverage,
        "b3_observed_coverage": b3.route_ahead_prefetch_coverage,
        "b0_measured_h2d_gbps": bandwidth / 1e9 if bandwidth else None,
        "same_tokens": b0.engine["output_digest"] == b3.engine["output_digest"],
        "b0_cell_seconds": b0_seconds,
        "b3_cell_seconds": b3_seconds,
    }


MEDIAN_KEYS = (
    "b0_tokens_per_second",
    "b3_tokens_per_second",
    "b0_over_b3",
    "b0_hit_rate",
    "b0_exposed_fetch_fraction",
    "b0_prefetch_coverage",
)


def median_row(table: list[dict], c: int) -> dict:
    """Medians over the repeats at concurrency ``c``."""
    mine = [t for t in table if t["concurrency"] == c]
    return {
        "concurrency": c,
        **{k: statistics.median(t[k] for t in mine) for k in MEDIAN_KEYS},
        "same_tokens": all(t["same_tokens"] for t in mine),
    }


def measure_training(presets: list[str]) -> list[dict]:
    import torch

    from pd_dflash.engine.reference.presets.catalog import get_preset
    from pd_dflash.engine.reference.presets.training import load_preset

    out = []
    for name in presets:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            _, card = load_preset(get_preset(name), cache_dir=tmp)
            total = time.perf_counter() - start
        out.append(
            {
                "preset": name,
                "train_seconds": card["train"]["seconds"],
                "train_plus_save_load_seconds": total,
                "steps": card["train"]["steps"],
                "eval_nats": card["loss"]["eval_nats"],
                "entropy_floor_nats": card["loss"]["entropy_floor_nats"],
                "uniform_nats": card["loss"]["uniform_nats"],
                "routing": card["routing"],
                "torch_threads_during_training": 1,
                "cpu_count": os.cpu_count(),
                "torch": torch.__version__,
            }
        )
    return out


def time_spec_cell(path: str) -> dict:
    """Load the spec's first model (training it if not cached) and time its first cell of each runnable baseline."""
    from pd_dflash.engine.interface import Refused
    from pd_dflash.engine.registry import blocked_reason
    from pd_dflash.spec import expand, load_spec

    spec = load_spec(path)
    start = time.perf_counter()
    engine = engine_for(spec)
    load = time.perf_counter() - start
    timed = {}
    for cell in expand(spec):
        key = f"{cell.baseline}|c{cell.concurrency}"
        if cell.model != spec.models[0].id or blocked_reason(spec.engine, cell) or key in timed:
            continue
        t0 = time.perf_counter()
        try:
            status = engine.run_cell(cell).status
        except Refused as refusal:  # as the runner records it
            status = refusal.status
        timed[key] = {"seconds": time.perf_counter() - t0, "status": status.value}
    engine.close()
    return {"spec": path, "engine_load_seconds": load, "cells": timed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-gpt-oss")
    p.add_argument("--gbps", type=float, default=1.0, help="emulated host-to-device bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, default=10.0)
    p.add_argument(
        "--fraction", type=float, default=0.25, help="expert cache capacity / all routed-expert bytes"
    )
    p.add_argument("--eviction", choices=("lru", "lfu"), default="lru")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--measure-training", action="store_true", help="train each mini preset fresh and time it")
    p.add_argument(
        "--time-spec", default=None, help="also time one cell per baseline/concurrency of this spec"
    )
    p.add_argument("--skip-compare", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    results: dict = {}
    if args.measure_training:
        results["training"] = measure_training(["mini-qwen3-coder", "mini-gpt-oss"])
        for t in results["training"]:
            print(
                f"train {t['preset']:18s} {t['train_seconds']:6.1f} s ({t['steps']} steps, 1 thread)  "
                f"loss {t['eval_nats']:.3f} nats (floor {t['entropy_floor_nats']:.3f}, uniform {t['uniform_nats']:.3f})"
            )
    if not args.skip_compare:
        results["compare"] = cmp = compare(args)
        print(
            f"{cmp['preset']}: expert {cmp['expert_nbytes']} B, all experts {cmp['total_expert_bytes']} B, cache "
            f"{args.fraction:.0%}, emulated link {args.gbps} GB/s + {args.latency_us} us, {args.threads} thread(s)"
        )
        print(f"medians over {args.repeats} repeat(s), B0 and B3 interleaved")
        print(
            " c  B0 tok/s  B3 tok/s  B0/B3  B0 hit rate  B0 exposed fetch  AR prefetch coverage  same tokens"
        )
        for r in cmp["summary_medians"]:
            print(
                f"{r['concurrency']:2d}  {r['b0_tokens_per_second']:8.1f}  {r['b3_tokens_per_second']:8.1f}"
                f"  {r['b0_over_b3']:5.2f}  {r['b0_hit_rate']:11.3f}  {r['b0_exposed_fetch_fraction']:16.3f}"
                f"  {r['b0_prefetch_coverage']:20.3f}  {r['same_tokens']}"
            )
    if args.time_spec:
        results["spec_cells"] = ts = time_spec_cell(args.time_spec)
        print(f"{ts['spec']}: engine load {ts['engine_load_seconds']:.1f} s")
        for key, v in ts["cells"].items():
            print(f"  {key:8s} {v['seconds']:6.2f} s  {v['status']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
