"""Planning speculative decoding from measured costs: which dtype, which drafter, how many drafts.

Whether verifying k tokens in one call is nearly free depends on the machine. On a GPU, and on
a CPU with native bf16 dot products (AVX512-BF16, AMX), a bf16 decode step is memory-bound:
scoring 8 tokens costs about one step. On an AVX2-only CPU bf16 is emulated and compute-bound
(8 tokens cost about 4 steps) while fp32 reads twice the bytes but stays memory-bound. So
``measure.cost_curves`` measures the curve of every dtype here, and the plan picks the
combination with the best expected speedup over the *fastest plain decoding on this machine*
(Leviathan et al., arXiv 2211.17192, Thm 3.8, with the measured verification cost in place of a
constant); ``best_tree_size`` cuts each draft tree to the nodes that pay on the same curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmsys.specdec.theory import expected_tokens

KS = (1, 2, 4, 8, 16)


def call_cost(curve: dict[int, float], k: int) -> float:
    """The cost of scoring k tokens, linearly interpolated between measured k (extrapolated past the last)."""
    ks = sorted(curve)
    if k in curve:
        return curve[k]
    if k < ks[0]:
        return curve[ks[0]]
    for low, high in zip(ks, ks[1:]):
        if low < k < high:
            return curve[low] + (curve[high] - curve[low]) * (k - low) / (high - low)
    last, before = ks[-1], ks[-2]
    return curve[last] + (curve[last] - curve[before]) * (k - last) / (last - before)


def check_curve(curve) -> None:
    """A measured cost curve maps at least two token counts >= 1 to positive seconds; anything else is refused."""
    if (not isinstance(curve, dict) or len(curve) < 2 or any(not isinstance(k, int) or k < 1 for k in curve)
            or any(not isinstance(s, (int, float)) or not s > 0 for s in curve.values())):
        raise ValueError(f"a cost curve maps at least two token counts >= 1 to positive seconds "
                         f"(``specdec.cost_curves`` measures one), got {curve!r}")


def ridge_point(curve: dict[int, float]) -> float:
    """Tokens per call where a measured cost curve {tokens: seconds} stops being flat: the roofline's ridge,
    the flat cost (of the fewest tokens measured) over the price of one more token in the compute-bound part
    (the slope of the curve's last segment). Past it every token costs its own compute, so drafts that may be
    rejected cost more than they save. Infinite when the curve never rises."""
    check_curve(curve)
    ks = sorted(curve)
    slope = (curve[ks[-1]] - curve[ks[-2]]) / (ks[-1] - ks[-2])
    return curve[ks[0]] / slope if slope > 0 else math.inf


def best_tree_size(chances: list[float], curve: dict[int, float], draft_seconds: float = 0.0) -> int:
    """How many of a draft tree's nodes to verify, given each node's chance of being accepted, best first
    (a node after its parent): the count n with the most expected tokens per second,
    (1 + chance_1 + ... + chance_n) / (call(n + 1) + n · draft_seconds), on the measured cost curve
    {tokens scored in one call: seconds}. 0 (plain decoding) when no draft pays for its place in the call."""
    check_curve(curve)
    if any(not 0 <= c <= 1 for c in chances) or draft_seconds < 0:
        raise ValueError(f"chances must lie in [0, 1] and draft_seconds be >= 0, got {chances!r}, {draft_seconds!r}")
    best, best_rate, expected = 0, 1.0 / call_cost(curve, 1), 1.0
    for n, chance in enumerate(chances, start=1):
        expected += chance
        rate = expected / (call_cost(curve, n + 1) + n * draft_seconds)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


@dataclass(frozen=True)
class Plan:
    dtype: str
    drafter: str
    gamma: int
    speedup: float  # expected, over the fastest plain decoding here
    tokens_per_call: float
    baseline: str  # the dtype of the fastest plain decoding

    def describe(self) -> str:
        if self.gamma == 0:
            return f"plain decoding in {self.dtype}: no drafter is expected to pay here"
        return (f"{self.drafter} with γ={self.gamma}, verified in {self.dtype}: {self.tokens_per_call:.2f} tokens per "
                f"call, expected {self.speedup:.2f}× plain decoding in {self.baseline}")


def plan(curves: dict[str, dict[int, float]], drafters: dict[str, tuple[float, float]], max_gamma: int = 15) -> Plan:
    """The best (dtype, drafter, γ) by expected throughput.

    ``curves``: ``cost_curves``'s output; ``drafters``: {name: (α, c)}, α the measured
    acceptance and c the cost of drafting one token as a share of a one-token step of the same
    dtype. A round verifying γ drafts costs call(γ + 1) + γ·c·call(1) and yields
    (1 − α^(γ+1))/(1 − α) tokens; plain decoding (γ = 0) is a candidate too."""
    if not curves or any(1 not in c for c in curves.values()):
        raise ValueError("every cost curve needs k = 1 (the plain decoding step)")
    for name, (alpha, c) in drafters.items():
        if not 0 <= alpha <= 1 or c < 0:
            raise ValueError(f"drafter {name!r}: acceptance must be in [0, 1] and cost ratio >= 0, got ({alpha}, {c})")
    baseline = min(curves, key=lambda d: curves[d][1])
    fastest = curves[baseline][1]
    best = Plan(baseline, "none", 0, 1.0, 1.0, baseline)
    for dtype, curve in curves.items():
        step = curve[1]
        for name, (alpha, c) in drafters.items():
            for gamma in range(1, max_gamma + 1):
                tokens = expected_tokens(alpha, gamma)
                seconds = call_cost(curve, gamma + 1) + gamma * c * step
                speedup = tokens / seconds * fastest
                if speedup > best.speedup:
                    best = Plan(dtype, name, gamma, speedup, tokens, baseline)
    return best
