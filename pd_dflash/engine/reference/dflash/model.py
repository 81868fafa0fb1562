"""The DFlash drafter of z-lab's published checkpoints, in plain torch (gpt-fast style), batched over requests.

What one draft computes (the official ``dflash`` package's ``DFlashDraftModel``, arXiv 2602.06036), per request:

- context: the target's hidden states after the decoder layers ``target_layer_ids`` at the positions committed
  since the previous draft, concatenated, projected by ``fc`` (n·H → H) and normalised by ``hidden_norm``;
- block: ``[anchor, mask × (B − 1)]`` (the anchor is the last committed token, not yet seen by the target)
  embedded with the TARGET's input embedding (× ``input_embedding_scale``);
- each layer: queries from the block only; keys/values from the context rows (without the layer's input norm)
  and the block rows, Qwen3-style q/k RMS norms, RoPE at the true positions; the block attends to every earlier
  context position (the request's drafter KV) and to the whole block — non-causal, unless the config makes a
  layer causal or sliding; then a SwiGLU MLP;
- output: the drafter's ``norm``, then the TARGET's ``lm_head`` (× ``output_multiplier``, optional softcap) at
  block positions 1..B−1: the drafts.

The drafter KV holds the context rows of every committed position (cache index = position). Each draft writes
its new context rows and the block rows, attends, and crops the block rows again, as the official loop does, so
rejected drafts never enter the KV. The linear layers run once over the rows of all c requests; attention runs
per request on its own KV (the target's verify batches its attention instead: ``decoding/kv_arena.py``).

``teacher_forced`` is the same computation for training (differentiable, no KV): a batch of sequences with the
target's features at every position and a set of anchors, each block seeing the context rows before its anchor.
The presets' drafters are trained with it (``presets/drafter_training.py``) and then served by ``forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pd_dflash.engine.reference.dflash.config import DFlashConfig


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm, bit for bit: normalise in fp32, cast back, then scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x32 = x.dtype, x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DraftKV:
    """One request's drafter KV: per layer ``[kv_heads, positions, head_dim]`` keys and values, grown by doubling."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = (
            0  # committed context positions held (the block rows beyond are cropped after each draft)
        )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` [kv_heads, n, d] at ``length``; return the layer's keys/values up to them."""
        n = k.shape[1]
        if layer == len(self.keys):
            self.keys.append(k.new_empty(k.shape[0], max(64, n), k.shape[2]))
            self.values.append(v.new_empty(v.shape[0], max(64, n), v.shape[2]))
        end = self.length + n
        if end > self.keys[layer].shape[1]:
            grow = max(end, 2 * self.keys[layer].shape[1]) - self.keys[layer].shape[1]
            self.keys[layer] = torch.cat(
                [self.keys[layer], self.keys[layer].new_empty(k.shape[0], grow, k.shape[2])], 1
            )
            self.values[layer] = torch.cat(
                [self.values[layer], self.values[layer].new_empty(v.shape[0], grow, v.shape[2])], 1
            )
        self.keys[layer][:, self.length : end] = k
        self.values[layer][:, self.length : end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def crop(self, length: int) -> None:
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(t[:, : self.length].numel() * t.element_size() for t in self.keys + self.values)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of rows ``x`` [rows, heads, d] with per-row ``cos``/``sin`` [rows, d] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig, *, causal: bool, window: int | None) -> None:
        super().__init__()
        d, bias = cfg.head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.causal, self.window = causal, window
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.kv_heads, self.head_dim))
        return rotate(k, cos, sin), self.v_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.heads, self.head_dim))
        return rotate(q, cos, sin)

    def rule(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor | None:
        """Which keys each query may see by the layer's causal/sliding rule (positions broadcast against each
        other); None when it sees every key (a non-causal, non-sliding layer)."""
        if not self.causal and self.window is None:
            return None
        mask = torch.ones(
            torch.broadcast_shapes(qpos.shape, kpos.shape), dtype=torch.bool, device=qpos.device
        )
        if self.causal:
            mask &= kpos <= qpos
        if self.window is not None:
            mask &= qpos - kpos < self.window
            if not self.causal:
                mask &= kpos - qpos < self.window
        return mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Block queries [heads, B, d] (positions start..start+B−1) over keys/values [kv_heads, T, d] at
        positions 0..T−1 (T = start + B): the whole context and block, within the layer's causal/sliding rule."""
        qpos = torch.arange(start, start + q.shape[1], device=q.device)[:, None]
        mask = self.rule(qpos, torch.arange(k.shape[1], device=q.device)[None, :])
        out = self.sdpa(q[None], k[None], v[None], mask)
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)

    def sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q [..., heads, Q, d] over k/v [..., kv_heads, T, d] (GQA: a kv head per head group)."""
        if self.heads != self.kv_heads and mask is not None:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=-3)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=-3)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            scale=self.head_dim**-0.5,
            enable_gqa=self.heads != self.kv_heads and mask is None,
        )


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig, *, causal: bool, window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, causal=causal, window=window)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class DraftRows:
    """One request's input to a draft: its KV, the context rows not yet in it [n, len(ids)·H], its anchor."""

    kv: DraftKV
    context: torch.Tensor
    anchor: int


class DFlashDrafter(nn.Module):
    """The drafter's own weights (published tensor names); the target's embedding and lm_head are borrowed."""

    def __init__(
        self, cfg: DFlashConfig, rotary: nn.Module, layer_rules: Sequence[tuple[bool, int | None]]
    ) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(Layer(cfg, causal=c, window=w) for c, w in layer_rules)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self._rotary = (rotary,)  # transformers' Qwen3 RoPE (every rope_type); no weights
        self._target: tuple[torch.Tensor, nn.Module] | None = None

    def attach_target(self, embedding: torch.Tensor, lm_head: nn.Module) -> DFlashDrafter:
        """Borrow the target's input embedding weight and lm_head (and move the RoPE to their device)."""
        self._target = (embedding, lm_head)
        self._rotary[0].to(embedding.device)
        return self

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rotary[0](x[None], positions[None])
        return cos[0], sin[0]

    @torch.no_grad()
    def forward(self, rows: Sequence[DraftRows], block_size: int) -> torch.Tensor:
        """Hidden states [c, B, H] (before the final norm) of each request's block; writes each request's new
        context rows into its KV (the block rows are cropped)."""
        cfg, (embedding, _) = self.config, self._target
        dev = embedding.device
        ctx_spans = [(r.kv.length, r.kv.length + r.context.shape[0]) for r in rows]
        ctx = self.hidden_norm(self.fc(torch.cat([r.context for r in rows]).to(embedding.dtype)))
        ids = torch.tensor([[r.anchor] + [cfg.mask_token_id] * (block_size - 1) for r in rows], device=dev)
        x = F.embedding(ids.flatten(), embedding) * cfg.input_embedding_scale
        ctx_pos = torch.cat([torch.arange(a, b) for a, b in ctx_spans]).to(dev)
        block_pos = torch.cat([torch.arange(b, b + block_size) for _, b in ctx_spans]).to(dev)
        cos_c, sin_c = self._rope(ctx, ctx_pos)
        cos_b, sin_b = self._rope(x, block_pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.queries(h, cos_b, sin_b)
            k_b, v_b = attn.keys_values(h, cos_b, sin_b)
            k_c, v_c = attn.keys_values(ctx, cos_c, sin_c)
            outs, c0 = [], 0
            for j, r in enumerate(rows):
                n, b0 = r.context.shape[0], j * block_size
                k = torch.cat([k_c[c0 : c0 + n], k_b[b0 : b0 + block_size]]).transpose(0, 1)
                v = torch.cat([v_c[c0 : c0 + n], v_b[b0 : b0 + block_size]]).transpose(0, 1)
                keys, values = r.kv.write(i, k, v)
                outs.append(
                    attn.attend(q[b0 : b0 + block_size].transpose(0, 1), keys, values, ctx_spans[j][1])
                )
                c0 += n
            x = x + attn.o_proj(torch.cat(outs))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for r, (_, end) in zip(rows, ctx_spans, strict=True):
            r.kv.crop(end)  # the block rows leave the KV: only committed context stays
        return x.view(len(rows), block_size, -1)

    def teacher_forced(
        self, features: torch.Tensor, anchor_ids: torch.Tensor, anchors: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Hidden states [batch, A, B, H] (before the final norm) of the block at each of A anchors per sequence,
        differentiable: what ``forward`` computes for the anchor at position t when the request's drafter KV holds
        the context rows of positions 0..t−1 (training and the offline τ; tests/engine/reference/
        test_dflash_drafter.py checks the two agree).

        ``features`` [batch, S, n·H]: the target's features at every position of each sequence; ``anchor_ids``
        and ``anchors`` [batch, A]: each anchor's token and position t (0 ≤ t ≤ S); its block sits at t..t+B−1.
        """
        cfg, (embedding, _) = self.config, self._target
        (batch, seq, _), n, dev = features.shape, anchors.shape[1], embedding.device
        ctx = self.hidden_norm(self.fc(features.to(embedding.dtype))).flatten(0, 1)  # [batch·S, H]
        masks = anchor_ids.new_full((batch, n, block_size - 1), cfg.mask_token_id)
        ids = torch.cat([anchor_ids[..., None], masks], -1).flatten()
        x = F.embedding(ids, embedding) * cfg.input_embedding_scale  # [batch·n·B, H]
        ctx_pos = torch.arange(seq, device=dev)
        block_pos = anchors[..., None] + torch.arange(block_size, device=dev)  # [batch, n, B]
        cos_c, sin_c = self._rope(ctx, ctx_pos.repeat(batch))
        cos_b, sin_b = self._rope(x, block_pos.flatten())
        # each block's keys: every context row (those from its anchor on are masked out) and its own block rows
        key_pos = torch.cat([ctx_pos.expand(batch, n, seq), block_pos], -1)  # [batch, n, S + B]
        own = torch.ones(batch, n, block_size, dtype=torch.bool, device=dev)
        visible = torch.cat([ctx_pos < anchors[..., None], own], -1)[:, :, None]  # [batch, n, 1, S + B]
        for layer in self.layers:
            attn = layer.self_attn
            rule = attn.rule(block_pos[..., None], key_pos[:, :, None])
            mask = (visible if rule is None else visible & rule)[:, :, None]  # heads broadcast
            h = layer.input_layernorm(x)
            q = attn.queries(h, cos_b, sin_b).view(batch, n, block_size, attn.heads, -1).transpose(2, 3)
            k_b, v_b = (t.view(batch, n, block_size, *t.shape[1:]) for t in attn.keys_values(h, cos_b, sin_b))
            k_c, v_c = (t.view(batch, 1, seq, *t.shape[1:]) for t in attn.keys_values(ctx, cos_c, sin_c))
            k = torch.cat([k_c.expand(-1, n, -1, -1, -1), k_b], 2).transpose(2, 3)  # [batch, n, kv, S+B, d]
            v = torch.cat([v_c.expand(-1, n, -1, -1, -1), v_b], 2).transpose(2, 3)
            out = attn.sdpa(q, k, v, mask)  # [batch, n, heads, B, d]
            x = x + attn.o_proj(out.transpose(2, 3).reshape(batch * n * block_size, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x.view(batch, n, block_size, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits from hidden states: the drafter's norm, the target's lm_head, multiplier, softcap."""
        cfg = self.config
        logits = self._target[1](self.norm(hidden))
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits
