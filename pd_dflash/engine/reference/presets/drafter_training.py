"""Distillation of the block drafter against a (frozen) target, teacher-forced along sampled sequences.

For an anchor at position t of a training sequence x, the drafter sees the token x_t and the target's features
at positions t−context_len .. t−1; its output at block position k (1 ≤ k ≤ B−1) is trained towards the
target's next-token distribution at position t+k−1 (the target's prediction of x_{t+k} given the true prefix),
by KL(p_target ‖ q_drafter). Every step draws a batch from ``sample_batch(generator)`` and
``anchors_per_sequence`` random anchors per sequence, so the data source is the caller's.

Recommended data (DFlash trains on target-generated responses): ``target_rollouts`` continues prompts of the
synthetic language with the target's own greedy decoding, and ``pool_sampler`` draws training batches from that
pool. With greedy verification this lifts τ by 0.9-3.5 tokens per round on every reference preset
(docs/reference-engine.md, "The block drafter"; measured by
``python -m pd_dflash.engine.reference.presets.drafter_training --data both``):
along noisy language data the teacher's distribution at depth k is conditioned on intermediate tokens the
drafter cannot see, along greedy rollouts it is not.

The drafter is trained once at ``block_size_max``; because attention inside the block is causal, its first B
positions serve any smaller B unchanged.

Deterministic: the drafter's initial weights, the data generator and the anchor draws all derive from
``seed``, the step count is fixed, and nothing depends on wall time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pd_dflash.engine.reference.block_drafter import (
    BlockDrafter,
    DrafterConfig,
    SharedTargetParts,
    gather_features,
)
from pd_dflash.engine.reference.sampling import probabilities, sample


@dataclass(frozen=True)
class DrafterTrainReport:
    steps: int
    seconds: float
    #: Training loss per step: KL(p_target ‖ q_drafter) in nats, position-weighted (see distillation_loss).
    losses: list[float] = field(default_factory=list)


@torch.no_grad()
def target_rollouts(
    target: nn.Module,
    prompts: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    batch_size: int = 512,
) -> torch.Tensor:
    """Continue each prompt [n, p] by ``new_tokens`` tokens of the target's own decoding (greedy at temperature
    0, else sampled with ``generator``), with a KV cache; returns [n, p + new_tokens] on the prompts' device."""
    from transformers import DynamicCache  # engine-only dependency, imported where used

    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be a LongTensor [n, prompt_len ≥ 1], got {tuple(prompts.shape)}")
    device = next(target.parameters()).device
    was_training = target.training
    target.eval()
    chunks = []
    try:
        for start in range(0, prompts.shape[0], batch_size):
            ids = prompts[start : start + batch_size].to(device)
            out = target(ids, cache=DynamicCache(config=target.config), use_cache=True)
            pieces = [ids]
            for _ in range(new_tokens):
                last = out.logits[:, -1]
                nxt = (
                    last.argmax(-1)
                    if temperature == 0
                    else sample(probabilities(last, temperature), generator)
                )
                pieces.append(nxt[:, None])
                out = target(nxt[:, None], cache=out.cache, use_cache=True)
            chunks.append(torch.cat(pieces, dim=1))
    finally:
        target.train(was_training)
    return torch.cat(chunks).to(prompts.device)


def pool_sampler(pool: torch.Tensor, batch: int) -> Callable[[torch.Generator], torch.Tensor]:
    """A ``sample_batch`` drawing ``batch`` rows of a fixed pool [n, seq] (with replacement)."""
    if pool.dim() != 2 or pool.shape[0] < 1:
        raise ValueError(f"pool must be a LongTensor [n ≥ 1, seq], got {tuple(pool.shape)}")

    def sample_batch(generator: torch.Generator) -> torch.Tensor:
        return pool[torch.randint(0, pool.shape[0], (batch,), generator=generator)]

    return sample_batch


@torch.no_grad()
def measure_block_tau(
    target: nn.Module,
    drafter: BlockDrafter,
    prompts: torch.Tensor,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Committed tokens (bonus included) of ONE draft/verify round after each prompt [n, p ≥ context_len]: the
    anchor is the target's token after the prompt, the drafter proposes B−1 tokens, one target forward over
    ``[prompt, anchor, drafts]`` verifies them with the greedy rule (T = 0) or speculative sampling. An offline
    check of a trained drafter, without a KV cache; the engine measures τ in its own decode loop. Returns [n]."""
    from pd_dflash.engine.reference.sampling import greedy_accept, speculative_sample

    cfg = drafter.config
    if prompts.dim() != 2 or prompts.shape[1] < cfg.context_len:
        raise ValueError(f"prompts must be [n, ≥ context_len={cfg.context_len}], got {tuple(prompts.shape)}")
    ids = prompts.to(next(target.parameters()).device)
    out = target(ids, output_hidden_states=True)
    last = out.logits[:, -1]
    anchor = last.argmax(-1) if temperature == 0 else sample(probabilities(last, temperature), generator)
    context = gather_features(out.hidden_states, cfg.target_layer_ids)[:, -cfg.context_len :]
    drafted = drafter.draft(anchor, context, block_size, temperature, generator)
    verify = target(torch.cat([ids, anchor[:, None], drafted.tokens], dim=1)).logits[:, -block_size:]
    if temperature == 0:
        result = greedy_accept(verify, drafted.tokens)
    else:
        result = speculative_sample(verify, drafted.tokens, drafted.probs, temperature, generator)
    return result.num_committed


def _lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10%."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def distillation_loss(
    drafter: BlockDrafter,
    features: torch.Tensor,
    teacher_logits: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    position_decay: float | None = None,
) -> torch.Tensor:
    """KL over the B−1 draft positions of every anchor, averaged with weights exp(−(k−1)/position_decay)
    over draft position k (uniform when None): acceptance is prefix-based, so early positions matter most.

    ``features`` [batch, seq, F] and ``teacher_logits`` [batch, seq, vocab] come from one target forward over
    ``input_ids`` [batch, seq]; ``anchors`` [batch, A] are positions with context_len ≤ t ≤ seq − block_size + 1.
    """
    ctx_len = drafter.config.context_len
    batch = anchors.shape[0]
    rows = torch.arange(batch, device=anchors.device)[:, None, None]
    ctx_pos = anchors[:, :, None] - ctx_len + torch.arange(ctx_len, device=anchors.device)
    context = features[rows, ctx_pos].flatten(0, 1)  # [batch·A, ctx, F]
    anchor_tokens = input_ids.gather(1, anchors).flatten()
    hidden = drafter.hidden_states(anchor_tokens, context, block_size)
    log_q = F.log_softmax(drafter.logits(hidden[:, 1:]).float(), dim=-1)  # [batch·A, B−1, V]
    teach_pos = anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)
    log_p = F.log_softmax(teacher_logits[rows, teach_pos].float(), dim=-1).flatten(0, 1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean(0)  # [B−1]
    if position_decay is None:
        return kl.mean()
    weights = torch.exp(-torch.arange(block_size - 1, device=kl.device, dtype=kl.dtype) / position_decay)
    return (kl * weights).sum() / weights.sum()


def train_drafter(
    target: nn.Module,
    sample_batch: Callable[[torch.Generator], torch.Tensor],
    *,
    steps: int,
    seed: int,
    block_size_max: int = 16,
    config: DrafterConfig | None = None,
    lr: float = 3e-3,
    anchors_per_sequence: int = 8,
    position_decay: float | None = 4.0,
) -> tuple[BlockDrafter, DrafterTrainReport]:
    """Train a ``BlockDrafter`` for a transformers MoE CausalLM ``target`` (left unchanged).

    ``sample_batch(generator)`` returns a LongTensor [batch, seq] of training sequences, with
    seq ≥ context_len + block_size_max. ``config`` defaults to ``DrafterConfig.for_target(target.config)``.
    """
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    config = _drafter_config(target, config, block_size_max)
    drafter = _initial_drafter(target, config, seed)
    device = next(target.parameters()).device
    data_gen = torch.Generator().manual_seed(seed)
    anchor_gen = torch.Generator().manual_seed(seed + 1)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    start = time.perf_counter()
    with _frozen(target):
        drafter.train()
        for step in range(steps):
            input_ids = _checked_batch(sample_batch(data_gen), config.context_len + block_size_max).to(device)
            features, teacher_logits = _teacher(target, input_ids, config)
            anchors = torch.randint(
                config.context_len,
                input_ids.shape[1] - block_size_max + 2,
                (input_ids.shape[0], anchors_per_sequence),
                generator=anchor_gen,
            ).to(device)
            loss = distillation_loss(
                drafter, features, teacher_logits, input_ids, anchors, block_size_max, position_decay
            )
            losses.append(_optimizer_step(optimizer, drafter, loss, _lr_at(step, steps, lr)))
    drafter.eval()
    return drafter, DrafterTrainReport(steps=steps, seconds=time.perf_counter() - start, losses=losses)


def _drafter_config(target: nn.Module, config: DrafterConfig | None, block_size_max: int) -> DrafterConfig:
    if config is None:
        return DrafterConfig.for_target(target.config, block_size=block_size_max)
    if config.block_size != block_size_max:
        raise ValueError(
            f"config.block_size {config.block_size} differs from block_size_max {block_size_max}"
        )
    return config


def _initial_drafter(target: nn.Module, config: DrafterConfig, seed: int) -> BlockDrafter:
    """The untrained drafter on the target's device, its weights drawn from ``seed`` (global RNG untouched)."""
    shared = SharedTargetParts.from_causal_lm(target)
    device = next(target.parameters()).device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BlockDrafter(config, shared).to(device)


@contextmanager
def _frozen(target: nn.Module) -> Iterator[None]:
    """The target in eval mode with no gradient (its shared head, norm and embedding included), restored after."""
    was_training = target.training
    requires_grad = [p.requires_grad for p in target.parameters()]
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(target.parameters(), requires_grad, strict=True):
            p.requires_grad_(flag)
        target.train(was_training)


def _checked_batch(input_ids: torch.Tensor, min_len: int) -> torch.Tensor:
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(
            f"sample_batch must return a LongTensor [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] < min_len:
        raise ValueError(
            f"sample_batch sequences of length {input_ids.shape[1]} are shorter than context_len + "
            f"block_size_max = {min_len}"
        )
    return input_ids


@torch.no_grad()
def _teacher(target: nn.Module, input_ids: torch.Tensor, config: DrafterConfig):
    """The target's features at the drafter's layers [batch, seq, F] and its logits [batch, seq, vocab]."""
    out = target(input_ids, output_hidden_states=True)
    return gather_features(out.hidden_states, config.target_layer_ids), out.logits


def _optimizer_step(optimizer, drafter: BlockDrafter, loss: torch.Tensor, lr: float) -> float:
    """One AdamW step at ``lr`` with the gradient norm clipped to 1; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    optimizer.step()
    return loss.detach().item()


def main(argv: list[str] | None = None) -> None:
    """Train a drafter for a reference preset and print its τ (greedy and T=1, B=8 and 16) per data source."""
    import argparse

    from pd_dflash.engine.reference.presets.catalog import get_preset
    from pd_dflash.engine.reference.presets.training import load_preset

    ap = argparse.ArgumentParser(
        prog="python -m pd_dflash.engine.reference.presets.drafter_training", description=main.__doc__
    )
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", choices=["rollouts", "language", "both"], default="both")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # deterministic and fast on shared cores, like preset training
    preset = get_preset(args.preset)
    target, _card = load_preset(preset, seed=args.seed)
    lang, batch, seq = preset.language, 16, 48
    config = DrafterConfig.for_target(target.config, block_size=16)
    prompts = torch.from_numpy(lang.sample(256, 40, seed=[args.seed, 99]))
    sources = {
        "language": lambda g: torch.from_numpy(
            lang.sample(batch, seq, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
        ),
    }
    if args.data in ("rollouts", "both"):
        start = time.perf_counter()
        pool = target_rollouts(target, torch.from_numpy(lang.sample(2048, 8, seed=[args.seed, 98])), seq - 8)
        print(f"rollout pool {tuple(pool.shape)}: {time.perf_counter() - start:.1f} s")
        sources["rollouts"] = pool_sampler(pool, batch)
    for name, source in sources.items():
        if args.data not in (name, "both"):
            continue
        drafter, report = train_drafter(target, source, steps=args.steps, seed=args.seed, config=config)
        taus = {
            (b, t): measure_block_tau(target, drafter, prompts, b, t, torch.Generator().manual_seed(6))
            .float()
            .mean()
            .item()
            for b in (8, 16)
            for t in (0.0, 1.0)
        }
        print(
            f"{args.preset} drafter on {name}: {report.steps} steps {report.seconds:.1f} s, loss "
            f"{report.losses[0]:.3f} -> {report.losses[-1]:.3f}; tau greedy B8 {taus[8, 0.0]:.2f} B16 "
            f"{taus[16, 0.0]:.2f}; tau T=1 B8 {taus[8, 1.0]:.2f} B16 {taus[16, 1.0]:.2f}"
        )


if __name__ == "__main__":
    main()
