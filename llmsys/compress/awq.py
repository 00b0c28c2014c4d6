"""AWQ: activation-aware weight quantization.

A few input channels carry large activations; their weights matter most for the output. AWQ
scales those weight columns up by s before rounding (so they lose relatively less) and divides
the input by s, folded into the op before (``calibrate.fold_input_scale``), which in full
precision changes nothing. The scale is s = mean|x|^α, and α is chosen on a grid of 20 values
in [0, 1) to minimise the output error of the linears sharing that input on calibration tokens:

    Σ_linears ‖X Wᵀ - X (Q(W diag s) diag s⁻¹)ᵀ‖²

Then each group of a row has its range clipped before rounding: a smaller range rounds the
many ordinary weights more finely at the cost of the few largest. The clip, from the group's
absmax down to half of it in steps of 1/20, minimises that group's share of the output error,
‖X_g (Q(clip(W_g)) - W_g)ᵀ‖², on the (scaled) calibration inputs. Queries and keys keep their
range: their error reaches the attention scores, which this output error does not see.

Reference: AWQ (Lin et al., arXiv 2306.00978) §3.2; mit-han-lab/llm-awq ``auto_scale.py``
(which scores the output of the whole attention or MLP module; here the linears' outputs) and
``auto_clip.py`` (the clipping search, q and k excluded).
"""

from __future__ import annotations

import torch

from llmsys.compress.calibrate import FOLD_TARGETS, SHARED_INPUTS, InputStats, block_linears, fold_input_scale
from llmsys.compress.formats import fake_quantize

GRID = 20
MAX_SHRINK = 0.5  # the clip search tries ranges from the absmax down to this share below it
UNCLIPPED = ("attention.wq", "attention.wk")


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
def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, granularity=128, symmetric: bool = True,
                grid: int = GRID, max_shrink: float = MAX_SHRINK) -> torch.Tensor:
    """w (out, in) with each row's groups clipped to ±(1 - i/grid)·absmax, i = 0 .. max_shrink·grid, the
    i that minimises ‖x_g (Q(clip(w_g)) - w_g)ᵀ‖² for inputs x (m, in); not yet rounded. Per-tensor
    grids are returned as they are (one range for the whole tensor)."""
    if granularity == "tensor":
        return w
    g = w.size(1) if granularity == "channel" else granularity
    if w.size(1) % g:  # whole groups, then the shorter last group, as fake_quantize cuts them
        full = w.size(1) // g * g
        parts = ([(slice(0, full), g)] if full else []) + [(slice(full, None), w.size(1) - full)]
        return torch.cat([search_clip(w[:, cols], x[:, cols], bits, size, symmetric, grid, max_shrink)
                          for cols, size in parts], dim=1)
    out, n_groups = w.size(0), w.size(1) // g
    wg, xg = w.float().view(out, n_groups, g), x.float().view(-1, n_groups, g)
    absmax = wg.abs().amax(-1, keepdim=True)
    best, best_err = wg, torch.full((out, n_groups), float("inf"), device=w.device)
    for i in range(int(max_shrink * grid) + 1):
        limit = absmax * (1 - i / grid)
        clipped = wg.clamp(-limit, limit)
        rounded = fake_quantize(clipped.view(out, -1), bits, g, symmetric).view(out, n_groups, g)
        err = torch.einsum("mgk,ogk->mog", xg, rounded - wg).pow(2).sum(0)  # (out, groups)
        better = err < best_err
        best, best_err = torch.where(better[..., None], clipped, best), torch.where(better, err, best_err)
    return best.reshape(w.shape).to(w.dtype)


@torch.no_grad()
def fold_scales(block, stats: dict[str, InputStats], bits: int, granularity=128, symmetric: bool = True):
    """Search and fold the scale of every foldable group. Returns (α per group, s per group): a
    group's linears now see their calibration inputs divided by its s."""
    alphas, scales = {}, {}
    for group in FOLD_TARGETS:
        weights = [block.get_submodule(name).weight for name in SHARED_INPUTS[group]]
        s, alphas[group], _ = search_scale(weights, stats[SHARED_INPUTS[group][0]], bits, granularity, symmetric)
        fold_input_scale(block, group, s)
        scales[group] = s
    return alphas, scales


@torch.no_grad()
def awq_block(block, stats: dict[str, InputStats], bits: int, granularity=128, symmetric: bool = True) -> dict:
    """Search and fold the scale of every foldable group, search each linear's clipping (but q's
    and k's), then round every linear to nearest. Returns the chosen α per group."""
    alphas, scales = fold_scales(block, stats, bits, granularity, symmetric)
    inputs = {name: stats[name].x / scales[group] if group in scales else stats[name].x
              for group, names in SHARED_INPUTS.items() for name in names}  # what each linear now sees
    for name, linear in block_linears(block).items():
        w = linear.weight if name in UNCLIPPED else search_clip(linear.weight, inputs[name], bits, granularity,
                                                                 symmetric)
        linear.weight.copy_(fake_quantize(w, bits, granularity, symmetric))
    return alphas
