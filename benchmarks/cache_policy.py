"""Expert-cache eviction against Belady's optimum on a recorded verify access trace.

Runs one cell of a spec with the reference engine (default: B1 at B = 8, c = 1 of ``jobs/cpu_reference.yaml``),
takes the verify access trace of its timed loop (per round, per MoE layer: the experts needed and the experts
the cell's prefetcher predicted), and replays it offline, demand-only, with the cell's number of cache slots
under LRU, LFU, the round plan (history only: what B0/B1/B2's cache knows), the round plan with the round's
prediction reserved (what route-ahead gives OURS's cache) and Belady. Prints misses and the ratio to Belady, and
the engine's own transfers in the same cell (prefetches included).

    .venv/bin/python benchmarks/cache_policy.py
    .venv/bin/python benchmarks/cache_policy.py --baseline OURS --block-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PD_DFLASH_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "pd-dflash"))


def traced_engine(spec):
    """The reference engine for ``spec``'s first model, keeping each cell's verify access trace.

    The cell's runtime records the trace, its timeline and the cache's slots for every cell (they are not part
    of a row); this subclass keeps them when the timed loop ends, before the runtime closes."""
    from pd_dflash.engine.interface import EngineContext
    from pd_dflash.engine.reference.engine import ReferenceEngine

    if spec.engine != "reference":
        raise SystemExit(
            f"benchmarks/cache_policy.py replays the reference engine's trace, not {spec.engine!r}"
        )
    if not callable(getattr(ReferenceEngine, "_timed", None)):
        raise SystemExit(
            "benchmarks/cache_policy.py: ReferenceEngine has no _timed(cell, setup) any more; "
            "update traced_engine() to the engine's timed-loop seam"
        )

    class TracedEngine(ReferenceEngine):
        recorded: tuple[list, int, list] | None = None

        def _timed(self, cell, setup):
            out = super()._timed(cell, setup)
            runtime = setup.runtime
            self.recorded = (runtime.trace, runtime.cache.num_slots, runtime.timeline)
            return out

    return TracedEngine(EngineContext.for_model(spec, device="cpu"))


def record(spec_path: str, baseline: str, block_size: int, concurrency: int, eviction: str | None) -> dict:
    """Run the cell; its trace, slots and the engine's measured transfers."""
    from pd_dflash.schema import Row
    from pd_dflash.spec import expand, load_spec

    spec = load_spec(spec_path)
    if eviction:
        model = spec.models[0].model_copy(
            update={"engine_options": {**spec.models[0].engine_options, "eviction": eviction}}
        )
        spec = spec.model_copy(update={"models": [model]})
    cells = [
        c
        for c in expand(spec)
        if c.baseline == baseline
        and c.concurrency == concurrency
        and c.repeat == 0
        and (block_size in c.block_sizes_covered)
    ]
    if not cells:
        raise SystemExit(f"no {baseline} cell at B={block_size}, c={concurrency} in {spec_path}")
    engine = traced_engine(spec)
    try:
        row = Row.from_result(cells[0], engine.run_cell(cells[0]))
        trace, slots, timeline = engine.recorded
        rate = engine.link_bytes_per_second(cells[0])
    finally:
        engine.close()
    ec = row.engine["expert_cache"]
    return {
        "trace": trace,
        "slots": slots,
        "timeline": timeline,
        "transfer_seconds": engine.store.expert_nbytes / rate if rate else None,
        "expert_cache": ec,
        "timed_seconds": row.timed_seconds,
        "engine": {
            "eviction": ec["policy"],
            "h2d_transfers": ec["h2d_transfers"],
            "demand_transfers": ec["demand_transfers"],
            "prefetch_transfers": ec["prefetch_transfers"],
            "generated_tokens": row.generated_tokens,
            "recall": row.route_ahead_prefetch_coverage,
            "in_time": row.prefetched_in_time_coverage,
        },
    }


def main() -> int:
    from pd_dflash.engine.reference.offload.replay import POLICIES, accesses, clairvoyant_in_time, replay

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default="jobs/cpu_reference.yaml")
    p.add_argument("--baseline", default="B1")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument(
        "--eviction", default=None, help="the engine's eviction for the recorded cell (default: spec's)"
    )
    p.add_argument(
        "--trace", default=None, help="replay this recorded trace (JSON) instead of running a cell"
    )
    p.add_argument("--json", default=None, help="write the trace and the results here")
    args = p.parse_args()
    if args.trace:
        rec = json.loads(Path(args.trace).read_text())
    else:
        rec = record(args.spec, args.baseline, args.block_size, args.concurrency, args.eviction)
    trace, slots = rec["trace"], rec["slots"]
    misses = {policy: replay(trace, slots, policy) for policy in POLICIES}
    n = len(accesses(trace))
    keys = [len({(layer, e) for layer, needed, _ in rnd for e in needed}) for rnd in trace]
    print(
        f"{args.baseline} B={args.block_size} c={args.concurrency}: {len(trace)} verify rounds, {n} accesses, "
        f"{sum(keys) / max(1, len(keys)):.1f} keys per round, {slots} slots"
    )
    for policy, m in misses.items():
        print(f"  {policy:16s} misses {m:6d}   x Belady {m / max(1, misses['belady']):5.2f}")
    eng = rec.get("engine")
    if eng:
        print(
            f"  engine ({eng['eviction']}): {eng['h2d_transfers']} transfers ({eng['demand_transfers']} on demand, "
            f"{eng['prefetch_transfers']} prefetched), {eng['h2d_transfers'] / eng['generated_tokens']:.2f} "
            f"experts moved per generated token"
        )
    bound = None
    if rec.get("timeline") and rec.get("transfer_seconds"):
        bound = clairvoyant_in_time(trace, rec["timeline"], slots, rec["transfer_seconds"])
        print(
            f"  clairvoyant prefetch on the recorded compute timeline ({rec['transfer_seconds'] * 1e3:.2f} ms per "
            f"expert): in time {bound['in_time'] / bound['actual']:.3f} of the accesses the predictor named "
            f"({bound['landed'] / bound['actual']:.3f} with perfect prediction), {bound['loads']} loads, "
            f"{bound['stall_seconds']:.3f} s stalled"
        )
        if eng and eng.get("in_time") is not None:
            print(f"  engine: prediction recall {eng['recall']:.3f}, prefetched in time {eng['in_time']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**rec, "misses": misses, "clairvoyant": bound}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
