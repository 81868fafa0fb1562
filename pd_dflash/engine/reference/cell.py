"""One cell of the reference engine: its configuration resolved once, and its parts built by factories keyed by
the table's fields (``pd_dflash/baselines.py``), typed by the seams (``seams.py``).

| table field | factories | part |
|---|---|---|
| ``decoding`` | ``DECODINGS`` | ``seams.Decoding`` (a speculative one drafts with the runner's ``Drafter``) |
| ``prefetcher`` | ``PREFETCHERS`` | ``seams.Prefetcher`` or None (on-demand fetches only) |
| ``admission`` | ``ADMISSIONS`` | ``seams.Admission`` |

A configuration that recombines parts is one table entry; one with a new part is one entry plus the module of its
part and its factory here. A table value without a factory is refused when a spec is loaded
(``check_configurations``, from ``engine/registry.py``'s reference check: ``pd-dflash plan`` exits 2).

Torch-free at import, because that check runs at plan time: each factory imports its part when it is called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_dflash.baselines import Configuration, configuration
from pd_dflash.errors import InputError
from pd_dflash.spec import Cell

if TYPE_CHECKING:
    from pd_dflash.engine.reference.decoding.target import TargetModel
    from pd_dflash.engine.reference.drafters import Drafters
    from pd_dflash.engine.reference.offload.store import HostExpertStore
    from pd_dflash.engine.reference.options import ReferenceOptions
    from pd_dflash.engine.reference.seams import Admission, Decoding, Key, Prefetcher


@dataclass(frozen=True)
class ConfiguredCell:
    """A cell with its configuration, looked up once (``configured``); every part of the engine reads this."""

    cell: Cell
    configuration: Configuration


def configured(cell: Cell) -> ConfiguredCell:
    """The one place the reference engine looks a cell's configuration up."""
    return ConfiguredCell(cell, configuration(cell.baseline))


@dataclass(frozen=True)
class PartInputs:
    """What a cell's parts are built from: the cell, its configuration, and the engine's loaded pieces."""

    cell: Cell
    configuration: Configuration
    options: ReferenceOptions
    target: TargetModel
    store: HostExpertStore
    top_k: int
    temperature: float
    drafters: Drafters
    #: The link's rate as known before the cell runs (``offload/cell.py``); None when there is none.
    link_bytes_per_second: float | None
    #: The longest prompt of the cell's requests (warm-up and timed): the largest prefill demand.
    longest_prompt: int


#: A decoding and its drafter's facts for the row (None: no drafter).
DecodingFactory = Callable[[PartInputs], "tuple[Decoding, dict[str, Any] | None]"]
PrefetcherFactory = Callable[[PartInputs], "Prefetcher | None"]
#: An admission from the inputs, the cell's prefetcher and the cache's residency test.
AdmissionFactory = Callable[[PartInputs, "Prefetcher | None", "Callable[[Key], bool]"], "Admission"]


# -- decodings --------------------------------------------------------------------------------------------------
def autoregressive(inputs: PartInputs) -> tuple[Decoding, dict[str, Any] | None]:
    from pd_dflash.engine.reference.decoding.target import AutoregressiveDecoding

    return AutoregressiveDecoding(inputs.temperature), None


def speculative(inputs: PartInputs) -> tuple[Decoding, dict[str, Any] | None]:
    """A drafted block of B tokens per round, from the runner's drafter (route-ahead proxy left on each block
    when the configuration's prefetcher routes ahead)."""
    from pd_dflash.engine.reference.decoding.speculative import SpeculativeDecoding

    b = inputs.cell.block_size
    drafter, facts = inputs.drafters.drafter(b, route_ahead=inputs.configuration.route_ahead)
    return SpeculativeDecoding(drafter, b, inputs.temperature), facts


# -- prefetchers ------------------------------------------------------------------------------------------------
def activation_aware(inputs: PartInputs) -> Prefetcher | None:
    """The AR prefetcher; observe-only when the configuration is resident (B3), so its prediction quality is on
    the same scale as the offloaded ones'."""
    from pd_dflash.engine.reference.offload.prefetch import ActivationAwarePrefetcher

    store = inputs.store
    return ActivationAwarePrefetcher(
        store.layer_ids, store.num_experts, inputs.top_k, issue=inputs.configuration.offloaded
    )


def route_ahead(inputs: PartInputs) -> Prefetcher | None:
    """Route-ahead prefetch, with the cost-aware verify width when the link's rate is known."""
    from pd_dflash.engine.reference.offload.route_prefetch import RouteAheadPrefetcher
    from pd_dflash.engine.reference.offload.verify_width import CostAwareWidth

    opts, store, rate = inputs.options, inputs.store, inputs.link_bytes_per_second
    width = CostAwareWidth(rate) if opts.verify_width == "cost_aware" and rate else None
    return RouteAheadPrefetcher(
        inputs.target,
        store.layer_ids,
        inputs.top_k,
        history=opts.route_ahead_history,
        width=width,
        expert_nbytes=store.expert_nbytes,
    )


def no_prefetcher(inputs: PartInputs) -> Prefetcher | None:
    """On-demand fetches only: nothing predicted, so no coverage (absent, flagged)."""
    return None


# -- admissions -------------------------------------------------------------------------------------------------
def admit_all(
    inputs: PartInputs, prefetcher: Prefetcher | None, is_resident: Callable[[Key], bool]
) -> Admission:
    from pd_dflash.engine.reference.decoding.loop import AdmitAll

    return AdmitAll()


def token_deficit(
    inputs: PartInputs, prefetcher: Prefetcher | None, is_resident: Callable[[Key], bool]
) -> Admission:
    from pd_dflash.engine.reference.decoding.admission import TokenBudget, token_deficit_admission

    return token_deficit_admission(TokenBudget.of(inputs.cell, inputs.options, inputs.longest_prompt))


def two_dim_deficit(
    inputs: PartInputs, prefetcher: Prefetcher | None, is_resident: Callable[[Key], bool]
) -> Admission:
    from pd_dflash.engine.reference.decoding.admission import TokenBudget, two_dim_deficit_admission

    return two_dim_deficit_admission(
        inputs.configuration.name,
        TokenBudget.of(inputs.cell, inputs.options, inputs.longest_prompt),
        inputs.options,
        inputs.store,
        inputs.top_k,
        prefetcher,
        is_resident,
        inputs.link_bytes_per_second,
    )


DECODINGS: dict[str, DecodingFactory] = {"autoregressive": autoregressive, "speculative": speculative}
PREFETCHERS: dict[str, PrefetcherFactory] = {
    "activation_aware": activation_aware,
    "route_ahead": route_ahead,
    "none": no_prefetcher,
}
ADMISSIONS: dict[str, AdmissionFactory] = {
    "all": admit_all,
    "token_deficit": token_deficit,
    "two_dim_deficit": two_dim_deficit,
}


def _tables(c: Configuration) -> tuple[tuple[str, str, dict[str, Any]], ...]:
    return (
        ("decoding", c.decoding, DECODINGS),
        ("prefetcher", c.prefetcher, PREFETCHERS),
        ("admission", c.admission, ADMISSIONS),
    )


def check_configurations(names: Iterable[str], where: str = "baselines") -> None:
    """Every part each named configuration needs has a factory here; else ``InputError`` naming the baseline,
    the field and its value (plan time: the spec's baselines)."""
    for name in names:
        for field, value, table in _tables(configuration(name)):
            if value not in table:
                raise InputError(
                    f"{name}'s {field} {value!r} has no factory in the reference engine "
                    f"(engine/reference/cell.py; known: {', '.join(table)})",
                    where=where,
                )


def _factory(table: dict[str, Any], field: str, c: Configuration) -> Any:
    """The factory of one part (loudly, if the plan-time check was bypassed)."""
    value = next(v for f, v, _ in _tables(c) if f == field)
    if value not in table:
        raise LookupError(f"{c.name}'s {field} {value!r} has no factory (engine/reference/cell.py)")
    return table[value]


def decoding(inputs: PartInputs) -> tuple[Decoding, dict[str, Any] | None]:
    factory: DecodingFactory = _factory(DECODINGS, "decoding", inputs.configuration)
    return factory(inputs)


def prefetcher(inputs: PartInputs) -> Prefetcher | None:
    factory: PrefetcherFactory = _factory(PREFETCHERS, "prefetcher", inputs.configuration)
    return factory(inputs)


def admission(
    inputs: PartInputs, prefetcher: Prefetcher | None, is_resident: Callable[[Key], bool]
) -> Admission:
    factory: AdmissionFactory = _factory(ADMISSIONS, "admission", inputs.configuration)
    return factory(inputs, prefetcher, is_resident)
