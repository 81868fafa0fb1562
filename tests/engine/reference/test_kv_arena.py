"""Attention batched across the blocks of a round on the KV arena (``decoding/kv_arena.py``): one attention-module call per
layer gives each block what it gets alone (bit for bit), the MoE sees the real rows only, the arena is allocated once per cell and
rollback is length bookkeeping, and the ops of a forward do not grow with the number of blocks."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pd_dflash.engine.reference.decoding.loop import RoundHooks, run_requests
from pd_dflash.engine.reference.decoding.speculative import EarlyExitDrafter, SpeculativeDecoding
from pd_dflash.engine.reference.decoding.target import AutoregressiveDecoding, Block, Request, TargetModel
from pd_dflash.engine.reference.families import family_of
from tests.engine.reference.helpers import tiny_model

CPU = torch.device("cpu")
FAMILIES = ["qwen3_moe", "gpt_oss", "mixtral"]


def target_of(family: str, **overrides) -> TargetModel:
    model = tiny_model(family, seed=1, **overrides)
    return TargetModel(model, family_of(model.config), CPU)


def prefilled(target: TargetModel, prompts: list[list[int]]) -> list[Request]:
    requests = []
    for i, p in enumerate(prompts):
        r = Request(i, p, 8, cache=target.new_cache())
        target.forward([Block(r, p, len(p) - 1)])
        requests.append(r)
    return requests


@pytest.mark.parametrize(
    ("family", "dtype"),
    [*((f, torch.float32) for f in FAMILIES), ("qwen3_moe", torch.bfloat16), ("gpt_oss", torch.bfloat16)],
)
def test_one_batched_forward_gives_each_block_what_it_gets_alone(family, dtype):
    """Blocks of different lengths (a prompt, a 1-token step, a 5-row verify) at different positions, past
    gpt-oss's sliding window (8): one forward over the three gives each what it gets alone — in bf16 bit for
    bit (each block's attention kernel sees its exact KV length: a padded kernel call changed bf16 bits and
    greedy tokens), in fp32 to rounding (fp32 matmuls of 1-3 rows round differently from larger ones)."""
    target = target_of(family)
    target.model.to(dtype)
    target.arena = type(target.arena)(target.model, CPU)
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, atol=1e-5)
    prompts = [[(3 * j + 1) % 64 for j in range(40)], [7, 1, 9, 4, 22, 5, 5, 13, 2, 30, 11]]  # KV 41 and 16
    tokens = [[5], [6, 7, 8, 9, 10]]
    alone, batched = prefilled(target, prompts), prefilled(target, prompts)
    want = [target.forward([Block(r, t, 0)])[0][0] for r, t in zip(alone, tokens, strict=True)]
    fresh = [Request("new", [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 12, 13], 8, cache=target.new_cache())]
    want.append(target.forward([Block(fresh[0], fresh[0].prompt, 0)])[0][0])
    fresh.append(Request("new2", list(fresh[0].prompt), 8, cache=target.new_cache()))
    blocks = [
        *(Block(r, t, 0) for r, t in zip(batched, tokens, strict=True)),
        Block(fresh[1], fresh[1].prompt, 0),
    ]
    got, _ = target.forward(blocks)
    for g, w in zip(got, want, strict=True):
        assert same(g, w)
    for a, b in zip([*alone, fresh[0]], [*batched, fresh[1]], strict=True):
        assert a.cached == b.cached
        for layer in range(target.num_layers):
            (ka, va), (kb, vb) = target.kv_entries(a, layer), target.kv_entries(b, layer)
            assert same(ka, kb) and same(va, vb)


@pytest.mark.parametrize(("family", "dtype"), [("qwen3_moe", torch.bfloat16), ("gpt_oss", torch.bfloat16)])
def test_blocks_in_lockstep_run_one_kernel_call_and_get_what_they_get_alone(family, dtype):
    """Requests at the same position with blocks of the same width (equal prompt lengths: AR decode steps, or
    verify blocks) share ONE kernel call as batch elements: still bit for bit what each gets alone (bf16)."""
    target = target_of(family)
    target.model.to(dtype)
    target.arena = type(target.arena)(target.model, CPU)
    prompts = [[(3 * j + 1) % 64 for j in range(20)], [(5 * j + 2) % 64 for j in range(20)]]
    for tokens in ([[5], [6]], [[5, 1, 2, 3], [6, 7, 8, 9]]):
        alone, together = prefilled(target, prompts), prefilled(target, prompts)
        want = [target.forward([Block(r, t, 0)])[0][0] for r, t in zip(alone, tokens, strict=True)]
        got, _ = target.forward([Block(r, t, 0) for r, t in zip(together, tokens, strict=True)])
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_the_moe_block_sees_exactly_the_real_rows():
    """The MoE block (routing, expert statistics) sees exactly the round's real rows, blocks of any lengths."""
    target = target_of("qwen3_moe")
    requests = prefilled(target, [list(range(3, 13)), list(range(20, 26))])
    seen = []
    handles = [
        layer.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[:-1]))
        for layer in target.model.model.layers
    ]
    target.forward([Block(requests[0], [1, 2, 3, 4, 5, 6], 0), Block(requests[1], [7], 0)])
    for h in handles:
        h.remove()
    assert seen == [torch.Size([1, 7])] * target.num_layers


def test_the_arena_is_allocated_once_per_cell_and_rollback_is_bookkeeping():
    """Serving speculative requests (rejections: the early-exit drafter of an untrained model) never reallocates
    the arena; the row's KV bytes are the positions in use × bytes per position; finished requests free their
    rows for the next ones."""
    target = target_of("gpt_oss")
    prompts = [[(5 * i + j) % 64 for j in range(9 + i)] for i in range(4)]
    requests = [Request(i, p, 12) for i, p in enumerate(prompts)]
    target.reserve(requests, 2, 4)
    pointers = [t.data_ptr() for t in target.arena.keys + target.arena.values]
    rounds = run_requests(
        target,
        requests,
        concurrency=2,
        decoding=SpeculativeDecoding(EarlyExitDrafter(target, 1), 4),
        hooks=RoundHooks(),
    )
    assert [t.data_ptr() for t in target.arena.keys + target.arena.values] == pointers
    assert target.arena.slots == 2 and target.arena.max_len == max(len(p) for p in prompts) + 12 + 4
    per_position = target.num_layers * 2 * 2 * 8 * 4  # layers × (K, V) × kv_heads × head_dim × fp32
    assert target.arena.bytes_per_position == per_position
    assert all(rec.kv_bytes % per_position == 0 and rec.kv_bytes > 0 for rec in rounds[:-1])
    assert all(rec.kv_allocated_bytes == target.arena.allocated_bytes for rec in rounds)
    assert sorted(target.arena._free) == [0, 1] and all(r.cache is None for r in requests)


def test_a_forward_over_more_blocks_dispatches_few_more_ops():
    """One attention-module call per layer over every block: each further block adds only its kernel call on its
    own rows and KV window — at most 12 ops per layer (the per-request attention this replaces added ≈ 60).
    The model's own grouped-mm experts keep the MoE constant."""
    target = target_of("qwen3_moe", num_hidden_layers=4)
    target.model.set_experts_implementation("grouped_mm")
    requests = prefilled(target, [[(3 * i + j) % 64 for j in range(6 + i)] for i in range(8)])

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def ops(rs):
        Count.ops = 0
        with Count():
            target.forward([Block(r, [1], 0) for r in rs])
        return Count.ops

    one, eight = ops(requests[:1]), ops(requests)
    assert eight - one <= 7 * 12 * target.num_layers, (one, eight)


def test_an_unsupported_attention_implementation_is_refused_by_name():
    model = tiny_model("qwen3_moe")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="flex_attention"):
        TargetModel(model, family_of(model.config), CPU)


def test_ar_serving_equals_generate_with_mixed_lengths_in_flight():
    """Continuous batching with prompts of different lengths in one forward (a prefill beside decode steps),
    every family, equals transformers' greedy ``generate``."""
    for family in FAMILIES:
        target = target_of(family)
        prompts = [[(7 * i + j) % 64 for j in range(5 + 4 * i)] for i in range(4)]
        want = []
        for p in prompts:
            out = target.model.generate(
                torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False
            )
            want.append(out[0, len(p) :].tolist())
        requests = [Request(i, p, 10) for i, p in enumerate(prompts)]
        run_requests(target, requests, concurrency=3, decoding=AutoregressiveDecoding(), hooks=RoundHooks())
        assert [r.output for r in requests] == want, family
