"""FlashAttention-2 in plain PyTorch: the algorithm of ``flash_triton.py`` with tiles as tensor slices.

The step before Triton (Dao, "FlashAttention-2", arXiv 2307.08691, Algorithms 1
and 2). Each block of BLOCK_M queries walks the keys BLOCK_N at a time with the
online softmax; with S_j = scale · Q_i K_jᵀ,

    m' = max(m, rowmax S_j)    P = exp(S_j - m')    c = exp(m - m')
    l  = c · l + rowsum P      acc = c · acc + P V_j

and O_i = acc / l. Forward keeps only O and the log-sum-exp L = m + log l (one
float per query row). Backward recomputes P = exp(S - L) tile by tile, with
delta = rowsum(dO ∘ O):

    dV_j += Pᵀ dO_i    dP = dO_i V_jᵀ    dS = P ∘ (dP - delta)
    dQ_i += scale · dS K_j    dK_j += scale · dSᵀ Q_i

The loops run in Python over tiles, every (batch, head) at once, so the
largest temporary is (B, H, BLOCK_M, BLOCK_N), never (N, N). Causal attention
(query i sees keys 0..i, as ``scaled_dot_product_attention(is_causal=True)``)
skips the tiles wholly above the diagonal. Tiles are computed in fp32 for
16-bit inputs, as the Triton kernel accumulates (fp64 stays fp64).
"""

import torch

from .common import FLOAT_DTYPES, softmax_scale

DTYPES = (*FLOAT_DTYPES, torch.float64)


def check_inputs(q, k, v, causal, sm_scale) -> float:
    """q (B, H, Nq, d), k and v (B, H, Nk, d) of one float dtype on one device; returns the scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seq_len, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; use float32, float16, bfloat16 or float64")
    if len({q.dtype, k.dtype, v.dtype}) > 1 or len({q.device, k.device, v.device}) > 1:
        raise ValueError("q, k and v must share one dtype and one device")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share batch, heads "
                         "and head_dim, and k and v one seq_len")
    if min(q.shape) < 1 or k.shape[2] < 1:
        raise ValueError(f"every dimension must be at least 1, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    return softmax_scale(causal, sm_scale, q.shape[-1])


def tile_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, the input's own dtype from fp32 up."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q_tile, k_tile, scale, causal, start_m, start_n):
    """scale · Q_i K_jᵀ (B, H, bm, bn), with keys after each query masked when causal."""
    s = (q_tile @ k_tile.mT) * scale
    if causal and start_n + k_tile.shape[2] - 1 > start_m:  # the tile crosses the diagonal
        rows = torch.arange(start_m, start_m + q_tile.shape[2], device=s.device)
        cols = torch.arange(start_n, start_n + k_tile.shape[2], device=s.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return s


def _key_end(causal: bool, start_m: int, block_m: int, n_keys: int) -> int:
    """Keys a query block needs: all of them, or under the causal mask up to its last query."""
    return min(n_keys, start_m + block_m) if causal else n_keys


def flash_forward(q, k, v, causal=False, sm_scale=None, block_m=64, block_n=64):
    """Return (O, L): O (B, H, Nq, d) in q's dtype and L (B, H, Nq) the log-sum-exp of the scores
    (fp32, or fp64 for fp64 inputs)."""
    scale = check_inputs(q, k, v, causal, sm_scale)
    B, H, n_q, d = q.shape
    acc_dtype = tile_dtype(q.dtype)
    o = torch.empty_like(q)
    lse = q.new_empty(B, H, n_q, dtype=acc_dtype)
    for start_m in range(0, n_q, block_m):
        q_tile = q[:, :, start_m : start_m + block_m].to(acc_dtype)  # (B, H, bm, d)
        bm = q_tile.shape[2]
        m = q_tile.new_full((B, H, bm), float("-inf"))  # running row max
        l = q_tile.new_zeros(B, H, bm)  # running sum of exp(S - m)
        acc = q_tile.new_zeros(B, H, bm, d)  # running P V
        for start_n in range(0, _key_end(causal, start_m, bm, k.shape[2]), block_n):
            k_tile = k[:, :, start_n : start_n + block_n].to(acc_dtype)  # (B, H, bn, d)
            v_tile = v[:, :, start_n : start_n + block_n].to(acc_dtype)
            s = _scores(q_tile, k_tile, scale, causal, start_m, start_n)  # (B, H, bm, bn)
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)  # rescales what was summed under the old max
            l = c * l + p.sum(dim=-1)
            acc = c[..., None] * acc + p @ v_tile
            m = m_new
        o[:, :, start_m : start_m + bm] = (acc / l[..., None]).to(q.dtype)
        lse[:, :, start_m : start_m + bm] = m + torch.log(l)
    return o, lse


def flash_backward(do, q, k, v, o, lse, causal=False, sm_scale=None, block_m=64, block_n=64):
    """Return (dQ, dK, dV) from dO, the inputs, O and L: P is recomputed tile by tile, never stored."""
    scale = check_inputs(q, k, v, causal, sm_scale)
    if do.shape != o.shape:
        raise ValueError(f"dO has shape {tuple(do.shape)} but the output has shape {tuple(o.shape)}")
    acc_dtype = tile_dtype(q.dtype)
    delta = (do.to(acc_dtype) * o.to(acc_dtype)).sum(dim=-1)  # (B, H, Nq): rowsum(dO ∘ O) = rowsum(P ∘ dP)
    dq, dk, dv = (torch.zeros_like(t, dtype=acc_dtype) for t in (q, k, v))
    for start_m in range(0, q.shape[2], block_m):
        rows = slice(start_m, start_m + block_m)
        q_tile, do_tile = q[:, :, rows].to(acc_dtype), do[:, :, rows].to(acc_dtype)  # (B, H, bm, d)
        bm = q_tile.shape[2]
        for start_n in range(0, _key_end(causal, start_m, bm, k.shape[2]), block_n):
            cols = slice(start_n, start_n + block_n)
            k_tile, v_tile = k[:, :, cols].to(acc_dtype), v[:, :, cols].to(acc_dtype)  # (B, H, bn, d)
            s = _scores(q_tile, k_tile, scale, causal, start_m, start_n)
            p = torch.exp(s - lse[:, :, rows, None])  # (B, H, bm, bn): the forward's probabilities
            dv[:, :, cols] += p.mT @ do_tile
            ds = p * (do_tile @ v_tile.mT - delta[:, :, rows, None])
            dq[:, :, rows] += scale * (ds @ k_tile)
            dk[:, :, cols] += scale * (ds.mT @ q_tile)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionTorch(torch.autograd.Function):
    """Forward: O, saving only q, k, v, O and L. Backward: dQ, dK, dV, recomputing P."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, block_m, block_n):
        o, lse = flash_forward(q, k, v, causal, sm_scale, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (causal, sm_scale, block_m, block_n)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(do, q, k, v, o, lse, *ctx.options)
        return dq, dk, dv, None, None, None, None


def flash_attention_torch(q, k, v, causal: bool = False, sm_scale: float | None = None,
                          block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """softmax(sm_scale · q kᵀ [+ causal mask]) v, differentiable, for q (B, H, Nq, d) and k, v (B, H, Nk, d);
    any head_dim and device. sm_scale defaults to 1/sqrt(d)."""
    check_inputs(q, k, v, causal, sm_scale)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    return FlashAttentionTorch.apply(q, k, v, causal, sm_scale, block_m, block_n)
