"""Tensor parallelism (Megatron-LM, arXiv 1909.08053), by hand and with DTensor.

A linear layer Y = XA can be split two ways over t ranks:

- column-parallel: A = [A_1 .. A_t] by output columns; rank i computes XA_i from the
  whole X and holds a slice of Y. Weight shard (out/t, in).
- row-parallel: A split by input rows; rank i computes X_i A_i from its slice of X
  and the partial results are summed. Weight shard (out, in/t).

An MLP is column-parallel then row-parallel: the element-wise activation works on
each rank's columns alone, so the only communication is the final sum. Two
conjugate operations carry it (picotron's names in brackets):

- f (copy to the TP region): identity forward, all-reduce of the gradient backward
- g (reduce from the TP region): all-reduce forward, identity backward

Attention splits the same way with whole heads per rank: wq, wk, wv
column-parallel, wo row-parallel. A transformer block therefore costs exactly
2 all-reduces forward (two g) and 2 backward (two f).

``dtensor_parallelize_block`` does the same with ``torch.distributed.tensor.parallel``
(ColwiseParallel / RowwiseParallel) for comparison.

Run ``torchrun --nproc-per-node=2 -m llmsys.parallel.tensor`` for the NCCL demo
(on the CPU, ``python -m llmsys.parallel.tensor`` runs it on 2 gloo ranks).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from llmsys.core.model import ModelConfig, attend, rope_heads

# -----------------------------------------------------------------------------
# f and g and their relatives: tiny autograd functions


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f. Forward: identity (every rank already holds the whole input).
    Backward: all-reduce, because each rank's columns contribute a part of dL/dX."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # the incoming gradient may be shared with other branches
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g. Forward: all-reduce the partial sums of a row-parallel layer.
    Backward: identity (the summed output's gradient is every rank's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dimension (column shards -> whole output).
    Backward: keep this rank's slice of the gradient (no communication)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, n = _world(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, n = _world(ctx.group)
        return grad.chunk(n, dim=-1)[rank].contiguous(), None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension (no communication).
    Backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, n = _world(group)
        return x.chunk(n, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        rank, n = _world(ctx.group)
        parts = [torch.empty_like(grad) for _ in range(n)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None


def copy_to_tp(x, group=None):
    """f: identity forward, all-reduce backward."""
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tp(x, group=None):
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_tp(x, group=None):
    """All-gather the last dim forward, take this rank's slice backward."""
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_tp(x, group=None):
    """Take this rank's slice of the last dim forward, all-gather backward."""
    return _ScatterToTensorParallelRegion.apply(x, group)


# -----------------------------------------------------------------------------
# column- and row-parallel linear layers


def check_tp_degree(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming the constraint when ``tp`` cannot split ``cfg``'s layers."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the tensor-parallel degree must be a positive int, got {tp!r}")
    for name, value, why in [
        ("n_heads", cfg.n_heads, "each rank computes whole attention heads"),
        ("n_kv_heads", cfg.n_kv_heads, "each rank needs whole KV heads for its query heads"),
        ("ffn hidden size", cfg.hidden, "each rank takes hidden/tp columns of w1, w3 and rows of w2"),
    ]:
        if value % tp:
            raise ValueError(f"tensor-parallel degree tp={tp} does not divide {name}={value} ({why}); "
                             f"choose tp among the divisors of {value}")


def _shard(weight: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    if weight.size(dim) % n:
        raise ValueError(f"cannot split a weight of shape {tuple(weight.shape)} into {n} equal parts along dim {dim}")
    return weight.detach().chunk(n, dim=dim)[rank].clone()


class _ShardedLinear(nn.Module):
    """A bias-free linear layer holding this rank's slice of the weight along ``shard_dim``."""

    shard_dim: int  # 0: out_features are split (column-parallel), 1: in_features (row-parallel)

    def __init__(self, in_features: int, out_features: int, group=None):
        super().__init__()
        rank, n = _world(group)
        shape = [out_features, in_features]
        if shape[self.shard_dim] % n:
            name = ("out_features", "in_features")[self.shard_dim]
            raise ValueError(f"{name}={shape[self.shard_dim]} must be divisible by the tensor-parallel degree {n}")
        shape[self.shard_dim] //= n
        self.group, self.rank, self.tp = group, rank, n
        self.weight = nn.Parameter(torch.empty(shape))
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs):
        if linear.bias is not None:
            raise ValueError("only bias-free linear layers are supported (Llama has none)")
        layer = cls(linear.in_features, linear.out_features, group, **kwargs).to(linear.weight.device)
        layer.weight.data = layer.shard_of(linear.weight)
        return layer

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full (out, in) tensor such as the one-process weight or its gradient."""
        return _shard(full, self.shard_dim, self.rank, self.tp)


class ColumnParallelLinear(_ShardedLinear):
    """Y_i = X A_i: this rank's out_features/t outputs. Weight shard (out/t, in).

    copy_input applies f to the input; turn it off when several column-parallel
    layers read the same input, so one f (one backward all-reduce) serves them all.
    gather_output all-gathers the output slices into the full output.
    """

    shard_dim = 0  # output features

    def __init__(self, in_features: int, out_features: int, group=None, copy_input: bool = True,
                 gather_output: bool = False):
        super().__init__(in_features, out_features, group)
        self.copy_input, self.gather_output = copy_input, gather_output


    def forward(self, x):
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight)  # (..., out/t)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(_ShardedLinear):
    """Y = Σ_i X_i A_i: this rank multiplies its in_features/t inputs. Weight shard (out, in/t).

    input_is_parallel=False scatters a whole input first; reduce_output applies g.
    """

    shard_dim = 1  # input features

    def __init__(self, in_features: int, out_features: int, group=None, input_is_parallel: bool = True,
                 reduce_output: bool = True):
        super().__init__(in_features, out_features, group)
        self.input_is_parallel, self.reduce_output = input_is_parallel, reduce_output


    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = F.linear(x, self.weight)  # partial sums (..., out)
        return reduce_from_tp(y, self.group) if self.reduce_output else y


# -----------------------------------------------------------------------------
# Megatron MLP, attention and block, built from a llmsys.core.model block


class TensorParallelMLP(nn.Module):
    """SwiGLU split Megatron-style: w1, w3 column-parallel, w2 row-parallel. One f, one g."""

    def __init__(self, feed_forward: nn.Module, group=None):
        super().__init__()
        self.group = group
        self.w1 = ColumnParallelLinear.from_linear(feed_forward.w1, group, copy_input=False)
        self.w3 = ColumnParallelLinear.from_linear(feed_forward.w3, group, copy_input=False)
        self.w2 = RowParallelLinear.from_linear(feed_forward.w2, group, reduce_output=False)

    def forward(self, x):
        x = copy_to_tp(x, self.group)  # f: w1 and w3 read the same x, so one f serves both
        h = F.silu(self.w1(x)) * self.w3(x)  # (B, T, hidden/t): the activation needs no communication
        return reduce_from_tp(self.w2(h), self.group)  # g


class TensorParallelAttention(nn.Module):
    """Attention with n_heads/t query heads and n_kv_heads/t KV heads per rank. One f, one g."""

    def __init__(self, attention: nn.Module, group=None):
        super().__init__()
        rank, n = _world(group)
        for name in ("n_heads", "n_kv_heads"):
            if getattr(attention, name) % n:
                raise ValueError(f"tensor-parallel degree tp={n} does not divide {name}={getattr(attention, name)}; "
                                 f"each rank computes whole heads, so choose tp among its divisors")
        self.group = group
        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads // n, attention.n_kv_heads // n, attention.head_dim
        # heads are contiguous rows of wq/wk/wv, so row chunk i is heads i·nh/t .. (i+1)·nh/t
        self.wq = ColumnParallelLinear.from_linear(attention.wq, group, copy_input=False)
        self.wk = ColumnParallelLinear.from_linear(attention.wk, group, copy_input=False)
        self.wv = ColumnParallelLinear.from_linear(attention.wv, group, copy_input=False)
        self.wo = RowParallelLinear.from_linear(attention.wo, group, reduce_output=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        x = copy_to_tp(x, self.group)  # f
        q, k, v = rope_heads(self.wq(x), self.wk(x), self.wv(x), self.n_heads, self.n_kv_heads, cos, sin)  # nh/t, nkv/t heads
        y = attend(q, k, v).transpose(1, 2).reshape(B, T, -1)  # (B, T, dim/t)
        return reduce_from_tp(self.wo(y), self.group)  # g


class TensorParallelBlock(nn.Module):
    """A ``llmsys.core.model.Block`` with its attention and MLP split over the group; norms replicated."""

    def __init__(self, block: nn.Module, group=None):
        super().__init__()
        self.attention_norm = copy.deepcopy(block.attention_norm)
        self.attention = TensorParallelAttention(block.attention, group)
        self.ffn_norm = copy.deepcopy(block.ffn_norm)
        self.feed_forward = TensorParallelMLP(block.feed_forward, group)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def tensor_parallel_block(block: nn.Module, cfg: ModelConfig | None = None, group=None) -> TensorParallelBlock:
    """Split ``block`` over ``group`` (default: the world), checking the degree against ``cfg`` first."""
    if cfg is not None:
        check_tp_degree(cfg, dist.get_world_size(group))
    return TensorParallelBlock(block, group)


def sharded_pairs(tp_module: nn.Module, full_module: nn.Module):
    """Pair every parameter of a tensor-parallel module with the one-process module's.

    Yields (name, tp_param, full_param, slicer) where slicer(full_tensor) is this
    rank's part of it, so weights or gradients can be compared shard by shard.
    """
    full = dict(full_module.named_parameters())
    for name, module in tp_module.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            slicer = module.shard_of if hasattr(module, "shard_of") else (lambda t: t)
            yield key, param, full[key], slicer


# -----------------------------------------------------------------------------
# the same with DTensor


def dtensor_parallelize_block(block: nn.Module, mesh) -> nn.Module:
    """A copy of ``block`` split with ``parallelize_module`` on a 1-D mesh.

    PrepareModuleInput turns each sub-layer's input into one replicated DTensor,
    so wq/wk/wv (and w1/w3) share one backward all-reduce as in the hand-made
    version; without it DTensor issues one per column-parallel linear.
    """
    tp = mesh.size()
    for name in ("n_heads", "n_kv_heads"):
        if getattr(block.attention, name) % tp:
            raise ValueError(f"tensor-parallel degree tp={tp} does not divide {name}={getattr(block.attention, name)}")
    block = copy.deepcopy(block)
    replicate_x = dict(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)
    replicate_x_rope = dict(input_layouts=(Replicate(), None, None, None),  # (x, cos, sin, cache)
                            desired_input_layouts=(Replicate(), None, None, None), use_local_output=False)
    plan = {
        "attention": PrepareModuleInput(**replicate_x_rope),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward": PrepareModuleInput(**replicate_x),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    parallelize_module(block, mesh, plan)
    # the local projections hold this rank's heads only; the module reshapes by these counts
    block.attention.n_heads //= tp
    block.attention.n_kv_heads //= tp
    return block


# -----------------------------------------------------------------------------
# demo: one block, by hand, counted (NCCL under torchrun on GPUs, gloo otherwise)


def block_demo(rank: int, world_size: int, dim: int = 256, n_heads: int = 8, seq_len: int = 128,
               batch: int = 4) -> dict:
    """Worker: a tensor-parallel block equals the one-process block; count its collectives."""
    from llmsys.core.comm import CommCounter
    from llmsys.core.model import Transformer, rope_tables

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)  # the same full weights and input on every rank
    cfg = ModelConfig(vocab_size=128, dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_heads // 2, max_seq_len=seq_len)
    block = Transformer(cfg).layers[0].to(dev)
    tp_block = tensor_parallel_block(block, cfg)
    x = torch.randn(batch, seq_len, dim, device=dev)
    cos, sin = rope_tables(cfg.head_dim, torch.arange(seq_len, device=dev), cfg.rope_theta)
    want = block(x, cos, sin)
    with CommCounter() as forward:
        got = tp_block(x.requires_grad_(), cos, sin)
    with CommCounter() as backward:
        got.sum().backward()
    return {"max_error": (got - want).abs().max().item(), "forward": dict(forward.calls),
            "backward": dict(backward.calls), "all_reduce_bytes": forward.bytes["all_reduce"], "device": str(dev)}


if __name__ == "__main__":
    from llmsys.core.dist import torchrun_main

    print(torchrun_main(block_demo, accelerator=torch.cuda.is_available()))  # one dict per rank under torchrun, a list of them otherwise
