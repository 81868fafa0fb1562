"""Fake route-ahead recorders: ``RouteAheadStats`` and the per-session ``RouteUnionCollector``.

``RouteAheadStats`` mirrors TorchMoE/MoE-Infinity@0690efefe42477164031e6020c986650d9f89e6a
``moe_infinity/spec_decode/_route_ahead_stats.py``: per committed verify step, A = union of the routed rows,
U_keep = union of the kept rows, P = predicted; a step with no observed layer leaves every counter untouched
(``steps`` included); byte fields stay None until a step carried ``expert_nbytes``.

``RouteUnionCollector`` mirrors ``RouteUnionCollector`` in TorchMoE/MoE-Infinity@0bfebf51a126613ca73e45426e9952b29ea46c51
``moe_infinity/spec_decode/dflash.py``: it duck-types the recorder slot, ignores the predicted set and keeps only
the union of the experts the last verify actually routed (the next round's admission projection).
"""

from __future__ import annotations

from typing import Any


class RouteAheadStats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._pending: list[tuple[set[int], list[set[int]], dict[int, int] | None]] = []
        self.c = dict.fromkeys(("steps", "layers", "predicted", "actual", "covered", "kept", "wasted"), 0)
        self.bytes: dict[str, int] | None = None

    def begin_step(self) -> None:
        self._pending = []

    def observe_layer(self, layer_id, predicted_ids, router_mask, expert_nbytes=None) -> None:
        self._pending.append((set(predicted_ids), [set(r) for r in router_mask], expert_nbytes))

    def commit_step(self, kept_rows: int) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        self.c["steps"] += 1
        for predicted, rows, nbytes in pending:
            actual = set().union(*rows)
            keep = set().union(*rows[: max(0, min(kept_rows, len(rows)))])
            self.c["layers"] += 1
            self.c["predicted"] += len(predicted)
            self.c["actual"] += len(actual)
            self.c["covered"] += len(predicted & actual)
            self.c["kept"] += len(keep)
            self.c["wasted"] += len(predicted - keep)
            if nbytes is not None:
                b = self.bytes or {"predicted": 0, "kept": 0, "wasted": 0}
                b["predicted"] += sum(nbytes.get(e, 0) for e in predicted)
                b["kept"] += sum(nbytes.get(e, 0) for e in predicted & keep)
                b["wasted"] += sum(nbytes.get(e, 0) for e in predicted - keep)
                self.bytes = b

    def as_dict(self) -> dict[str, Any]:
        c, b = self.c, self.bytes
        return {
            "steps": c["steps"],
            "layers_observed": c["layers"],
            "predicted_experts": c["predicted"],
            "actual_experts": c["actual"],
            "covered_experts": c["covered"],
            "kept_experts": c["kept"],
            "wasted_experts": c["wasted"],
            "coverage": c["covered"] / c["actual"] if c["actual"] else 1.0,
            "waste_ratio": c["wasted"] / c["predicted"] if c["predicted"] else 0.0,
            "predicted_prefetch_bytes": b["predicted"] if b else None,
            "kept_prefetch_bytes": b["kept"] if b else None,
            "wasted_prefetch_bytes": b["wasted"] if b else None,
            "executor_evidence": {"wiring_reachable": bool(c["layers"])},
        }


class RouteUnionCollector:
    def __init__(self) -> None:
        self._pending: set[tuple[int, int]] = set()
        self.union: set[tuple[int, int]] = set()

    def begin_step(self) -> None:
        self._pending = set()

    def observe_layer(self, layer_id, predicted_ids, router_mask, expert_nbytes=None) -> None:
        del predicted_ids, expert_nbytes  # the routed union, not the pin
        for row in router_mask:
            self._pending.update((int(layer_id), int(e)) for e in row)

    def commit_step(self, kept_rows: int = 0) -> None:
        del kept_rows
        self.union, self._pending = set(self._pending), set()
