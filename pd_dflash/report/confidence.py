"""The confidence-aware verdict, beside upstream's mean-based one (docs/metrics.md §7b).

The gates of ``gates.py`` compare means, as upstream's ``evaluate_matrix`` does, and stay exactly so. Here each
verdict gate is asked again of the repeats' Student-t 95 % intervals (``aggregate.summary_stats``):

- ``PASS`` when the interval clears the threshold (every value in it passes);
- ``FAIL`` when it lies wholly on the wrong side (every value in it fails);
- ``INCONCLUSIVE`` otherwise: the interval straddles the threshold, there is a single repeat (no interval), the
  repeats hold one value (a zero-width interval from n ≥ 2 is no evidence: "no spread across repeats"), or the
  mean-based gate could not be evaluated at all.

A gate that compares two quantities (speedup, ordering, BM1's router against verify time) asks the 95 % interval
of their difference *paired by repeat*: the configurations of one repeat saw the same sample (``Row.sample_seed``),
so the per-repeat differences cancel what the sample contributes and the interval is tighter, and still valid.
Where the rows cannot be paired (repeats or sample seeds that differ, fewer than two pairs) it compares the two
intervals instead: apart on the right side passes, apart on the wrong side fails (stricter than a test of the
difference, so conservative). A stored hide inequality that disagrees with its own terms fails here as on the
means (the row is invalid, whatever the spread).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from pd_dflash.baselines import BASE, CANDIDATE, ordering_step_loose
from pd_dflash.report.aggregate import Group, Matrix, scaled_moments, summary_stats
from pd_dflash.report.brief import NUMERIC_COLUMNS
from pd_dflash.report.gates import DISABLED, NOT_EVALUATED, TOKENS, VERDICT_GATES
from pd_dflash.spec import Gates

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"


@dataclass(frozen=True)
class Interval:
    """A mean's 95 % interval (``why``: how it was formed, e.g. paired by repeat), or why there is none
    (``low``/``high`` None)."""

    low: float | None
    high: float | None
    why: str = ""

    @property
    def known(self) -> bool:
        return self.low is not None and self.high is not None


def interval(matrix: Matrix, key: str, baseline: str, column: str) -> Interval:
    stats = matrix.stats.get((key, baseline), {}).get(column)
    if stats is None:
        return Interval(None, None, f"{baseline} {column} not measured")
    if stats.get("no_interval"):
        return Interval(None, None, f"{baseline} {column}: {stats['no_interval']}")
    if stats["ci95_low"] is None:
        return Interval(None, None, f"{baseline} has {stats['n']} repeat (no interval)")
    if stats.get("distinct") == 1 or stats["std"] == 0:
        return Interval(None, None, f"{baseline} {column}: {_flat(stats['n'], stats['mean'])}")
    return Interval(stats["ci95_low"], stats["ci95_high"])


def _flat(n: int, value: float) -> str:
    return f"no spread across repeats ({n} repeats, all {value:.4g})"


def _per_repeat(group: Group, baseline: str, column: str) -> dict[int, tuple[float, int | None]]:
    """repeat -> (value, sample seed) of a baseline's measured repeats that carry ``column``."""
    i = NUMERIC_COLUMNS.index(column)
    return {
        p.row.repeat: (p.row.numbers[i], p.row.sample_seed)
        for p in group.by_baseline.get(baseline, [])
        if p.measured and p.row.numbers[i] is not None
    }


def paired(
    group: Group, a: tuple[str, str], b: tuple[str, str], k: float = 1.0, coverage: float = 0.95
) -> Interval | None:
    """The 95 % interval (``coverage``: an adaptive look's, ``Matrix.coverage``) of the mean of ``a − k·b`` over
    the repeats both hold (each side ``(baseline, column)``), or None when they cannot be paired: other repeats,
    a sample seed that differs, < 2 pairs."""
    xs, ys = _per_repeat(group, *a), _per_repeat(group, *b)
    if set(xs) != set(ys) or len(xs) < 2 or any(xs[r][1] != ys[r][1] for r in xs):
        return None
    diffs = [xs[r][0] - k * ys[r][0] for r in sorted(xs)]
    if not all(math.isfinite(d) for d in diffs):
        return Interval(None, None, "a paired difference exceeds the float range")
    if len(set(diffs)) == 1:
        return Interval(None, None, f"paired difference: {_flat(len(diffs), diffs[0])}")
    mean, std = scaled_moments(diffs)
    stats = summary_stats(mean, std, len(diffs), lower=None, coverage=coverage)
    if stats["ci95_low"] is None:
        return Interval(None, None, f"paired difference: {stats.get('no_interval', 'no interval')}")
    return Interval(stats["ci95_low"], stats["ci95_high"], f"paired by repeat, n={len(diffs)}")


def _difference(text: str, d: Interval, *, strict: bool) -> dict:
    """A paired difference that must be > 0 (``strict``) or ≥ 0: PASS / FAIL / INCONCLUSIVE on its interval."""
    if not d.known:
        return _result(INCONCLUSIVE, f"{text}: {d.why}")
    about = f"{text}, {d.why}: 95% interval {_fmt(d)}"
    if (d.low > 0) if strict else (d.low >= 0):
        return _result(PASS, f"{about} {'>' if strict else '>='} 0: holds")
    if (d.high <= 0) if strict else (d.high < 0):
        return _result(FAIL, f"{about} {'<=' if strict else '<'} 0: fails")
    return _result(INCONCLUSIVE, f"{about} straddles 0")


def _result(status: str, summary: str = "") -> dict[str, str]:
    return {"status": status, "summary": summary}


def _fmt(i: Interval, scale: float = 1.0) -> str:
    return f"[{i.low * scale:.4g}, {i.high * scale:.4g}]"


def _threshold(name: str, i: Interval, at_least: float | None = None, at_most: float | None = None) -> dict:
    """One interval against a threshold (``at_least``: the value must be ≥ it; ``at_most``: ≤ it)."""
    if not i.known:
        return _result(INCONCLUSIVE, i.why)
    text = f"{name} 95% interval {_fmt(i)}"
    if at_least is not None:
        if i.low >= at_least:
            return _result(PASS, f"{text} >= {at_least:g}")
        if i.high < at_least:
            return _result(FAIL, f"{text} < {at_least:g}")
        return _result(INCONCLUSIVE, f"{text} straddles {at_least:g}")
    if i.high <= at_most:
        return _result(PASS, f"{text} <= {at_most:g}")
    if i.low > at_most:
        return _result(FAIL, f"{text} > {at_most:g}")
    return _result(INCONCLUSIVE, f"{text} straddles {at_most:g}")


def _combine(parts: list[dict[str, str]]) -> dict[str, str]:
    """Several comparisons of one gate: FAIL if any fails, PASS if all pass, else INCONCLUSIVE."""
    for status in (FAIL, INCONCLUSIVE):
        hit = [p["summary"] for p in parts if p["status"] == status]
        if hit:
            return _result(status, "; ".join(hit))
    return _result(PASS, "; ".join(p["summary"] for p in parts))


def _below(left: str, a: Interval, right: str, b: Interval, *, loose: bool = False) -> dict:
    """``a < b`` (``a ≤ b`` when loose) on intervals: apart on the right side passes, on the wrong side fails."""
    if not a.known or not b.known:
        return _result(INCONCLUSIVE, a.why or b.why)
    op = "<=" if loose else "<"
    text = f"{left} {_fmt(a)} vs {right} {_fmt(b)}"
    if (a.high <= b.low) if loose else (a.high < b.low):
        return _result(PASS, f"{text}: {op} holds")
    if (a.low > b.high) if loose else (a.low >= b.high):
        return _result(FAIL, f"{text}: {op} fails")
    return _result(INCONCLUSIVE, f"{text}: intervals overlap")


def _bm1(matrix: Matrix, group: Group, mean: dict, gates: Gates, detail: dict) -> dict:
    key = group.key
    parts = []
    for b in detail.get("bm1", {}):
        d = paired(group, (b, "t_verify_seconds"), (b, "t_router_seconds"), coverage=matrix.coverage)
        if d is not None:
            parts.append(_difference(f"{b} t_verify - t_router", d, strict=True))
            continue
        router, verify = (
            interval(matrix, key, b, "t_router_seconds"),
            interval(matrix, key, b, "t_verify_seconds"),
        )
        parts.append(_below(f"{b} t_router", router, "t_verify", verify))
    return _combine(parts) if parts else _result(INCONCLUSIVE, mean["summary"])


def _hide(matrix: Matrix, group: Group, mean: dict, gates: Gates, detail: dict) -> dict:
    if any(p.row.hide_mismatch for ps in group.by_baseline.values() for p in ps):
        return _result(FAIL, mean["summary"])
    margin = interval(matrix, group.key, CANDIDATE, "hide_inequality.margin_seconds")
    return _threshold(f"{CANDIDATE} hide margin (window - fetch, s)", margin, at_least=0.0)


def _speedup(matrix: Matrix, group: Group, mean: dict, gates: Gates, detail: dict) -> dict:
    b0 = interval(matrix, group.key, BASE, TOKENS)
    k = gates.min_speedup_over_b0
    parts = []
    for b in mean.get("per_baseline", {}):
        d = paired(group, (b, TOKENS), (BASE, TOKENS), k, coverage=matrix.coverage)
        if d is not None:
            parts.append(_difference(f"{b} - {k:g} x {BASE} tokens/s", d, strict=False))
        else:
            parts.append(_at_least_times(b, interval(matrix, group.key, b, TOKENS), b0, k))
    return _combine(parts) if parts else _result(INCONCLUSIVE, f"no configuration besides {BASE}")


def _at_least_times(name: str, x: Interval, b0: Interval, k: float) -> dict:
    """``x ≥ k·b0`` on intervals (the speedup gate)."""
    if not x.known or not b0.known:
        return _result(INCONCLUSIVE, x.why or b0.why)
    text = f"{name} tokens/s {_fmt(x)} vs {k:g} x {BASE} {_fmt(b0, k)}"
    if x.low >= k * b0.high:
        return _result(PASS, f"{text}: speedup holds")
    if x.high < k * b0.low:
        return _result(FAIL, f"{text}: speedup fails")
    return _result(INCONCLUSIVE, f"{text}: intervals overlap")


def _coverage(matrix: Matrix, group: Group, mean: dict, gates: Gates, detail: dict) -> dict:
    i = interval(matrix, group.key, CANDIDATE, "route_ahead_prefetch_coverage")
    return _threshold(f"{CANDIDATE} coverage", i, at_least=gates.min_coverage)


def _waste(matrix: Matrix, group: Group, mean: dict, gates: Gates, detail: dict) -> dict:
    i = interval(matrix, group.key, CANDIDATE, "route_ahead.waste_ratio")
    return _threshold(f"{CANDIDATE} waste ratio", i, at_most=gates.max_waste_ratio)


def _ordering(matrix: Matrix, group: Group, mean: dict, gates: Gates, detail: dict) -> dict:
    chain = list(mean.get("tokens_per_second", {}))
    parts = []
    for left, right in pairwise(chain):
        loose = ordering_step_loose(left, right)
        d = paired(group, (right, TOKENS), (left, TOKENS), coverage=matrix.coverage)
        if d is not None:
            parts.append(_difference(f"{right} - {left} tokens/s", d, strict=not loose))
            continue
        a, b = interval(matrix, group.key, left, TOKENS), interval(matrix, group.key, right, TOKENS)
        parts.append(_below(f"{left} tokens/s", a, right, b, loose=loose))
    return _combine(parts) if parts else _result(INCONCLUSIVE, mean["summary"])


_RULES: dict[str, Callable[[Matrix, Group, dict, Gates, dict], dict]] = {
    "bm1": _bm1,
    "hide_inequality": _hide,
    "speedup_over_b0": _speedup,
    "coverage": _coverage,
    "waste": _waste,
    "ordering": _ordering,
}


def group_confidence(matrix: Matrix, group: Group, gates: Gates, detail: dict[str, Any]) -> dict[str, dict]:
    """Every verdict gate of one group on intervals; a gate not evaluated on means is INCONCLUSIVE here, a
    disabled one stays disabled."""
    out = {}
    for name in VERDICT_GATES:
        mean = detail["gates"][name]
        if mean["status"] == DISABLED:
            out[name] = _result(DISABLED, mean["summary"])
        elif mean["status"] == NOT_EVALUATED:
            out[name] = _result(INCONCLUSIVE, f"not evaluated: {mean['summary']}")
        else:
            out[name] = _RULES[name](matrix, group, mean, gates, detail)
    return out


def confidence_verdict(matrix: Matrix, details: dict[str, dict[str, Any]], gates: Gates) -> dict[str, Any]:
    """Adds ``confidence`` (gate → PASS/FAIL/INCONCLUSIVE) to every group's detail; returns the overall verdict:
    NO-GO if any gate fails somewhere; GO if every group is complete and valid and every enabled gate passes
    everywhere; INCONCLUSIVE otherwise. ``line`` gives the count of each."""
    for key, detail in details.items():
        group = matrix.groups.get(key) or Group(*_split(key))
        detail["confidence"] = group_confidence(matrix, group, gates, detail)
    return tally(details)


def tally(details: dict[str, dict[str, Any]], on: str = "95% intervals") -> dict[str, Any]:
    """The overall confidence-aware verdict from every group's ``confidence`` (``on`` names the intervals in the
    line: an adaptive run's are its looks', report/adaptive.py)."""
    counts = {PASS: 0, FAIL: 0, INCONCLUSIVE: 0}
    first_fail = None
    for key, detail in details.items():
        for name, g in detail["confidence"].items():
            if g["status"] in counts:
                counts[g["status"]] += 1
            if g["status"] == FAIL and first_fail is None:
                first_fail = f"{key} {name}: {g['summary']}"
    complete = bool(details) and all(d["complete"] and d["valid"] for d in details.values())
    if counts[FAIL]:
        verdict = "NO-GO"
    elif complete and not counts[INCONCLUSIVE] and counts[PASS]:
        verdict = "GO"
    else:
        verdict = "INCONCLUSIVE"
    text = f"{counts[PASS]} pass, {counts[FAIL]} fail, {counts[INCONCLUSIVE]} inconclusive"
    if not complete and details:
        text += "; some groups incomplete"
    return {
        "verdict": verdict,
        "counts": counts,
        "first_fail": first_fail,
        "line": f"{verdict} on {on} ({text})",
    }


def _split(key: str) -> tuple[str, int, int]:
    model, b, c = key.rsplit("|", 2)
    return model, int(b[1:]), int(c[1:])
