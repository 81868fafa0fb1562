"""The swappable parts of a cell, typed: what the step loop, the offload runtime and the cache call on each one.

A configuration (``pd_dflash/baselines.py``) is a choice of one implementation per seam:

| seam | implementations |
|---|---|
| ``Decoding`` | ``decoding/target.AutoregressiveDecoding``, ``decoding/speculative.SpeculativeDecoding`` |
| ``Drafter`` (speculative decoding's proposer) | ``dflash/source.DFlashSource`` (published layout: published and preset drafters), ``decoding/speculative.EarlyExitDrafter`` |
| ``Prefetcher`` | ``offload/prefetch.ActivationAwarePrefetcher`` (the AR prefetcher), ``offload/route_prefetch.RouteAheadPrefetcher`` |
| ``Admission`` | ``decoding/loop.AdmitAll``, ``decoding/admission.DeficitAdmission`` (token or 2-D deficit) |
| ``RoundHooks`` (around each forward) | ``offload/runtime.OffloadRuntime``, ``decoding/loop.RoundHooks`` (no-op) |
| ``Link`` (host→device) | ``offload/link.HostLink`` (CPU: emulated or a plain copy), ``offload/cuda_link.CudaLink`` |

Where a cell picks each one: ``cell.py``'s factories, keyed by the table's fields (decoding, prefetcher,
admission), ``drafters.py`` (the drafter), ``offload/cell.py`` (the link). The consumers take these types:
``decoding/loop.py`` (decoding, admission), ``decoding/speculative.py`` (drafter), ``offload/runtime.py``
(prefetcher).

Only the structure is declared here (``typing.Protocol``); each implementation documents its policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pd_dflash.engine.reference.decoding.target import Block, Commit, Request
    from pd_dflash.engine.reference.offload.cache import ExpertCache

Key = tuple[int, int]  # (layer, expert)


class Decoding(Protocol):
    """Proposes each in-flight request's next block and commits what the verify accepted."""

    #: A drafted block per round (False: one token a round).
    speculative: bool
    #: The widest block a round verifies after the prefill (1: AR; the KV arena is reserved for it).
    block_size: int
    #: Hidden-state indices the verify forward keeps for the drafter (HF ``output_hidden_states`` numbering).
    capture: tuple[int, ...]

    def propose(self, requests: Sequence[Request]) -> list[Block]:
        """One block per request: its prompt on the first round, then a width-1 (AR) or drafted block."""
        ...

    def commit(self, block: Block, logits: torch.Tensor, captured: dict[int, torch.Tensor]) -> Commit:
        """The accept rule on one block's logits: tokens appended, rejected rows rolled back out of the KV."""
        ...


class Drafter(Protocol):
    """Speculative decoding's proposer: drafts B−1 tokens after each request's last committed token."""

    kind: str
    capture: tuple[int, ...]

    def describe(self) -> dict[str, Any]: ...

    def draft(self, requests: Sequence[Request], block_size: int, temperature: float) -> list[Block]:
        """``[anchor, d1 .. d_{B−1}]`` per request (with the route-ahead proxy when asked to leave one)."""
        ...

    def observe(self, request: Request, rows: dict[int, torch.Tensor]) -> None:
        """The kept rows' captured target features, after a commit (the drafter's context)."""
        ...


class Prefetcher(Protocol):
    """Predicts which experts each verify layer will route and fetches them ahead (or only observes)."""

    name: str
    #: False: observe-only (a resident configuration measures prediction quality but fetches nothing).
    issue: bool
    #: The verified round's predicted experts per MoE layer (what the statistics compare with the routing).
    predicted: dict[int, frozenset[int]]
    #: What it issued, by outcome (the row's ``engine.prediction.issue``); empty when it counts nothing.
    counters: dict[str, int]

    def describe(self) -> dict[str, Any]: ...

    def route(self, blocks: list[Block], cache: ExpertCache) -> bool:
        """New blocks before scheduling: a router pass over them when this prefetcher has one (True if it ran)."""
        ...

    def begin_round(self, cache: ExpertCache, owners: list[tuple[Any, int]]) -> None:
        """Before the verify forward: ``owners`` = (request id, rows) in row order."""
        ...

    def after_layer(self, cache: ExpertCache, layer: int, routed: torch.Tensor | np.ndarray) -> None:
        """A verify layer's routing ``[tokens, k]`` on the host is known (its experts are being acquired)."""
        ...

    def layer_done(self, cache: ExpertCache, layer: int) -> None:
        """A verify layer has computed (its slots may be reused)."""
        ...

    def end_round(self, cache: ExpertCache, kept_spans: list[tuple[int, int]], finished: set[Any]) -> None:
        """After the accept rule: the kept row span of each verified block, and the requests that finished."""
        ...

    def keys(self, rid: Any) -> set[Key]:
        """The (layer, expert) keys the request's next verify is expected to fetch (the 2-D scheduler's bytes)."""
        ...

    def in_flight(self, rid: Any) -> bool:
        """Whether the request's next verify is already under way (seated by the 2-D scheduler)."""
        ...

    def forget(self, rid: Any) -> None:
        """The request left: drop what is kept about it."""
        ...


class RoundHooks(Protocol):
    """What the step loop calls around each target forward (``offload/runtime.OffloadRuntime``; the no-op
    ``decoding/loop.RoundHooks`` when nothing is offloaded)."""

    def plan(self, blocks: list[Block]) -> bool:
        """Predict the new blocks' experts before admission; True when a router pass ran."""
        ...

    def begin_round(self, owners: list[tuple[Any, int]]) -> None: ...

    def end_round(self, *, kept_spans: list[tuple[int, int]], finished: set[Any] | None = None) -> None: ...

    def forget(self, rid: Any) -> None: ...


class Admission(Protocol):
    """Which pending blocks the step verifies now (the others wait with their block)."""

    name: str

    def select(self, blocks: list[Block]) -> list[Block]: ...

    def reset(self) -> None:
        """A measurement starts (after warm-up): counters and carried deficits restart."""
        ...

    def describe(self) -> dict[str, Any]: ...
