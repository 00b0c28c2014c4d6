"""Sequence parallelism (Korthikanti et al., arXiv 2205.05198).

Tensor parallelism splits attention and the MLP but leaves the norms (and, in
GPT, the dropouts) replicated: every rank holds their full (B, T, D)
activations. Those layers act on each token alone, so they can be split along
the sequence instead. The all-reduce at the end of a TP region then becomes a
reduce-scatter (each rank keeps the sum for its own tokens) and the f at the
start becomes an all-gather (attention needs every token):

    TP:     norm(x) -> f -> [column, row] -> g (all-reduce)      -> + x
    TP+SP:  norm(x_i) -> all-gather -> [column, row] -> reduce-scatter -> + x_i

An all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes are
the same. Memory: with the linear layers' input stored as this rank's shard
(the all-gather is redone in backward) every activation of the layer is split,
sbh(34 + 5as/h)/t per layer instead of sbh(10 + 24/t + 5as/(ht)).

``GPTLayer`` is the GPT layer whose activations that formula counts (LayerNorm,
dropout, GeLU MLP, explicit softmax attention), and ``llmsys.core.measure.saved_activation_bytes``
measures what autograd keeps for backward, so the formula can be checked.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from llmsys.core.comm import all_gather_single, reduce_scatter_single
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core.measure import saved_activation_bytes
from llmsys.core.model import attend, rope_heads
from llmsys.parallel.tensor import TensorParallelAttention, TensorParallelMLP, copy_to_tp, reduce_from_tp

# -----------------------------------------------------------------------------
# collectives along the sequence dimension (dim 1 of (B, T, ...))


def _all_gather_sequence(x, group):
    """(B, T/t, ...) -> (B, T, ...), rank order along T."""
    n = dist.get_world_size(group)
    chunk = x.transpose(0, 1).contiguous()  # the collectives work on dim 0
    out = torch.empty((n * chunk.size(0),) + chunk.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_single(out, chunk, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_sequence(x, group):
    """(B, T, ...) partial sums -> (B, T/t, ...) this rank's tokens, summed over ranks."""
    n = dist.get_world_size(group)
    if x.size(1) % n:
        raise ValueError(f"sequence length {x.size(1)} must be divisible by the tensor-parallel degree {n}")
    full = x.transpose(0, 1).contiguous()
    out = torch.empty((full.size(0) // n,) + full.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, full, group=group)
    return out.transpose(0, 1)


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter partial sums to sequence shards. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


class _GatheredLinears(torch.autograd.Function):
    """Forward: all-gather the sequence once, then X W_jᵀ for each weight.
    Backward: all-gather X again (unless it was kept), then weight gradients from the
    full X and a reduce-scatter of the input gradient.

    Only this rank's shard is saved, which is what splits the linear layers' input
    memory by t; the price is one more all-gather in backward, which Megatron
    overlaps with the input-gradient matmul."""

    @staticmethod
    def forward(ctx, x, group, keep_gathered, *weights):
        ctx.group, ctx.keep_gathered = group, keep_gathered
        full = _all_gather_sequence(x, group)  # (B, T, D)
        ctx.save_for_backward(full if keep_gathered else x, *weights)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        saved, *weights = ctx.saved_tensors
        full = saved if ctx.keep_gathered else _all_gather_sequence(saved, ctx.group)
        grad_full = sum(g @ w for g, w in zip(grads, weights))  # (B, T, D)
        flat = full.reshape(-1, full.size(-1))
        grad_weights = [g.reshape(-1, g.size(-1)).t() @ flat for g in grads]
        return (_reduce_scatter_sequence(grad_full, ctx.group), None, None, *grad_weights)


def reduce_scatter_sequence(x, group=None):
    """Reduce-scatter along the sequence forward, all-gather backward."""
    return _ReduceScatterSequence.apply(x, group)


def gathered_linears(x, weights, group=None, keep_gathered: bool = False):
    """All-gather x's sequence shards, then apply each (column-parallel) weight; see _GatheredLinears."""
    return _GatheredLinears.apply(x, group, keep_gathered, *weights)


def sequence_shard(x, group=None, dim: int = 1):
    """This rank's contiguous chunk of ``x`` along the sequence (no communication, no gradient link)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if x.size(dim) % n:
        raise ValueError(f"sequence length {x.size(dim)} must be divisible by the tensor-parallel degree {n}")
    return x.chunk(n, dim=dim)[rank].clone()


def sync_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """All-reduce the gradients of replicated parameters (norm gains) that saw only this rank's tokens."""
    for name, param in module.named_parameters():
        if "norm" in name and param.grad is not None:
            dist.all_reduce(param.grad, group=group)


# -----------------------------------------------------------------------------
# the Llama block with TP + SP


class SequenceParallelMLP(TensorParallelMLP):
    def __init__(self, feed_forward, group=None, keep_gathered: bool = False):
        super().__init__(feed_forward, group)
        self.keep_gathered = keep_gathered

    def forward(self, x):  # x: (B, T/t, D), this rank's tokens
        gate, up = gathered_linears(x, [self.w1.weight, self.w3.weight], self.group, self.keep_gathered)  # all-gather
        h = F.silu(gate) * up  # (B, T, hidden/t)
        return reduce_scatter_sequence(self.w2(h), self.group)  # (B, T/t, D)


class SequenceParallelAttention(TensorParallelAttention):
    def __init__(self, attention, group=None, keep_gathered: bool = False):
        super().__init__(attention, group)
        self.keep_gathered = keep_gathered

    def forward(self, x, cos, sin):  # x: (B, T/t, D); cos, sin for all T positions
        weights = [self.wq.weight, self.wk.weight, self.wv.weight]
        q, k, v = gathered_linears(x, weights, self.group, self.keep_gathered)  # all-gather: (B, T, ·)
        B, T, _ = q.shape
        q, k, v = rope_heads(q, k, v, self.n_heads, self.n_kv_heads, cos, sin)  # (B, nh/t or nkv/t, T, hs)
        y = attend(q, k, v).transpose(1, 2).reshape(B, T, -1)  # (B, T, dim/t)
        return reduce_scatter_sequence(self.wo(y), self.group)  # (B, T/t, D)


class SequenceParallelBlock(nn.Module):
    """A Llama block under TP + SP: input and output are this rank's tokens (B, T/t, D)."""

    def __init__(self, block: nn.Module, group=None, keep_gathered: bool = False):
        super().__init__()
        self.attention_norm = copy.deepcopy(block.attention_norm)
        self.attention = SequenceParallelAttention(block.attention, group, keep_gathered)
        self.ffn_norm = copy.deepcopy(block.ffn_norm)
        self.feed_forward = SequenceParallelMLP(block.feed_forward, group, keep_gathered)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)  # norm on T/t tokens only
        return x + self.feed_forward(self.ffn_norm(x))


# -----------------------------------------------------------------------------
# activation memory: the GPT layer of the formula, measured


class _Dropout(torch.autograd.Function):
    """Dropout that keeps a 1-byte bool mask for backward, as the formula assumes (and CUDA does);
    the CPU's native dropout keeps its mask in the activation dtype, 2 bytes in bf16."""

    @staticmethod
    def forward(ctx, x, p):
        keep = torch.rand_like(x, dtype=torch.float32) >= p  # bool: 1 byte per element
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None


def dropout(x, p: float, training: bool):
    return _Dropout.apply(x, p) if training and p > 0 else x


def gpt_attention(qkv, heads: int, p_drop: float, training: bool):
    """Softmax attention as GPT computes it (no fused kernel, so the T×T scores are stored).
    qkv (B, T, 3·heads·hs) -> (B, T, heads·hs)."""
    B, T, _ = qkv.shape
    q, k, v = (t.view(B, T, heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, nh, T, hs)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, T)
    probs = dropout(F.softmax(scores, dim=-1), p_drop, training)
    return (probs @ v).transpose(1, 2).reshape(B, T, -1)


class GPTLayer(nn.Module):
    """The GPT layer whose activations Korthikanti et al. count (§4.1), with 2-byte activations:

    LayerNorm -> QKV -> QKᵀ -> softmax -> dropout -> ·V -> proj -> dropout -> + x,
    LayerNorm -> h→4h -> GeLU -> 4h→h -> dropout -> + x. No biases in the linears.
    """

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
        self.hidden, self.heads, self.dropout = hidden, heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        a = gpt_attention(self.qkv(self.ln1(x)), self.heads, self.dropout, self.training)
        x = x + dropout(self.proj(a), self.dropout, self.training)
        return x + dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, self.training)


class ParallelGPTLayer(nn.Module):
    """``GPTLayer`` split over a group: TP (norms and dropouts on whole sequences) or TP + SP."""

    def __init__(self, layer: GPTLayer, group=None, sequence_parallel: bool = False):
        super().__init__()
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        if layer.heads % n or layer.hidden % n:
            raise ValueError(f"tensor-parallel degree {n} must divide heads={layer.heads} and hidden={layer.hidden}")
        self.group, self.sequence_parallel, self.dropout = group, sequence_parallel, layer.dropout
        self.heads = layer.heads // n
        self.ln1, self.ln2 = copy.deepcopy(layer.ln1), copy.deepcopy(layer.ln2)
        h = layer.hidden
        qkv = layer.qkv.weight.detach()  # rows [q; k; v]: take this rank's heads of each
        self.qkv = nn.Parameter(torch.cat([part.chunk(n)[rank] for part in qkv.split(h)]).clone())
        self.proj = nn.Parameter(layer.proj.weight.detach().chunk(n, dim=1)[rank].clone())
        self.fc1 = nn.Parameter(layer.fc1.weight.detach().chunk(n, dim=0)[rank].clone())
        self.fc2 = nn.Parameter(layer.fc2.weight.detach().chunk(n, dim=1)[rank].clone())

    def _enter(self, x, weight):
        if self.sequence_parallel:
            return gathered_linears(x, [weight], self.group)[0]  # all-gather; only the shard is saved
        return F.linear(copy_to_tp(x, self.group), weight)  # f

    def _exit(self, y):
        return reduce_scatter_sequence(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)

    def forward(self, x):  # (B, T, h) under TP; (B, T/t, h) under SP
        a = gpt_attention(self._enter(self.ln1(x), self.qkv), self.heads, self.dropout, self.training)  # local heads
        x = x + dropout(self._exit(F.linear(a, self.proj)), self.dropout, self.training)
        m = F.gelu(self._enter(self.ln2(x), self.fc1))
        return x + dropout(self._exit(F.linear(m, self.fc2)), self.dropout, self.training)


def gpt_layer_activation_demo(rank: int, world_size: int, seq: int = 64, batch: int = 2, hidden: int = 128,
                              heads: int = 4) -> dict:
    """Worker: activation bytes per rank of one GPT layer, unsplit, under TP and under TP + SP (bf16)."""
    torch.manual_seed(0)
    layer = GPTLayer(hidden, heads).to(torch.bfloat16).train()
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    full = saved_activation_bytes(layer, x)
    tp = saved_activation_bytes(ParallelGPTLayer(layer, sequence_parallel=False).train(), x)
    sp = saved_activation_bytes(ParallelGPTLayer(layer, sequence_parallel=True).train(), sequence_shard(x))
    return {"one_process": full, "tensor_parallel": tp, "sequence_parallel": sp}
