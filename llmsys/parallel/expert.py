"""Expert parallelism: a top-k router with capacity, and all-to-all dispatch and combine.

A mixture-of-experts (MoE) layer replaces one MLP by E expert MLPs and a router
that sends each token to its top-k experts, weighting their outputs by the
router's probabilities. Under expert parallelism each of EP ranks holds E/EP
experts, and every rank's tokens travel to the ranks of their experts and back:

1. route: top-k experts per token; an expert takes at most ``capacity`` tokens
   (capacity_factor · tokens · k / E), the rest of its queue is dropped
2. sort this rank's (token, expert) assignments by expert, hence by rank
3. exchange how many tokens each rank will receive (a small all-to-all)
4. dispatch: all_to_all_single with uneven split sizes
5. every rank runs its experts on what it received
6. combine: the reverse all-to-all, then a gate-weighted sum per token

Tokens received over all ranks = tokens × top_k - drops. The Switch
Transformer's auxiliary loss E·Σ_e f_e·P_e (f: share of assignments, P: mean
router probability) is smallest when the load is even, and pushes the router
toward it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Routing:
    experts: torch.Tensor  # (N, k) chosen expert per token and slot
    weights: torch.Tensor  # (N, k) gate weights, the chosen probabilities renormalised over the k slots
    keep: torch.Tensor  # (N, k) False where the expert was already full
    probs: torch.Tensor  # (N, E) router probabilities
    capacity: int

    @property
    def n_experts(self) -> int:
        return self.probs.size(1)

    @property
    def drops(self) -> int:
        return int((~self.keep).sum())

    def demand(self) -> torch.Tensor:
        """Assignments per expert before capacity: (E,)."""
        return torch.bincount(self.experts.flatten(), minlength=self.n_experts)

    def load(self) -> torch.Tensor:
        """Assignments per expert that were kept: (E,)."""
        return torch.bincount(self.experts[self.keep], minlength=self.n_experts)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None = None) -> Routing:
    """Top-k routing with a per-expert capacity.

    Queue order (GShard/Switch): every token's first choice comes before any
    second choice, then token order; assignments past an expert's capacity are
    dropped. ``capacity_factor=None`` means no capacity limit.
    """
    n_tokens, n_experts = logits.shape
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in 1..n_experts={n_experts}, got {top_k}")
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)  # (N, k)
    weights = weights / weights.sum(-1, keepdim=True)
    if capacity_factor is None:
        capacity = n_tokens * top_k
    elif capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for no limit), got {capacity_factor}")
    else:
        capacity = math.ceil(capacity_factor * n_tokens * top_k / n_experts)
    one_hot = F.one_hot(experts.t().reshape(-1), n_experts)  # (k·N, E), slot-major
    position = (one_hot.cumsum(0) - 1)[torch.arange(one_hot.size(0)), experts.t().reshape(-1)]  # place in its queue
    keep = (position < capacity).view(top_k, n_tokens).t()  # (N, k)
    return Routing(experts, weights.to(logits.dtype), keep, probs, capacity)


def load_imbalance(counts: torch.Tensor) -> float:
    """Busiest expert's load over the mean load (1.0 = perfectly even)."""
    counts = counts.float()
    return float(counts.max() / counts.mean()) if counts.sum() > 0 else 1.0


def aux_balance_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's load-balancing loss E · Σ_e f_e · P_e (1.0 when perfectly even)."""
    f = routing.demand().float() / routing.experts.numel()  # share of assignments (no gradient)
    P = routing.probs.mean(0)  # mean router probability (carries the gradient)
    return routing.n_experts * (f * P).sum()


class Expert(nn.Module):
    """One SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A mixture of experts in one process: the reference for expert parallelism."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25):
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(n_experts))

    def forward(self, x) -> tuple[torch.Tensor, Routing]:  # x (N, dim) tokens
        routing = route(self.router(x), self.top_k, self.capacity_factor)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero((routing.experts == e) & routing.keep, as_tuple=True)
            if token.numel():
                y = y.index_add(0, token, routing.weights[token, slot, None] * expert(x[token]))
        return y, routing


class _AllToAll(torch.autograd.Function):
    """Forward: all_to_all_single with the given split sizes. Backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits),) + x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits),) + grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x, output_splits, input_splits, group=None):
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


class ExpertParallelMoE(nn.Module):
    """The same MoE with E/EP experts per rank; the router is replicated.

    ``forward`` returns (output, routing, tokens received by this rank).
    """

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        rank, ep = dist.get_rank(group), dist.get_world_size(group)
        n_experts = len(moe.experts)
        if n_experts % ep:
            raise ValueError(f"expert-parallel degree {ep} must divide the number of experts {n_experts}")
        self.group, self.ep, self.n_experts, self.local = group, ep, n_experts, n_experts // ep
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[rank * self.local + i]) for i in range(self.local))

    def forward(self, x):
        routing = route(self.router(x), self.top_k, self.capacity_factor)
        # 1. this rank's kept (token, slot) assignments, sorted by expert: contiguous per destination rank
        token, slot = torch.nonzero(routing.keep, as_tuple=True)
        expert = routing.experts[token, slot]
        order = torch.argsort(expert, stable=True)
        token, slot, expert = token[order], slot[order], expert[order]
        # 2. how many go to each expert; the receivers learn it first (a small all-to-all of counts)
        per_expert = torch.bincount(expert, minlength=self.n_experts)  # (E,)
        incoming = torch.empty_like(per_expert)
        dist.all_to_all_single(incoming, per_expert, group=self.group)  # (EP·local,): from rank s, for my expert j
        send_splits = per_expert.view(self.ep, self.local).sum(1).tolist()
        incoming = incoming.view(self.ep, self.local)
        recv_splits = incoming.sum(1).tolist()
        # 3. dispatch, compute, combine
        received = all_to_all(x[token], recv_splits, send_splits, self.group)  # (Σ recv, dim)
        outputs = []
        for chunk, counts in zip(received.split(recv_splits), incoming.tolist()):  # one chunk per source rank
            for j, part in enumerate(chunk.split(counts)):  # sorted by expert within it
                outputs.append(self.experts[j](part))
        processed = torch.cat(outputs) if outputs else received
        returned = all_to_all(processed, send_splits, recv_splits, self.group)  # back in our sorted order
        y = torch.zeros_like(x).index_add(0, token, routing.weights[token, slot, None] * returned)
        return y, routing, received.size(0)


def expert_parallel_demo(rank: int, world_size: int, moe: MoE, tokens_per_rank: int = 32) -> dict:
    """Worker: EP output equals the one-process MoE on this rank's tokens, and expert gradients equal
    the one-process gradients of the loss summed over every rank's tokens; counts tokens and bytes."""
    from llmsys.core.comm import CommCounter

    dim = moe.router.in_features
    xs = [torch.randn(tokens_per_rank, dim, generator=torch.Generator().manual_seed(100 + r)) for r in range(world_size)]
    reference = copy.deepcopy(moe)  # the whole layer, fed every rank's tokens
    outputs = [reference(x)[0] for x in xs]
    sum(y.square().sum() for y in outputs).backward()
    ep = ExpertParallelMoE(moe)
    with CommCounter() as comm:
        got, routing, received = ep(xs[rank])
        got.square().sum().backward()
    grad_errors = [(p.grad - reference.experts[rank * ep.local + i].get_parameter(n).grad).abs().max().item()
                   for i, e in enumerate(ep.experts) for n, p in e.named_parameters()]
    return {
        "max_error": (got - outputs[rank]).abs().max().item(),
        "max_grad_error": max(grad_errors),
        "router_grad": ep.router.weight.grad,  # this rank's tokens only; summed over ranks = the reference
        "reference_router_grad": reference.router.weight.grad,
        "received": received,
        "assigned": routing.experts.numel(),
        "drops": routing.drops,
        "all_to_all_calls": comm.calls["all_to_all"],
        "all_to_all_bytes": comm.ring_bytes["all_to_all"],
        "demand": routing.demand(),
    }


def balance_demo(aux_weight: float, steps: int = 60, n_tokens: int = 256, dim: int = 16, n_experts: int = 8,
                 top_k: int = 2, seed: int = 0) -> list[float]:
    """Train a MoE to imitate a fixed random MLP, from a router skewed toward one expert; return
    the load imbalance (max/mean demand) after every step. aux_weight scales the balance loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: waking a second thread costs more than it saves
    try:
        return _train_router(aux_weight, steps, n_tokens, dim, n_experts, top_k, seed)
    finally:
        torch.set_num_threads(threads)


def _train_router(aux_weight, steps, n_tokens, dim, n_experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    moe = MoE(dim, 2 * dim, n_experts, top_k, capacity_factor=None)
    with torch.no_grad():
        moe.router.weight.mul_(0.1)
        moe.router.weight[0] += 1.0  # expert 0 sees every token with a positive feature sum first
    x = torch.randn(n_tokens, dim, generator=gen) + 0.5
    teacher = Expert(dim, 4 * dim)
    with torch.no_grad():
        target = teacher(x)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2)
    history = []
    for _ in range(steps):
        y, routing = moe(x)
        loss = F.mse_loss(y, target) + aux_weight * aux_balance_loss(routing)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(load_imbalance(routing.demand()))
    return history
