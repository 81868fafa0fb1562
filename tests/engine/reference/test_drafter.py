"""The presets' DFlash drafter (``DFlashDrafter``, the published layout): distillation against a briefly trained tiny
MoE target on a seeded order-2 language, saved and reloaded in the published layout.

A random target is useless for acceptance, so the module fixture trains one for a few seconds first. Run with
``-s`` to see the measured τ.
"""

from __future__ import annotations

import math

import pytest
import torch

from pd_dflash.engine.reference.dflash.load import load_dflash_drafter
from pd_dflash.engine.reference.dflash.model import DraftKV, DraftRows
from pd_dflash.engine.reference.dflash.tiny import published_tensor_shapes, save_drafter
from pd_dflash.engine.reference.presets.drafter_training import (
    measure_block_tau,
    new_drafter,
    pool_sampler,
    preset_drafter_config,
    target_features,
    target_rollouts,
    train_drafter,
)

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, P_RULE = 32, 64, 0.85
#: Distillation steps per drafter, and the greedy τ a trained one must beat (an untrained one gives ≈ 1).
STEPS, TRAINED_GREEDY_TAU = 200, 3.0
RULE = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=torch.Generator().manual_seed(0))


def sample_batch(gen: torch.Generator, batch: int = 16, seq: int = 32) -> torch.Tensor:
    """Order-2 synthetic language: x_{t+1} = RULE[x_{t-1}, x_t] with probability P_RULE, else uniform."""
    x = torch.empty(batch, seq, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (batch, 2), generator=gen)
    follow = torch.rand(batch, seq, generator=gen) < P_RULE
    noise = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    for t in range(2, seq):
        x[:, t] = torch.where(follow[:, t], RULE[x[:, t - 2], x[:, t - 1]], noise[:, t])
    return x


@pytest.fixture(scope="module")
def one_thread():
    """Two shared cores: a second OpenMP thread under contention makes tiny-model steps 10-20× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(one_thread):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        moe_intermediate_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        ids = sample_batch(gen)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    # A target that learned the language, not a collapsed one (its argmax follows the rule).
    assert loss.item() < math.log(VOCAB) - 1.5
    ids = sample_batch(torch.Generator().manual_seed(9), batch=64)
    with torch.no_grad():
        argmax = model(ids).logits.argmax(-1)
    assert (argmax[:, 1:-1] == RULE[ids[:, :-2], ids[:, 1:-1]]).float().mean() > 0.75
    return model


@pytest.fixture(scope="module")
def rollout_pool(target):
    """The target's own greedy continuations of language prompts: the distillation data (DFlash practice)."""
    prompts = sample_batch(torch.Generator().manual_seed(3), batch=2048, seq=8)
    return target_rollouts(target, prompts, new_tokens=24)


def test_rollouts_are_the_targets_greedy_continuations(target, rollout_pool):
    assert rollout_pool.shape == (2048, 32)
    sample = rollout_pool[:64]
    with torch.no_grad():
        argmax = target(sample).logits.argmax(-1)
    assert torch.equal(argmax[:, 7:-1], sample[:, 8:])  # KV-cached decoding == full-forward argmax


def drafter_config(target, block: int = 16) -> dict:
    return preset_drafter_config(target.config, block)


def test_a_trained_drafter_accepts_far_more_than_an_untrained_one(target, rollout_pool):
    """At the published drafters' block size (a drafter per B; the presets' B = 8 drafters: test_speculative.py)."""
    prompts = sample_batch(torch.Generator().manual_seed(5), batch=256, seq=24)
    for block in (16,):
        cfg = drafter_config(target, block)
        untrained = new_drafter(target, cfg, seed=0).eval()
        trained, report = train_drafter(
            target, pool_sampler(rollout_pool, 16), steps=STEPS, seed=0, config=cfg, min_anchor=8
        )
        assert report.steps == STEPS and report.losses[-1] < report.losses[0] - 0.5
        taus = {
            (name, temperature): measure_block_tau(
                target, drafter, prompts, temperature, torch.Generator().manual_seed(6)
            )
            .float()
            .mean()
            .item()
            for name, drafter in (("untrained", untrained), ("trained", trained))
            for temperature in (0.0, 1.0)
        }
        print(
            f"\nB={block} τ (committed tokens per round incl. bonus):",
            {k: round(v, 2) for k, v in taus.items()},
        )
        print(
            f"{report.steps} steps, {report.seconds:.1f} s, loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f}"
        )
        assert taus["untrained", 0.0] < 1.3
        assert taus["trained", 0.0] > TRAINED_GREEDY_TAU
        assert taus["trained", 0.0] > taus["untrained", 0.0] + 1.5
        assert taus["trained", 1.0] > taus["untrained", 1.0] + 0.5


def test_training_is_deterministic_and_leaves_the_target_unchanged(target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    flags = [p.requires_grad for p in target.parameters()]
    runs = [
        train_drafter(target, sample_batch, steps=4, seed=s, config=drafter_config(target))[0]
        for s in (3, 3, 4)
    ]
    a, b, c = (r.state_dict() for r in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p.requires_grad for p in target.parameters()] == flags and not target.training


def test_a_trained_drafter_saves_and_loads_in_the_published_layout(target, tmp_path):
    """What training leaves is a published-layout directory: the loader of real drafters rebuilds it exactly,
    and serving it (drafter KV) drafts what the training forward computed."""
    from safetensors.torch import load_file

    cfg = drafter_config(target, 8)
    drafter, _ = train_drafter(target, sample_batch, steps=2, seed=0, config=cfg)
    save_drafter(tmp_path / "d", cfg, drafter.state_dict())
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in stored.items()} == published_tensor_shapes(drafter.config)
    loaded, facts = load_dflash_drafter(tmp_path / "d", target)
    assert facts["ignored_tensors"] == [] and facts["attention"] == ["non-causal", "non-causal"]
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in drafter.state_dict().items())
    ids = sample_batch(torch.Generator().manual_seed(2), batch=1, seq=12)
    with torch.no_grad():
        features = target_features(
            target(ids, output_hidden_states=True).hidden_states, cfg["dflash_config"]["target_layer_ids"]
        )
        trained = drafter.teacher_forced(features, ids[:, 11:], torch.tensor([[11]]), 8)[0, 0]
    served = loaded([DraftRows(DraftKV(), features[0, :11], int(ids[0, 11]))], 8)[0]
    torch.testing.assert_close(served, trained, atol=1e-5, rtol=1e-4)


def test_bad_inputs_raise(target):
    cfg = drafter_config(target)
    with pytest.raises(ValueError, match="shorter than min_anchor"):
        train_drafter(target, lambda g: sample_batch(g, seq=10), steps=1, seed=0, config=cfg, min_anchor=8)
    with pytest.raises(ValueError, match="steps must be"):
        train_drafter(target, sample_batch, steps=0, seed=0, config=cfg)
    with pytest.raises(ValueError, match="exceed"):
        target_features([torch.zeros(1)] * 2, [1])
