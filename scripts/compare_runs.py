"""Compare two sweeps' rows apart from what depends on wall-clock time.

Used to check that a behaviour-preserving change (a restructuring) leaves `make run`'s rows unchanged:
``python scripts/compare_runs.py BEFORE AFTER``, each a sweep directory (its rows.jsonl) or a row file
(rows.jsonl, upstream raw JSON). Each input is read as ``pd-dflash report`` reads it and refused where the
report refuses it (a torn line, a row the schema rejects, a duplicate identity, a file without rows, a
matrix), with the file named; an ERROR/TIMEOUT row followed by a retry is superseded, as in the report. Rows
are matched by their full identity (``Row.identity``: model, baseline, block_size, concurrency, repeat and the
ablation values). Two things are compared:

- the *shape*: every row has the same nested field names (a field added, dropped or renamed shows up);
- the *values* of every field that does not depend on timing: identity, status, token counts and output
  digests, acceptance (length and histogram), route-ahead prediction counts, cache geometry, scheduler and
  drafter facts. Values driven by the clock (seconds, rates, hit counts of an emulated link whose timeline
  follows measured compute time) are listed by ``TIMED`` and skipped; ``--show-timed`` prints them side by side.

Exit 0 when both agree on at least one compared value, 1 on any difference or when nothing could be compared
(no value compared is no agreement), 2 on bad input (the file named).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pd_dflash.errors import InputError
from pd_dflash.report.aggregate import build_matrix
from pd_dflash.report.build import open_inputs
from pd_dflash.rows import ROWS_FILE, iter_rows, read_line_at

#: Field paths (regular expressions over dotted paths) whose values follow the clock.
TIMED = [
    r".*seconds.*",
    r".*_at$",
    r".*per_second.*",
    r"output_tokens_per_second|goodput_at_slo|ttft_seconds|per_round_latency_seconds",
    r"expert_cache_hit_rate|wasted_prefetch_bytes|route_ahead_prefetch_coverage",
    r"latency\..*",
    r"cost_terms\..*",
    r"hide_inequality\..*",
    r"timings\..*",
    r"runner\..*",
    r"environment\..*",
    r"engine\.expert_cache\.(?!capacity_bytes|slots|expert_nbytes|total_expert_bytes|policy|resident$).*",
    r"engine\.overlap\..*",
    r"engine\.batch\.(issue_seconds|idle_scheduling_steps)",
    r"engine\.telemetry.*",
    r"engine\.bm1\..*",
    r"engine\.model_card\.(train\.seconds|code_version|cache_hit).*",
    r"engine\.drafter\.card\.(train\.seconds|cache_hit).*",
    r"engine\.threads",
    r"engine\.load_seconds",
    r"engine\.scheduler\..*",
    r"route_ahead\.(covered|kept|wasted)_.*|route_ahead\.(coverage|waste_ratio)",
    r"engine\.prediction\..*",
    r"expert_occupancy_bytes|kv_occupancy_bytes",
    # ready when the verify acquired it: on the emulated link's timeline, which follows measured compute time
    r"prefetched_in_time_coverage",
    # placement: a runner keeps its KV arena from its previous cell; the cell that loads the drafter is whichever
    # runs first (timings.drafter_load exists only there)
    r"engine\.kv_cache\.allocated_bytes_peak",
    r"timings\.drafter_load",
    # a cache directory is named by the code versions it was trained with: a restructuring renames it
    r"engine\.drafter\.checkpoint",
]
_TIMED = re.compile("|".join(f"(?:{p})" for p in TIMED))
#: With c > 1 a deficit scheduler (B2, OURS) admits by measured cost, so which requests share a forward, and
#: everything counted per forward or per round, follows the clock too.
SCHEDULED = [
    r"engine\.batch\..*",
    r"route_ahead\..*",
    r"acceptance_histogram\..*",
    r"acceptance_length_a",
    r"engine\.verify_width\..*",
    r"engine\.draft_verify_rounds",
    # counted per round and per verified row: which rows a round verifies follows the clock here
    r"engine\.host_syncs\..*",
    r"engine\.kv_cache\.in_use_bytes_peak",
    r"engine\.drafter\.peak_draft_kv_bytes",
]
_SCHEDULED = re.compile("|".join(f"(?:{p})" for p in SCHEDULED))
#: Configurations admitted by a deficit scheduler (their batches follow the clock when c > 1), and those whose
#: route-ahead verify width is cost-aware: it cuts blocks by the measured seconds per token, so which rows are
#: verified (acceptance, route-ahead counts, batch facts) follows the clock at every c.
DEFICIT = ("B2", "OURS", "AR2D")
COST_AWARE_WIDTH = ("OURS", "RA")


def flatten(obj, prefix=""):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def rows_path(given: Path) -> Path:
    """The row file of an input: a sweep directory's rows.jsonl, or the file itself."""
    if given.is_dir():
        path = given / ROWS_FILE
        if not path.is_file():
            raise InputError(
                f"is a directory without {ROWS_FILE} (expected a sweep directory or a row file)",
                where=str(given),
            )
        return path
    if not given.exists():
        raise InputError("does not exist", where=str(given))
    return given


def load(given: Path) -> dict[tuple, dict]:
    """The current row of each identity in ``given`` (stored JSON), refused as ``pd-dflash report`` refuses."""
    path = rows_path(given)
    with open_inputs([path]) as (briefs, sources):
        build_matrix(briefs, sources)  # the report's own checks: duplicates, covered block sizes, ...
    rows: dict[tuple, dict] = {}
    for row, source in iter_rows(path):
        # a later row of an identity supersedes an ERROR/TIMEOUT one (build_matrix refused any other repeat)
        text = read_line_at(source) if source.offset is not None else None
        rows[row.identity] = json.loads(text) if text else row.model_dump(mode="json", exclude_unset=True)
    return rows


#: Fields whose presence follows the clock or the placement: the verify width's survival table has a key per
#: width seen; ``timings.drafter_load`` exists only in the cell that loaded the drafter.
PRESENCE = re.compile(r"engine\.verify_width\.survival\..*|timings\.drafter_load")


def shape(flat: dict) -> set[str]:
    # series and per-layer tables vary in length with timing; compare their parents only
    # histogram keys are the values seen (their set follows the clock where the values do)
    return {
        re.sub(r"_histogram\.\d+$", "_histogram.*", re.sub(r"\[\d+\]", "[]", k))
        for k in flat
        if not re.search(r"_series", k) and not PRESENCE.fullmatch(k)
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--show-timed", action="store_true")
    args = ap.parse_args(argv)
    try:
        a, b = load(args.before), load(args.after)
    except InputError as exc:
        print(f"compare_runs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    problems = []
    if set(a) != set(b):
        problems.append(
            f"cells differ: only before {sorted(set(a) - set(b))}, only after {sorted(set(b) - set(a))}"
        )
    compared = 0
    for key in sorted(set(a) & set(b), key=str):
        fa, fb = flatten(a[key]), flatten(b[key])
        sa, sb = shape(fa), shape(fb)
        if sa != sb:
            problems.append(f"{key}: fields only before {sorted(sa - sb)}, only after {sorted(sb - sa)}")
        for path in sorted(set(fa) & set(fb)):
            scheduled = (key[1] in DEFICIT and key[3] > 1) or key[1] in COST_AWARE_WIDTH
            if path == "cell_id" or _TIMED.fullmatch(path) or (scheduled and _SCHEDULED.fullmatch(path)):
                if args.show_timed and fa[path] != fb[path]:
                    print(f"timed {key} {path}: {fa[path]!r} -> {fb[path]!r}")
                continue
            compared += 1
            if fa[path] != fb[path]:
                problems.append(f"{key} {path}: {fa[path]!r} != {fb[path]!r}")
    for p in problems:
        print(p)
    print(f"{len(a)} vs {len(b)} rows, {compared} deterministic values compared, {len(problems)} differences")
    if not compared:
        print("nothing compared: no deterministic value in common, which is no agreement", file=sys.stderr)
    return 1 if problems or not compared else 0


if __name__ == "__main__":
    sys.exit(main())
