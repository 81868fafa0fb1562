"""BM1 for one row, with the semantics of upstream's ``summarise_row``: the route-ahead router pass must cost
strictly less than the width-B verify it front-runs (``t_router < t_verify``).

The gates evaluate BM1 on the means over repeats (``gates.bm1_on_means``); this is the per-row form, for a
stored row, an upstream row or an aggregated matrix row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from pd_dflash.costmodel import bm1_summary as _bm1

BM1_TERMS = ("t_router_seconds", "t_verify_seconds")


def bm1_summary(row: Mapping[str, Any] | BaseModel) -> dict[str, float | bool]:
    """``{t_router_seconds, t_verify_seconds, bm1_router_to_verify_ratio, bm1_pass}`` of one row.

    Raises ValueError, as upstream does, when a term is missing (``row missing BM1 term: ...``), not a
    finite non-negative number, or ``t_verify_seconds`` is not positive. Unlike upstream, a bool or a numeric
    string is not a number here.
    """
    data = row.model_dump(exclude_none=True) if isinstance(row, BaseModel) else row
    for key in BM1_TERMS:
        if data.get(key) is None:
            raise ValueError(f"row missing BM1 term: {key}")
    return _bm1(data["t_router_seconds"], data["t_verify_seconds"])
