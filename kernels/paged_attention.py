"""Paged attention for decoding: one query token per sequence, its keys and
values scattered over fixed-size blocks of a shared KV pool.

One program per (sequence, query head). It walks the sequence's block table,
loads one block of keys (BLOCK_SIZE, HEAD_DIM) at a time from wherever the
table says it lives, and keeps an online softmax (running max m, running sum
l, rescaled accumulator) exactly as FlashAttention does over key tiles, so the
scores never exist as a whole row. Grouped-query attention: query head h reads
KV head h // (n_heads / n_kv_heads).

    k_cache, v_cache: (num_blocks, BLOCK_SIZE, n_kv_heads, HEAD_DIM)
    block_tables:     (batch, max_blocks) int32, entry j = physical block of tokens j·BLOCK_SIZE ..
    context_lens:     (batch,) int32, tokens each query attends to (>= 1)

Reference: vLLM's PagedAttention (Kwon et al., SOSP'23, arXiv 2309.06180).
"""

import math

import torch
import triton
import triton.language as tl

from .common import check_same, check_tensor


@triton.jit
def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
                        scale, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32)  # (HEAD_DIM,)
    context = tl.load(lens_ptr + seq)
    m_i = -float("inf")  # running max of the scores
    l_i = 0.0  # running sum of exp(score - m_i)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)  # running sum of exp(score - m_i) · v
    for j in range(0, tl.cdiv(context, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)  # where logical block j lives
        visible = j * BLOCK_SIZE + slots < context
        offsets = block * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)  # (BLOCK_SIZE, HEAD_DIM)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        rescale = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * rescale + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """softmax(scale · q Kᵀ) V for each sequence's single query over its paged keys/values.

    q (batch, n_heads, head_dim) -> (batch, n_heads, head_dim)."""
    check_tensor(q, "q", ndim=3)
    check_tensor(k_cache, "k_cache", ndim=4)
    check_tensor(v_cache, "v_cache", ndim=4)
    check_same({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    batch, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    if kv_dim != head_dim or n_heads % n_kv_heads:
        raise ValueError(f"q has {n_heads} heads of {head_dim}, the cache {n_kv_heads} KV heads of {kv_dim}; "
                         f"head dims must match and n_kv_heads must divide n_heads")
    for name, size in (("head_dim", head_dim), ("block_size", block_size)):
        if size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two for this kernel")
    for name, t, ndim in (("block_tables", block_tables, 2), ("context_lens", context_lens, 1)):
        if t.dtype != torch.int32 or t.ndim != ndim or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {ndim}-d int32 tensor on {q.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if block_tables.size(0) != batch or context_lens.size(0) != batch:
        raise ValueError(f"block_tables and context_lens need one row per sequence ({batch})")
    if batch and (int(context_lens.min()) < 1 or int(context_lens.max()) > block_tables.size(1) * block_size):
        raise ValueError(f"context_lens must be in 1..{block_tables.size(1) * block_size} (the blocks in each table)")
    out = torch.empty_like(q)
    if batch:
        paged_decode_kernel[(batch, n_heads)](
            q, k_cache, v_cache, block_tables, context_lens, out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            1.0 / math.sqrt(head_dim) if scale is None else scale,
            GROUP=n_heads // n_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim)
    return out
