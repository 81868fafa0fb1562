"""The decode loop against transformers' own generate, and offloading against residency, token for token."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.decoding.target import Block, Request
from pd_dflash.engine.reference.families import family_of
from tests.engine.reference.helpers import eager_copy, generate, offloaded, prompts_for, runtime, tiny_model

CPU = torch.device("cpu")


def hf_generate(model, prompts, max_new):
    ref = eager_copy(model)
    out = []
    for p in prompts:
        ids = ref.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new)
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_loop_matches_hf_generate_greedy(family):
    model = tiny_model(family)
    prompts = prompts_for(model.config.vocab_size)
    want = hf_generate(model, prompts, 12)  # 12 + 14 tokens > gpt-oss's sliding window of 8
    target, store = offloaded(model)
    got, _ = generate(target, runtime(target, store), prompts, 12)
    assert got == want


def test_loop_matches_hf_generate_on_the_trained_micro(micro):
    model, _ = micro
    prompts = prompts_for(model.config.vocab_size, n=2, length=16, seed=1)
    target, store = offloaded(model)
    got, _ = generate(target, runtime(target, store), prompts, 20)
    assert got == hf_generate(model, prompts, 20)


def test_offloaded_experts_are_a_drop_in_module_for_hf_forward():
    model = tiny_model("qwen3_moe")
    target, store = offloaded(model)
    rt = runtime(target, store, fraction=0.25)
    rt.begin_round([("hf", 10)])
    ids = torch.tensor([prompts_for(64, n=1, length=10)[0]])
    with torch.no_grad():
        got = target.model(ids).logits
        want = eager_copy(model)(ids).logits
    rt.end_round(kept_rows=10)
    assert torch.equal(got, want)
    rt.close()


def test_captured_hidden_states_match_hf_output_hidden_states(micro):
    model, _ = micro
    prompt = prompts_for(model.config.vocab_size, n=1, length=9)[0]
    with torch.no_grad():
        want = eager_copy(model)(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    target, store = offloaded(model)
    rt = runtime(target, store)
    request = Request("h", prompt, 1, cache=target.new_cache())
    rt.begin_round([("h", len(prompt))])
    _, captured = target.forward([Block(request, prompt, len(prompt) - 1)], capture=range(len(want)))
    assert sorted(captured) == list(range(len(want)))
    for i, h in captured.items():
        assert torch.allclose(h, want[i], atol=1e-6), i


@pytest.mark.parametrize(
    ("concurrency", "policy", "storage"),
    [(1, "lru", "fp32"), (4, "lru", "fp32"), (4, "lfu", "fp32"), (2, "lru", "fp8")],
)
def test_offloaded_equals_resident_token_for_token(micro, concurrency, policy, storage):
    model, _ = micro
    prompts = prompts_for(model.config.vocab_size, n=5, length=10, seed=2)
    target, store = offloaded(model, storage)
    resident, _ = generate(target, runtime(target, store), prompts, 16, concurrency)
    rt = runtime(target, store, fraction=0.3, policy=policy, gbps=5.0)
    got, rounds = generate(target, rt, prompts, 16, concurrency)
    assert got == resident
    c = rt.cache.counters
    assert c.misses > 0 and c.h2d_bytes > 0  # really offloaded
    assert c.peak_occupancy_bytes <= 0.3 * store.total_bytes
    assert max(r.requests for r in rounds) == concurrency  # c requests in one batched forward
    rt.close()


def test_prefetch_statistics_are_on_the_route_ahead_scale(micro):
    model, _ = micro
    prompts = prompts_for(model.config.vocab_size, n=3, length=12, seed=3)
    target, store = offloaded(model)
    rt = runtime(target, store, fraction=0.5, gbps=5.0)
    _, rounds = generate(target, rt, prompts, 12, concurrency=3)
    stats = rt.stats.as_dict()
    assert stats["steps"] == len(rounds)
    assert stats["layers_observed"] == len(rounds) * len(store.layer_ids)
    assert 0 < stats["covered_experts"] <= stats["actual_experts"] == sum(rt.needed_per_round)
    assert stats["predicted_prefetch_bytes"] == stats["predicted_experts"] * store.expert_nbytes
    assert stats["kept_experts"] == stats["actual_experts"]  # AR keeps every row
    rt.close()


def test_forwards_outside_a_round_fetch_but_do_not_feed_the_statistics(micro):
    model, _ = micro
    target, store = offloaded(model)
    rt = runtime(target, store, fraction=0.3, gbps=5.0)
    ids = torch.tensor([prompts_for(model.config.vocab_size, n=1, length=8)[0]])
    with torch.no_grad():
        target.model(ids)  # e.g. a drafter running target layers between rounds
        target.model(ids)
    assert rt.cache.counters.accesses > 0
    assert rt.stats.as_dict()["steps"] == 0 and rt.needed_per_round == []
    rt.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
@pytest.mark.parametrize("fraction", [None, 0.25])
def test_the_grouped_layer_equals_the_eager_experts(family, fraction):
    """One sort by slot and one grouped GEMM per projection over the slot pool (no host sync per expert): the
    output equals the eager experts module's on many tokens with random distinct top-k (a streaming cache too),
    to fp32 rounding: the GEMMs and the per-token sum are the eager ones bit for bit, but CPU elementwise kernels
    (sigmoid, SiLU) round an element differently depending on where it falls in a vector, which the grouping
    moves (measured ≤ 1e-9 here)."""
    model = tiny_model(family)
    reference = family_of(model.config).experts_module(eager_copy(model).model.layers[1])
    target, store = offloaded(model)
    rt = runtime(target, store, fraction=fraction)
    experts = target.model.model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(3)
    tokens, k, n = 97, model.config.num_experts_per_tok, store.num_experts
    hidden = torch.randn(tokens, model.config.hidden_size, generator=g)
    top_k_index = torch.rand(tokens, n, generator=g).argsort(dim=-1)[:, :k]
    top_k_weights = torch.rand(tokens, k, generator=g)
    with torch.no_grad():
        got = experts(hidden, top_k_index, top_k_weights)
        want = reference(hidden, top_k_index, top_k_weights)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    rt.close()
