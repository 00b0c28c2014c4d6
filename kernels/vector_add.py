"""Vector addition: the "hello world" of Triton.

Each program handles one BLOCK_SIZE slice of the flattened tensors; the mask
switches off the lanes past the end when the length is not a multiple of it.
"""

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, check_same, check_tensor

BLOCK_SIZE = 4096 if INTERPRETED else 1024


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two contiguous tensors of the same shape (no broadcasting)."""
    check_tensor(x, "x")
    check_tensor(y, "y")
    check_same({"x": x, "y": y})
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        add_kernel[(triton.cdiv(n, BLOCK_SIZE),)](x, y, out, n, BLOCK_SIZE=BLOCK_SIZE)
    return out
