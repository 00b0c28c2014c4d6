"""AWQ: activation-aware weight quantization.

A few input channels carry large activations; their weights matter most for the output. AWQ
scales those weight columns up by s before rounding (so they lose relatively less) and divides
the input by s, folded into the op before (``calibrate.fold_input_scale``), which in full
precision changes nothing. The scale is s = mean|x|^α, and α is chosen on a grid of 20 values
in [0, 1) to minimise the output error of the linears sharing that input on calibration tokens:

    Σ_linears ‖X Wᵀ - X (Q(W diag s) diag s⁻¹)ᵀ‖²

Reference: AWQ (Lin et al., arXiv 2306.00978) §3.2; mit-han-lab/llm-awq ``auto_scale.py``
(which scores the output of the whole attention or MLP module; here the linears' outputs).
"""

from __future__ import annotations

import torch

from llmsys.compress.calibrate import FOLD_TARGETS, SHARED_INPUTS, InputStats, block_linears, fold_input_scale
from llmsys.compress.formats import fake_quantize

GRID = 20


def candidate_scale(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^α, normalised so max(s)·min(s) = 1 (as llm-awq does)."""
    s = abs_mean.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(weights: list[torch.Tensor], stats: InputStats, bits: int, granularity=128,
                 symmetric: bool = True, grid: int = GRID) -> tuple[torch.Tensor, float, list[float]]:
    """(best s, its α, the output error of every α on the grid) for linears sharing one input."""
    x = stats.x  # (m, in)
    references = [x @ w.float().T for w in weights]
    errors, best = [], None
    for alpha in [i / grid for i in range(grid)]:
        s = candidate_scale(stats.abs_mean, alpha)
        err = sum(float((x @ (fake_quantize(w.float() * s, bits, granularity, symmetric) / s).T - ref).pow(2).sum())
                  for w, ref in zip(weights, references))
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2], errors


@torch.no_grad()
def awq_block(block, stats: dict[str, InputStats], bits: int, granularity=128, symmetric: bool = True) -> dict:
    """Search and fold the scale of every foldable group, then round every linear to nearest.
    Returns the chosen α per group."""
    alphas = {}
    for group in FOLD_TARGETS:
        weights = [block.get_submodule(name).weight for name in SHARED_INPUTS[group]]
        s, alphas[group], _ = search_scale(weights, stats[SHARED_INPUTS[group][0]], bits, granularity, symmetric)
        fold_input_scale(block, group, s)
    for linear in block_linears(block).values():
        linear.weight.copy_(fake_quantize(linear.weight, bits, granularity, symmetric))
    return alphas
