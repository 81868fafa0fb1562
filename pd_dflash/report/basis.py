"""What a verdict rests on: the link and device the measured rows ran on, where their bandwidth came from, and how
many repeats each group has (docs/metrics.md §7, "Basis").

A CPU sweep over an emulated link (``make run``) exercises the whole pipeline, but its gates say nothing about
route-ahead on hardware; a single repeat on a shared machine is one sample of a noisy quantity. Both are facts of
the rows, so the verdict states them instead of leaving a reader to find them in ``cost_terms``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pd_dflash.report.aggregate import Matrix

#: ``cost_terms.h2d_link`` values that are no device link: the CPU engine's emulated link, or host copies.
NOT_HARDWARE_LINKS = frozenset({"emulated", "host"})
PIPELINE_CHECK = "pipeline check, not a hardware verdict"
UNRECORDED = "not recorded"


def _rows(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


def _is_cpu(device: str) -> bool:
    return device == "cpu" or device.startswith("cpu:")


def verdict_basis(matrix: Matrix) -> dict[str, Any]:
    """Counts over the distinct measured rows (a B0 row shared across block sizes counts once), the repeats of
    every group (the fewest measured repeats of any of its baselines), and whether this is a hardware verdict."""
    seen: set[tuple] = set()
    links: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    devices: Counter[str] = Counter()
    gbps: set[float] = set()
    for group in matrix.groups.values():
        for placed in group.by_baseline.values():
            for p in placed:
                if not p.measured or p.row.identity in seen:
                    continue
                seen.add(p.row.identity)
                terms = p.row.cost_terms or {}
                links[terms.get("h2d_link") or UNRECORDED] += 1
                if terms.get("h2d_link") != "none":  # every expert resident: no bandwidth to measure
                    sources[terms.get("h2d_bandwidth_source") or UNRECORDED] += 1
                devices[p.row.device or UNRECORDED] += 1
                if terms.get("h2d_link") == "emulated" and terms.get("emulated_h2d_gbps") is not None:
                    gbps.add(float(terms["emulated_h2d_gbps"]))
    repeats = {key: _group_repeats(matrix, key) for key in matrix.groups}
    reasons = [f"{link} link ({_rows(n)})" for link, n in sorted(links.items()) if link in NOT_HARDWARE_LINKS]
    reasons += [f"{d} device ({_rows(n)})" for d, n in sorted(devices.items()) if _is_cpu(d)]
    unknown = UNRECORDED in links or UNRECORDED in devices
    return {
        #: True only when every measured row names a device link (or none: all resident) and a non-CPU device.
        "hardware_verdict": bool(seen) and not reasons and not unknown,
        "pipeline_check": bool(reasons),
        "not_hardware_because": reasons,
        "measured_rows": len(seen),
        "h2d_link": dict(sorted(links.items())),
        "h2d_bandwidth_source": dict(sorted(sources.items())),
        "emulated_h2d_gbps": sorted(gbps),
        "device": dict(sorted(devices.items())),
        "repeats_per_group": repeats,
        "min_repeats": min(repeats.values(), default=0),
        "max_repeats": max(repeats.values(), default=0),
    }


def _group_repeats(matrix: Matrix, key: str) -> int:
    """The fewest measured repeats of any baseline of the group that has one (0 when nothing was measured)."""
    counts = [sum(p.measured for p in ps) for ps in matrix.groups[key].by_baseline.values()]
    return min((n for n in counts if n), default=0)


def _counted(counts: dict[str, int]) -> str:
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{k} ({_rows(n)})" for k, n in counts.items())


def _link_text(basis: dict[str, Any]) -> str:
    gbps = "/".join(f"{g:g}" for g in basis["emulated_h2d_gbps"])

    def name(link: str) -> str:
        if link == "none":
            return "none (all experts resident)"
        return f"emulated {gbps} GB/s" if link == "emulated" and gbps else link

    links = basis["h2d_link"]
    if list(links) == [UNRECORDED]:
        return "link not recorded"
    if len(links) == 1:
        return f"{name(next(iter(links)))} link"
    return "links " + ", ".join(f"{name(k)} ({_rows(n)})" for k, n in links.items())


def basis_text(basis: dict[str, Any]) -> str:
    """One clause for the verdict line, e.g. ``basis: emulated link 0.05 GB/s, device cpu, bandwidth from
    transfers, 1 repeat per group (no interval)``."""
    if not basis["measured_rows"]:
        return "basis: no measured rows"
    link = _link_text(basis)
    lo, hi = basis["min_repeats"], basis["max_repeats"]
    reps = f"{lo} repeat{'s' if lo != 1 else ''}" if lo == hi else f"{lo}-{hi} repeats"
    reps += " per group" + (" (no interval)" if lo < 2 else "")
    sources = basis["h2d_bandwidth_source"]
    if not sources:
        source = "no bandwidth (nothing offloaded)"
    elif list(sources) == [UNRECORDED]:
        source = "bandwidth source not recorded"
    else:
        source = f"bandwidth from {_counted(sources)}"
    return f"basis: {link}, device {_counted(basis['device'])}, {source}, {reps}"


def verdict_line(on_means: dict[str, Any], confidence: dict[str, Any], basis: dict[str, Any]) -> str:
    """The one line ``run`` and ``report`` print: both verdicts and what they rest on, e.g. ``go/no-go (pipeline
    check, not a hardware verdict): NO-GO on means (...); INCONCLUSIVE on 95% intervals (...); basis: ...``."""
    head = f"go/no-go ({PIPELINE_CHECK})" if basis["pipeline_check"] else "go/no-go"
    return (
        f"{head}: {on_means['verdict']} on means ({on_means['because']}); {confidence['line']}; "
        f"{basis_text(basis)}"
    )
