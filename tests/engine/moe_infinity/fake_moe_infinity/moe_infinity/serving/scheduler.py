"""Fake serving ``Scheduler`` (2-D verify admission) and ``PagedKVCache`` with the real KV bookkeeping.

Mirrors TorchMoE/MoE-Infinity@0690efefe42477164031e6020c986650d9f89e6a ``moe_infinity/serving/scheduler.py``:
``admit_verify_demands`` (seat in-flight demands, admit the others while tokens and bytes both fit budget +
carried, carried = clamp(pool, 0, cap), and a cap below the largest demand raises); admission allocates a
sequence's prompt blocks (``allocate_sequence(num_tokens=prompt_length)``); ``update_after_step`` appends KV only
for ``new_decode_seq_ids`` and frees completed sequences. A speculative commit passes ``new_decode_seq_ids=[]``,
so the paged cache of a speculative sequence holds its prompt blocks only.
"""

from __future__ import annotations

import math

from moe_infinity import FEATURES


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {count}, {len(self._free)} free")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._allocator = BlockAllocator(num_blocks)
        self.block_allocator = self._allocator
        self._tables: dict[int, list[int]] = {}
        self._tokens: dict[int, int] = {}

    def allocate_sequence(self, seq_id: int, num_tokens: int) -> None:
        self._tables[seq_id] = []
        self._tokens[seq_id] = 0
        self.append_tokens(seq_id, num_tokens)

    def append_tokens(self, seq_id: int, num_new_tokens: int = 1) -> None:
        if seq_id not in self._tables:
            raise KeyError(seq_id)
        self._tokens[seq_id] += num_new_tokens
        missing = math.ceil(self._tokens[seq_id] / self.block_size) - len(self._tables[seq_id])
        if missing > 0:
            self._tables[seq_id].extend(self._allocator.allocate(missing))

    def free_sequence(self, seq_id: int) -> None:
        self._allocator.free(self._tables.pop(seq_id, []))
        self._tokens.pop(seq_id, None)


class Scheduler:
    def __init__(
        self,
        kv_cache: PagedKVCache,
        max_batch_size: int = 32,
        max_tokens_per_step: int = 2048,
        *,
        verify_token_budget: int | None = None,
        verify_expert_byte_budget: int | None = None,
        verify_token_deficit_cap: int | None = None,
        verify_expert_byte_deficit_cap: int | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        values = (
            verify_token_budget,
            verify_expert_byte_budget,
            verify_token_deficit_cap,
            verify_expert_byte_deficit_cap,
        )
        if any(v is None for v in values) and not all(v is None for v in values):
            raise ValueError("verify scheduling requires all four budgets or none of them")
        self._enabled = values[0] is not None
        self.budget = (verify_token_budget or 0, verify_expert_byte_budget or 0)
        self.cap = (verify_token_deficit_cap or 0, verify_expert_byte_deficit_cap or 0)
        self.carried = (0, 0)
        self.demands: dict[int, tuple[int, int]] = {}

    @property
    def verify_scheduling_enabled(self) -> bool:
        return self._enabled

    def set_verify_demand(self, seq_id: int, tokens: int, expert_bytes: int, in_flight: bool = False) -> None:
        self.demands[seq_id] = (tokens, expert_bytes)

    def clear_verify_demand(self, seq_id: int) -> None:
        self.demands.pop(seq_id, None)

    def admit_verifies(self) -> list[int]:
        if not self._enabled:
            return list(self.demands)
        if self.demands:
            largest = (max(d[0] for d in self.demands.values()), max(d[1] for d in self.demands.values()))
            if self.cap[0] < largest[0] or self.cap[1] < largest[1]:
                raise ValueError(f"deficit_cap {self.cap} below the largest demand {largest}")
        pool = [self.budget[0] + self.carried[0], self.budget[1] + self.carried[1]]
        admitted = []
        for seq_id, (tokens, nbytes) in self.demands.items():
            if tokens <= pool[0] and nbytes <= pool[1]:
                pool[0] -= tokens
                pool[1] -= nbytes
                admitted.append(seq_id)
        self.carried = (min(max(0, pool[0]), self.cap[0]), min(max(0, pool[1]), self.cap[1]))
        return admitted

    def update_after_step(
        self,
        completed_seq_ids: list[int],
        new_decode_seq_ids: list[int],
        committed_counts: dict | None = None,
    ) -> None:
        completed = set(completed_seq_ids)
        for seq_id in dict.fromkeys(new_decode_seq_ids):
            if seq_id not in completed:
                self.kv_cache.append_tokens(seq_id, (committed_counts or {}).get(seq_id, 1))
        for seq_id in completed:
            self.kv_cache.free_sequence(seq_id)


class LegacyScheduler(Scheduler):
    """The scheduler before the 2-D verify budgets: none in its signature."""

    def __init__(self, kv_cache: PagedKVCache, max_batch_size: int = 32, max_tokens_per_step: int = 2048):
        super().__init__(kv_cache, max_batch_size, max_tokens_per_step)


if "verify_scheduler" not in FEATURES:
    Scheduler = LegacyScheduler  # type: ignore[misc]
