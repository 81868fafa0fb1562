"""The one interface every engine implements; the orchestrator talks to engines only through it.

An engine instance lives in one runner process and holds one loaded model. It runs cells one at a time and
returns an :class:`~pd_dflash.schema.EngineResult`; the runner turns that into a stored row. No torch here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pydantic import BaseModel, ConfigDict

from pd_dflash.schema import BLOCKED_STATUSES, REFUSAL_KINDS, EngineResult, RefusalKind, Status
from pd_dflash.spec import SLO, Cell, Hardware, Memory, ModelSpec, SweepSpec, Workload


class Refused(Exception):
    """A configuration the engine must not run, raised anywhere inside an engine.

    The runner turns it into one row with this ``status`` (REFUSED, BLOCKED_*, UNAVAILABLE_CAPACITY) and
    ``reason``; an engine never builds that row itself. A REFUSED one has a ``kind`` (``schema.RefusalKind``):
    "input" (the default: the spec or what it names cannot be honoured; the run exits non-zero) or
    "documented" (a configuration the engine documents it does not run; not counted).
    """

    def __init__(self, status: Status, reason: str, kind: RefusalKind = "input") -> None:
        if status not in BLOCKED_STATUSES:
            raise ValueError(
                f"Refused needs a no-metric status ({', '.join(sorted(BLOCKED_STATUSES))}), got {status}"
            )
        if kind not in REFUSAL_KINDS:
            raise ValueError(f"Refused kind must be one of {', '.join(REFUSAL_KINDS)}, got {kind!r}")
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.kind = kind

    def __reduce__(self):  # Ray carries it from a runner to the driver (a load that is refused)
        return (type(self), (self.status, self.reason, self.kind))

    def result(self) -> EngineResult:
        """The engine's result this refusal stands for (its kind on a REFUSED row only)."""
        kind = self.kind if self.status == Status.REFUSED else None
        return EngineResult(status=self.status, reason=self.reason, refusal=kind)


class EngineContext(BaseModel):
    """Everything an engine needs to load a model once and serve every cell of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep: str
    model: ModelSpec
    memory: Memory
    hardware: Hardware
    workload: Workload
    slo: SLO
    #: "cpu" or "cuda:0" (the runner sees exactly the GPU Ray assigned to it).
    device: str
    #: From ``registry.load_group``: "shared" (serves every baseline) or "resident" (B3-only load).
    load_group: str = "shared"

    @classmethod
    def for_model(
        cls, spec: SweepSpec, model_id: str | None = None, *, device: str, load_group: str = "shared"
    ) -> EngineContext:
        """The context a runner builds for one model of a spec (the first model when ``model_id`` is None)."""
        return cls(
            sweep=spec.name,
            model=(spec.model(model_id) if model_id is not None else spec.models[0]).single_valued(),
            memory=spec.memory,
            hardware=spec.hardware,
            workload=spec.workload,
            slo=spec.slo,
            device=device,
            load_group=load_group,
        )


class Engine(ABC):
    """Load in ``__init__`` (once per runner), then ``run_cell`` any number of times, then ``close``."""

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def run_cell(self, cell: Cell) -> EngineResult:
        """Measure one cell. Raise :class:`Refused` for a configuration the engine must not run (the runner
        stores a row with its status and reason); any other exception is a genuine failure (an ERROR row)."""

    def describe(self) -> dict[str, Any]:
        """Facts about the loaded engine and model, merged into every row's ``engine`` field."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free what the engine holds (the runner process exits after a model switch anyway)."""
