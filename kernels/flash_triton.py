"""FlashAttention-2 in Triton: O = softmax(scale * Q Kᵀ) V without the N x N matrix.

Forward (one program per block of BLOCK_M queries of one head): walk the keys
BLOCK_N at a time with the online softmax. With S_j = scale * Q K_jᵀ,

    m' = max(m, rowmax S_j)    P = exp(S_j - m')    c = exp(m - m')
    l  = c * l + rowsum P      acc = c * acc + P V_j

and finally O = acc / l. Only O and the log-sum-exp L = m + log l (one float
per query row) are written; the kernel works in base 2 (exp2 is the fast
hardware exponential), so scores are pre-multiplied by log2(e).

Backward recomputes P = exp(S - L) block by block instead of storing it:
a preprocess computes delta = rowsum(dO * O); one kernel per key block sums
dV = Pᵀ dO and dK = scale * dSᵀ Q over the query blocks, another per query
block sums dQ = scale * dS K over the key blocks, where dS = P * (dO Vᵀ - delta).

Causal attention skips the key blocks that lie wholly above the diagonal and
masks the rest; padding rows and columns (N not a multiple of the block) are
masked the same way.
"""

import math
import weakref

import torch
import triton
import triton.language as tl
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from .common import INTERPRETED, check_same, check_tensor, dot_precision, softmax_scale

# Kernels may only read globals that are constexpr.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns a base-2 log into a natural one
HEAD_DIMS = (16, 32, 64, 128)

# Block sizes per kernel. The interpreter pays per block step, not per element,
# but its blocks stay small and unequal so that short CPU tests still cover
# several blocks per row, ragged edges and the causal block bounds.
if INTERPRETED:
    FWD_BLOCKS = dict(BLOCK_M=64, BLOCK_N=32)
    DKDV_BLOCKS = dict(BLOCK_M=32, BLOCK_N=64)
    DQ_BLOCKS = dict(BLOCK_M=64, BLOCK_N=32)
else:
    FWD_BLOCKS = dict(BLOCK_M=128, BLOCK_N=64)
    DKDV_BLOCKS = dict(BLOCK_M=32, BLOCK_N=64)
    DQ_BLOCKS = dict(BLOCK_M=64, BLOCK_N=32)
PREPROCESS_BLOCK = 64


def launch_options(head_dim: int, dtype: torch.dtype) -> dict:
    """num_warps / num_stages, plus the dot precision; fp32 tiles are twice as big,
    so they get fewer pipeline stages to fit in shared memory."""
    if dtype == torch.float32:
        stages = 1 if head_dim > 64 else 2
    else:
        stages = 3
    return dict(num_warps=4 if head_dim <= 64 else 8, num_stages=stages, DOT_PRECISION=dot_precision(dtype))


@triton.jit
def flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)  # flattened (batch, head)
    offset = head * seq_len * HEAD_DIM
    q_ptr += offset
    k_ptr += offset
    v_ptr += offset
    o_ptr += offset
    lse_ptr += head * seq_len

    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq_len
    q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running P V
    if CAUSAL:
        hi = tl.minimum(seq_len, start_m + BLOCK_M)  # no key after this block's last query
    else:
        hi = seq_len
    # Key 0 is visible to every query, so after the first block m_i is finite.
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        k_t = tl.load(k_ptr + cols[None, :] * HEAD_DIM + dims[:, None], mask=col_ok[None, :], other=0.0)
        v = tl.load(v_ptr + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        rescale = tl.exp2(m_i - m_new)  # shrinks what was summed under the old max
        l_i = l_i * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * HEAD_DIM + dims[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + rows, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)  # natural log


@triton.jit
def flash_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, seq_len,
                                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq_len
    offsets = head * seq_len * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    o = tl.load(o_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + head * seq_len + rows, tl.sum(o * do, axis=1), mask=row_ok)


@triton.jit
def flash_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                          seq_len, sm_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    head = tl.program_id(1).to(tl.int64)
    offset = head * seq_len * HEAD_DIM
    q_ptr += offset
    k_ptr += offset
    v_ptr += offset
    do_ptr += offset
    dk_ptr += offset
    dv_ptr += offset
    lse_ptr += head * seq_len
    delta_ptr += head * seq_len
    qk_scale = sm_scale * LOG2E

    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    col_ok = cols < seq_len
    k = tl.load(k_ptr + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # queries before this key block never see it
    else:
        lo = 0
    for start_m in range(lo, seq_len, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < seq_len
        q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        p = tl.exp2(tl.where(keep, s, float("-inf")) - lse[:, None] * LOG2E)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
    dk = dk * sm_scale
    tl.store(dk_ptr + cols[:, None] * HEAD_DIM + dims[None, :], dk.to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + cols[:, None] * HEAD_DIM + dims[None, :], dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                        seq_len, sm_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    offset = head * seq_len * HEAD_DIM
    q_ptr += offset
    k_ptr += offset
    v_ptr += offset
    do_ptr += offset
    dq_ptr += offset
    lse_ptr += head * seq_len
    delta_ptr += head * seq_len
    qk_scale = sm_scale * LOG2E

    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq_len
    q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(seq_len, start_m + BLOCK_M)
    else:
        hi = seq_len
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        k = tl.load(k_ptr + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptr + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        p = tl.exp2(tl.where(keep, s, float("-inf")) - lse[:, None] * LOG2E)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq = dq * sm_scale
    tl.store(dq_ptr + rows[:, None] * HEAD_DIM + dims[None, :], dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def check_attention_inputs(q, k, v, causal, sm_scale) -> float:
    """Validate (B, H, N, d) inputs; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=4)
    check_same({"q": q, "k": k, "v": v})
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must share one shape (batch, heads, seq_len, head_dim); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, heads, seq_len, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} (a power of two the tiles can hold), got {head_dim}")
    if min(batch, heads, seq_len) < 1:
        raise ValueError(f"batch, heads and seq_len must be at least 1, got shape {tuple(q.shape)}")
    return softmax_scale(causal, sm_scale, head_dim)


def flash_attention_forward(q, k, v, causal: bool = False, sm_scale: float | None = None):
    """Return (O, L): O (B, H, N, d) in q's dtype, L (B, H, N) fp32 log-sum-exp of the scaled scores."""
    sm_scale = check_attention_inputs(q, k, v, causal, sm_scale)
    batch, heads, seq_len, head_dim = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq_len, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(seq_len, FWD_BLOCKS["BLOCK_M"]), batch * heads)
    flash_fwd_kernel[grid](
        q, k, v, o, lse, seq_len, sm_scale * LOG2E.value,
        HEAD_DIM=head_dim, CAUSAL=causal, **FWD_BLOCKS, **launch_options(head_dim, q.dtype),
    )
    return o, lse


def flash_attention_backward(do, q, k, v, o, lse, causal: bool = False, sm_scale: float | None = None):
    """Return (dQ, dK, dV) from dO and the forward's inputs, O and L; P is recomputed, never stored."""
    sm_scale = check_attention_inputs(q, k, v, causal, sm_scale)
    batch, heads, seq_len, head_dim = q.shape
    do = do.contiguous()
    if do.shape != q.shape:
        raise ValueError(f"dO has shape {tuple(do.shape)} but the output has shape {tuple(q.shape)}")
    bh = batch * heads
    delta = torch.empty_like(lse)
    flash_bwd_preprocess_kernel[(triton.cdiv(seq_len, PREPROCESS_BLOCK), bh)](
        o, do, delta, seq_len, HEAD_DIM=head_dim, BLOCK_M=PREPROCESS_BLOCK,
    )
    options = launch_options(head_dim, q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flash_bwd_dkdv_kernel[(triton.cdiv(seq_len, DKDV_BLOCKS["BLOCK_N"]), bh)](
        q, k, v, do, lse, delta, dk, dv, seq_len, sm_scale,
        HEAD_DIM=head_dim, CAUSAL=causal, **DKDV_BLOCKS, **options,
    )
    flash_bwd_dq_kernel[(triton.cdiv(seq_len, DQ_BLOCKS["BLOCK_M"]), bh)](
        q, k, v, do, lse, delta, dq, seq_len, sm_scale,
        HEAD_DIM=head_dim, CAUSAL=causal, **DQ_BLOCKS, **options,
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Forward: O = softmax(scale QKᵀ)V, saving only q, k, v, O and L. Backward: dQ, dK, dV."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = flash_attention_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(sm_scale * q kᵀ [+ causal mask]) v for q, k, v of shape (B, H, N, d); differentiable.

    sm_scale defaults to 1/sqrt(d); d must be 16, 32, 64 or 128.
    """
    check_attention_inputs(q, k, v, causal, sm_scale)
    return FlashAttentionFunction.apply(q, k, v, causal, sm_scale)


def naive_attention(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """The textbook version: materialises the (N, N) scores and probabilities per head."""
    n, d = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, N)
    if causal:
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, H, N, N)
    return probs @ v


class LiveTensorBytes(TorchDispatchMode):
    """Track the bytes of tensors that torch ops allocate inside the mode, and their peak.

    Each new storage that an op returns is counted until Python frees it (a
    weakref finalizer on the storage). Memory outside torch tensors (numpy
    tiles of the Triton interpreter, a GPU kernel's registers and shared
    memory) is not counted: that is on-chip memory in a compiled kernel.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.tracked = set()

    def _free(self, key, nbytes):
        self.tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self.tracked:
                continue  # a view, an in-place result or an already counted storage
            self.tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def attention_peak_bytes(n: int, d: int = 64, impl: str = "flash", causal: bool = False,
                         batch: int = 1, heads: int = 1) -> int:
    """Peak bytes of new tensors while one attention forward runs (inputs excluded, output included).

    impl is "naive" (materialises N x N scores) or "flash" (this module's kernel).
    Inputs are fp32 under the interpreter and fp16 on a GPU. On CUDA this is
    the caching allocator's peak (after a warm-up call); elsewhere
    LiveTensorBytes counts every tensor torch allocates during the call.
    """
    implementations = {"naive": naive_attention, "flash": flash_attention}
    if impl not in implementations:
        raise ValueError(f"impl must be one of {sorted(implementations)}, got {impl!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    device = "cpu" if INTERPRETED else "cuda"
    dtype = torch.float32 if INTERPRETED else torch.float16
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device=device, dtype=dtype, generator=generator) for _ in range(3))
    attention = implementations[impl]
    if device == "cuda":
        attention(q, k, v, causal=causal)  # compile the kernel, create cuBLAS workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak
    with torch.no_grad(), LiveTensorBytes() as tracker:
        out = attention(q, k, v, causal=causal)
    del out
    return tracker.peak
