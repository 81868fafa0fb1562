"""Speculative decoding in the reference engine: lossless against greedy AR for every configuration, drafter,
block size and concurrency; KV rollback; B1/B2/OURS rows with their distinct code paths observable."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.decoding.loop import run_requests
from pd_dflash.engine.reference.decoding.speculative import EarlyExitDrafter, SpeculativeDecoding
from pd_dflash.engine.reference.decoding.target import AutoregressiveDecoding, Block, Request, TargetModel
from pd_dflash.engine.reference.families import family_of
from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.drafters import load_drafter
from pd_dflash.engine.registry import blocked_reason
from pd_dflash.errors import InputError
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import make_engine, make_spec, offloaded_runtime, tiny_model

CPU = torch.device("cpu")
LINK = {"emulated_h2d_gbps": 2.0, "emulated_latency_us": 5.0}
# Long enough for several draft/verify rounds at B=16 with partial acceptance, short enough for CI.
WORKLOAD = {"requests": 4, "warmup_rounds": 1, "max_new_tokens": 40, "prompt_tokens": 12, "seed": 3}


def spec_for(
    drafter, baselines=("B0", "B1", "B2", "B3", "OURS"), concurrency=(1, 4), block_sizes=(8, 16), **options
):
    spec = make_spec(
        baselines=baselines,
        concurrency=concurrency,
        options={**LINK, "drafter": drafter, **options},
        workload=WORKLOAD,
    )
    return spec.model_copy(update={"block_sizes": list(block_sizes)})


@pytest.fixture(scope="module", params=["dflash", "early_exit"])
def rows_by_drafter(request, micro):
    spec = spec_for(request.param)
    engine = make_engine(spec)
    rows = {
        (c.baseline, c.block_size, c.concurrency): Row.from_result(c, engine.run_cell(c))
        for c in expand(spec)
    }
    engine.close()
    return request.param, rows


def test_greedy_speculative_output_equals_greedy_ar_for_every_configuration(rows_by_drafter):
    """The test that proves the engine right: B1, B2, B3 and OURS, B ∈ {8, 16}, c ∈ {1, 4}, each drafter."""
    drafter, rows = rows_by_drafter
    reference = rows[("B0", 8, 1)].engine["output_digest"]
    assert rows[("B0", 8, 4)].engine["output_digest"] == reference
    checked = 0
    for (baseline, block, conc), row in rows.items():
        assert row.status == Status.OK, (baseline, block, conc, row.warnings)
        assert row.engine["output_digest"] == reference, (drafter, baseline, block, conc)
        if baseline != "B0":
            checked += 1
            assert row.engine["drafter"]["kind"] == drafter
            # Real speculation with rejections: some rounds accept several drafts, some reject.
            hist = row.acceptance_histogram
            assert 1.0 < row.acceptance_length_a < block and len(hist) > 1, (baseline, block, conc, hist)
            assert sum(k * v for k, v in hist.items()) / sum(hist.values()) == pytest.approx(
                row.acceptance_length_a
            )
    assert checked == 4 * 2 * 2


def test_speculative_rows_carry_the_round_timings_bm1_and_hide_inequality(rows_by_drafter):
    _, rows = rows_by_drafter
    for baseline in ("B1", "B2", "OURS"):
        row = rows[(baseline, 16, 4)]
        assert row.t_draft_seconds > 0 and row.t_verify_seconds > 0
        assert {"draft_seconds", "router_seconds", "verify_seconds", "round_seconds"} <= set(row.latency)
        bm1 = row.engine["bm1"]
        assert bm1["t_router_seconds"] == row.t_router_seconds and isinstance(bm1["bm1_pass"], bool)
        hide = row.hide_inequality
        assert hide is not None and hide.draft_seconds > 0
        overlap = row.engine["overlap"]
        assert overlap["h2d_bytes"] == row.cost_terms.h2d_bytes
        assert 0 <= overlap["overlap_fraction"]["any_compute"] <= 1
        assert hide.overlap_seconds == pytest.approx(
            overlap["overlapped_seconds"]["verify"] / row.engine["batch"]["rounds"]
        )
    assert rows[("OURS", 16, 4)].t_router_seconds > 0
    assert rows[("B1", 16, 4)].t_router_seconds == 0.0  # B1 runs no route-ahead router pass


def test_b1_b2_and_ours_are_distinct_code_paths(rows_by_drafter):
    _, rows = rows_by_drafter
    b1, b2, ours = rows[("B1", 16, 4)], rows[("B2", 16, 4)], rows[("OURS", 16, 4)]
    # B1: the unchanged AR prefetcher, no scheduler (every request verifies every step).
    assert b1.engine["prefetcher"] == "activation_aware" and b1.engine["scheduler"]["kind"] == "none"
    assert b1.engine["batch"]["requests_per_forward_max"] == 4
    # B2: the AR prefetcher with the token-deficit scheduler (no byte dimension).
    assert b2.engine["prefetcher"] == "activation_aware"
    assert b2.engine["scheduler"]["kind"] == "token_deficit" and b2.engine["scheduler"]["dimensions"] == [
        "tokens"
    ]
    # OURS: route-ahead predictions issued before the verify, and a 2-D scheduler trace.
    assert ours.engine["prefetcher"] == "route_ahead"
    sched = ours.engine["scheduler"]
    assert sched["kind"] == "two_dim_deficit" and sched["dimensions"] == ["tokens", "expert_bytes"]
    assert sched["trace_first_steps"] and all(len(s["used"]) == 2 for s in sched["trace_first_steps"])
    assert ours.engine["prediction"]["issue"]["issued"] > 0
    ra = ours.route_ahead
    assert ra["steps"] == ours.engine["batch"]["rounds"] and ra["predicted_prefetch_bytes"] > 0
    assert ra["predicted_prefetch_bytes"] == ra["kept_prefetch_bytes"] + ra["wasted_prefetch_bytes"]
    # Byte waste split: mispredicted (P \ A) + experts only rejected rows routed = upstream's P \ U_keep.
    pred = ours.engine["prediction"]
    assert pred["mispredicted_bytes"] + pred["wasted_on_rejected_rows_bytes"] == ours.wasted_prefetch_bytes
    # Route-ahead predicts the verify's routing from the known draft tokens: far better than AR history.
    assert ours.route_ahead_prefetch_coverage > b1.route_ahead_prefetch_coverage + 0.15


def test_b2_token_budget_binds_and_is_measured(micro):
    spec = spec_for(
        "dflash", baselines=("B2",), concurrency=(4,), block_sizes=(8,), scheduler_budget_tokens=8
    )
    engine = make_engine(spec)
    cell = expand(spec)[0]
    row = Row.from_result(cell, engine.run_cell(cell))
    sched = row.engine["scheduler"]
    assert row.status == Status.OK and sched["budget"] == {"tokens": 8}
    assert sched["binding_steps"]["tokens"] > 0 and sched["steps_with_deferral"] > 0
    assert row.engine["batch"]["requests_per_forward_max"] == 1  # a budget of one block per step
    assert row.generated_tokens == WORKLOAD["requests"] * WORKLOAD["max_new_tokens"]


def test_a_cap_below_the_largest_single_demand_is_refused_with_the_fix(micro):
    spec = spec_for(
        "dflash", baselines=("B2", "OURS"), concurrency=(1,), block_sizes=(8,), scheduler_cap_tokens=9
    )
    engine = make_engine(spec)
    for cell in expand(spec):
        with pytest.raises(Refused) as refused:
            engine.run_cell(cell)
        assert refused.value.status == Status.REFUSED
        assert "scheduler_cap_tokens=9" in refused.value.reason and "at least 12" in refused.value.reason
    spec = spec_for("dflash", baselines=("OURS",), concurrency=(1,), block_sizes=(8,), scheduler_cap_bytes=1)
    with pytest.raises(Refused) as refused:
        make_engine(spec).run_cell(expand(spec)[0])
    assert refused.value.status == Status.REFUSED and "scheduler_cap_bytes=1" in refused.value.reason


def test_sampling_at_temperature_one_is_reproducible_and_accepts(micro):
    spec = spec_for("dflash", baselines=("B1", "OURS"), concurrency=(2,), block_sizes=(8,))
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"temperature": 1.0})})
    engine = make_engine(spec)
    first = {c.baseline: engine.run_cell(c) for c in expand(spec)}
    again = engine.run_cell(expand(spec)[0])
    assert first["B1"].engine["output_digest"] == again.engine["output_digest"]
    for result in first.values():
        assert result.status == Status.OK and result.acceptance_length_a > 1.0


def test_every_baseline_is_supported_by_the_reference_engine():
    for cell in expand(spec_for("dflash", baselines=("B0", "B1", "B2", "B3", "OURS"))):
        assert blocked_reason("reference", cell) is None


def test_early_exit_layers_must_leave_a_layer_to_verify(micro):
    with pytest.raises(InputError, match="early_exit_layers"):
        make_engine(spec_for("early_exit", early_exit_layers=2))


def test_the_dflash_drafters_are_cached_in_the_published_layout_with_their_cards(micro):
    from safetensors.torch import load_file

    from pd_dflash.engine.reference.dflash.tiny import published_tensor_shapes

    model, _ = micro
    for block in (8, 16):  # one drafter per block size, each trained by the engine fixtures above
        drafter, facts = load_drafter(get_preset("micro"), model, block_size=block)
        card = facts["card"]
        assert card["cache_hit"] and facts["kind"] == "dflash" and facts["architecture"] == "DFlashDraftModel"
        assert drafter.config.block_size == block and facts["attention"] == ["non-causal", "non-causal"]
        assert set(card["tau"]) == {"greedy", "t1"}
        assert card["tau"]["greedy"] > 2.5  # trained: an untrained drafter gives ≈ 1
        stored = load_file(f"{facts['checkpoint']}/model.safetensors")  # z-lab's tensor names, nothing else
        assert {k: tuple(v.shape) for k, v in stored.items()} == published_tensor_shapes(drafter.config)


def test_cpu_transfers_without_emulation_are_not_called_a_real_link(micro):
    spec = make_spec(baselines=("B0",), concurrency=[1], options={})
    result = make_engine(spec).run_cell(expand(spec)[0])
    assert result.cost_terms.h2d_link == "host" and result.cost_terms.h2d_bytes > 0


# -- below the engine: KV rollback and the sliding window ------------------------------------------------------


def test_rejected_rows_are_rolled_back_out_of_the_kv_cache(micro):
    """Verify a block whose 4th draft is wrong: the kept cache equals the cache of feeding the accepted tokens
    one by one, and the next forward gives the same logits."""
    model, _ = micro
    target, rt = offloaded_runtime(model)
    prompt = [3, 17, 5, 9, 33, 12, 7, 40]
    ar = Request("ar", prompt, 8, cache=target.new_cache())
    run_requests(target, [ar], concurrency=1, decoding=AutoregressiveDecoding(), hooks=rt)
    greedy = ar.output  # the greedy continuation (its cache is dropped at the end)

    spec = Request("spec", prompt, 8, cache=target.new_cache())
    decoding = SpeculativeDecoding(EarlyExitDrafter(target, 1), block_size=8)
    logits, _ = target.forward([Block(spec, prompt, len(prompt) - 1, prefill=True)])
    decoding.commit(Block(spec, prompt, len(prompt) - 1, prefill=True), logits[0], {})
    drafts = [*greedy[1:4], (greedy[4] + 1) % model.config.vocab_size, 0, 1, 2]
    block = Block(spec, [greedy[0], *drafts], 0, drafts=drafts)
    logits, _ = target.forward([block])
    commit = decoding.commit(block, logits[0], {})
    assert (
        commit.kept_rows == 4 and commit.committed == 4
    )  # anchor + 3 accepted drafts kept; 3 drafts + bonus
    assert spec.output == greedy[:5] and spec.cached == len(prompt) + 4

    fed = Request("fed", prompt, 8, cache=target.new_cache())
    for tokens in [prompt, *[[t] for t in greedy[:4]]]:
        target.forward([Block(fed, tokens, len(tokens) - 1)])
    for layer in range(target.num_layers):
        (ka, va), (kb, vb) = target.kv_entries(spec, layer), target.kv_entries(fed, layer)
        assert ka.shape == kb.shape
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    nxt = [greedy[4]]
    got, _ = target.forward([Block(spec, nxt, 0)])
    want, _ = target.forward([Block(fed, nxt, 0)])
    assert torch.allclose(got[0], want[0], atol=1e-5)
    rt.close()


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_early_exit_speculation_is_lossless_beyond_the_sliding_window(family, block_size):
    """gpt-oss's sliding window (8 here) is exceeded: rollback of sliding layers must still be exact."""
    model = tiny_model(family, seed=1)
    target, rt = offloaded_runtime(model)
    prompts = [[(7 * i + j) % 64 for j in range(10 + i)] for i in range(3)]

    def serve(decoding, concurrency):
        requests = [Request(i, p, 20) for i, p in enumerate(prompts)]
        run_requests(target, requests, concurrency=concurrency, decoding=decoding, hooks=rt)
        return [r.output for r in requests]

    want = serve(AutoregressiveDecoding(), 1)
    for concurrency in (1, 3):
        got = serve(SpeculativeDecoding(EarlyExitDrafter(target, 1), block_size), concurrency)
        assert got == want, concurrency
    rt.close()


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_the_verify_resuming_from_the_router_pass_is_bit_identical(family):
    """Route-ahead's router pass keeps its first-layer work (``Prefix``); the verify resumes from it instead of
    recomputing it: logits and KV caches equal, bit for bit, to a verify from scratch (two requests at once,
    past gpt-oss's sliding window)."""
    model = tiny_model(family, seed=1)
    target = TargetModel(model, family_of(model.config), CPU)
    prompts = [list(range(3, 15)), [7, 1, 9, 4, 22, 5, 5, 13, 2, 30]]

    def requests():
        out = []
        for i, p in enumerate(prompts):
            r = Request(f"r{i}", p, 8, cache=target.new_cache())
            target.forward([Block(r, p, len(p) - 1)])
            out.append(r)
        return out

    blocks = lambda rs: [Block(r, [5, 6, 7, 8, 9, 10], 0) for r in rs]  # noqa: E731
    plain, resumed = requests(), requests()
    want, _ = target.forward(blocks(plain))
    kept = blocks(resumed)
    target.first_gate_inputs(kept, 0, keep=True)
    assert all(b.prefix is not None for b in kept)
    got, _ = target.forward(kept)
    assert all(b.prefix is None for b in kept)  # consumed
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for a, b in zip(plain, resumed, strict=True):
        assert a.cached == b.cached
        for layer in range(target.num_layers):
            (ka, va), (kb, vb) = target.kv_entries(a, layer), target.kv_entries(b, layer)
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    # A block verified with one that kept nothing: its prefix is dropped (KV rolled back), then recomputed.
    mixed = requests()
    first, second = blocks(mixed)
    target.first_gate_inputs([first], 0, keep=True)
    got, _ = target.forward([first, second])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
