"""`pd-dflash overlap`: upstream's BM4 host→device / compute overlap from ``nsys stats`` CSV exports.

Inputs are the two reports upstream's ``parse_overlap`` reads (docs/operators.md §6), exported with
``nsys stats --report cuda_gpu_trace,nvtx_pushpop_trace --format csv --output <prefix> <rep>.nsys-rep``:

- H2D memcpys: rows whose name mentions HtoD or "Host-to-Device" (``[CUDA memcpy HtoD]``,
  ``[CUDA memcpy Host-to-Device]``); bytes from the ``Bytes`` column scaled by its unit (``Bytes (MB)`` × 1e6,
  exactly, as decimal text: no float rounding of the byte count);
- compute spans: the union of the NVTX push/pop ranges named in ``--compute-range`` (default ``dflash_draft``,
  ``route_ahead_router``, ``target_verify``; ``route_ahead_issue`` and ``expert_h2d`` issue transfers, they do
  not hide them), matched after stripping the ``:`` nsys prefixes to default-domain ranges (named domains such
  as ``CCCL:`` are kept, so they never match a bare name).

Each memcpy contributes ``bytes × overlapped duration / duration`` against the union of the spans (overlapping
ranges are unioned, so nothing counts twice); a zero-duration memcpy counts fully only if its start lies in a
span. ``overlap_fraction`` = overlapped / total bytes (0 without bytes). With ``--h2d-gbps`` (a measured
bandwidth, e.g. ``pd-dflash probe``) the overlapped bytes become ``overlap_with_prev_verify_seconds``, the
overlap term of the hide inequality. ``--rep`` runs ``nsys stats`` itself, as upstream did. No torch, no Ray.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from pd_dflash.errors import InputError
from pd_dflash.intervals import merge

DEFAULT_COMPUTE_RANGES: tuple[str, ...] = ("dflash_draft", "route_ahead_router", "target_verify")
_TIME_UNITS = {
    "ns": Decimal(1),
    "us": Decimal(1_000),
    "μs": Decimal(1_000),
    "ms": Decimal(10**6),
    "s": Decimal(10**9),
}
_BYTE_UNITS = {"b": Decimal(1), "kb": Decimal(10**3), "mb": Decimal(10**6), "gb": Decimal(10**9)}
_UNIT = re.compile(r"\(([^)]*)\)\s*$")


@dataclass(frozen=True)
class Memcpy:
    start_ns: float
    end_ns: float
    nbytes: int


@dataclass(frozen=True)
class NvtxRange:
    name: str
    start_ns: float
    end_ns: float


@dataclass(frozen=True)
class _Table:
    path: Path
    header: list[str]
    #: (line number, row as header → cell)
    rows: list[tuple[int, dict[str, str]]]


def _read_table(path: str | Path, *, what: str) -> _Table:
    """A ``nsys stats`` CSV: the header is the first row with a ``Start`` column (preamble lines skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise InputError(f"cannot read {what} CSV: {exc.strerror or exc}", where=str(path)) from None
    header: list[str] | None = None
    rows: list[tuple[int, dict[str, str]]] = []
    for number, record in enumerate(csv.reader(text.splitlines()), start=1):
        cells = [c.strip() for c in record]
        if not any(cells):
            continue
        if header is None:
            if any(c.lower().startswith("start") for c in cells):
                header = cells
            continue
        rows.append((number, dict(zip(header, cells, strict=False))))
    if header is None:
        raise InputError(
            f"no header row with a 'Start' column: is this an nsys {what} CSV export?", where=str(path)
        )
    return _Table(path, header, rows)


def _column(table: _Table, *prefixes: str, required: bool = True) -> str | None:
    for prefix in prefixes:
        for name in table.header:
            if name.lower().startswith(prefix.lower()):
                return name
    if required:
        raise InputError(
            f"missing a column starting with {' or '.join(repr(p) for p in prefixes)} (header: {table.header})",
            where=str(table.path),
        )
    return None


def _scale(column: str, units: dict[str, Decimal], default: Decimal, table: _Table) -> Decimal:
    match = _UNIT.search(column)
    if not match:
        return default
    unit = match.group(1).strip().lower()
    if unit not in units:
        raise InputError(f"column {column!r}: unknown unit {unit!r}", where=str(table.path))
    return units[unit]


def _decimal(table: _Table, line: int, column: str, value: str) -> Decimal:
    try:
        return Decimal(value.replace(",", "").strip())
    except InvalidOperation:
        raise InputError(
            f"column {column!r}: not a number: {value!r}", where=f"{table.path}:{line}"
        ) from None


def _timing(table: _Table) -> tuple[str, Decimal, str | None, str | None, Decimal]:
    start = _column(table, "Start")
    duration = _column(table, "Duration", required=False)
    end = None if duration else _column(table, "End")
    return (
        start,
        _scale(start, _TIME_UNITS, Decimal(1), table),
        duration,
        end,
        _scale(duration or end, _TIME_UNITS, Decimal(1), table),
    )


def _interval(table: _Table, line: int, row: dict[str, str], timing) -> tuple[float, float]:
    start_col, start_scale, duration_col, end_col, other_scale = timing
    start = _decimal(table, line, start_col, row[start_col]) * start_scale
    if duration_col:
        end = start + _decimal(table, line, duration_col, row[duration_col]) * other_scale
    else:
        end = _decimal(table, line, end_col, row[end_col]) * other_scale
    if end < start:
        raise InputError("range ends before it starts", where=f"{table.path}:{line}")
    return float(start), float(end)


def is_h2d(name: str) -> bool:
    lowered = name.lower()
    return "htod" in lowered or "host-to-device" in lowered


def read_memcpys(path: str | Path) -> list[Memcpy]:
    """Host→device memcpys of a ``cuda_gpu_trace`` export, with exact byte counts."""
    table = _read_table(path, what="cuda_gpu_trace")
    timing = _timing(table)
    name_col = _column(table, "Name")
    bytes_col = _column(table, "Bytes", "Size")
    byte_scale = _scale(bytes_col, _BYTE_UNITS, Decimal(1), table)
    memcpys = []
    for line, row in table.rows:
        if not is_h2d(row.get(name_col, "")):
            continue
        start, end = _interval(table, line, row, timing)
        nbytes = _decimal(table, line, bytes_col, row[bytes_col]) * byte_scale
        memcpys.append(Memcpy(start, end, int(nbytes.to_integral_value())))
    return memcpys


def read_ranges(path: str | Path) -> list[NvtxRange]:
    """Push/pop ranges of an ``nvtx_pushpop_trace`` export (names as nsys prints them)."""
    table = _read_table(path, what="nvtx_pushpop_trace")
    timing = _timing(table)
    name_col = _column(table, "Name", "Text")
    ranges = []
    for line, row in table.rows:
        name = row.get(name_col, "")
        if name:
            ranges.append(NvtxRange(name, *_interval(table, line, row, timing)))
    return ranges


def strip_empty_domain(name: str) -> str:
    """nsys renders a default-domain range as ``:name``; named domains (``CCCL:...``) stay as they are."""
    return name[1:] if name.startswith(":") else name


def hidden_fraction(memcpy: Memcpy, spans: Sequence[tuple[float, float]]) -> float:
    """Fraction of one memcpy's duration inside the spans (instant copies: 1 if inside a span, else 0)."""
    duration = memcpy.end_ns - memcpy.start_ns
    if duration <= 0:
        return 1.0 if any(lo <= memcpy.start_ns <= hi for lo, hi in spans) else 0.0
    covered = sum(max(0.0, min(memcpy.end_ns, hi) - max(memcpy.start_ns, lo)) for lo, hi in spans)
    return min(max(covered / duration, 0.0), 1.0)


def compute_overlap(
    memcpys: Sequence[Memcpy],
    ranges: Sequence[NvtxRange],
    compute_ranges: Sequence[str] = DEFAULT_COMPUTE_RANGES,
) -> dict[str, Any]:
    names = {strip_empty_domain(n) for n in compute_ranges}
    spans = merge(
        ((r.start_ns, r.end_ns) for r in ranges if strip_empty_domain(r.name) in names), keep_empty=True
    )
    total = sum(m.nbytes for m in memcpys)
    overlapped = sum(m.nbytes * hidden_fraction(m, spans) for m in memcpys)
    return {
        "total_h2d_bytes": total,
        "overlapped_h2d_bytes": overlapped,
        "overlap_fraction": overlapped / total if total > 0 else 0.0,
        "exposed_fetch_bytes": total - overlapped,
        "num_memcpys": len(memcpys),
    }


def range_totals(ranges: Sequence[NvtxRange]) -> dict[str, dict[str, float]]:
    """Count and summed seconds per range name (``:`` stripped): t_draft, t_router, t_verify for BM1/hide."""
    totals: dict[str, dict[str, float]] = {}
    for r in ranges:
        entry = totals.setdefault(strip_empty_domain(r.name), {"count": 0, "seconds": 0.0})
        entry["count"] += 1
        entry["seconds"] += (r.end_ns - r.start_ns) / 1e9
    return dict(sorted(totals.items()))


def overlap_report(
    gpu_trace: str | Path,
    nvtx_trace: str | Path,
    compute_ranges: Sequence[str] | None = None,
    h2d_gbps: float | None = None,
) -> dict[str, Any]:
    """Upstream's BM4 JSON (same keys) plus the overlap seconds, per-range totals and the input paths."""
    compute = list(compute_ranges) if compute_ranges else list(DEFAULT_COMPUTE_RANGES)
    if h2d_gbps is not None and not (h2d_gbps > 0 and h2d_gbps != float("inf")):
        raise InputError(f"must be a positive, finite GB/s figure, got {h2d_gbps}", where="--h2d-gbps")
    ranges = read_ranges(nvtx_trace)
    result = compute_overlap(read_memcpys(gpu_trace), ranges, compute)
    gpu_trace = str(gpu_trace)
    rep = (
        gpu_trace.removesuffix("_cuda_gpu_trace.csv")
        if gpu_trace.endswith("_cuda_gpu_trace.csv")
        else gpu_trace
    )
    report: dict[str, Any] = {"benchmark": "BM4", "rep": rep, **result, "compute_ranges": compute}
    if h2d_gbps is not None:
        bandwidth = h2d_gbps * 1e9
        report["h2d_bytes_per_second"] = bandwidth
        report["overlap_with_prev_verify_seconds"] = result["overlapped_h2d_bytes"] / bandwidth
    report["range_totals"] = range_totals(ranges)
    report["gpu_trace"] = gpu_trace
    report["nvtx_trace"] = str(nvtx_trace)
    return report


NSYS_REPORTS = ("cuda_gpu_trace", "nvtx_pushpop_trace")


def export_nsys_reports(rep: str | Path, nsys: str = "nsys") -> tuple[Path, Path]:
    """Run ``nsys stats`` on a report as upstream's parse_overlap does; return the two CSV paths.

    nsys writes ``<prefix>_cuda_gpu_trace.csv`` and ``<prefix>_nvtx_pushpop_trace.csv`` next to the report.
    """
    rep = Path(rep)
    if not rep.is_file():
        raise InputError("no such .nsys-rep file", where=str(rep))
    binary = shutil.which(nsys)
    if binary is None:
        raise InputError(
            "nsys is not on PATH (install Nsight Systems, or export the CSVs elsewhere and pass --gpu-trace "
            "and --nvtx-trace)",
            where="--rep",
        )
    prefix = rep.with_suffix("")
    command = [binary, "stats", *(f"--report={r}" for r in NSYS_REPORTS), "--format=csv",
               "--force-export=true", "--force-overwrite=true", f"--output={prefix}", str(rep)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    outputs = tuple(Path(f"{prefix}_{r}.csv") for r in NSYS_REPORTS)
    if done.returncode != 0 or not all(p.is_file() for p in outputs):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise InputError(f"nsys stats failed (exit {done.returncode}): {' | '.join(tail)}", where=str(rep))
    return outputs[0], outputs[1]


def overlap_main(args: argparse.Namespace) -> int:
    gpu_trace, nvtx_trace = getattr(args, "gpu_trace", None), getattr(args, "nvtx_trace", None)
    rep = getattr(args, "rep", None)
    if rep and (gpu_trace or nvtx_trace):
        raise InputError("give either --rep or both --gpu-trace and --nvtx-trace, not both", where="--rep")
    if rep:
        gpu_trace, nvtx_trace = export_nsys_reports(rep)
    elif not (gpu_trace and nvtx_trace):
        raise InputError("needs --rep, or both --gpu-trace and --nvtx-trace", where="pd-dflash overlap")
    report = overlap_report(gpu_trace, nvtx_trace, args.compute_range, args.h2d_gbps)
    text = json.dumps(report, indent=2, sort_keys=True) + "\n"
    if args.output:
        from pd_dflash.rows import write_atomic

        out = Path(args.output)
        if out.parent and not out.parent.exists():
            raise InputError("directory does not exist", where=str(out.parent))
        write_atomic(out, text)
    print(text, end="")
    return 0
