"""Distillation of a preset's DFlash drafter against a (frozen) target, teacher-forced along sampled sequences.

The drafter is ``dflash/model.py``'s ``DFlashDrafter``, the module published drafters run on, built from a
published-layout ``config.json`` (``preset_drafter_config``). For an anchor at position t of a training sequence
x, it sees the token x_t and the target's features at every position before t — what its drafter KV holds when
it drafts at t while serving (``DFlashDrafter.teacher_forced``); its output at block position k (1 ≤ k ≤ B−1) is
trained towards the target's next-token distribution at position t+k−1 (the target's prediction of x_{t+k} given
the true prefix), by KL(p_target ‖ q_drafter). Every step draws a batch from ``sample_batch(generator)`` and
``anchors_per_sequence`` random anchors per sequence, so the data source is the caller's. The loop and its
schedule are the presets' one (``training.fit``).

Attention inside the block is non-causal, as in z-lab's published drafters: block positions see each other, so a
drafter is trained for, and serves, one block size (``presets/drafters.py`` trains one per block size in use).

Recommended data (DFlash trains on target-generated responses): ``target_rollouts`` continues prompts of the
synthetic language with the target's own greedy decoding, and ``pool_sampler`` draws training batches from that
pool (docs/reference-engine.md, "The block drafter"): along noisy language data the teacher's distribution at
depth k is conditioned on intermediate tokens the drafter cannot see, along greedy rollouts it is not.

Deterministic: the drafter's initial weights, the data generator and the anchor draws all derive from
``seed``, the step count is fixed, and nothing depends on wall time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pd_dflash.engine.reference.decoding.sampling import (
    greedy_accept,
    probabilities,
    sample,
    speculative_sample,
)
from pd_dflash.engine.reference.dflash.config import parse_drafter_config
from pd_dflash.engine.reference.dflash.load import build_drafter
from pd_dflash.engine.reference.dflash.model import DFlashDrafter
from pd_dflash.engine.reference.dflash.tiny import tiny_drafter_config
from pd_dflash.engine.reference.presets.training import fit

#: The q/k RMS norms' initial scale. At 1, a head's attention logits are at most head_dim^0.5 (4 at head_dim 16),
#: too flat to single out one context position among dozens; 2 lets a head attend sharply from the start, which
#: lifted micro's greedy τ at B = 16 from 4.05 to 4.64 in 400 steps (docs/reference-engine.md, "The block drafter").
QK_NORM_INIT = 2.0


@dataclass(frozen=True)
class DrafterTrainReport:
    steps: int
    seconds: float
    #: Training loss per step: KL(p_target ‖ q_drafter) in nats, position-weighted (see distillation_loss).
    losses: list[float] = field(default_factory=list)


def preset_drafter_config(target_config: Any, block_size: int, *, num_features: int = 4) -> dict[str, Any]:
    """The published-layout ``config.json`` of a preset's drafter for a transformers target config: 2 layers of
    the target's width, 4 heads with their own keys/values, a SwiGLU of 2·hidden, conditioned on up to
    ``num_features`` evenly spaced target layers ending at the last, the last vocabulary id as mask token, fp32."""
    depth = int(target_config.num_hidden_layers)
    k = max(1, min(num_features, depth))
    layer_ids = sorted({round(depth - i * depth / k) - 1 for i in range(k)} - {-1})
    config = tiny_drafter_config(
        target_config.to_dict(), layers=2, block_size=block_size, target_layer_ids=layer_ids, dtype="float32"
    )
    config["num_key_value_heads"] = config["num_attention_heads"]
    return config


def new_drafter(target: nn.Module, config: Mapping[str, Any], seed: int) -> DFlashDrafter:
    """The untrained drafter of ``config`` on ``target``'s device, borrowing its embedding and lm_head. Weights
    from ``seed`` (the global RNG untouched): N(0, 0.02), the residual projections scaled by 1/√(2·layers) (GPT-2
    style), norms at 1 except the q/k norms at ``QK_NORM_INIT``."""
    drafter = build_drafter(config, parse_drafter_config(config, "the preset drafter's config"))
    scaled = 0.02 / math.sqrt(2 * len(drafter.layers))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, p in drafter.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                nn.init.constant_(p, QK_NORM_INIT)
            elif name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(
                    p, std=scaled if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                )
    param = next(target.parameters())
    drafter = drafter.to(device=param.device, dtype=param.dtype)
    return drafter.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings())


def target_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """The drafter's context: the target's states after each decoder layer of ``layer_ids`` (HF
    ``hidden_states[i + 1]``), concatenated [..., len(ids)·hidden] — what ``DFlashSource`` captures when serving."""
    if max(layer_ids) + 1 >= len(hidden_states):
        raise ValueError(
            f"target_layer_ids {tuple(layer_ids)} exceed the {len(hidden_states) - 1} target layers"
        )
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


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
    drafter: DFlashDrafter,
    prompts: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Committed tokens (bonus included) of ONE draft/verify round at ``block_size`` (default: the drafter's) after each prompt
    [n, p ≥ 1]: the anchor is the target's token after the prompt, the drafter (context: every prompt position)
    proposes B−1 tokens, one target forward over ``[prompt, anchor, drafts]`` verifies them with the greedy rule
    (T = 0) or speculative sampling. An offline check of a trained drafter, without a KV cache; the engine
    measures τ in its own decode loop. Returns [n]."""
    cfg, block = drafter.config, block_size or drafter.config.block_size
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [n, ≥ 1], got {tuple(prompts.shape)}")
    ids = prompts.to(next(target.parameters()).device)
    out = target(ids, output_hidden_states=True)
    last = out.logits[:, -1]
    anchor = last.argmax(-1) if temperature == 0 else sample(probabilities(last, temperature), generator)
    at = torch.full((ids.shape[0], 1), ids.shape[1], device=ids.device)
    features = target_features(out.hidden_states, cfg.target_layer_ids)
    logits = drafter.logits(drafter.teacher_forced(features, anchor[:, None], at, block)[:, 0, 1:])
    q = probabilities(logits, temperature) if temperature > 0 else None
    drafts = logits.argmax(-1) if q is None else sample(q, generator)
    verify = target(torch.cat([ids, anchor[:, None], drafts], dim=1)).logits[:, -block:]
    if q is None:
        return greedy_accept(verify, drafts).num_committed
    return speculative_sample(verify, drafts, q, temperature, generator).num_committed


def distillation_loss(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    teacher_logits: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    position_decay: float | None = None,
) -> torch.Tensor:
    """KL over the B−1 draft positions of every anchor, averaged with weights exp(−(k−1)/position_decay)
    over draft position k (uniform when None): acceptance is prefix-based, so early positions matter most.

    ``features`` [batch, seq, F] and ``teacher_logits`` [batch, seq, vocab] come from one target forward over
    ``input_ids`` [batch, seq]; ``anchors`` [batch, A] are positions t ≤ seq − B + 1 (B: the drafter's block).
    """
    block = drafter.config.block_size
    hidden = drafter.teacher_forced(features, input_ids.gather(1, anchors), anchors, block)
    log_q = F.log_softmax(drafter.logits(hidden[:, :, 1:]).float(), dim=-1)  # [batch, A, B−1, V]
    rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]
    teach_pos = anchors[:, :, None] + torch.arange(block - 1, device=anchors.device)
    log_p = F.log_softmax(teacher_logits[rows, teach_pos].float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).flatten(0, 1).mean(0)  # [B−1]
    if position_decay is None:
        return kl.mean()
    weights = torch.exp(-torch.arange(block - 1, device=kl.device, dtype=kl.dtype) / position_decay)
    return (kl * weights).sum() / weights.sum()


def train_drafter(
    target: nn.Module,
    sample_batch: Callable[[torch.Generator], torch.Tensor],
    *,
    steps: int,
    seed: int,
    config: Mapping[str, Any],
    lr: float = 1e-2,
    anchors_per_sequence: int = 8,
    position_decay: float | None = 4.0,
    min_anchor: int = 1,
) -> tuple[DFlashDrafter, DrafterTrainReport]:
    """Train the drafter of ``config`` (a published-layout ``config.json`` dict, e.g. ``preset_drafter_config``)
    for a transformers MoE CausalLM ``target`` (left unchanged), at the config's block size B.

    ``sample_batch(generator)`` returns a LongTensor [batch, seq] of training sequences, seq ≥ min_anchor + B − 1;
    anchors are drawn from [min_anchor, seq − B + 1] (``min_anchor``: e.g. the prompt length of rollouts).
    """
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    drafter = new_drafter(target, config, seed)
    block, layer_ids = drafter.config.block_size, drafter.config.target_layer_ids
    device = next(target.parameters()).device
    data_gen = torch.Generator().manual_seed(seed)
    anchor_gen = torch.Generator().manual_seed(seed + 1)

    def loss_at(step: int) -> torch.Tensor:
        input_ids = _checked_batch(sample_batch(data_gen), min_anchor + block - 1).to(device)
        features, teacher_logits = _teacher(target, input_ids, layer_ids)
        shape = (input_ids.shape[0], anchors_per_sequence)
        anchors = torch.randint(min_anchor, input_ids.shape[1] - block + 2, shape, generator=anchor_gen)
        return distillation_loss(
            drafter, features, teacher_logits, input_ids, anchors.to(device), position_decay
        )

    start = time.perf_counter()
    with _frozen(target):
        drafter.train()
        params = list(drafter.parameters())
        losses = fit(params, loss_at, steps=steps, lr=lr, warmup_steps=max(1, steps // 20), floor=0.1)
    drafter.eval()
    return drafter, DrafterTrainReport(steps=steps, seconds=time.perf_counter() - start, losses=losses)


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
            f"sample_batch sequences of length {input_ids.shape[1]} are shorter than min_anchor + block_size − 1 "
            f"= {min_len}"
        )
    return input_ids


@torch.no_grad()
def _teacher(target: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]):
    """The target's features at the drafter's layers [batch, seq, F] and its logits [batch, seq, vocab]."""
    out = target(input_ids, output_hidden_states=True)
    return target_features(out.hidden_states, layer_ids), out.logits
