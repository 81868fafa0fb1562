"""The device expert cache's memory: a slot pool, the stored-format slot buffers and the slot table.

- ``pool``: one ``[slots, ...]`` tensor per compute tensor of an expert (``tensor_names`` order, compute dtype):
  what ``offload/grouped.py`` multiplies with, all slots at once.
- ``buffers`` / ``slot_views``: the slots in the stored format (``store.spec``), what a transfer writes. When the
  storage IS the compute format (``direct``: fp32/bf16 experts computed at their dtype), the pool views these
  bytes and there is nothing else. Otherwise (fp8, MXFP4) each landing is dequantised ONCE into the pool slot
  (``lander``: the transfer's step after its copy; on CUDA it runs on the copy stream, so no host sync), a batch
  of landings (a layer's prefetches, ``land_many``) in ONE grouped dequantisation when the store takes a slot
  batch (``batched_dequantize``: the checkpoint store, MXFP4), and a resident cache (B3) dequantises every
  expert at load through a one-expert temporary (no buffers kept).
- ``table``: ``[layer, expert] → slot`` on the device (−1 = absent). The cache records every insert and eviction
  with ``set`` (on the host); the writes since the last read reach the device as ONE ``index_put_`` when the table
  is next read (a MoE layer's compute), so a layer's fetches cost one small host→device copy, not an op each.

Device bytes per slot (``device_slot_nbytes``) are reported as they are; the cache's capacity counts stored bytes
(``offload/cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pd_dflash.engine.reference.host_sync import to_device
from pd_dflash.engine.reference.offload.grouped import expert_compute_choice
from pd_dflash.engine.reference.offload.store import HostExpertStore


class SlotPool:
    def __init__(
        self, store: HostExpertStore, num_slots: int, device: torch.device, dtype: torch.dtype, linked: bool
    ) -> None:
        self.store, self.device, self.dtype = store, device, dtype
        meta = [torch.empty((num_slots, *shape), dtype=dt, device="meta") for shape, dt in store.spec]
        #: The pool views the stored bytes: a transfer writes compute-dtype weights, nothing to dequantise.
        self.direct = store.compute_views(meta, dtype) is not None
        staged = linked or self.direct
        self.buffers = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in meta] if staged else []
        self.slot_views = [[b[i] for b in self.buffers] for i in range(num_slots)] if staged else []
        if self.direct:
            self.pool = store.compute_views(self.buffers, dtype)
        else:
            spec = store.compute_spec(dtype)
            self.pool = [torch.empty((num_slots, *shape), dtype=dt, device=device) for shape, dt in spec]
        self._table = torch.full(
            (max(store.layer_ids) + 1, store.num_experts), -1, dtype=torch.long, device=device
        )
        #: (layer, expert) → slot, not yet on the device (``set`` writes here; a batched issue directly).
        self.pending: dict[tuple[int, int], int] = {}
        #: ``grouped_mm`` or the named fallback, and why (``offload/grouped.py``): the row's ``engine.expert_compute``.
        self.expert_compute_facts = expert_compute_choice(self.pool)
        self.expert_compute: str = self.expert_compute_facts["path"]
        self.device_slot_nbytes = store.device_slot_nbytes(dtype, linked=linked)
        #: (layer, expert) → its host payload views (``store.payload``), made on its first transfer: a fetch
        #: again later costs no view op.
        self._payloads: dict[tuple[int, int], list[torch.Tensor]] = {}
        #: ``[slots, *shape]`` views of the stored parts when the store dequantises a batch from them: a
        #: landing gathers each part (one op each) instead of viewing the gathered bytes part by part.
        gathers = staged and not self.direct and getattr(store, "batched_dequantize", False)
        self._stored_parts = store.stored_parts(self.buffers) if gathers else None
        #: Compute tensors that are a stored part as it is (MXFP4's biases): the pool views the slot bytes.
        self._passthrough: dict[int, int] = store.passthrough(dtype) if gathers else {}
        for c, p in self._passthrough.items():
            self.pool[c] = self._stored_parts[p]

    @property
    def table(self) -> torch.Tensor:
        """The device table, current: pending writes applied first (one host→device copy, one op)."""
        if self.pending:
            n = self.store.num_experts
            where = torch.tensor([layer * n + e for layer, e in self.pending], dtype=torch.long)
            slots = torch.tensor(list(self.pending.values()), dtype=torch.long)
            self.pending.clear()
            self._table.view(-1).index_put_((to_device(where, self.device),), to_device(slots, self.device))
        return self._table

    def set(self, key: tuple[int, int], slot: int) -> None:
        """``key`` now lives in ``slot`` (−1: evicted)."""
        self.pending[key] = slot

    def weights(self, slot: int) -> list[torch.Tensor]:
        """One slot's compute tensors (views of the pool)."""
        return [p[slot] for p in self.pool]

    def lander(self, slot: int) -> Callable[[], None] | None:
        """The step a transfer into ``slot`` runs after its copy: dequantise into the pool (None if direct)."""
        if self.direct:
            return None
        if self._stored_parts is not None:
            return lambda: self._dequantize_slots([slot])
        return lambda: self._dequantize_into(slot, self.slot_views[slot])

    @property
    def land_many(self) -> Callable[[list[int]], None] | None:
        """The step a batch of transfers runs after its copies: dequantise their slots (None if direct)."""
        return None if self.direct else self._dequantize_slots

    def copy_many(self, members, non_blocking: bool = False) -> None:
        """A batch's copies (``offload/link.py``): each run of consecutive experts of one layer into consecutive
        slots as ONE slice copy per stored tensor (a saturated layer: one copy), the rest in one
        ``_foreach_copy_``; a member's source is read from the store by its key when not given."""
        store, buffers, n = self.store, self.buffers, len(members)
        dst, src, i = [], [], 0
        while i < n:
            (layer, e0), s0, j = members[i].key, members[i].slot, i + 1
            while j < n and members[j].key == (layer, e0 + j - i) and members[j].slot == s0 + j - i:
                j += 1
            if j - i == 1:
                m = members[i]
                dst += m.dst
                src += m.src if m.src is not None else self.payload(m.key)
            else:
                stored = [*store.parts[layer], *(s for s in store.scales[layer] if s is not None)]
                for buffer, part in zip(buffers, stored, strict=True):
                    dst.append(buffer[s0 : s0 + j - i])
                    src.append(part[e0 : e0 + j - i].view(j - i, *buffer.shape[1:]))
            i = j
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)

    def payload(self, key: tuple[int, int]) -> list[torch.Tensor]:
        """``store.payload(*key)``, its views made once per key (a transfer of the key again costs no view op)."""
        views = self._payloads.get(key)
        if views is None:
            views = self._payloads[key] = self.store.payload(*key)
        return views

    def load(self, slot: int, payload: list[torch.Tensor]) -> bool:
        """Place an expert's host ``payload`` in ``slot`` now (the resident load); True if it was dequantised."""
        if self.direct:
            for dst, src in zip(self.slot_views[slot], payload, strict=True):
                dst.copy_(src)
            return False
        self._dequantize_into(slot, [src.to(self.device) for src in payload])
        return True

    def place_layer(self, layer: int, first_slot: int) -> None:
        """The resident load put ``layer``'s experts in consecutive slots from ``first_slot``."""
        n = self.store.num_experts
        self._table[layer] = torch.arange(first_slot, first_slot + n, device=self.device)

    def close(self) -> None:
        self.buffers, self.slot_views, self.pool, self._stored_parts = [], [], [], None
        self._payloads = {}

    def _dequantize_slots(self, slots: list[int]) -> None:
        """The landed ``slots``' stored bytes → the pool: one gather per stored part, one grouped dequantisation,
        one scatter per compute tensor, whatever the count (per slot when the store dequantises one expert at a
        time)."""
        if self._stored_parts is None:
            for slot in slots:
                self._dequantize_into(slot, self.slot_views[slot])
            return
        where = to_device(torch.tensor(slots, dtype=torch.long), self.device)
        skip = set(self._passthrough.values())
        stored = [None if j in skip else p.index_select(0, where) for j, p in enumerate(self._stored_parts)]
        weights = self.store.dequantize_parts(stored, self.dtype, contiguous=False)
        for dst, w in zip(self.pool, weights, strict=True):
            if w is not None:  # None: a passthrough part, already in place
                dst.index_copy_(0, where, w)

    def _dequantize_into(self, slot: int, stored: list[torch.Tensor]) -> None:
        for dst, w in zip(self.weights(slot), self.store.dequantize(stored, self.dtype), strict=True):
            dst.copy_(w)
