"""Accept rules: greedy on hand-built logits; speculative sampling against its theory on a toy distribution."""

from __future__ import annotations

import math

import pytest
import torch

from pd_dflash.engine.reference.decoding.sampling import (
    PAD_TOKEN,
    greedy_accept,
    probabilities,
    sample,
    speculative_sample,
)


def one_hot_logits(tokens: list[list[int]], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(tokens), len(tokens[0]), vocab)
    for b, row in enumerate(tokens):
        for i, t in enumerate(row):
            logits[b, i, t] = 5.0
    return logits


def test_greedy_accept_on_hand_built_logits():
    # target argmax over the block [anchor, d1, d2, d3] (B = 4): what the target would emit after each position
    target = [[7, 3, 9, 1], [7, 3, 9, 1], [7, 3, 9, 1], [2, 2, 2, 2]]
    drafts = torch.tensor([[7, 3, 9], [7, 4, 9], [0, 3, 9], [2, 2, 2]])
    out = greedy_accept(one_hot_logits(target, 10), drafts)
    assert out.accepted.tolist() == [3, 1, 0, 3]
    assert out.num_committed.tolist() == [4, 2, 1, 4]
    # all accepted -> bonus after the last draft; first mismatch -> the target's token there
    assert out.committed() == [[7, 3, 9, 1], [7, 3], [7], [2, 2, 2, 2]]
    assert out.tokens[1].tolist() == [7, 3, PAD_TOKEN, PAD_TOKEN]


def test_greedy_accept_rejects_bad_shapes():
    with pytest.raises(ValueError, match="draft_tokens must be"):
        greedy_accept(torch.zeros(2, 4, 10), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="target_logits must be"):
        greedy_accept(torch.zeros(4, 10), torch.zeros(1, 3, dtype=torch.long))


P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
Q = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])
N = 40_000
BLOCK = 4  # three drafts per round


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value for 5 degrees of freedom at p = 1e-4 (a fixed seed makes the test deterministic;
# the threshold is what a wrong rule must exceed, e.g. resampling from p instead of the residual gives > 1000)
CHI2_DF5_P1E4 = 25.74


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_matches_theory(temperature):
    gen = torch.Generator().manual_seed(1234)
    # logits whose tempered softmax is exactly P (target) and Q (draft)
    target_logits = (P.log() * temperature).expand(N, BLOCK, -1).clone()
    q = probabilities((Q.log() * temperature).expand(N, BLOCK - 1, -1), temperature)
    assert torch.allclose(q[0, 0], Q, atol=1e-6)
    drafts = sample(q, gen)
    out = speculative_sample(target_logits, drafts, q, temperature, gen)

    alpha = float(torch.minimum(P, Q).sum())  # theoretical per-draft acceptance rate
    first_accept = (out.accepted >= 1).float().mean().item()
    assert abs(first_accept - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / N)
    # i.i.d. positions: P(accepted ≥ k) = α^k, so τ = 1 + α + α² + α³
    tau = out.num_committed.float().mean().item()
    tau_theory = sum(alpha**k for k in range(BLOCK))
    var = sum(alpha**k for k in range(1, BLOCK)) * 3  # loose bound on the variance of the accepted count
    assert abs(tau - tau_theory) < 5 * math.sqrt(var / N)
    # every committed token is distributed as p (position 0 for every request; later ones where reached)
    for position in range(BLOCK):
        reached = out.accepted >= position
        tokens = out.tokens[reached, position]
        assert (tokens >= 0).all()
        if reached.sum() < 2000:
            continue
        counts = torch.bincount(tokens, minlength=len(P)).float()
        assert chi_square(counts, P) < CHI2_DF5_P1E4, (position, counts / counts.sum())


def test_wrong_rule_would_fail_the_distribution_check():
    """The chi-square check has teeth: the accepted drafts alone are distributed as min(p, q)/α, not p."""
    gen = torch.Generator().manual_seed(7)
    q = Q.expand(N, 1, -1).clone()
    drafts = sample(q, gen)
    out = speculative_sample(P.log().expand(N, 2, -1).clone(), drafts, q, 1.0, gen)
    accepted_tokens = out.tokens[out.accepted >= 1, 0]
    counts = torch.bincount(accepted_tokens, minlength=len(P)).float()
    assert chi_square(counts, P) > 10 * CHI2_DF5_P1E4


def test_speculative_sampling_is_seeded_and_handles_identical_p_q():
    logits = torch.randn(8, 5, 11)
    q = probabilities(logits[:, :-1], 1.0)  # drafter identical to the target: everything is accepted
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(99)
        drafts = sample(q, gen)
        runs.append(speculative_sample(logits, drafts, q, 1.0, gen))
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert runs[0].accepted.tolist() == [4] * 8
    with pytest.raises(ValueError, match="temperature must be > 0"):
        speculative_sample(logits, drafts, q, 0.0, None)
    with pytest.raises(ValueError, match="draft_probs must be"):
        speculative_sample(logits, drafts, q[:, :2], 1.0, None)
