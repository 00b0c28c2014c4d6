"""GPTQ: one-shot weight quantization that pushes each column's rounding error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer's reconstruction error.

A linear layer y = W x is quantized to minimise ‖W X - Ŵ X‖² over calibration inputs X (in, n);
the rows of W are independent and share the Hessian H = 2 X Xᵀ / n. Quantizing column j to q_j,
the optimal change of the columns still free is (Optimal Brain Quantization, Frantar & Alistarh 2022)

    δ = -(w_j - q_j) / [H⁻¹]_jj · H⁻¹[j, :]          then H⁻¹ loses row and column j.

GPTQ quantizes columns in a fixed order, which makes every H⁻¹ it needs a row of the upper
Cholesky factor of the initial H⁻¹ (no updates of H⁻¹ at all), and applies the updates lazily:
inside a block of 128 columns at once, to the rest of the matrix once per block (a matmul).

``obq_reference`` is the explicit update above in float64 (the test's exact solution);
``gptq_quantize`` is the Cholesky / lazy-batch form. Both return the dequantized weight.

Reference: GPTQ (Frantar et al., arXiv 2210.17323), Algorithm 1; IST-DASLab/gptq ``gptq.py``.
"""

from __future__ import annotations

import torch

from llmsys.compress.formats import check_granularity, grouped, rtn_codes, rtn_dequantize, rtn_scales


class Hessian:
    """H = 2 X Xᵀ / n of a linear layer's inputs, accumulated over calibration batches."""

    def __init__(self, in_features: int):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.size(-1)).double()  # (n, in)
        self.sum += x.T @ x
        self.count += x.size(0)

    @property
    def value(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no calibration inputs were added to the Hessian")
        return 2 * self.sum / self.count


def _damped(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """H + damp·mean(diag H)·I (a dead input, diag 0, gets 1 and its weights no say); and the dead mask."""
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H += damp * torch.diag(H).mean() * torch.eye(H.size(0), dtype=H.dtype)
    return H, dead


class _Grid:
    """The quantization grid of each column, as GPTQ fixes it.

    Per-channel and per-tensor grids come from the weights before any update; a group's grid is
    found when its first column comes up, from the group's weights as updated so far."""

    def __init__(self, W: torch.Tensor, bits: int, granularity, symmetric: bool):
        self.bits, self.granularity, self.symmetric = bits, granularity, symmetric
        if not isinstance(granularity, int):
            scale, offset = rtn_scales(grouped(W, granularity), bits, symmetric)
            self.scale = scale.expand(W.size(0), 1)
            self.offset = None if offset is None else offset.expand(W.size(0), 1)

    def quantize(self, columns: torch.Tensor, j: int) -> torch.Tensor:
        """Column j of the matrix, given as columns[:, 0] with the columns after it beside it."""
        if isinstance(self.granularity, int) and j % self.granularity == 0:
            self.scale, self.offset = rtn_scales(columns[:, :self.granularity], self.bits, self.symmetric)
        column = columns[:, :1]
        return rtn_dequantize(rtn_codes(column, self.scale, self.offset, self.bits), self.scale, self.offset)[:, 0]


def _check(weight: torch.Tensor, H: torch.Tensor, granularity, blocksize: int) -> None:
    if weight.dim() != 2 or H.shape != (weight.size(1), weight.size(1)):
        raise ValueError(f"weight (out, in) and H (in, in) must agree, got {tuple(weight.shape)} and {tuple(H.shape)}")
    check_granularity(granularity)
    if isinstance(granularity, int) and blocksize % granularity:
        raise ValueError(f"blocksize={blocksize} must be a multiple of the group size {granularity}, "
                         f"so every group is quantized within one block")


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, bits: int, granularity=128, symmetric: bool = True,
                  blocksize: int = 128, damp: float = 0.01, act_order: bool = False) -> torch.Tensor:
    """GPTQ with the Cholesky form and lazy batches: the dequantized weight (same shape and dtype).

    ``act_order``: quantize the columns in order of decreasing H_jj (the inputs with the largest
    activations first, while many columns are still free to absorb their error); a group is then
    a run of columns in that order, so a kernel needs each column's group index besides the scales."""
    _check(weight, H, granularity, blocksize)
    if act_order:
        order = torch.argsort(torch.diag(H), descending=True, stable=True)
        permuted = gptq_quantize(weight[:, order], H[order][:, order], bits, granularity, symmetric, blocksize, damp)
        return permuted[:, torch.argsort(order)]
    H, dead = _damped(H, damp)
    W = weight.detach().double().clone()  # (out, in)
    W[:, dead] = 0
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # rows: the H⁻¹ rows GPTQ needs
    Q = torch.zeros_like(W)
    grid = _Grid(W, bits, granularity, symmetric)
    columns = W.size(1)
    for start in range(0, columns, blocksize):
        end = min(start + blocksize, columns)
        block = W[:, start:end].clone()  # (out, B): updated inside the block
        errors = torch.zeros_like(block)
        Hblock = Hinv[start:end, start:end]
        for i in range(end - start):
            q = grid.quantize(block[:, i:], start + i)  # a group lies within one block
            Q[:, start + i] = q
            err = (block[:, i] - q) / Hblock[i, i]  # (out,)
            block[:, i:] -= err[:, None] * Hblock[i, i:][None, :]
            errors[:, i] = err
        W[:, end:] -= errors @ Hinv[start:end, end:]  # the lazy update of every later column
    return Q.to(weight.dtype)


@torch.no_grad()
def obq_reference(weight: torch.Tensor, H: torch.Tensor, bits: int, granularity=128, symmetric: bool = True,
                  damp: float = 0.01) -> torch.Tensor:
    """The same quantization by the explicit OBQ update: H⁻¹ updated after every column, float64."""
    _check(weight, H, granularity, weight.size(1) if not isinstance(granularity, int) else granularity)
    H, dead = _damped(H, damp)
    W = weight.detach().double().clone()
    W[:, dead] = 0
    Hinv = torch.linalg.inv(H)
    grid = _Grid(W, bits, granularity, symmetric)
    for j in range(W.size(1)):
        W, Hinv = obq_step(W, Hinv, j, grid.quantize(W[:, j:], j))
    return W.to(weight.dtype)


def obq_step(W: torch.Tensor, Hinv: torch.Tensor, j: int, q: torch.Tensor):
    """Fix column j of W (out, in) at q (out,): the columns after it absorb the error,
    δ = -(w_j - q) / [H⁻¹]_jj · H⁻¹[j, j:]; H⁻¹ loses row and column j. Returns new (W, H⁻¹)."""
    err = (W[:, j] - q) / Hinv[j, j]  # (out,)
    W = W.clone()
    W[:, j:] -= err[:, None] * Hinv[j, j:][None, :]
    W[:, j] = q  # exact (the update above gives q up to rounding)
    return W, Hinv - Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / Hinv[j, j]


def reconstruction_error(weight: torch.Tensor, quantized: torch.Tensor, H: torch.Tensor) -> float:
    """The layer's output error GPTQ minimises, tr((W - Ŵ) H (W - Ŵ)ᵀ) = 2/n ‖(W - Ŵ) X‖²."""
    delta = (weight.double() - quantized.double())
    return float(torch.einsum("oi,ij,oj->", delta, H.double(), delta))
