"""W8A8: int8 weights and int8 activations, with SmoothQuant's migration and LLM.int8()'s split.

Activations have outlier channels (a few channels 10-100× larger than the rest, in every token),
so a per-token int8 scale wastes most of its levels on them. Two answers:

- SmoothQuant divides channel j of the input by s_j = max|X_j|^α / max|W_j|^(1-α) (α = 0.5) and
  multiplies the weight column by it, folded offline (``calibrate.fold_input_scale``): the
  difficulty migrates from the activations to the weights, and both quantize well.
- LLM.int8() keeps the input columns that contain an outlier (|x| ≥ 6) in 16 bits and multiplies
  them with the matching weight columns in 16 bits; everything else runs in int8 with a scale per
  token (rows of X) and per output channel (rows of W).

An int8 × int8 matmul with int32 accumulation, scaled by s_x s_w, equals the product of the
dequantized operands (up to float rounding), which is how it is computed here.

References: SmoothQuant (Xiao et al., arXiv 2211.10438) §4; LLM.int8() (Dettmers et al.,
arXiv 2208.07339) §3; bitsandbytes ``Linear8bitLt`` (threshold=6.0).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from llmsys.compress.calibrate import FOLD_TARGETS, SHARED_INPUTS, InputStats, fold_input_scale
from llmsys.compress.formats import fake_quantize, rtn_codes, rtn_dequantize, rtn_scales
from llmsys.lora.quant import replace_linears

OUTLIER_THRESHOLD = 6.0


def smooth_scale(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α), over the weight columns of every linear sharing the input."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    w_absmax = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)  # (in,)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def smooth_block(block, stats: dict[str, InputStats], alpha: float = 0.5) -> None:
    """Fold SmoothQuant's scales into every foldable group of the block (full precision: same function)."""
    for group in FOLD_TARGETS:
        names = SHARED_INPUTS[group]
        s = smooth_scale(stats[names[0]].absmax, [block.get_submodule(n).weight for n in names], alpha)
        fold_input_scale(block, group, s)


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ weightᵀ with int8 activations (a scale per token) and int8 weights (per output channel)."""
    shape = x.shape
    x_q = fake_quantize(x.reshape(-1, shape[-1]).float(), 8, "channel")  # per token: rows of X
    w_q = fake_quantize(weight.float(), 8, "channel")
    return (x_q @ w_q.T).reshape(*shape[:-1], -1).to(x.dtype)


def int8_outlier_matmul(x: torch.Tensor, weight: torch.Tensor, threshold: float = OUTLIER_THRESHOLD) -> torch.Tensor:
    """LLM.int8(): input columns holding any |x| ≥ threshold in full precision, the rest int8.

    The weight is stored once in int8 per output channel; its outlier columns are dequantized
    for the full-precision part (as bitsandbytes' Linear8bitLt does with frozen int8 weights)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()  # (n, in)
    w_q = fake_quantize(weight.float(), 8, "channel")
    large = x2.abs() >= threshold  # (n, in)
    outliers = large.any(dim=0)  # (in,): columns computed in full precision
    # the per-token scale comes from the entries below the threshold (as bitsandbytes computes it)
    scale, _ = rtn_scales(x2.masked_fill(large, 0), 8, symmetric=True)  # (n, 1)
    codes = rtn_codes(x2, scale, None, 8).masked_fill(outliers[None, :], 0)
    y = rtn_dequantize(codes, scale, None) @ w_q.T + x2[:, outliers] @ w_q[:, outliers].T
    return y.reshape(*shape[:-1], -1).to(x.dtype)


class W8A8Linear(nn.Module):
    """A linear layer computed by ``w8a8_matmul`` (or LLM.int8()'s split with ``outlier_threshold``)."""

    def __init__(self, linear: nn.Linear, outlier_threshold: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        self.outlier_threshold = outlier_threshold

    def forward(self, x):
        if self.outlier_threshold is None:
            return w8a8_matmul(x, self.weight)
        return int8_outlier_matmul(x, self.weight, self.outlier_threshold)


def w8a8_linears(model: nn.Module, outlier_threshold: float | None = None, skip=("output",)) -> list[str]:
    """Replace every linear of the decoder blocks by a W8A8Linear, in place; returns the names."""
    return replace_linears(model, skip, lambda linear: W8A8Linear(linear, outlier_threshold))
