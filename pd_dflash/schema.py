"""The row contract: one row of metrics per cell, compatible with upstream's Phase-A rows.

Upstream's row fixes the identity ``(model, baseline, block_size, concurrency,
repeat)``, the ten ``REQUIRED_METRICS`` in order and units, and the optional ``status``, ``warnings`` and
``cost_terms``. pd-dflash keeps all of them and adds fields; it never renames or drops one. The one rule that
differs: a metric the engine cannot measure is *absent* (with a warning, status ``PARTIAL``), never a 0.0.
Metric definitions live in docs/metrics.md.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pd_dflash.ablation import group_model, identity_of
from pd_dflash.baselines import Baseline
from pd_dflash.errors import InputError, excerpt, format_validation_error
from pd_dflash.spec import Cell
from pd_dflash.upstream import RATIO_METRICS, REQUIRED_METRICS, ROUTE_AHEAD_KEYS


class Status(str, Enum):
    OK = "OK"
    #: Measured, but at least one metric could not be measured: it is absent and a warning says why.
    PARTIAL = "PARTIAL"
    BLOCKED_UNTIL_2D_SCHEDULER = "BLOCKED_UNTIL_2D_SCHEDULER"
    UNAVAILABLE_CAPACITY = "UNAVAILABLE_CAPACITY"
    #: The engine refuses the configuration (e.g. an "offloaded" cell whose cache holds every expert).
    REFUSED = "REFUSED"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"

    def __str__(self) -> str:
        return self.value


MEASURED_STATUSES = frozenset({Status.OK, Status.PARTIAL})
BLOCKED_STATUSES = frozenset({Status.BLOCKED_UNTIL_2D_SCHEDULER, Status.UNAVAILABLE_CAPACITY, Status.REFUSED})
FAILED_STATUSES = frozenset({Status.ERROR, Status.TIMEOUT})
REASON_REQUIRED = frozenset({Status.REFUSED, Status.ERROR, Status.TIMEOUT})
#: A row with a final status stands for its cell for good. A failed row (ERROR/TIMEOUT) is superseded by a later
#: row of the same cell (``pd-dflash run --retry-errors`` appends one; nothing stored is ever deleted). The sweep's
#: resume and the report both apply this one rule.
FINAL_STATUSES = frozenset(Status) - FAILED_STATUSES


#: Which kind a REFUSED row is. "input": of the user's own making — a spec value, a checkpoint, file or drafter it
#: names, or what a box lacks for them (memory, a chat template, a load the engine refused); a run that stores
#: one exits non-zero and says so. "documented": a configuration the engine documents it does not run (a baseline
#: it does not implement, a feature the installed library build lacks); not counted against the run.
RefusalKind = Literal["input", "documented"]
REFUSAL_KINDS: tuple[str, ...] = ("input", "documented")


#: The largest integer a row holds (a signed 64-bit count: bytes, tokens, ids); also the bound on int fields.
MAX_INT = 2**63 - 1


def check_number(name: str, value: Any, *, upper: float | None = None) -> int | float:
    """A metric value: an int or float (never a bool), finite, non-negative, and at most ``upper``.

    An int stays an int (byte counts are whole numbers) and is at most :data:`MAX_INT`.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {excerpt(value)}")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise ValueError(f"{name} must be at most 2**63 - 1, got an integer of {_digits(value)} digits")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value!r}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be at most {upper}, got {value!r}")
    return value


def _digits(value: int) -> str:
    """Roughly how many decimal digits an int has (printing it may be impossible: Python stops at 4300)."""
    return f"about {int(abs(value).bit_length() * 0.30103) + 1}"


NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False, strict=False)]
#: A whole count (bytes, tokens, transfers): a non-negative int that fits in 64 bits.
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
#: A byte figure: an int stays an int; a float (upstream writes some byte metrics as floats) stays a float.
Bytes = Count | NonNegative


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LatencyStats(_Model):
    """Distribution of one latency over requests (or rounds). Percentiles interpolate linearly (numpy's default)."""

    n: Annotated[int, Field(ge=1, le=MAX_INT)]
    mean: NonNegative
    p50: NonNegative
    p90: NonNegative
    p99: NonNegative
    max: NonNegative

    @classmethod
    def from_samples(cls, samples: list[float]) -> LatencyStats | None:
        if not samples:
            return None
        xs = sorted(float(x) for x in samples)
        return cls(
            n=len(xs),
            mean=sum(xs) / len(xs),
            p50=percentile(xs, 50),
            p90=percentile(xs, 90),
            p99=percentile(xs, 99),
            max=xs[-1],
        )


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation percentile of an already sorted, non-empty list."""
    if not sorted_xs:
        raise ValueError("percentile of an empty list")
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


class CostTerms(_Model):
    """Upstream's ``cost_terms`` keys first, then pd-dflash's transfer accounting."""

    route_ahead_coverage: NonNegative | None = None
    wasted_prefetch_bytes: Bytes | None = None
    #: Measured host→device bandwidth in bytes/s (a probe or the measured rate of the cell's own transfers).
    measured_h2d_bytes_per_second: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    #: How that bandwidth was obtained: "probe" (pinned 256 MiB × 20 copies), "transfers" (this cell's copies).
    h2d_bandwidth_source: Literal["probe", "transfers"] | None = None
    #: The link the transfers used: a real device link, an emulated one (CPU engine), or none (resident).
    #: "host": the CPU engine without emulation, whose "transfers" are host-to-host copies (no device link).
    h2d_link: Literal["real", "emulated", "host", "none"] | None = None
    emulated_h2d_gbps: NonNegative | None = None
    emulated_latency_us: NonNegative | None = None
    h2d_bytes: Count | None = None
    h2d_seconds: NonNegative | None = None
    h2d_transfers: Count | None = None
    #: Time compute waited for a transfer (the on-demand part of fetching).
    exposed_fetch_seconds: NonNegative | None = None


class HideInequality(_Model):
    """``(1−r)·s·M/BW ≤ t_draft + t_router + overlap``, per verify round, from measured terms."""

    resident_fraction: Annotated[float, Field(ge=0.0, le=1.0)]
    saturation: Annotated[float, Field(ge=0.0, le=1.0)]
    total_expert_bytes: Bytes
    measured_h2d_bytes_per_second: Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
    draft_seconds: NonNegative
    router_seconds: NonNegative
    overlap_seconds: NonNegative
    fetch_seconds: NonNegative
    hide_window_seconds: NonNegative
    margin_seconds: Annotated[float, Field(allow_inf_nan=False)]
    hidden: bool


class EngineResult(_Model):
    """What an engine returns for one cell: the row minus identity and bookkeeping."""

    output_tokens_per_second: float | None = None
    acceptance_length_a: float | None = None
    ttft_seconds: float | None = None
    per_round_latency_seconds: float | None = None
    goodput_at_slo: float | None = None
    expert_cache_hit_rate: float | None = None
    route_ahead_prefetch_coverage: float | None = None
    #: Byte metrics keep an int as an int (bytes are whole); upstream's float byte figures are accepted.
    wasted_prefetch_bytes: int | float | None = None
    expert_occupancy_bytes: int | float | None = None
    kv_occupancy_bytes: int | float | None = None

    status: Status = Status.OK
    reason: str | None = None
    #: A REFUSED row's kind (``RefusalKind``); absent on every other row (and on rows from before it: counted).
    refusal: RefusalKind | None = None
    warnings: list[str] = Field(default_factory=list)
    cost_terms: CostTerms | None = None

    #: The second coverage (pd-dflash): of the experts the verify routed (Σ|A| over layers and rounds), the
    #: share the prefetcher had predicted AND had resident and ready when the verify acquired it. Recall
    #: (``route_ahead_prefetch_coverage``, upstream's meaning) minus late or dropped prefetches.
    prefetched_in_time_coverage: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None

    #: BM1 terms (upstream optional fields) and the draft time: sums over the timed loop, in seconds.
    t_draft_seconds: NonNegative | None = None
    t_router_seconds: NonNegative | None = None
    t_verify_seconds: NonNegative | None = None

    #: Distributions: ttft_seconds, tpot_seconds, e2e_seconds (per request), round_seconds, draft_seconds,
    #: router_seconds, verify_seconds (per round).
    latency: dict[str, LatencyStats] = Field(default_factory=dict)
    #: Committed tokens per verify round (bonus included) → number of rounds.
    acceptance_histogram: dict[Annotated[int, Field(ge=0, le=MAX_INT)], Count] | None = None
    #: Upstream RouteAheadStats.as_dict() of the configuration's prefetcher, keys in ROUTE_AHEAD_KEYS order.
    route_ahead: dict[str, int | float | None] | None = None
    hide_inequality: HideInequality | None = None
    requests: Count | None = None
    generated_tokens: Count | None = None
    timed_seconds: NonNegative | None = None
    #: Engine facts: name, version, preset, drafter, scheduler, link, model card, ... (free-form, JSON).
    engine: dict[str, Any] = Field(default_factory=dict)
    #: Device telemetry at cell start and end (NVML), when a device is present.
    telemetry: dict[str, Any] | None = None
    #: Named phase durations of the cell (load, warm-up, timed loop...), seconds.
    timings: dict[str, NonNegative] = Field(default_factory=dict)

    @field_validator(*REQUIRED_METRICS, mode="before")
    @classmethod
    def _metric(cls, value: Any, info) -> Any:
        if value is None:
            return None
        return check_number(info.field_name, value, upper=1.0 if info.field_name in RATIO_METRICS else None)

    @field_validator("route_ahead")
    @classmethod
    def _route_ahead(cls, value: dict | None) -> dict | None:
        if value is None:
            return None
        unknown = [k for k in value if k not in ROUTE_AHEAD_KEYS]
        if unknown:
            raise ValueError(f"unknown route_ahead keys {unknown}; expected {list(ROUTE_AHEAD_KEYS)}")
        for k, v in value.items():
            if v is not None:
                check_number(f"route_ahead.{k}", v)
        return {k: value.get(k) for k in ROUTE_AHEAD_KEYS if k in value}

    @model_validator(mode="after")
    def _status_consistent(self) -> EngineResult:
        present = self.present_metrics()
        if self.status == Status.OK:
            missing = [m for m in REQUIRED_METRICS if m not in present]
            if missing:
                raise ValueError(
                    f"status OK but metrics missing: {', '.join(missing)} "
                    "(an unmeasured metric makes the row PARTIAL, with a warning)"
                )
        elif self.status == Status.PARTIAL:
            if len(present) == len(REQUIRED_METRICS):
                raise ValueError("status PARTIAL but every metric is present; use OK")
            if not self.warnings:
                raise ValueError("status PARTIAL needs a warning saying which metric is absent and why")
        elif present:
            raise ValueError(f"status {self.status.value} must carry no metrics, found: {', '.join(present)}")
        if self.status in REASON_REQUIRED and not (self.reason and self.reason.strip()):
            raise ValueError(f"status {self.status.value} needs a reason")
        if self.refusal is not None and self.status != Status.REFUSED:
            raise ValueError(
                f"refusal {self.refusal!r} is the kind of a REFUSED row, not of a {self.status.value} one"
            )
        return self

    @property
    def counted_refusal(self) -> bool:
        """A REFUSED row of the user's own making (kind "input", or a row from before kinds): the run that
        stores it exits non-zero. A documented refusal is not counted."""
        return self.status == Status.REFUSED and self.refusal != "documented"

    def present_metrics(self) -> list[str]:
        return [m for m in REQUIRED_METRICS if getattr(self, m) is not None]

    def missing_metrics(self) -> list[str]:
        return [m for m in REQUIRED_METRICS if getattr(self, m) is None]


_IDENTITY = ("model", "draft", "baseline", "block_size", "concurrency", "repeat")


class Row(EngineResult):
    """A stored row: upstream identity + draft, the engine's result, and pd-dflash bookkeeping."""

    model: Annotated[str, Field(min_length=1)]
    draft: str = ""
    baseline: Baseline
    block_size: Annotated[int, Field(ge=1, le=MAX_INT, strict=True)]
    concurrency: Annotated[int, Field(ge=1, le=MAX_INT, strict=True)]
    repeat: Annotated[int, Field(ge=0, le=MAX_INT, strict=True)] = 0

    #: Absent on upstream rows.
    cell_id: str | None = None
    sweep: str | None = None
    attempt: Annotated[int, Field(ge=1, le=MAX_INT)] = 1
    #: Block sizes whose report groups this row fills (B0 is measured once for all of them).
    block_sizes_covered: list[Annotated[int, Field(ge=1, le=MAX_INT)]] | None = None
    #: The cell's ablation values (``ablation.ABLATION_AXES``): part of its identity and of its report group.
    ablation: dict[str, float] | None = None
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    #: The seed of the repeat's sample of the workload (``spec.sample_seed``): the configurations of one repeat
    #: share it (paired), the repeats differ (independent samples). Absent on upstream rows.
    sample_seed: Annotated[int, Field(strict=True)] | None = None
    #: Host, device, driver, package versions, git revision of the runner that measured the row.
    environment: dict[str, Any] | None = None
    #: Which runner measured it: node id/ip, GPU ids Ray assigned, actor pid.
    runner: dict[str, Any] | None = None
    started_at: str | None = None
    finished_at: str | None = None

    @model_validator(mode="after")
    def _acceptance_in_range(self) -> Row:
        a = self.acceptance_length_a
        # τ counts committed tokens per round including the bonus token: 1 ≤ τ ≤ B (B0: exactly 1).
        out_of_range = a is not None and (a < 1.0 - 1e-9 or a > self.block_size + 1e-9)
        if out_of_range and self.status in MEASURED_STATUSES:
            raise ValueError(f"acceptance_length_a must lie in [1, block_size={self.block_size}], got {a}")
        return self

    @property
    def identity(self) -> tuple:
        """Upstream's ``(model, baseline, block_size, concurrency, repeat)``, plus the ablation values if any."""
        return identity_of(
            self.model, self.baseline, self.block_size, self.concurrency, self.repeat, self.ablation
        )

    @property
    def group_model(self) -> str:
        """The model part of the row's report group key (``spec.group_model``)."""
        return group_model(self.model, self.ablation)

    @classmethod
    def from_result(cls, cell: Cell, result: EngineResult, **bookkeeping: Any) -> Row:
        """Attach a cell's identity and bookkeeping to an engine result (re-validating everything)."""
        data = result.model_dump(exclude_none=False)
        data.update(_cell_fields(cell))
        data.update(bookkeeping)
        return cls.model_validate(data)

    @classmethod
    def without_metrics(cls, cell: Cell, status: Status, reason: str, **bookkeeping: Any) -> Row:
        """A row for a cell that was not measured (blocked, refused, errored, timed out); a REFUSED one is of
        kind "input" unless ``refusal=`` says otherwise."""
        if status == Status.REFUSED:
            bookkeeping.setdefault("refusal", "input")
        return cls.model_validate({**_cell_fields(cell), "status": status, "reason": reason, **bookkeeping})

    def to_json_dict(self) -> dict[str, Any]:
        """The stored form: identity first, metrics in upstream order, absent fields omitted (as upstream)."""
        data = self.model_dump(mode="json", exclude_none=True)
        if not data.get("warnings"):
            data.pop("warnings", None)
        if not data.get("latency"):
            data.pop("latency", None)
        for empty in ("engine", "timings"):
            if not data.get(empty):
                data.pop(empty, None)
        ordered = {k: data.pop(k) for k in (*_IDENTITY, *REQUIRED_METRICS) if k in data}
        ordered.update(data)
        return ordered


def _cell_fields(cell: Cell) -> dict[str, Any]:
    return {
        "model": cell.model,
        "draft": cell.draft,
        "baseline": cell.baseline,
        "block_size": cell.block_size,
        "concurrency": cell.concurrency,
        "repeat": cell.repeat,
        "cell_id": cell.cell_id,
        "block_sizes_covered": list(cell.block_sizes_covered),
        "max_new_tokens": cell.max_new_tokens,
        "sample_seed": cell.sample_seed,
        **({"ablation": dict(cell.ablation)} if cell.ablation else {}),
    }


def parse_row(obj: Any, *, where: str) -> Row:
    """Validate one row object; errors name the place (file:line) and the field."""
    if not isinstance(obj, dict):
        raise InputError(f"a row must be a JSON object, got {type(obj).__name__}", where=where)
    try:
        return Row.model_validate(obj)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc), where=where) from None
