"""Print a sweep's rows as the Markdown table docs/reference-engine.md records for `make run`.

    python scripts/run_table.py results/cpu_reference/rows.jsonl
    python scripts/run_table.py runs/engine_spec/rows.jsonl --model mini-gpt-oss-full-width

One line per row, sorted by block size, concurrency and the configuration table's order: tokens/s, τ, the
prefetcher's recall (the headline coverage), the in-time coverage, experts moved per generated token, host syncs
per generated token (when the row has them) and the output digest; ``--model`` keeps one model's rows (a spec
with several). Torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pd_dflash.baselines import ORDER


def _fmt(value, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| B | c | config | tok/s | τ | recall | in time | experts/token | host syncs/token | output digest |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(
        rows, key=lambda r: (r["block_size"], r["concurrency"], ORDER.index(r["baseline"]), r["repeat"])
    )
    for r in rows:
        engine = r.get("engine") or {}
        syncs = (engine.get("host_syncs") or {}).get("per_generated_token")
        lines.append(
            f"| {r['block_size']} | {r['concurrency']} | {r['baseline']} | {_fmt(r.get('output_tokens_per_second'), 1)} "
            f"| {_fmt(r.get('acceptance_length_a'), 2)} | {_fmt(r.get('route_ahead_prefetch_coverage'), 3)} "
            f"| {_fmt(r.get('prefetched_in_time_coverage'), 3)} "
            f"| {_fmt((engine.get('expert_cache') or {}).get('experts_moved_per_token'), 2)} | {_fmt(syncs, 1)} "
            f"| `{engine.get('output_digest', '—')}` |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=Path)
    ap.add_argument("--model", default=None, help="only this model's rows")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if args.model in (None, r["model"])]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
