"""A copy kernel that tells whether Triton gives right answers here.

Some numpy/triton pairs make the interpreter return zeros without any error.
A kernel that only copies a tensor detects that in milliseconds, before a
wrong attention output is blamed on the attention kernel.
"""

import functools

import torch
import triton
import triton.language as tl

from .common import INTERPRETED


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def copy_canary(n: int = 1000) -> bool:
    """Copy ``n`` distinct nonzero numbers with a Triton kernel; True when they arrive intact."""
    device = "cpu" if INTERPRETED else "cuda"
    src = torch.arange(1, n + 1, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)
    block = 256
    copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK_SIZE=block)
    return bool(torch.equal(src, dst))


@functools.lru_cache(maxsize=1)
def interpreter_ok() -> bool:
    """Whether Triton kernels compute correctly in this process (checked once)."""
    return copy_canary()
