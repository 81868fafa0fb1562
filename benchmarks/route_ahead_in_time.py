"""Route-ahead in time: the engine's realised prefetched-in-time coverage against the clairvoyant policy's on
the same trace, at c = 1 and c = 4, in one run (issue 28 item 5; target ≥ 0.9 ×).

For each concurrency it runs one OURS cell of the spec with the reference engine (``cache_policy.record``:
the verify access trace, its recorded compute timeline, the cell's slots and link rate), replays that trace
under ``offload/replay.clairvoyant_in_time`` and prints both coverages and their ratio. Then it splits the
engine's shortfall by where each predicted access went, from the cache's own counters:

- late: the prefetch was issued but had not landed when the verify acquired it (``inflight_hits``): issue time
  or link occupancy; the link's busy share (``h2d_seconds`` / timed seconds) says which;
- dropped: the prefetch found every slot pinned or in flight (``prefetch_dropped``);
- prediction age: the time from a round's first MoE layer to each later layer's start, against one expert's
  transfer time: how many transfers the link can finish ahead of each layer once the round's prediction is in.

    .venv/bin/python benchmarks/route_ahead_in_time.py
    .venv/bin/python benchmarks/route_ahead_in_time.py --block-size 16 --json /tmp/in_time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_policy import record  # sets the offline cache env on import

TARGET = 0.9


def lead_times(timeline) -> list[float]:
    """Per round, per MoE layer after the first: seconds from the round's first layer start to its start."""
    out = []
    for rnd in timeline:
        if rnd:
            first = rnd[0][0]
            out.extend(start - first for start, _, _ in rnd[1:])
    return out


def measure(spec: str, block_size: int, concurrency: int) -> dict:
    from pd_dflash.engine.reference.offload.replay import clairvoyant_in_time

    rec = record(spec, "OURS", block_size, concurrency, None)
    eng, tau = rec["engine"], rec["transfer_seconds"]
    bound = clairvoyant_in_time(rec["trace"], rec["timeline"], rec["slots"], tau)
    ec, timed = rec["expert_cache"], rec["timed_seconds"]
    lead = lead_times(rec["timeline"])
    return {
        "concurrency": concurrency,
        "engine_in_time": eng["in_time"],
        "engine_recall": eng["recall"],
        "clairvoyant_in_time": bound["in_time"] / bound["actual"] if bound["actual"] else None,
        "clairvoyant_perfect": bound["landed"] / bound["actual"] if bound["actual"] else None,
        "accesses": ec["accesses"],
        "hits": ec["hits"],
        "late": ec["inflight_hits"],
        "misses": ec["misses"],
        "dropped": ec["prefetch_dropped"],
        "prefetches": ec["prefetch_transfers"],
        "link_busy": ec["h2d_seconds"] / timed if timed else None,
        "transfer_ms": tau * 1e3 if tau else None,
        "lead_ms_median": statistics.median(lead) * 1e3 if lead else None,
        "rounds": len(rec["trace"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default="jobs/cpu_reference.yaml")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    results = []
    for c in args.concurrency:
        r = measure(args.spec, args.block_size, c)
        results.append(r)
        ratio = (
            r["engine_in_time"] / r["clairvoyant_in_time"]
            if r["engine_in_time"] is not None and r["clairvoyant_in_time"]
            else None
        )
        r["ratio"] = ratio
        n = max(1, r["accesses"])
        print(
            f"OURS B={args.block_size} c={c}: {r['rounds']} verify rounds, {r['accesses']} accesses\n"
            f"  in time: engine {r['engine_in_time']:.3f}, clairvoyant {r['clairvoyant_in_time']:.3f} "
            f"(perfect prediction {r['clairvoyant_perfect']:.3f}); engine / clairvoyant "
            + (f"{ratio:.3f}" if ratio is not None else "absent")
            + f" (target >= {TARGET}: {'yes' if ratio is not None and ratio >= TARGET else 'no'})\n"
            f"  engine recall {r['engine_recall']:.3f}; of accesses: ready {r['hits'] / n:.3f}, "
            f"late (in flight) {r['late'] / n:.3f}, missed {r['misses'] / n:.3f}; "
            f"prefetches {r['prefetches']}, dropped (no slot) {r['dropped']}\n"
            f"  link busy {r['link_busy']:.3f} of the timed loop; one expert {r['transfer_ms']:.2f} ms; "
            f"median lead from a round's first MoE layer to a later layer {r['lead_ms_median']:.2f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
