"""Route-ahead statistics: how well a prefetcher's predicted experts match what a verify pass really routed.

Upstream semantics (MoE-Infinity's ``moe_infinity/spec_decode/_route_ahead_stats.py``; docs/reference-engine.md,
"Route-ahead statistics"): a read-only observer with a per-verify-step lifecycle ``begin_step`` →
``observe_layer`` (one call per MoE layer) → ``commit_step(kept_rows)``. Per observed layer, at commit:

- A      = union of the experts routed by any token row of the verify block (the "actual" set);
- U_keep = union over the kept rows only (anchor + accepted drafts: the rows whose work survives);
- P      = the predicted (prefetched) expert set.

predicted = Σ|P|, actual = Σ|A|, covered = Σ|P∩A|, kept = Σ|U_keep|, wasted = Σ|P \\ U_keep|;
coverage = covered/actual (1.0 when actual == 0, upstream's vacuous value, flagged by ``vacuous``) and
waste_ratio = wasted/predicted (0.0 when predicted == 0), both ratios of sums over layers and steps. Bytes are
counted over P only (predicted = kept + wasted by construction); they stay None until a step that carried an
``expert_nbytes`` map is committed, so no expert size is ever invented.

Pure Python on purpose (no torch import): the AR prefetcher, the route-ahead prefetcher and the tests all
feed it. Tensors are accepted duck-typed through ``.tolist()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pd_dflash.upstream import ROUTE_AHEAD_KEYS

RoutedKind = Literal["auto", "mask", "ids"]


@dataclass(frozen=True)
class RouteAheadStepSummary:
    """What one committed verify step added to the counters (all zero / None for a step with no layer)."""

    layers: int = 0
    predicted: int = 0
    actual: int = 0
    covered: int = 0
    kept: int = 0
    wasted: int = 0
    predicted_bytes: int | None = None
    kept_bytes: int | None = None
    wasted_bytes: int | None = None


@dataclass(frozen=True)
class _LayerRecord:
    layer_id: int
    predicted: frozenset[int]
    rows: tuple[frozenset[int], ...]  # per token row: the experts it routed to
    expert_nbytes: Mapping[int, int] | None


def _dtype_kind(value: Any) -> str | None:
    """'bool' / 'int' / 'float' for a tensor or array, None for plain Python sequences."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return None
    name = str(dtype).lower()
    if "bool" in name:
        return "bool"
    if "int" in name:  # int8..int64, uint8
        return "int"
    return "float"


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or type(x).__name__ in ("bool", "bool_")  # numpy bool scalars too


def _ndim(value: Any) -> int | None:
    ndim = getattr(value, "ndim", None)
    if ndim is None and hasattr(value, "dim"):
        ndim = value.dim()
    return None if ndim is None else int(ndim)


def routed_rows(routed: Any, kind: RoutedKind = "auto") -> tuple[frozenset[int], ...]:
    """Normalise ``routed`` to one expert-id set per token row.

    ``routed`` is either a 2-D mask ``[tokens, experts]`` (a bool tensor/array or a list of lists of bools;
    with ``kind="mask"`` any truthy entry counts as routed) or, per token, an iterable of routed expert ids
    (an integer ``[tokens, top_k]`` tensor or a list of id lists). ``kind="auto"`` decides by element type:
    bool → mask, integer → ids; a float tensor needs an explicit ``kind``. A mask that is not 2-D raises
    ValueError.
    """
    if kind not in ("auto", "mask", "ids"):
        raise ValueError(f"routed kind must be 'auto', 'mask' or 'ids', got {kind!r}")
    if _dtype_kind(routed) is not None:  # tensor / array
        routed, kind = _tensor_rows(routed, kind)
    rows = _python_rows(routed)
    if kind == "auto":
        kind = _kind_of_entries(rows)
    return _mask_rows(rows) if kind == "mask" else _id_rows(rows)


def _tensor_rows(routed: Any, kind: RoutedKind) -> tuple[list, RoutedKind]:
    """A 2-D tensor or array as nested lists, and its kind (auto: decided by its dtype)."""
    dtype_kind = _dtype_kind(routed)
    if kind == "auto":
        if dtype_kind == "float":
            raise ValueError(
                "routed is a float tensor: pass kind='mask' for a [tokens, experts] mask or kind='ids'"
            )
        kind = "mask" if dtype_kind == "bool" else "ids"
    ndim = _ndim(routed)
    if ndim != 2:
        what = "router mask" if kind == "mask" else "routed expert ids"
        raise ValueError(
            f"{what} must be 2-D [tokens, {'experts' if kind == 'mask' else 'top_k'}], got {ndim}-D"
        )
    return routed.tolist(), kind


def _python_rows(routed: Any) -> list[list]:
    """One list per token row; a 1-D input (a flat mask or id list) is rejected."""
    if isinstance(routed, (str, bytes)) or not isinstance(routed, Iterable):
        raise ValueError(
            f"routed must be a 2-D mask or a sequence of per-token expert ids, got {type(routed).__name__}"
        )
    rows = [r.tolist() if hasattr(r, "tolist") else r for r in routed]
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
            raise ValueError(
                f"routed must be 2-D: row {i} is a {type(row).__name__}, not a sequence "
                "(a 1-D mask or a flat id list is not accepted)"
            )
    return [list(r) for r in rows]


def _kind_of_entries(rows: list[list]) -> RoutedKind:
    """All bools: a mask; no bool: ids; a mix is ambiguous."""
    entries = [x for r in rows for x in r]
    is_mask = bool(entries) and all(_is_bool(x) for x in entries)
    if not is_mask and any(_is_bool(x) for x in entries):
        raise ValueError("routed mixes bools and ids; pass kind='mask' or kind='ids'")
    return "mask" if is_mask else "ids"


def _mask_rows(rows: list[list]) -> tuple[frozenset[int], ...]:
    widths = {len(r) for r in rows}
    if len(widths) > 1:
        raise ValueError(f"router mask must be 2-D and rectangular, got row widths {sorted(widths)}")
    for r in rows:
        for x in r:
            if isinstance(x, (list, tuple)):
                raise ValueError("router mask must be 2-D, got a deeper nesting")
    return tuple(frozenset(j for j, x in enumerate(r) if x) for r in rows)


def _id_rows(rows: list[list]) -> tuple[frozenset[int], ...]:
    out = []
    for i, r in enumerate(rows):
        ids = set()
        for x in r:
            if isinstance(x, (list, tuple)):
                raise ValueError(f"routed expert ids must be 2-D, row {i} nests deeper")
            if _is_bool(x) or int(x) != x or x < 0:
                raise ValueError(f"routed expert id {x!r} in row {i} is not a non-negative integer")
            ids.add(int(x))
        out.append(frozenset(ids))
    return tuple(out)


def _nbytes(ids: Iterable[int], nbytes: Mapping[int, int] | None) -> int:
    if not nbytes:
        return 0
    return sum(int(nbytes.get(e, 0)) for e in ids)  # an expert missing from the map counts 0 (upstream)


def _kept_indices(
    rows: int, kept_rows: int | None, kept_spans: Sequence[tuple[int, int]] | None
) -> Iterable[int]:
    """The kept row indices of a layer with ``rows`` rows: a prefix, or the union of spans, clipped."""
    if kept_spans is None:
        return range(max(0, min(int(kept_rows), rows)))
    return sorted({i for a, b in kept_spans for i in range(max(0, int(a)), min(int(b), rows))})


def _step_summary(
    records: list[_LayerRecord], kept_rows: int | None, kept_spans: Sequence[tuple[int, int]] | None
) -> RouteAheadStepSummary:
    """The set math of one verify step, summed over its layers (see the module docstring)."""
    predicted = actual = covered = kept = wasted = 0
    p_bytes = k_bytes = w_bytes = 0
    for rec in records:
        keep_idx = _kept_indices(len(rec.rows), kept_rows, kept_spans)
        u_all: set[int] = set().union(*rec.rows) if rec.rows else set()
        u_keep: set[int] = set().union(*(rec.rows[i] for i in keep_idx))
        p = rec.predicted
        waste_set = p - u_keep
        predicted += len(p)
        actual += len(u_all)
        covered += len(p & u_all)
        kept += len(u_keep)
        wasted += len(waste_set)
        p_bytes += _nbytes(p, rec.expert_nbytes)
        k_bytes += _nbytes(p & u_keep, rec.expert_nbytes)
        w_bytes += _nbytes(waste_set, rec.expert_nbytes)
    has_bytes = any(rec.expert_nbytes is not None for rec in records)
    return RouteAheadStepSummary(
        layers=len(records),
        predicted=predicted,
        actual=actual,
        covered=covered,
        kept=kept,
        wasted=wasted,
        predicted_bytes=p_bytes if has_bytes else None,
        kept_bytes=k_bytes if has_bytes else None,
        wasted_bytes=w_bytes if has_bytes else None,
    )


class RouteAheadStats:
    """Accumulates route-ahead counters over committed verify steps (read-only observer, upstream semantics)."""

    def __init__(self) -> None:
        self._pending: list[_LayerRecord] = []
        self.steps = 0
        self.layers_observed = 0
        self.predicted_experts = 0
        self.actual_experts = 0
        self.covered_experts = 0
        self.kept_experts = 0
        self.wasted_experts = 0
        self.predicted_prefetch_bytes: int | None = None
        self.kept_prefetch_bytes: int | None = None
        self.wasted_prefetch_bytes: int | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a verify step; drops uncommitted records so an aborted step cannot corrupt the counters."""
        self._pending = []

    def observe_layer(
        self,
        layer_id: int,
        predicted_ids: Iterable[int],
        routed: Any,
        expert_nbytes: Mapping[int, int] | None = None,
        *,
        kind: RoutedKind = "auto",
    ) -> None:
        """Record one MoE layer of the verify forward: the predicted set and what the tokens really routed.

        ``routed`` is a 2-D ``[tokens, experts]`` mask or per-token expert ids (see ``routed_rows``);
        ``expert_nbytes`` maps expert id → stored bytes for this layer. One call per layer per step: a second
        call for the same layer raises ValueError (it would double-count the layer).
        """
        rows = routed_rows(routed, kind)
        if hasattr(predicted_ids, "tolist"):
            predicted_ids = predicted_ids.tolist()
        predicted = frozenset(int(e) for e in predicted_ids)
        layer_id = int(layer_id)
        if any(rec.layer_id == layer_id for rec in self._pending):
            raise ValueError(f"layer {layer_id} observed twice in one verify step")
        self._pending.append(
            _LayerRecord(
                layer_id, predicted, rows, dict(expert_nbytes) if expert_nbytes is not None else None
            )
        )

    def commit_step(
        self, kept_rows: int | None = None, *, kept_spans: Sequence[tuple[int, int]] | None = None
    ) -> RouteAheadStepSummary:
        """Fold the step's layers into the counters and return the step's summary.

        ``kept_rows`` = anchor + accepted drafts (upstream ``accept + 1``): the first ``kept_rows`` rows are
        kept, clamped to ``[0, rows]``. For a verify batched over several requests, pass ``kept_spans``
        instead: ``(start, stop)`` row ranges that are kept (one per request: its anchor row up to its last
        accepted draft); each span is clipped to the layer's rows. Exactly one of the two must be given.
        """
        if (kept_rows is None) == (kept_spans is None):
            raise ValueError("commit_step needs exactly one of kept_rows or kept_spans")
        records, self._pending = self._pending, []
        if not records:
            return RouteAheadStepSummary()
        summary = _step_summary(records, kept_rows, kept_spans)
        self._add(summary)
        return summary

    def _add(self, summary: RouteAheadStepSummary) -> None:
        self.steps += 1
        self.layers_observed += summary.layers
        self.predicted_experts += summary.predicted
        self.actual_experts += summary.actual
        self.covered_experts += summary.covered
        self.kept_experts += summary.kept
        self.wasted_experts += summary.wasted
        if summary.predicted_bytes is not None:
            self.predicted_prefetch_bytes = (self.predicted_prefetch_bytes or 0) + summary.predicted_bytes
            self.kept_prefetch_bytes = (self.kept_prefetch_bytes or 0) + summary.kept_bytes
            self.wasted_prefetch_bytes = (self.wasted_prefetch_bytes or 0) + summary.wasted_bytes

    # -- ratios ----------------------------------------------------------------------------------------------
    @property
    def vacuous(self) -> bool:
        """True when nothing was routed in any committed step: ``coverage`` is then upstream's vacuous 1.0 and
        must be flagged (or left out of a row), never reported as a measurement."""
        return self.actual_experts == 0

    @property
    def coverage(self) -> float:
        """covered / actual over all layers and steps; 1.0 when actual == 0 (see ``vacuous``)."""
        return 1.0 if self.actual_experts == 0 else self.covered_experts / self.actual_experts

    @property
    def waste_ratio(self) -> float:
        """wasted / predicted over all layers and steps; 0.0 when nothing was predicted."""
        return 0.0 if self.predicted_experts == 0 else self.wasted_experts / self.predicted_experts

    def as_dict(self) -> dict[str, int | float | None]:
        """Upstream's ``as_dict``: keys exactly ``ROUTE_AHEAD_KEYS``, in that order."""
        values = {
            "steps": self.steps,
            "layers_observed": self.layers_observed,
            "predicted_experts": self.predicted_experts,
            "actual_experts": self.actual_experts,
            "covered_experts": self.covered_experts,
            "kept_experts": self.kept_experts,
            "wasted_experts": self.wasted_experts,
            "coverage": self.coverage,
            "waste_ratio": self.waste_ratio,
            "predicted_prefetch_bytes": self.predicted_prefetch_bytes,
            "kept_prefetch_bytes": self.kept_prefetch_bytes,
            "wasted_prefetch_bytes": self.wasted_prefetch_bytes,
        }
        return {k: values[k] for k in ROUTE_AHEAD_KEYS}
