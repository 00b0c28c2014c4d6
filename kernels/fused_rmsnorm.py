"""RMSNorm, forward and backward: y = x / sqrt(mean(x²) + eps) * weight.

Forward stores rstd = 1/sqrt(mean(x²) + eps), one float per row, so the
backward never recomputes the reduction. With g = dy * weight and n columns,

    dx = rstd * (g - x * rstd² * mean(g * x))
    dweight = sum over rows of dy * x * rstd

Each backward program walks several blocks of rows, adds its rows' share of
dweight in registers and writes one partial row; torch sums those few partial
rows, so the result does not depend on scheduling (no atomics).
"""

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, check_same, check_tensor
from .fused_softmax import MAX_COLS, launch_config


@triton.jit
def rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # padding adds 0 to the sum
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for start in range(pid * BLOCK_ROWS, n_rows, tl.num_programs(0) * BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        g = dy * w[None, :]
        mean_gx = tl.sum(g * x, axis=1) / n_cols
        dx = rstd[:, None] * (g - x * (rstd * rstd * mean_gx)[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x * rstd[:, None], axis=0)  # masked rows loaded as 0
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_ok)


def backward_programs(n_row_blocks: int, device: torch.device) -> int:
    """Enough programs to fill the GPU; each adds up the dweight of many rows."""
    if INTERPRETED:
        return min(n_row_blocks, 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(n_row_blocks, 4 * sms)


class RMSNormFunction(torch.autograd.Function):
    """Forward: y = x * rstd * weight (saves x, weight, rstd). Backward: dx and dweight."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        n_cols = x.shape[-1]
        x2d = x.view(-1, n_cols)
        n_rows = x2d.shape[0]
        y = torch.empty_like(x2d)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_rows, block_cols, num_warps = launch_config(n_rows, n_cols)
        if n_rows:
            rmsnorm_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
                x2d, weight, y, rstd, n_rows, n_cols, eps,
                BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
            )
        ctx.save_for_backward(x2d, weight, rstd)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2d.shape
        dy2d = dy.contiguous().view(-1, n_cols)
        dx = torch.empty_like(x2d)
        block_rows, block_cols, num_warps = launch_config(n_rows, n_cols)
        programs = backward_programs(triton.cdiv(n_rows, block_rows), x2d.device) if n_rows else 0
        dw_partial = torch.zeros(max(programs, 1), n_cols, dtype=torch.float32, device=x2d.device)
        if n_rows:
            rmsnorm_bwd_kernel[(programs,)](
                dy2d, x2d, weight, rstd, dx, dw_partial, n_rows, n_cols,
                BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
            )
        dweight = dw_partial.sum(0).to(weight.dtype)
        return dx.view(dy.shape), dweight, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of x (..., hidden) with weight (hidden,); differentiable."""
    check_tensor(x, "x")
    check_tensor(weight, "weight", ndim=1)
    check_same({"x": x, "weight": weight})
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} entries but x has hidden size {x.shape[-1]}; they must match")
    if not 1 <= x.shape[-1] <= MAX_COLS:
        raise ValueError(f"rmsnorm needs a hidden size from 1 to {MAX_COLS}, got {x.shape[-1]}")
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    return RMSNormFunction.apply(x, weight, float(eps))


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The same RMSNorm in plain torch (fp32 inside), for tests and benchmarks."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
