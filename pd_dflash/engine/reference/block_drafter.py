"""A DFlash-style block drafter: proposes a whole block of draft tokens in one parallel forward.

Architecture (after DFlash, arXiv 2602.06036, scaled down for the reference engine):

- Input block: ``[anchor embedding, m_1 .. m_{B-1}]`` where the anchor is the last committed token (the bonus
  of the previous round, which the target has not processed yet) and m_k are learned per-offset mask
  embeddings. Output at block position k ≥ 1 is the draft d_k, i.e. the token k positions after the anchor.
- Context: the target's hidden features at the ``context_len`` positions before the anchor (the last accepted
  positions), from ``target_layer_ids`` (indices into HF ``output_hidden_states``) concatenated, fused by a
  linear layer + RMSNorm and injected as extra keys/values into every drafter layer (DFlash's KV injection).
- ``num_layers`` pre-norm transformer layers (RoPE attention + SwiGLU MLP), plain torch. Block positions see
  all context positions and the block positions up to themselves. DFlash attends bidirectionally inside the
  block; we keep it causal so that a drafter trained at ``block_size`` serves every B ≤ block_size exactly
  (the first B positions never depend on later ones) — one trained drafter for B ∈ {8, 16}.
- Output: hidden states ``[batch, B, hidden]`` → the target's final norm + LM head → logits. The embedding,
  final norm and LM head are the target's own (shared, not part of the drafter's ``state_dict``), so the
  drafter's hidden size equals the target's and the target's routers can be applied to its hidden states
  (the route-ahead proxy).

The drafter is rebuilt from ``(DrafterConfig, state_dict)`` — ``to_checkpoint`` / ``from_checkpoint`` — so
the engine's cache layer can store it next to the target preset. Training lives in ``presets/drafter_training.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from pd_dflash.engine.reference.sampling import probabilities, sample


class DrafterConfig(BaseModel):
    """Everything needed to rebuild a ``BlockDrafter`` (with a target of matching hidden/vocab size)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: Annotated[int, Field(ge=8)]
    vocab_size: Annotated[int, Field(ge=2)]
    #: Indices into the target's ``output_hidden_states`` tuple (0 = embeddings, L = last layer, post-norm).
    target_layer_ids: tuple[int, ...]
    num_layers: Annotated[int, Field(ge=1)] = 2
    num_heads: Annotated[int, Field(ge=1)] = 4
    intermediate_size: Annotated[int, Field(ge=1)] | None = None
    #: Largest block size served (anchor included); any B in [2, block_size] works.
    block_size: Annotated[int, Field(ge=2)] = 16
    #: Target positions before the anchor whose features condition the block.
    context_len: Annotated[int, Field(ge=1)] = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0

    @model_validator(mode="after")
    def _check(self) -> DrafterConfig:
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: at least one target layer is needed")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size {self.hidden_size} must split into {self.num_heads} heads of even size"
            )
        return self

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 2 * self.hidden_size

    @classmethod
    def for_target(cls, target_config: Any, num_features: int = 4, **overrides: Any) -> DrafterConfig:
        """A config sized for a transformers CausalLM config, with ``num_features`` evenly spaced target layers
        ending at the last one."""
        layers = int(target_config.num_hidden_layers)
        k = max(1, min(num_features, layers))
        ids = sorted({round(layers - i * layers / k) for i in range(k)})
        values: dict[str, Any] = {
            "hidden_size": int(target_config.hidden_size),
            "vocab_size": int(target_config.vocab_size),
            "target_layer_ids": tuple(i for i in ids if i >= 1) or (layers,),
        }
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class SharedTargetParts:
    """The target modules the drafter shares: token embedding, final norm and LM head."""

    embed: nn.Module
    norm: nn.Module
    lm_head: nn.Module

    @classmethod
    def from_causal_lm(cls, model: nn.Module) -> SharedTargetParts:
        norm = getattr(model.base_model, "norm", None)
        if norm is None:
            raise ValueError(f"{type(model).__name__}: no final norm at model.base_model.norm")
        return cls(model.get_input_embeddings(), norm, model.get_output_embeddings())


def gather_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the selected target hidden states (HF ``output_hidden_states``): [..., len(ids)·hidden]."""
    if max(layer_ids) >= len(hidden_states):
        raise ValueError(f"target_layer_ids {tuple(layer_ids)} exceed the {len(hidden_states)} hidden states")
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


@dataclass(frozen=True)
class DraftBlock:
    """One drafted block per request."""

    tokens: torch.Tensor  # [batch, B-1] draft tokens d_1..d_{B-1}
    logits: torch.Tensor  # [batch, B-1, vocab]
    #: Drafter hidden states [batch, B, hidden] (position 0: anchor, k: the state that predicted d_k), before
    #: the final norm: the route-ahead proxy for the target's gate inputs.
    hidden: torch.Tensor
    #: q, the distributions the drafts were sampled from ([batch, B-1, vocab]); None for greedy drafts.
    probs: torch.Tensor | None


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on [batch, heads, seq, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, self.heads, self.theta = cfg.hidden_size, cfg.num_heads, cfg.rope_theta
        self.attn_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, h, bias=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return x.view(b, s, self.heads, h // self.heads).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        ctx_len = context.shape[1]
        hx = self.attn_norm(x)
        kv_in = torch.cat([context, hx], dim=1)  # context features injected as extra keys/values
        q = _rope(self._split(self.q_proj(hx)), positions[ctx_len:], self.theta)
        k = _rope(self._split(self.k_proj(kv_in)), positions, self.theta)
        v = self._split(self.v_proj(kv_in))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o_proj(attn.transpose(1, 2).reshape_as(x))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class BlockDrafter(nn.Module):
    """The block drafter; ``shared`` holds the target's embedding, final norm and LM head (not owned)."""

    def __init__(self, config: DrafterConfig, shared: SharedTargetParts):
        super().__init__()
        embed_shape = tuple(getattr(shared.embed, "weight", torch.empty(0)).shape)
        if embed_shape[1:] != (config.hidden_size,) or embed_shape[0] < config.vocab_size:
            raise ValueError(
                f"target embedding {embed_shape} does not match the drafter config "
                f"(vocab_size {config.vocab_size}, hidden_size {config.hidden_size})"
            )
        self.config = config
        h = config.hidden_size
        self.fuse = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.fuse_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.empty(config.block_size - 1, h))
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self._shared = (shared,)  # a tuple hides it from nn.Module: not a submodule, not in state_dict
        self.reset_parameters()

    @property
    def shared(self) -> SharedTargetParts:
        return self._shared[0]

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.layers:  # GPT-2 style scaling of the residual projections
            nn.init.normal_(layer.o_proj.weight, std=0.02 / math.sqrt(2 * len(self.layers)))
            nn.init.normal_(layer.down.weight, std=0.02 / math.sqrt(2 * len(self.layers)))
        nn.init.normal_(self.mask_embed, std=0.02)

    def hidden_states(
        self, anchor_tokens: torch.Tensor, context_features: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Drafter hidden states [batch, block_size, hidden] for anchors [batch] and context features
        [batch, ctx, len(target_layer_ids)·hidden] (ctx ≥ 1; the positions just before each anchor)."""
        cfg = self.config
        if not 2 <= block_size <= cfg.block_size:
            raise ValueError(
                f"block_size must be in [2, {cfg.block_size}] for this drafter, got {block_size}"
            )
        expect = len(cfg.target_layer_ids) * cfg.hidden_size
        if context_features.dim() != 3 or context_features.shape[-1] != expect:
            raise ValueError(
                f"context_features must be [batch, ctx, {expect}] (target layers {cfg.target_layer_ids}), "
                f"got {tuple(context_features.shape)}"
            )
        batch, ctx_len, _ = context_features.shape
        anchor = self.shared.embed(anchor_tokens.view(batch, 1))
        masks = self.mask_embed[: block_size - 1].to(anchor.dtype).expand(batch, -1, -1)
        x = torch.cat([anchor, masks], dim=1)
        context = self.fuse_norm(self.fuse(context_features.to(x.dtype)))
        positions = torch.arange(ctx_len + block_size, device=x.device)
        keys = torch.arange(ctx_len + block_size, device=x.device)
        mask = keys[None, :] <= positions[ctx_len:, None]  # all context, block causal
        for layer in self.layers:
            x = layer(x, context, positions, mask)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared.lm_head(self.shared.norm(hidden))

    @torch.no_grad()
    def draft(
        self,
        anchor_tokens: torch.Tensor,
        context_features: torch.Tensor,
        block_size: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> DraftBlock:
        """Propose d_1..d_{B-1} for each request: argmax at temperature 0, else sampled from q (returned)."""
        hidden = self.hidden_states(anchor_tokens, context_features, block_size)
        logits = self.logits(hidden[:, 1:])
        if temperature == 0:
            return DraftBlock(logits.argmax(dim=-1), logits, hidden, None)
        q = probabilities(logits, temperature)
        return DraftBlock(sample(q, generator), logits, hidden, q)

    def to_checkpoint(self) -> dict[str, Any]:
        """Config + the drafter's own weights (the shared target parts are not included)."""
        return {"config": self.config.model_dump(mode="json"), "state_dict": self.state_dict()}

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any], shared: SharedTargetParts) -> BlockDrafter:
        config = DrafterConfig.model_validate(checkpoint["config"])
        drafter = cls(config, shared)
        drafter.load_state_dict(checkpoint["state_dict"])
        return drafter.eval()
