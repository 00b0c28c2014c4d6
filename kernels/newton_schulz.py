"""The matmuls of a Newton–Schulz step, with a symmetric shortcut.

One quintic step on X (m, n), m ≤ n, is three products:

    A = X Xᵀ            symmetric (m, m)
    B = b·A + c·A Aᵀ    symmetric too (A is), so also a Gram product plus an addend
    X = a·X + B X       an ordinary product plus an addend

``ns_matmul`` computes C = alpha·P Q + beta·D with an fp32 accumulator and the
scaled addend fused into the store. With ``symmetric=True`` (Q = Pᵀ) only the
tiles on or above the diagonal are computed, and each one is also written to its
mirror position below it: the two Gram products cost about half their FLOPs.
"""

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, check_same, check_tensor, dot_precision

if INTERPRETED:
    BLOCK, BLOCK_K, NUM_WARPS, NUM_STAGES = 32, 32, 4, 1
else:
    BLOCK, BLOCK_K, NUM_WARPS, NUM_STAGES = 128, 64, 8, 3

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


@triton.jit
def ns_matmul_kernel(p_ptr, q_ptr, d_ptr, c_ptr, M, N, K,
                     stride_pm, stride_pk, stride_qk, stride_qn, stride_dm, stride_dn, stride_cm, stride_cn,
                     alpha, beta, SYMMETRIC: tl.constexpr, HAS_D: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if SYMMETRIC:
        if pid_n < pid_m:
            return  # below the diagonal: the mirror of tile (pid_n, pid_m), which writes it
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        p = tl.load(p_ptr + rows[:, None] * stride_pm + k[None, :] * stride_pk,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        q = tl.load(q_ptr + k[:, None] * stride_qk + cols[None, :] * stride_qn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(p, q, acc, input_precision=DOT_PRECISION)
    acc = acc * alpha
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_D:
        d = tl.load(d_ptr + rows[:, None] * stride_dm + cols[None, :] * stride_dn, mask=inside, other=0.0)
        acc += beta * d.to(tl.float32)
    out = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, out, mask=inside)
    if SYMMETRIC:
        # element (r, c) of this tile is also C[c, r] (D is symmetric, so the addend agrees);
        # a diagonal tile has already written its own mirror
        tl.store(c_ptr + cols[None, :] * stride_cm + rows[:, None] * stride_cn, out,
                 mask=inside & (pid_n > pid_m))


def ns_matmul(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor | None = None, alpha: float = 1.0,
              beta: float = 0.0, symmetric: bool = False) -> torch.Tensor:
    """alpha·(p @ q) + beta·d, (M, K) @ (K, N) [+ (M, N)] -> (M, N) in p's dtype, fp32 accumulation.

    symmetric=True promises that the result is symmetric (q = pᵀ and d symmetric) and
    computes only the upper tiles."""
    check_tensor(p, "p", ndim=2, contiguous=False)
    check_tensor(q, "q", ndim=2, contiguous=False)
    tensors = {"p": p, "q": q}
    if d is not None:
        check_tensor(d, "d", ndim=2, contiguous=False)
        tensors["d"] = d
    check_same(tensors)
    (M, K), (K2, N) = p.shape, q.shape
    if K != K2:
        raise ValueError(f"inner dimensions differ: p is {tuple(p.shape)}, q is {tuple(q.shape)}; "
                         f"need p (M, K) and q (K, N)")
    if d is not None and tuple(d.shape) != (M, N):
        raise ValueError(f"d must be ({M}, {N}) like p @ q, got {tuple(d.shape)}")
    if symmetric and M != N:
        raise ValueError(f"symmetric=True needs a square result, got ({M}, {N})")
    c = torch.empty(M, N, dtype=p.dtype, device=p.device)
    if M == 0 or N == 0:
        return c
    dd = d if d is not None else c  # an unused pointer when there is no addend
    grid = (triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))
    ns_matmul_kernel[grid](
        p, q, dd, c, M, N, K,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), dd.stride(0), dd.stride(1), c.stride(0), c.stride(1),
        float(alpha), float(beta), SYMMETRIC=symmetric, HAS_D=d is not None,
        BLOCK=BLOCK, BLOCK_K=BLOCK_K, DOT_PRECISION=dot_precision(p.dtype), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return c


def newton_schulz_triton(G: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS,
                         eps: float = 1e-7) -> torch.Tensor:
    """Newton–Schulz orthogonalisation of a matrix in G's dtype, every product through ``ns_matmul``
    (the same iteration as llmsys.optim.newton_schulz)."""
    check_tensor(G, "G", ndim=2, contiguous=False)
    a, b, c = coefficients
    tall = G.size(0) > G.size(1)
    X = G.mT if tall else G
    X = (X / X.norm().clamp(min=eps)).contiguous()
    for _ in range(steps):
        A = ns_matmul(X, X.mT, symmetric=True)  # X Xᵀ
        B = ns_matmul(A, A.mT, A, alpha=c, beta=b, symmetric=True)  # c·A Aᵀ + b·A
        X = ns_matmul(B, X, X, beta=a)  # B X + a·X
    return X.mT if tall else X
