"""The configurations a sweep can measure, in one table: what each one decodes with, which prefetcher fetches its
experts, which scheduler admits its verifies, whether it is offloaded, and how the report and the placement treat
it. Pure (no torch, no Ray).

Every part of pd-dflash that depends on what a baseline *means* reads this table (the spec's expansion, the
reference engine's cell setup, the MoE-Infinity adapter's refusals, the sweep's placement estimate, the report's
ordering, gates and plots, and ``docs/reference-engine.md``'s table, which ``tests/core/test_baselines.py``
compares with it). A new configuration is one entry here; its upstream description is in ``upstream.py`` when
upstream names it. The report's gates read the configurations' *roles* from here (``BASE``, ``CANDIDATE``,
``RESIDENT_BOUND``, ``SPECULATIVE_BASE``, ``ORDERING_CHAIN``), so no other module names a configuration (a test
greps for it).

| field | values |
|---|---|
| ``decoding`` | ``autoregressive`` (one token a round) or ``speculative`` (a drafted block of B tokens, one verify) |
| ``prefetcher`` | ``activation_aware`` (the AR prefetcher, MoE-Infinity-style), ``route_ahead`` (the target's routers run on the drafted block before the verify) or ``none`` (on-demand fetches only) |
| ``admission`` | ``all`` (every request verifies every step), ``token_deficit`` (tokens only) or ``two_dim_deficit`` (tokens and expert bytes) |
| ``offloaded`` | experts in host memory behind a bounded device cache (True) or all resident (False: the prefetcher only observes) |
| ``role`` | what the gates make of it: ``base`` (speedups are over it), ``candidate`` (the design under test: coverage, waste, hide inequality, BM1), ``resident_bound`` (the upper bound, every expert resident), ``speculative_base`` (speculative with the unchanged prefetcher: what route-ahead is plotted against), or none |
| ``ordering`` | its place in the design's expected ordering of tokens/s (``ORDERING_CHAIN``), or none |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pd_dflash.upstream import BASELINE_DESCRIPTIONS, UPSTREAM_BASELINES

Decoding = Literal["autoregressive", "speculative"]
Prefetcher = Literal["activation_aware", "route_ahead", "none"]
Admission = Literal["all", "token_deficit", "two_dim_deficit"]
Role = Literal["base", "candidate", "resident_bound", "speculative_base"]


@dataclass(frozen=True)
class Configuration:
    """One measurable configuration (a "baseline" in upstream's words)."""

    name: str
    description: str
    decoding: Decoding
    prefetcher: Prefetcher
    admission: Admission
    offloaded: bool
    #: Part of Phase A's go/no-go gates (speedup over B0, ordering, coverage, waste); an ablation is measured and
    #: reported, but no gate reads it.
    gated: bool
    #: Relative decode cost per generated token, for the sweep's placement estimate (B0 = 1.0).
    placement_factor: float
    #: Matplotlib line style and colour in the report's plots.
    plot_style: str
    plot_color: str
    #: What the report's gates make of it (table above); at most one configuration per role.
    role: Role | None = None
    #: Its place in the design's expected ordering of tokens/s (``ORDERING_CHAIN``), or None when not in it.
    ordering: int | None = None

    @property
    def speculative(self) -> bool:
        return self.decoding == "speculative"

    @property
    def route_ahead(self) -> bool:
        """The drafter leaves the route-ahead proxy on each block and the router pass runs before the verify."""
        return self.prefetcher == "route_ahead"

    @property
    def block_independent(self) -> bool:
        """Measured once per (model, c, repeat): nothing in it depends on the block size (AR decoding)."""
        return not self.speculative

    @property
    def upstream(self) -> bool:
        """One of upstream's configurations (its ``evaluate_matrix`` loops over these)."""
        return self.name in UPSTREAM_BASELINES


def _upstream(name: str, **fields) -> Configuration:
    return Configuration(name=name, description=BASELINE_DESCRIPTIONS[name], **fields)


#: The table, in report order.
CONFIGURATIONS: tuple[Configuration, ...] = (
    _upstream(
        "B0",
        decoding="autoregressive",
        prefetcher="activation_aware",
        admission="all",
        offloaded=True,
        gated=True,
        placement_factor=1.0,
        plot_style="o-",
        plot_color="tab:blue",
        role="base",
        ordering=1,
    ),
    _upstream(
        "B1",
        decoding="speculative",
        prefetcher="activation_aware",
        admission="all",
        offloaded=True,
        gated=True,
        placement_factor=0.7,
        plot_style="s-",
        plot_color="tab:orange",
        role="speculative_base",
        ordering=2,
    ),
    _upstream(
        "B2",
        decoding="speculative",
        prefetcher="activation_aware",
        admission="token_deficit",
        offloaded=True,
        gated=True,
        placement_factor=0.7,
        plot_style="^-",
        plot_color="tab:green",
    ),
    _upstream(
        "B3",
        decoding="speculative",
        prefetcher="activation_aware",
        admission="all",
        offloaded=False,
        gated=True,
        placement_factor=0.5,
        plot_style="D--",
        plot_color="tab:red",
        role="resident_bound",
        ordering=4,
    ),
    _upstream(
        "OURS",
        decoding="speculative",
        prefetcher="route_ahead",
        admission="two_dim_deficit",
        offloaded=True,
        gated=True,
        placement_factor=0.6,
        plot_style="*-",
        plot_color="tab:purple",
        role="candidate",
        ordering=3,
    ),
    Configuration(
        "RA",
        "DFlash with route-ahead prefetch and no deficit scheduler (ablation: OURS without the 2-D scheduler)",
        decoding="speculative",
        prefetcher="route_ahead",
        admission="all",
        offloaded=True,
        gated=False,
        placement_factor=0.6,
        plot_style="P:",
        plot_color="tab:pink",
    ),
    Configuration(
        "AR2D",
        "DFlash with the unchanged AR prefetcher and the 2-D scheduler (ablation: OURS without route-ahead)",
        decoding="speculative",
        prefetcher="activation_aware",
        admission="two_dim_deficit",
        offloaded=True,
        gated=False,
        placement_factor=0.7,
        plot_style="X:",
        plot_color="tab:brown",
    ),
)

BY_NAME: dict[str, Configuration] = {c.name: c for c in CONFIGURATIONS}
#: Every configuration's name, in report order.
ORDER: tuple[str, ...] = tuple(BY_NAME)
Baseline = Literal[ORDER]  # type: ignore[valid-type]  # the spec's and the rows' baseline field

OFFLOADED: frozenset[str] = frozenset(c.name for c in CONFIGURATIONS if c.offloaded)
SPECULATIVE: frozenset[str] = frozenset(c.name for c in CONFIGURATIONS if c.speculative)
BLOCK_INDEPENDENT: frozenset[str] = frozenset(c.name for c in CONFIGURATIONS if c.block_independent)
GATED: tuple[str, ...] = tuple(c.name for c in CONFIGURATIONS if c.gated)


def _with_role(role: Role) -> str:
    names = [c.name for c in CONFIGURATIONS if c.role == role]
    if len(names) != 1:
        raise ValueError(f"the table needs exactly one configuration with role {role!r}, has {names}")
    return names[0]


#: The roles the report's gates read (``role`` above): speedups are over BASE; CANDIDATE is the design under test;
#: RESIDENT_BOUND is the all-resident upper bound; SPECULATIVE_BASE drafts with the unchanged prefetcher.
BASE: str = _with_role("base")
CANDIDATE: str = _with_role("candidate")
RESIDENT_BOUND: str = _with_role("resident_bound")
SPECULATIVE_BASE: str = _with_role("speculative_base")
#: The design's expected ordering in mean tokens/s, each strictly below the next, except that the candidate may
#: reach the resident bound (B0 < B1 < OURS <= B3).
ORDERING_CHAIN: tuple[str, ...] = tuple(
    c.name for c in sorted((c for c in CONFIGURATIONS if c.ordering is not None), key=lambda c: c.ordering)
)


def ordering_step_loose(left: str, right: str) -> bool:
    """Whether ``left`` may equal ``right`` in the ordering chain: only the candidate may reach the resident
    bound."""
    return left == CANDIDATE and right == RESIDENT_BOUND


def configuration(name: str) -> Configuration:
    """The configuration called ``name`` (a validated cell's or row's baseline)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown configuration {name!r}; known: {', '.join(ORDER)}") from None
