"""The theory of speculative decoding: acceptance rate, tokens per target call, speedup,
and the goodness-of-fit test the losslessness checks use."""

from __future__ import annotations

import torch


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α = Σₓ min(p(x), q(x)) = 1 - TV(p, q) over the last dimension: the chance that a draft
    token x ~ q survives the test u < p(x)/q(x)."""
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(-1)


def _check_theory_args(alpha: float, gamma: int, cost_ratio: float = 0.0):
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is an acceptance probability and must be in [0, 1], got {alpha}")
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {gamma!r}")
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio c = draft step time / target step time must be >= 0, got {cost_ratio}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens produced per target call, E = (1 - α^(γ+1)) / (1 - α) (Leviathan et al., eq. 1),
    assuming every draft token is accepted with the same probability α."""
    _check_theory_args(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)  # the limit: every draft and the bonus token
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Walltime improvement over target-only decoding (Leviathan et al., Thm 3.8): a round costs
    γ draft steps plus one target call, γc + 1 target-step units, and yields E tokens."""
    _check_theory_args(alpha, gamma, cost_ratio)
    return expected_tokens(alpha, gamma) / (gamma * cost_ratio + 1)


def expected_tokens_by_position(alphas) -> float:
    """Tokens per target call when draft position k is accepted with its own probability α_k
    (given the ones before it were): 1 + Σ_k Π_{j≤k} α_j. Constant α gives expected_tokens."""
    total, survive = 1.0, 1.0
    for alpha in alphas:
        _check_theory_args(float(alpha), 1)
        survive *= float(alpha)
        total += survive
    return total


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int = 16) -> int:
    """The γ in 1..max_gamma with the largest expected speedup."""
    return max(range(1, max_gamma + 1), key=lambda g: expected_speedup(alpha, g, cost_ratio))


def best_gamma_by_position(alphas, cost_ratio: float) -> int:
    """The γ in 1..len(alphas) with the largest E_γ / (γc + 1), where E_γ uses the measured
    acceptance of each draft position (``DecodeStats.acceptance_by_position``): a drafter whose
    acceptance falls with depth wants a shorter chain than its mean α suggests."""
    if len(alphas) < 1:
        raise ValueError("need the acceptance of at least one draft position")
    return max(range(1, len(alphas) + 1),
               key=lambda g: expected_tokens_by_position(alphas[:g]) / (g * cost_ratio + 1))


def chi_square_test(counts: torch.Tensor, probs_expected: torch.Tensor, min_expected: float = 5.0):
    """Pearson's goodness-of-fit test of observed ``counts`` against a distribution.

    Cells expected to hold fewer than ``min_expected`` samples are pooled into one (the
    chi-square approximation needs a handful per cell). Returns (statistic, degrees of
    freedom, p-value); a p-value below a threshold a rejects 'these samples come from the
    distribution' and, when they do, happens with probability a (the false-alarm rate)."""
    counts, probs_expected = counts.double().flatten(), probs_expected.double().flatten()
    if counts.shape != probs_expected.shape:
        raise ValueError(f"counts and probabilities need one entry per cell, "
                         f"got {counts.numel()} and {probs_expected.numel()}")
    n = counts.sum()
    expected = n * probs_expected / probs_expected.sum()
    small = expected < min_expected
    if small.any():  # pool the small cells
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    if (counts[~keep] > 0).any():
        return float("inf"), int(keep.sum()) - 1, 0.0  # a sample where the distribution has no mass
    counts, expected = counts[keep], expected[keep]
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    if df < 1:
        return float(statistic), df, 1.0
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), statistic / 2)
    return float(statistic), df, float(p_value)
