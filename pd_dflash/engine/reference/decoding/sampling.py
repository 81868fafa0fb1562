"""Accept rules for one verify round, batched over requests.

The verify block of a request is ``[anchor, d_1 .. d_{B-1}]`` (B positions); the target's logits at block
position i are its distribution for the token at position i+1. Both rules commit ``accepted + 1`` tokens:
the accepted drafts plus one token of the target's own (the bonus), so a round always makes progress.

- ``greedy_accept``: accept the longest prefix of drafts equal to the target's argmax, then the target's argmax
  at the first disagreement (or after the last draft). Output equals greedy autoregressive decoding.
- ``speculative_sample`` (Leviathan et al. 2023, Chen et al. 2023): accept d_i with probability
  min(1, p(d_i)/q(d_i)); at the first rejection resample from norm(max(0, p − q)); if every draft is accepted,
  sample the bonus from p. The committed tokens are distributed exactly as sampling from p autoregressively.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_dflash.engine.reference import host_sync

#: Fills ``AcceptResult.tokens`` beyond each request's committed count.
PAD_TOKEN = -1


@dataclass(frozen=True)
class AcceptResult:
    """Per request: ``accepted`` drafts (0..B−1) and ``tokens[:, :accepted+1]`` committed (rest PAD_TOKEN)."""

    accepted: torch.Tensor  # LongTensor [batch]
    tokens: torch.Tensor  # LongTensor [batch, B]

    @property
    def num_committed(self) -> torch.Tensor:
        """Tokens committed per request, bonus included (DFlash's τ per round)."""
        return self.accepted + 1

    def committed(self) -> list[list[int]]:
        """The committed tokens per request (one host read for the whole batch)."""
        rows = host_sync.tolist("accept", torch.cat([self.accepted[:, None], self.tokens], dim=1))
        return [row[1 : row[0] + 2] for row in rows]


def _check_block(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [batch, B, vocab], got shape {tuple(target_logits.shape)}")
    batch, block, _ = target_logits.shape
    if tuple(draft_tokens.shape) != (batch, block - 1):
        raise ValueError(
            f"draft_tokens must be [batch, B-1] = [{batch}, {block - 1}] to match target_logits "
            f"{tuple(target_logits.shape)}, got {tuple(draft_tokens.shape)}"
        )
    return batch, block


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> AcceptResult:
    """Greedy rule: accepted drafts are exactly the target's argmax, so the committed tokens are the target's
    argmax over the first accepted+1 positions."""
    _check_block(target_logits, draft_tokens)
    target_tokens = target_logits.argmax(dim=-1)  # [batch, B]
    accepted = _leading_true(draft_tokens == target_tokens[:, :-1])
    keep = torch.arange(target_tokens.shape[1], device=target_tokens.device)[None, :] <= accepted[:, None]
    return AcceptResult(accepted, torch.where(keep, target_tokens, PAD_TOKEN))


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32; T must be > 0 (T = 0 is greedy: use argmax, not a distribution)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for a sampling distribution, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def _draw_device(generator: torch.Generator | None, fallback: torch.device) -> torch.device:
    """Random draws happen on the generator's device (a CPU generator cannot drive CUDA kernels)."""
    return fallback if generator is None else generator.device


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per distribution over the last dim (any leading shape), on ``probs``' device."""
    flat = probs.reshape(-1, probs.shape[-1]).to(_draw_device(generator, probs.device))
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1]).to(probs.device)


def speculative_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> AcceptResult:
    """Speculative sampling over one verify block per request.

    ``draft_probs`` [batch, B−1, vocab] is the drafter's distribution q each draft was sampled from (at the same
    temperature); the target's p is softmax(target_logits / temperature). Randomness comes only from
    ``generator`` (one uniform per draft, then one multinomial per request), so a seeded generator makes a
    round reproducible.
    """
    batch, block = _check_block(target_logits, draft_tokens)
    if tuple(draft_probs.shape) != (batch, block - 1, target_logits.shape[-1]):
        raise ValueError(
            f"draft_probs must be [batch, B-1, vocab] = [{batch}, {block - 1}, {target_logits.shape[-1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    p = probabilities(target_logits, temperature)  # [batch, B, V]
    q = draft_probs.float()
    index = draft_tokens.unsqueeze(-1)
    p_draft = p[:, :-1].gather(-1, index).squeeze(-1)
    q_draft = q.gather(-1, index).squeeze(-1)
    u = torch.rand(draft_tokens.shape, generator=generator, device=_draw_device(generator, p.device)).to(
        p.device
    )
    accepted = _leading_true(u * q_draft < p_draft)  # u < p/q without dividing by q
    # Resample at the first rejection from norm(max(0, p − q)); after the last draft q is 0, so this is p.
    q_padded = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)
    rows = torch.arange(batch, device=p.device)
    residual = (p[rows, accepted] - q_padded[rows, accepted]).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly makes the residual empty, but then a rejection has probability 0; fall back to p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[rows, accepted])
    bonus = sample(residual, generator)
    positions = torch.arange(block, device=p.device)[None, :]
    drafts_padded = torch.cat([draft_tokens, torch.full_like(draft_tokens[:, :1], PAD_TOKEN)], dim=1)
    tokens = torch.where(positions < accepted[:, None], drafts_padded, PAD_TOKEN)
    tokens[rows, accepted] = bonus
    return AcceptResult(accepted, tokens)
