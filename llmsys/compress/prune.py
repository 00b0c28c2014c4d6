"""Pruning: set weights to zero, by magnitude, by Wanda's score, or 2:4 semi-structured.

- Magnitude: drop the weights of smallest |W| in each layer.
- Wanda: drop the smallest |W_ij| · ‖X_j‖ in each output row, where ‖X_j‖ is the norm of input
  channel j over calibration tokens: a small weight on a large activation still matters. No
  weight update, no retraining (SparseGPT adds an OBS-style update of the weights kept).
- 2:4: in every 4 consecutive weights along the input dimension keep the 2 of highest score
  (magnitude or Wanda). NVIDIA's sparse tensor cores (Ampere and later) skip the zeros for up
  to 2× matmul throughput; a CPU has no such unit, so on a CPU the zeros only cost time.

References: Wanda (Sun et al., arXiv 2306.11695) §3; SparseGPT (Frantar & Alistarh,
arXiv 2301.00774); Accelerating Sparse Deep Neural Networks (Mishra et al., arXiv 2104.08378).
"""

from __future__ import annotations

import torch

from llmsys.compress.calibrate import InputStats, block_linears


def _check_sparsity(sparsity: float) -> None:
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask (bool, like weight) dropping the ``sparsity`` share of smallest |W| in the whole layer."""
    _check_sparsity(sparsity)
    drop = int(weight.numel() * sparsity)
    keep = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
    keep[weight.detach().abs().flatten().argsort()[:drop]] = False
    return keep.view_as(weight)


def wanda_scores(weight: torch.Tensor, column_norm: torch.Tensor) -> torch.Tensor:
    """|W_ij| · ‖X_j‖ (out, in)."""
    return weight.detach().abs().float() * column_norm.float()[None, :]


def row_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask dropping the ``sparsity`` share of smallest scores in every row (Wanda's comparison group)."""
    _check_sparsity(sparsity)
    drop = int(scores.size(1) * sparsity)
    keep = torch.ones_like(scores, dtype=torch.bool)
    keep.scatter_(1, scores.argsort(dim=1)[:, :drop], False)
    return keep


def n_m_mask(scores: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Keep-mask with exactly n kept in every m consecutive entries of a row."""
    if not 0 < n <= m or scores.size(-1) % m:
        raise ValueError(f"need 0 < n <= m and the input dimension {scores.size(-1)} a multiple of m={m}, "
                         f"got n={n}, m={m}")
    groups = scores.reshape(-1, m)  # (out·in/m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(n, dim=1).indices, True)
    return keep.view_as(scores)


def block_masks(block, stats: dict[str, InputStats], method: str, sparsity: float = 0.5) -> dict[str, torch.Tensor]:
    """The keep-mask of each linear in a block: method "magnitude", "wanda", "2:4" (magnitude scores)
    or "wanda 2:4" (Wanda scores; ``sparsity`` is then 0.5 by construction)."""
    masks = {}
    for name, linear in block_linears(block).items():
        w = linear.weight
        if method == "magnitude":
            masks[name] = magnitude_mask(w, sparsity)
        elif method == "wanda":
            masks[name] = row_mask(wanda_scores(w, stats[name].column_norm), sparsity)
        elif method == "2:4":
            masks[name] = n_m_mask(w.detach().abs())
        elif method == "wanda 2:4":
            masks[name] = n_m_mask(wanda_scores(w, stats[name].column_norm))
        else:
            raise ValueError(f"unknown pruning method {method!r}; choose magnitude, wanda, 2:4 or 'wanda 2:4'")
    return masks


@torch.no_grad()
def prune_block(block, stats: dict[str, InputStats], method: str, sparsity: float = 0.5) -> float:
    """Zero the dropped weights of every linear in the block, in place; returns the share zeroed."""
    masks = block_masks(block, stats, method, sparsity)
    for name, keep in masks.items():
        block.get_submodule(name).weight.mul_(keep)
    return sum(int((~k).sum()) for k in masks.values()) / sum(k.numel() for k in masks.values())
