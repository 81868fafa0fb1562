"""Options of the MoE-Infinity adapter (``models[].engine_options`` when ``engine: moe_infinity``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class MoEInfinityOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
