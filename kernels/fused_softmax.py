"""Fused row softmax: one read of x and one write of y per element.

torch's eager softmax over a row needs a max, a subtract, an exp, a sum and a
divide; fused into one kernel, each row is loaded into on-chip memory once.
A program owns a block of BLOCK_ROWS whole rows, padded to a power of two
columns; padding columns load as -inf so they add exp(-inf) = 0 to the sum.
"""

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, check_tensor

# A whole row must fit in one tile, so the row length is capped.
MAX_COLS = 1 << 16
# Elements per program: large numpy tiles are cheap for the interpreter,
# registers are the limit when compiled.
TILE_ELEMENTS = (1 << 16) if INTERPRETED else (1 << 12)


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_rows, n_cols,
                   BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    # Rows past the end re-read the last row (never stored), so no row is all -inf.
    safe_rows = tl.minimum(rows, n_rows - 1).to(tl.int64)
    col_ok = cols[None, :] < n_cols
    offsets = safe_rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=col_ok, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=1)[:, None]  # subtract the row max so exp never overflows
    numerator = tl.exp(x)
    y = numerator / tl.sum(numerator, axis=1)[:, None]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < n_rows) & col_ok)


def launch_config(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) for an (n_rows, n_cols) row-wise kernel."""
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = max(1, min(TILE_ELEMENTS // block_cols, triton.next_power_of_2(n_rows)))
    tile = block_rows * block_cols
    num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return block_rows, block_cols, num_warps


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, dim=-1) for a contiguous tensor with at most 65536 columns."""
    check_tensor(x, "x")
    n_cols = x.shape[-1]
    if n_cols == 0 or n_cols > MAX_COLS:
        raise ValueError(f"softmax needs 1 to {MAX_COLS} columns (a whole row per tile), got {n_cols}")
    y = torch.empty_like(x)
    n_rows = x.numel() // n_cols
    if n_rows == 0:
        return y
    block_rows, block_cols, num_warps = launch_config(n_rows, n_cols)
    softmax_kernel[(triton.cdiv(n_rows, block_rows),)](
        x, y, n_rows, n_cols, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps
    )
    return y
