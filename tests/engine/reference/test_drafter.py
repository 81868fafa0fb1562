"""Block drafter: distillation against a briefly trained tiny MoE target on a seeded order-2 language.

A random target is useless for acceptance, so the module fixture trains one for a few seconds first. Run with
``-s`` to see the measured τ (quoted in docs/reference-engine.md, "The block drafter").
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from pd_dflash.engine.reference.block_drafter import (
    BlockDrafter,
    DrafterConfig,
    SharedTargetParts,
)
from pd_dflash.engine.reference.presets.drafter_training import (
    measure_block_tau,
    pool_sampler,
    target_rollouts,
    train_drafter,
)

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, P_RULE = 32, 64, 0.85
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


def drafter_config(target) -> DrafterConfig:
    return DrafterConfig.for_target(target.config, block_size=16, num_layers=2, context_len=4)


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


def test_trained_drafter_accepts_far_more_than_untrained(target, rollout_pool):
    cfg = drafter_config(target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        untrained = BlockDrafter(cfg, SharedTargetParts.from_causal_lm(target)).eval()
    trained, report = train_drafter(
        target, pool_sampler(rollout_pool, 16), steps=300, seed=0, config=cfg, anchors_per_sequence=4
    )
    assert report.steps == 300 and report.losses[-1] < report.losses[0] - 0.5
    prompts = sample_batch(torch.Generator().manual_seed(5), batch=256, seq=24)
    taus = {
        (name, block, temperature): measure_block_tau(
            target, drafter, prompts, block, temperature, torch.Generator().manual_seed(6)
        )
        .float()
        .mean()
        .item()
        for name, drafter in (("untrained", untrained), ("trained", trained))
        for block in (8, 16)
        for temperature in (0.0, 1.0)
    }
    print("\nτ (committed tokens per round incl. bonus):", {k: round(v, 2) for k, v in taus.items()})
    print(
        f"drafter: {report.steps} steps, {report.seconds:.1f} s, loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f}"
    )
    for block in (8, 16):
        assert taus["untrained", block, 0.0] < 1.3
        assert taus["trained", block, 0.0] > 3.5
        assert taus["trained", block, 0.0] > taus["untrained", block, 0.0] + 2.0
        assert taus["trained", block, 1.0] > taus["untrained", block, 1.0] + 0.5


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


def test_checkpoint_round_trip_excludes_shared_target_parts(target):
    drafter, _ = train_drafter(target, sample_batch, steps=2, seed=0, config=drafter_config(target))
    ckpt = drafter.to_checkpoint()
    assert not any(k.startswith(("embed", "norm", "lm_head", "_shared")) for k in ckpt["state_dict"])
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    rebuilt = BlockDrafter.from_checkpoint(torch.load(buf), SharedTargetParts.from_causal_lm(target))
    anchor = torch.tensor([1, 2, 3])
    ctx = torch.randn(3, 4, len(drafter.config.target_layer_ids) * HIDDEN)
    x, y = drafter.draft(anchor, ctx, 16), rebuilt.draft(anchor, ctx, 16)
    assert torch.equal(x.tokens, y.tokens) and torch.allclose(x.hidden, y.hidden)


def test_smaller_block_is_an_exact_prefix_of_the_trained_block(target):
    drafter, _ = train_drafter(target, sample_batch, steps=2, seed=0, config=drafter_config(target))
    anchor = torch.tensor([4, 5])
    ctx = torch.randn(2, 4, len(drafter.config.target_layer_ids) * HIDDEN)
    full, short = drafter.draft(anchor, ctx, 16), drafter.draft(anchor, ctx, 8)
    assert torch.allclose(full.hidden[:, :8], short.hidden, atol=1e-6)
    assert torch.equal(full.tokens[:, :7], short.tokens)
    assert short.hidden.shape == (2, 8, HIDDEN) and short.probs is None
    sampled = drafter.draft(anchor, ctx, 8, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (2, 7, VOCAB) and torch.allclose(sampled.probs.sum(-1), torch.ones(2, 7))


def test_bad_inputs_raise(target):
    cfg = drafter_config(target)
    drafter = BlockDrafter(cfg, SharedTargetParts.from_causal_lm(target))
    ctx = torch.randn(1, 4, len(cfg.target_layer_ids) * HIDDEN)
    with pytest.raises(ValueError, match="block_size must be in"):
        drafter.draft(torch.tensor([1]), ctx, 17)
    with pytest.raises(ValueError, match="context_features must be"):
        drafter.draft(torch.tensor([1]), ctx[..., :HIDDEN], 8)
    with pytest.raises(ValueError, match="shorter than context_len"):
        train_drafter(target, lambda g: sample_batch(g, seq=10), steps=1, seed=0, config=cfg)
    with pytest.raises(ValueError, match="differs from block_size_max"):
        train_drafter(target, sample_batch, steps=1, seed=0, config=cfg, block_size_max=8)
    with pytest.raises(ValueError, match="does not match the drafter config"):
        BlockDrafter(
            DrafterConfig(hidden_size=32, vocab_size=VOCAB, target_layer_ids=(1,)),
            SharedTargetParts.from_causal_lm(target),
        )
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig(hidden_size=HIDDEN, vocab_size=VOCAB, target_layer_ids=())
