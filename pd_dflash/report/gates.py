"""Gates per group and the overall go/no-go on route-ahead (rules in docs/metrics.md, "Gates").

Every gate answers ``pass``, ``fail``, ``not evaluated`` (an input is missing: never a silent pass) or
``disabled`` (switched off in the spec). Gates read the means over repeats that the aggregation computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from pd_dflash.ablation import ablation_settings, group_model
from pd_dflash.baselines import BASE, CANDIDATE, GATED, ORDER, ORDERING_CHAIN, ordering_step_loose
from pd_dflash.costmodel import bm1_summary, evaluate_hide_inequality
from pd_dflash.report.aggregate import Group, Matrix, Placed, group_key
from pd_dflash.report.brief import HIDE_TERMS
from pd_dflash.schema import BLOCKED_STATUSES, FAILED_STATUSES, Status
from pd_dflash.spec import Gates, SweepSpec
from pd_dflash.upstream import UPSTREAM_BASELINES

PASS, FAIL, NOT_EVALUATED, DISABLED = "pass", "fail", "not evaluated", "disabled"
#: The gates that decide go/no-go (completeness decides only whether the verdict can be GO).
VERDICT_GATES: tuple[str, ...] = (
    "bm1",
    "hide_inequality",
    "speedup_over_b0",
    "coverage",
    "waste",
    "ordering",
)
GATES: tuple[str, ...] = ("completeness", *VERDICT_GATES)
TOKENS = "output_tokens_per_second"


@dataclass(frozen=True)
class Expectations:
    """What a complete matrix holds: its groups (None = the groups that have rows), baselines, repeats."""

    groups: tuple[tuple[str, int, int], ...] | None
    baselines: tuple[str, ...]
    repeats: tuple[int, ...]

    @classmethod
    def infer(cls, matrix: Matrix, spec: SweepSpec | None = None) -> Expectations:
        """From the spec when given; otherwise upstream's B0..B3 plus any baseline and repeat seen."""
        if spec is not None:
            grid = tuple(
                (group_model(m.id, a), b, c)
                for m in spec.models
                for a in ablation_settings(spec, m)
                for b in sorted(spec.block_sizes)
                for c in sorted(spec.concurrency)
            )
            # Adaptive: every group has at least min repeats; which group ran more is report/adaptive.py's.
            return cls(grid, tuple(b for b in ORDER if b in spec.baselines), tuple(range(spec.min_repeats)))
        seen_b, seen_r = set(UPSTREAM_BASELINES), set()
        for g in matrix.groups.values():
            for b, ps in g.by_baseline.items():
                seen_b.add(b)
                seen_r.update(p.row.repeat for p in ps)
        return cls(None, tuple(b for b in ORDER if b in seen_b), tuple(sorted(seen_r)))


def _gate(status: str, summary: str = "", **detail: Any) -> dict[str, Any]:
    return {"status": status, "summary": summary, **detail}


def _fmt(x: float) -> str:
    return f"{x:.4g}"


@dataclass
class _Findings:
    """What the completeness check found in one group, per baseline."""

    missing: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)
    missing_repeats: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, list[str]] = field(default_factory=dict)
    partial: dict[str, list[str]] = field(default_factory=dict)
    unmeasured: dict[str, list[str]] = field(default_factory=dict)
    mismatches: dict[str, list[str]] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = [f"missing {', '.join(self.missing)}"] if self.missing else []
        out.extend(f"{b} missing repeats {r}" for b, r in self.missing_repeats.items())
        if self.blocked:
            out.append(f"blocked {', '.join(self.blocked)} (not allowed)")
        out.extend(f"{b} {'; '.join(v)}" for b, v in self.failed.items())
        out.extend(f"{b} PARTIAL, missing {', '.join(v)}" for b, v in self.partial.items())
        out.extend(f"{b} hide_inequality mismatch: {'; '.join(v)}" for b, v in self.mismatches.items())
        return out


def _inspect(group: Group, expect: Expectations, allow: set[str], unmeasured_ok: frozenset[str]) -> _Findings:
    found = _Findings(missing=[b for b in expect.baselines if b not in group.by_baseline])
    for b, repeats in group.by_baseline.items():
        have = {p.row.repeat for p in repeats}
        gaps = [r for r in expect.repeats if r not in have] if b in expect.baselines else []
        if gaps:
            found.missing_repeats[b] = gaps
        for p in repeats:
            st = p.row.status
            if st in BLOCKED_STATUSES:
                (found.allowed if b in allow else found.blocked).append(b)
            elif st in FAILED_STATUSES:
                found.failed.setdefault(b, []).append(f"repeat {p.row.repeat}: {st.value} ({p.row.reason})")
            elif st == Status.PARTIAL:
                for m in p.row.missing_metrics():
                    bucket = found.unmeasured if m in unmeasured_ok else found.partial
                    if m not in bucket.setdefault(b, []):
                        bucket[b].append(m)
            if p.row.hide_mismatch:
                text = f"repeat {p.row.repeat} ({p.source}): {p.row.hide_mismatch}"
                found.mismatches.setdefault(b, []).append(text)
    found.blocked, found.allowed = sorted(set(found.blocked)), sorted(set(found.allowed))
    return found


def _completeness(
    group: Group, expect: Expectations, allow: set[str], unmeasured_ok: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Upstream's present/blocked/missing/invalid lists, plus repeats, failures and PARTIAL rows.

    A PARTIAL row whose absent metrics are all in ``unmeasured_ok`` (gates.allow_unmeasured) keeps the group
    complete; the absence is still listed under ``unmeasured``.
    """
    f = _inspect(group, expect, allow, unmeasured_ok)
    invalid = [b for b in group.by_baseline if b in f.mismatches]
    complete = not (f.missing or f.missing_repeats or f.blocked or f.failed or f.partial)
    return {
        "present": list(group.by_baseline),
        "missing": f.missing,
        "blocked": sorted(set(f.blocked) | set(f.allowed)),
        "blocked_allowed": f.allowed,
        "invalid": invalid,
        "invalid_detail": f.mismatches,
        "failed": f.failed,
        "partial": f.partial,
        "unmeasured": f.unmeasured,
        "missing_repeats": dict(f.missing_repeats),
        "complete": complete,
        "valid": not invalid,
        "gate": _gate(PASS if complete and not invalid else FAIL, "; ".join(f.problems())),
    }


def _skipped(group: Group, allow: set[str]) -> set[str]:
    """Baselines excused from the gates: allowed-blocked with no measured repeat."""
    return {
        b
        for b, ps in group.by_baseline.items()
        if b in allow and all(p.row.status in BLOCKED_STATUSES for p in ps)
    }


def _measured(group: Group, b: str) -> list[Placed]:
    return [p for p in group.by_baseline.get(b, []) if p.measured]


def hide_on_means(matrix: Matrix, key: str, baseline: str) -> dict[str, Any] | None:
    """The hide inequality evaluated on the repeats' mean terms (None when a term is missing)."""
    terms = {t: matrix.mean(key, baseline, f"hide_inequality.{t}") for t in HIDE_TERMS}
    if any(v is None for v in terms.values()) or not terms["measured_h2d_bytes_per_second"]:
        return None
    try:
        return evaluate_hide_inequality(**terms).model_dump()
    except ValueError:  # a fetch time beyond the float range (finite means near it)
        return None


def bm1_on_means(matrix: Matrix, key: str, baseline: str) -> dict[str, Any] | None:
    router = matrix.mean(key, baseline, "t_router_seconds")
    verify = matrix.mean(key, baseline, "t_verify_seconds")
    if router is None or verify is None or verify <= 0:
        return None
    summary = bm1_summary(router, verify)
    if not math.isfinite(summary["bm1_router_to_verify_ratio"]):  # beyond the float range: not written
        summary["bm1_router_to_verify_ratio"] = None
    return summary


def _bm1(matrix: Matrix, group: Group, expect: Expectations) -> tuple[dict, dict]:
    key = group.key
    per: dict[str, Any] = {}
    notes = []
    for b in group.by_baseline:
        s = bm1_on_means(matrix, key, b)
        if s is not None:
            per[b] = s
        elif matrix.mean(key, b, "t_router_seconds") is not None:
            notes.append(f"{b}: t_verify_seconds missing or 0")
    fails = [
        f"{b} t_router/t_verify {_fmt(s['bm1_router_to_verify_ratio'] or math.inf)} >= 1"
        for b, s in per.items()
        if not s["bm1_pass"]
    ]
    if fails:
        return _gate(FAIL, "; ".join(fails)), per
    required = CANDIDATE if CANDIDATE in expect.baselines or CANDIDATE in group.by_baseline else None
    if required and required not in per:
        why = "; ".join(notes) or f"{required} rows carry no t_router_seconds/t_verify_seconds"
        return _gate(NOT_EVALUATED, why), per
    if not per:
        return _gate(NOT_EVALUATED, "no row carries t_router_seconds and t_verify_seconds"), per
    return _gate(PASS, ""), per


def _hide(matrix: Matrix, group: Group, expect: Expectations) -> dict[str, Any]:
    key = group.key
    info = {}
    for b in group.by_baseline:
        done = [p.row.hide_hidden for p in _measured(group, b) if p.row.hide_hidden is not None]
        if done:
            info[b] = {"hidden_repeats": sum(done), "repeats_with_terms": len(done), "on_means": None}
            info[b]["on_means"] = hide_on_means(matrix, key, b)
    mismatches = [
        f"{b} repeat {p.row.repeat}: {p.row.hide_mismatch}"
        for b, ps in group.by_baseline.items()
        for p in ps
        if p.row.hide_mismatch
    ]
    if mismatches:
        return _gate(
            FAIL,
            "stored hide_inequality disagrees with its terms: " + "; ".join(mismatches),
            per_baseline=info,
        )
    if CANDIDATE not in expect.baselines and CANDIDATE not in group.by_baseline:
        return _gate(NOT_EVALUATED, f"no {CANDIDATE} rows", per_baseline=info)
    ours = _measured(group, CANDIDATE)
    if not ours:
        return _gate(NOT_EVALUATED, f"{CANDIDATE} not measured", per_baseline=info)
    if any(p.row.hide_hidden is None for p in ours):
        return _gate(NOT_EVALUATED, f"{CANDIDATE} rows carry no hide_inequality terms", per_baseline=info)
    on_means = info[CANDIDATE]["on_means"]
    if on_means is None:
        why = f"{CANDIDATE}'s mean terms give a fetch time beyond the float range"
        return _gate(NOT_EVALUATED, why, per_baseline=info)
    if on_means["hidden"]:
        return _gate(PASS, "", per_baseline=info)
    text = (
        f"{CANDIDATE} fetch {_fmt(on_means['fetch_seconds'])} s > window {_fmt(on_means['hide_window_seconds'])} s "
        f"(exposed by {_fmt(-on_means['margin_seconds'] * 1000)} ms)"
    )
    return _gate(FAIL, text, per_baseline=info)


def _speedup(matrix: Matrix, group: Group, expect: Expectations, gates: Gates, skipped: set[str]) -> dict:
    key = group.key
    configs = [
        b
        for b in GATED
        if b != BASE and b not in skipped and (b in expect.baselines or b in group.by_baseline)
    ]
    b0 = matrix.mean(key, BASE, TOKENS)
    if b0 is None or b0 <= 0:
        why = f"{BASE} tokens/s not measured" if b0 is None else f"{BASE} tokens/s is 0"
        return _gate(NOT_EVALUATED, why, per_baseline={})
    per: dict[str, float | None] = {}
    beyond = []  # a ratio beyond the float range: above any threshold, and not written (JSON has no inf)
    for b in configs:
        x = matrix.mean(key, b, TOKENS)
        per[b] = None if x is None else x / b0
        if per[b] is not None and not math.isfinite(per[b]):
            beyond.append(b)
            per[b] = None
    low = [
        f"{b} {_fmt(s)}x < {_fmt(gates.min_speedup_over_b0)}x"
        for b, s in per.items()
        if s is not None and s < gates.min_speedup_over_b0
    ]
    if low:
        return _gate(FAIL, f"speedup over {BASE}: " + ", ".join(low), per_baseline=per)
    absent = [b for b, s in per.items() if s is None and b not in beyond]
    if absent:
        return _gate(NOT_EVALUATED, f"tokens/s not measured for {', '.join(absent)}", per_baseline=per)
    note = f"speedup of {', '.join(beyond)} over {BASE} beyond the float range" if beyond else ""
    return _gate(PASS, note, per_baseline=per)


def _no_candidate(group: Group) -> str:
    return f"{CANDIDATE} not measured" if CANDIDATE in group.by_baseline else f"no {CANDIDATE} rows"


def _coverage(matrix: Matrix, group: Group, expect: Expectations, gates: Gates) -> dict:
    ours = _measured(group, CANDIDATE)
    if not ours:
        return _gate(NOT_EVALUATED, _no_candidate(group))
    vacuous = [p.row.repeat for p in ours if (p.row.route_ahead or {}).get("actual_experts") == 0]
    if vacuous:
        return _gate(
            NOT_EVALUATED,
            f"{CANDIDATE} coverage is vacuous (no routed experts observed) in repeats {vacuous}",
        )
    stats = matrix.stats.get((group.key, CANDIDATE), {}).get("route_ahead_prefetch_coverage")
    if stats is None:
        return _gate(NOT_EVALUATED, f"{CANDIDATE} route_ahead_prefetch_coverage not measured")
    checked = all(p.row.route_ahead is not None for p in ours)
    detail = {
        "value": stats["mean"],
        "ci95_low": stats["ci95_low"],
        "n": stats["n"],
        "vacuity_checked": checked,
    }
    if stats["mean"] < gates.min_coverage:
        return _gate(FAIL, f"{CANDIDATE} coverage {stats['mean']:.2f} < {gates.min_coverage:.2f}", **detail)
    return _gate(PASS, "" if checked else "no route_ahead counters: vacuity not checked", **detail)


def _waste(matrix: Matrix, group: Group, gates: Gates) -> dict:
    ours = _measured(group, CANDIDATE)
    if not ours:
        return _gate(NOT_EVALUATED, _no_candidate(group))
    lacking = [p.row.repeat for p in ours if (p.row.route_ahead or {}).get("waste_ratio") is None]
    if lacking:
        return _gate(NOT_EVALUATED, f"{CANDIDATE} rows carry no route_ahead.waste_ratio (repeats {lacking})")
    vacuous = [p.row.repeat for p in ours if p.row.route_ahead.get("predicted_experts") == 0]
    if vacuous:
        return _gate(
            NOT_EVALUATED, f"{CANDIDATE} prefetched nothing (predicted_experts 0) in repeats {vacuous}"
        )
    stats = matrix.stats[(group.key, CANDIDATE)]["route_ahead.waste_ratio"]
    detail = {"value": stats["mean"], "ci95_high": stats["ci95_high"], "n": stats["n"]}
    if stats["mean"] > gates.max_waste_ratio:
        return _gate(
            FAIL, f"{CANDIDATE} waste ratio {stats['mean']:.2f} > {gates.max_waste_ratio:.2f}", **detail
        )
    return _gate(PASS, "", **detail)


def _ordering(matrix: Matrix, group: Group, expect: Expectations, gates: Gates, skipped: set[str]) -> dict:
    if not gates.require_ordering:
        return _gate(DISABLED, "require_ordering is false")
    chain = [b for b in ORDERING_CHAIN if b not in skipped]
    if CANDIDATE not in expect.baselines and CANDIDATE not in group.by_baseline:
        return _gate(NOT_EVALUATED, f"no {CANDIDATE} rows")
    means = {b: matrix.mean(group.key, b, TOKENS) for b in chain}
    absent = [b for b, v in means.items() if v is None]
    if absent:
        return _gate(NOT_EVALUATED, f"tokens/s not measured for {', '.join(absent)}", tokens_per_second=means)
    broken = []
    for left, right in pairwise(chain):
        loose = ordering_step_loose(left, right)
        ok = means[left] <= means[right] if loose else means[left] < means[right]
        if not ok:
            op = "<=" if loose else "<"
            broken.append(f"{left} {_fmt(means[left])} !{op} {right} {_fmt(means[right])}")
    note = (
        f" ({', '.join(sorted(skipped))} allowed blocked, left out)" if set(ORDERING_CHAIN) & skipped else ""
    )
    if broken:
        return _gate(FAIL, "ordering: " + ", ".join(broken) + note, tokens_per_second=means)
    return _gate(PASS, note.strip(), tokens_per_second=means)


def evaluate_group(matrix: Matrix, group: Group, gates: Gates, expect: Expectations) -> dict[str, Any]:
    """The verdict of one group: upstream's detail keys, completeness, BM1, and every gate."""
    allow = set(gates.allow_blocked)
    detail = _completeness(group, expect, allow, frozenset(gates.allow_unmeasured))
    skipped = _skipped(group, allow)
    bm1_gate, bm1 = _bm1(matrix, group, expect)
    shared = {b: list(ps[0].shared) for b, ps in group.by_baseline.items() if ps[0].shared}
    detail["bm1"] = bm1
    if shared:
        detail["shared_across_block_sizes"] = shared
    detail["gates"] = {
        "completeness": detail.pop("gate"),
        "bm1": bm1_gate,
        "hide_inequality": _hide(matrix, group, expect),
        "speedup_over_b0": _speedup(matrix, group, expect, gates, skipped),
        "coverage": _coverage(matrix, group, expect, gates),
        "waste": _waste(matrix, group, gates),
        "ordering": _ordering(matrix, group, expect, gates, skipped),
    }
    return detail


def evaluate(matrix: Matrix, gates: Gates, expect: Expectations) -> dict[str, dict[str, Any]]:
    """Verdicts for every group the expectations name (spec grid) or that holds rows, sorted by (model, B, c)."""
    ids = set(expect.groups or ()) | {(g.model, g.block_size, g.concurrency) for g in matrix.groups.values()}
    out = {}
    for model, b, c in sorted(ids):
        key = group_key(model, b, c)
        out[key] = evaluate_group(matrix, matrix.groups.get(key) or Group(model, b, c), gates, expect)
    return out


def overall(details: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """GO / NO-GO / INCONCLUSIVE (see docs/metrics.md): NO-GO if any evaluated gate fails anywhere; GO if
    every group is complete and valid and every enabled gate passes everywhere; otherwise INCONCLUSIVE."""
    n = len(details)
    counts = {g: {PASS: 0, FAIL: 0, NOT_EVALUATED: 0, DISABLED: 0} for g in GATES}
    examples: dict[tuple[str, str], list[str]] = {}
    for key, d in details.items():
        for name, g in d["gates"].items():
            counts[name][g["status"]] += 1
            if g["status"] in (FAIL, NOT_EVALUATED):
                examples.setdefault((name, g["status"]), []).append(f"{key}: {g['summary']}")
    incomplete = [k for k, d in details.items() if not (d["complete"] and d["valid"])]

    def said(name: str, status: str) -> str:
        ex = examples[(name, status)]
        return (
            f"{name} {'fails' if status == FAIL else 'not evaluated'} in {len(ex)}/{n} groups (e.g. {ex[0]})"
        )

    failing = [said(g, FAIL) for g in VERDICT_GATES if counts[g][FAIL]]
    unevaluated = [said(g, NOT_EVALUATED) for g in VERDICT_GATES if counts[g][NOT_EVALUATED]]
    if incomplete:
        first = details[incomplete[0]]["gates"]["completeness"]["summary"]
        unevaluated.insert(
            0, f"{len(incomplete)}/{n} groups incomplete or invalid (e.g. {incomplete[0]}: {first})"
        )
    # The one-line form: every failure with an example; what is missing only as counts.
    short = [f"{len(incomplete)}/{n} groups incomplete or invalid"] if incomplete else []
    missing = [f"{g} {counts[g][NOT_EVALUATED]}/{n}" for g in VERDICT_GATES if counts[g][NOT_EVALUATED]]
    if missing:
        short.append("not evaluated: " + ", ".join(missing) + " groups")
    if n == 0:
        verdict, reasons, line = "INCONCLUSIVE", ["no rows"], ["no rows"]
    elif failing:
        verdict, reasons, line = "NO-GO", failing, failing
    elif unevaluated:
        verdict, reasons, line = "INCONCLUSIVE", unevaluated, short
    else:
        enabled = [g for g in VERDICT_GATES if counts[g][DISABLED] == 0]
        verdict = "GO"
        reasons = line = [f"{', '.join(enabled)} pass in all {n} groups"]
    return {
        "verdict": verdict,
        "reasons": reasons,
        "also": unevaluated if verdict == "NO-GO" else [],
        "gate_counts": counts,
        "groups": n,
        "groups_complete": n - len(incomplete),
        "because": "; ".join(line),
        "line": f"go/no-go: {verdict} ({'; '.join(line)})",
    }
