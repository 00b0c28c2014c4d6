"""Context parallelism: attention over a sequence split across ranks.

Each of CP ranks holds T/CP tokens of every sequence (queries, keys and values).
Attention needs every key for every query, so the keys and values must travel:

- ring attention: each rank computes attention of its queries against one block
  of keys/values at a time and passes the block to the next rank; the partial
  results are merged exactly with their log-sum-exps (the online softmax of
  FlashAttention, across ranks): L = logsumexp(L_i), O = Σ_i exp(L_i - L)·O_i.
  Backward sends the blocks around again, each with its gradient accumulator.
- all-gather K/V (Llama 3, §3.3.2): gather all keys and values, then attend
  locally. Simpler (document masks are easy), and with GQA the keys and values
  are n_kv_heads/n_heads of the queries' size, so the gather is cheap.

With a causal mask a contiguous split gives the last rank most of the work.
Cutting the sequence into 2·CP chunks and giving rank i chunks i and 2·CP-1-i
gives every rank the same number of unmasked scores.

torch's own ``context_parallel`` has no CPU implementation (no CPU sharding
strategy for SDPA), hence this one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmsys.core.comm import all_gather_single, reduce_scatter_single

# -----------------------------------------------------------------------------
# blockwise attention and the log-sum-exp merge


def _expand_kv(k, n_heads):
    """GQA: repeat each KV head for the query heads that share it. (B, n_kv, S, hs) -> (B, n_heads, S, hs)."""
    return k.repeat_interleave(n_heads // k.size(1), dim=1) if k.size(1) != n_heads else k


def block_attention(q, k, v, mask=None, scale: float | None = None):
    """Softmax attention of q against one block of keys; returns (out, lse).

    q (B, H, Tq, hs); k, v (B, H_kv, Tk, hs) with H_kv dividing H; mask (Tq, Tk) bool, True = attend.
    out (B, H, Tq, hs) is normalised within the block; lse (B, H, Tq) is the
    log-sum-exp of the block's scaled scores, -inf for a row that sees no key
    (its out is 0), so such a block drops out of a merge.
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    k, v = _expand_kv(k, q.size(1)), _expand_kv(v, q.size(1))
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Tq)
    probs = torch.exp(scores - _finite(lse)[..., None])  # a fully masked row: exp(-inf) = 0
    return probs @ v, lse


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint key blocks into attention over both.

    L = log(e^La + e^Lb); O = e^(La - L)·Oa + e^(Lb - L)·Ob. A block with lse -inf
    (no visible key) gets weight 0. ``out_a`` may be None (nothing merged yet).
    """
    if out_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)
    weight_a = torch.exp(lse_a - safe)[..., None]  # (B, H, Tq, 1)
    weight_b = torch.exp(lse_b - safe)[..., None]
    return weight_a * out_a + weight_b * out_b, lse


# -----------------------------------------------------------------------------
# who holds which tokens


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Token positions rank ``rank`` holds: chunks rank and 2·cp-1-rank of 2·cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2·CP = {2 * cp} "
                         "(the load-balanced layout cuts it into 2·CP equal chunks)")
    chunk = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def contiguous_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Token positions of a plain contiguous split (unbalanced under a causal mask)."""
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} must be divisible by CP = {cp}")
    chunk = seq_len // cp
    return torch.arange(rank * chunk, (rank + 1) * chunk)


def positions(seq_len: int, cp: int, rank: int, balanced: bool = True) -> torch.Tensor:
    return (load_balanced_positions if balanced else contiguous_positions)(seq_len, cp, rank)


def causal_work(seq_len: int, cp: int, balanced: bool = True) -> list[int]:
    """Unmasked (query, key) pairs each rank computes under a causal mask: its share of the work."""
    return [int((positions(seq_len, cp, r, balanced) + 1).sum()) for r in range(cp)]


def _causal_mask(q_pos, k_pos):
    return q_pos[:, None] >= k_pos[None, :]  # (Tq, Tk)


# -----------------------------------------------------------------------------
# ring attention


def _ring_neighbours(group):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    return rank, n, to_global((rank + 1) % n), to_global((rank - 1) % n)


def _exchange(tensor, send_to, recv_from, group):
    """Send ``tensor`` to the next rank and receive the previous rank's (started, not finished)."""
    incoming = torch.empty_like(tensor)
    requests = [dist.isend(tensor.contiguous(), send_to, group=group), dist.irecv(incoming, recv_from, group=group)]
    return incoming, requests


def _wait(requests):
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_len, balanced, causal, group):
        rank, n, send_to, recv_from = _ring_neighbours(group)
        q_pos = positions(seq_len, n, rank, balanced)
        kv = torch.stack([k, v])  # one message per step: (2, B, H_kv, T/CP, hs)
        out = lse = None
        for step in range(n):
            source = (rank - step) % n  # whose keys and values we hold now
            if step < n - 1:  # start passing them on; compute while they travel
                incoming, requests = _exchange(kv, send_to, recv_from, group)
            mask = _causal_mask(q_pos, positions(seq_len, n, source, balanced)).to(q.device) if causal else None
            out, lse = merge_attention(out, lse, *block_attention(q, kv[0], kv[1], mask))
            if step < n - 1:
                _wait(requests)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (seq_len, balanced, causal, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        seq_len, balanced, causal, group = ctx.config
        rank, n, send_to, recv_from = _ring_neighbours(group)
        q_pos = positions(seq_len, n, rank, balanced)
        scale = 1.0 / math.sqrt(q.size(-1))
        delta = (grad_out * out).sum(-1, keepdim=True)  # (B, H, Tq, 1): rowsum(dO ∘ O)
        grad_q = torch.zeros_like(q)
        kv, grad_kv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(n):
            source = (rank - step) % n
            keys, values = _expand_kv(kv[0], q.size(1)), _expand_kv(kv[1], q.size(1))
            scores = (q @ keys.transpose(-2, -1)) * scale
            if causal:
                mask = _causal_mask(q_pos, positions(seq_len, n, source, balanced)).to(q.device)
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.exp(scores - _finite(lse)[..., None])  # the final softmax, block by block
            grad_scores = probs * (grad_out @ values.transpose(-2, -1) - delta)
            grad_q += grad_scores @ keys * scale
            grad_k = _fold_heads(grad_scores.transpose(-2, -1) @ q * scale, kv.size(2))
            grad_v = _fold_heads(probs.transpose(-2, -1) @ grad_out, kv.size(2))
            grad_kv = grad_kv + torch.stack([grad_k, grad_v])
            # the block moves on with its accumulated gradient; after n hops both are home
            if step < n - 1:
                kv_in, requests_kv = _exchange(kv, send_to, recv_from, group)
            grad_in, requests_grad = _exchange(grad_kv, send_to, recv_from, group)
            _wait(requests_grad)
            grad_kv = grad_in
            if step < n - 1:
                _wait(requests_kv)
                kv = kv_in
        return grad_q, grad_kv[0], grad_kv[1], None, None, None, None


def _fold_heads(grad, n_kv_heads):
    """Sum the gradient of repeated KV heads back onto the shared head (GQA)."""
    B, H, S, hs = grad.shape
    return grad.view(B, n_kv_heads, H // n_kv_heads, S, hs).sum(2)


def ring_attention(q, k, v, seq_len: int, causal: bool = True, balanced: bool = True, group=None):
    """Attention of this rank's queries against the whole sequence, keys passed around a ring.

    q (B, H, T/CP, hs), k and v (B, H_kv, T/CP, hs): this rank's tokens, at the
    positions ``positions(seq_len, CP, rank, balanced)``. Returns this rank's
    output rows; forward and backward equal full attention on those rows.
    """
    _check_shard(q, seq_len, group)
    return _RingAttention.apply(q, k, v, seq_len, balanced, causal, group)


# -----------------------------------------------------------------------------
# all-gather K/V (Llama 3)


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather along the token dim (2). Backward: reduce-scatter the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        local = x.transpose(0, 2).contiguous()  # tokens first: (T/CP, H, B, hs)
        out = torch.empty((n * local.size(0),) + local.shape[1:], dtype=x.dtype, device=x.device)
        all_gather_single(out, local, group=group)
        return out.transpose(0, 2)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        full = grad.transpose(0, 2).contiguous()
        out = torch.empty((full.size(0) // n,) + full.shape[1:], dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(out, full, group=ctx.group)
        return out.transpose(0, 2), None


def allgather_kv_attention(q, k, v, seq_len: int, causal: bool = True, balanced: bool = True, group=None):
    """Attention with all keys and values gathered first (Llama 3's context parallelism); autograd-ready."""
    _check_shard(q, seq_len, group)
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    k_all, v_all = _GatherTokens.apply(k, group), _GatherTokens.apply(v, group)  # (B, H_kv, T, hs), rank order
    mask = None
    if causal:
        kv_pos = torch.cat([positions(seq_len, n, r, balanced) for r in range(n)])
        mask = _causal_mask(positions(seq_len, n, rank, balanced), kv_pos).to(q.device)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)


def _check_shard(q, seq_len, group):
    n = dist.get_world_size(group)
    if q.size(2) * n != seq_len:
        raise ValueError(f"each of the {n} context-parallel ranks must hold seq_len/CP = {seq_len}/{n} "
                         f"tokens, got {q.size(2)}")


def shard_tokens(x, cp: int, rank: int, balanced: bool = True, dim: int = 2):
    """This rank's tokens of a full (B, H, T, hs) tensor (a copy; no gradient link needed)."""
    return x.index_select(dim, positions(x.size(dim), cp, rank, balanced).to(x.device)).clone()


def kv_gather_bytes(seq_len: int, n_kv_heads: int, head_dim: int, cp: int, batch: int = 1,
                    bytes_per_element: int = 2) -> float:
    """Bytes each rank receives per layer when all-gathering K and V: (CP-1)/CP of the full K and V."""
    full = 2 * batch * seq_len * n_kv_heads * head_dim * bytes_per_element
    return full * (cp - 1) / cp


def context_parallel_demo(rank: int, world_size: int, seq_len: int = 32, heads: int = 4, kv_heads: int = 2,
                          head_dim: int = 8, batch: int = 2, balanced: bool = True) -> dict:
    """Worker: ring and all-gather attention vs full causal attention, forward and backward, with bytes."""
    from llmsys.core.comm import CommCounter

    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(batch, heads, seq_len, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen)
    grad = torch.randn(batch, heads, seq_len, head_dim, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    want.backward(grad)
    pos = positions(seq_len, world_size, rank, balanced)
    report = {}
    for name, attention in (("ring", ring_attention), ("allgather", allgather_kv_attention)):
        local = [shard_tokens(t, world_size, rank, balanced).requires_grad_() for t in (q, k, v)]
        with CommCounter() as comm:
            out = attention(*local, seq_len, causal=True, balanced=balanced)
            out.backward(grad[:, :, pos])
        errors = [(out - want[:, :, pos]).abs().max().item()]
        errors += [(t.grad - f.grad[:, :, pos]).abs().max().item() for t, f in zip(local, full)]
        report[name] = {"max_error_out": errors[0], "max_error_grads": max(errors[1:]),
                        "sent_bytes": sum(b for op, b in comm.ring_bytes.items() if op != "recv"),
                        "calls": dict(comm.calls)}
    return report
