"""Collectives primer: the five collectives of parallel training and their ring cost.

Every parallel dimension of this chapter is built from five collectives:

- all-reduce: every rank ends with the sum of every rank's tensor (DP gradients, TP's g)
- broadcast: every rank ends with rank 0's tensor (initial weights)
- all-gather: every rank ends with the concatenation of every rank's shard (FSDP, SP, CP)
- reduce-scatter: every rank ends with its shard of the sum (ZeRO-2 gradients, SP)
- all-to-all: rank i sends its j-th block to rank j (expert parallelism)

On a ring of N ranks each rank sends (N-1)/N of the full tensor for all-gather,
reduce-scatter and all-to-all, and 2(N-1)/N for all-reduce, which is a
reduce-scatter followed by an all-gather. ``ring_all_reduce`` does exactly that
with point-to-point sends, so ``llmsys.core.comm.CommCounter`` can count the bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmsys.core.accounting import collective_bytes
from llmsys.core.comm import CommCounter, all_gather_single, reduce_scatter_single

PRIMER_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def rank_tensor(rank: int, numel: int) -> torch.Tensor:
    """What rank ``rank`` contributes in the primer: numel values that say whose they are."""
    return torch.arange(numel, dtype=torch.float32) + 1000.0 * rank


def run_collective(op: str, numel: int, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``op`` over a "full" tensor of ``numel`` float32 values; return (what this rank gave, what it got).

    Full size means: the all-reduced / broadcast tensor, the all-gather's output,
    the reduce-scatter's input and the all-to-all's input all hold ``numel`` values,
    so one ring formula per op prices them.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if numel % n:
        raise ValueError(f"numel={numel} must be divisible by the world size {n}: shards are numel / N")
    full = rank_tensor(rank, numel)
    shard = full[rank * numel // n:(rank + 1) * numel // n].clone()
    if op == "all_reduce":
        out = full.clone()
        dist.all_reduce(out, group=group)
        return full, out
    if op == "broadcast":
        out = full.clone()
        dist.broadcast(out, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        return full, out
    if op == "all_gather":
        out = torch.empty(numel)
        all_gather_single(out, shard, group=group)
        return shard, out
    if op == "reduce_scatter":
        out = torch.empty(numel // n)
        reduce_scatter_single(out, full, group=group)
        return full, out
    if op == "all_to_all":
        out = torch.empty(numel)
        dist.all_to_all_single(out, full, group=group)
        return full, out
    raise ValueError(f"unknown collective {op!r}; use one of {PRIMER_OPS}")


def expected_result(op: str, rank: int, world_size: int, numel: int) -> torch.Tensor:
    """What ``run_collective(op, numel)`` must return on ``rank``, computed without any communication."""
    n, part = world_size, numel // world_size
    everyone = [rank_tensor(r, numel) for r in range(n)]
    if op == "all_reduce":
        return sum(everyone)
    if op == "broadcast":
        return everyone[0]
    if op == "all_gather":
        return torch.cat([t[r * part:(r + 1) * part] for r, t in enumerate(everyone)])
    if op == "reduce_scatter":
        return sum(everyone)[rank * part:(rank + 1) * part]
    if op == "all_to_all":  # block `rank` of every sender, in sender order
        return torch.cat([t[rank * part:(rank + 1) * part] for t in everyone])
    raise ValueError(f"unknown collective {op!r}; use one of {PRIMER_OPS}")


def ring_model(numel: int, world_size: int, bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes each rank sends per collective on a ring, for a full tensor of ``numel`` elements."""
    size = numel * bytes_per_element
    return {op: collective_bytes(op, size, world_size) for op in PRIMER_OPS}


def primer(rank: int, world_size: int, numel: int = 1024) -> dict[str, dict]:
    """Worker: run every collective, check its result, and count its bytes.

    Returns ``{op: {"ok", "calls", "payload", "ring_bytes"}}`` for this rank.
    """
    report = {}
    for op in PRIMER_OPS:
        with CommCounter() as comm:
            _, got = run_collective(op, numel)
        report[op] = {
            "ok": torch.equal(got, expected_result(op, rank, world_size, numel)),
            "calls": comm.calls[op],
            "payload": comm.bytes[op],
            "ring_bytes": comm.ring_bytes[op],
        }
    return report


def ring_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over all ranks in place, as a ring: N-1 reduce-scatter steps, then N-1 all-gather steps.

    The tensor is cut into N chunks. In step s of the reduce-scatter, rank r sends
    chunk (r - s) to rank r+1 and adds the chunk (r - s - 1) it receives from
    rank r-1; after N-1 steps rank r owns the full sum of chunk (r + 1). The
    all-gather then passes the finished chunks once more around the ring. Each
    step moves one chunk (size/N) per rank: 2(N-1)/N of the tensor in all.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if x.numel() % n:
        raise ValueError(f"ring_all_reduce cuts the tensor into {n} equal chunks: numel={x.numel()} must be divisible by {n}")
    if n == 1:
        return x
    send_to = dist.get_global_rank(group, (rank + 1) % n) if group else (rank + 1) % n
    recv_from = dist.get_global_rank(group, (rank - 1) % n) if group else (rank - 1) % n
    chunks = x.view(-1).chunk(n)
    incoming = torch.empty_like(chunks[0])

    def pass_along(send_index: int) -> None:
        request = dist.isend(chunks[send_index].contiguous(), send_to, group=group)
        dist.recv(incoming, recv_from, group=group)
        request.wait()

    for step in range(n - 1):  # reduce-scatter: partial sums travel and grow
        pass_along((rank - step) % n)
        chunks[(rank - step - 1) % n].add_(incoming)
    for step in range(n - 1):  # all-gather: finished sums travel and are copied
        pass_along((rank + 1 - step) % n)
        chunks[(rank - step) % n].copy_(incoming)
    return x


def ring_all_reduce_demo(rank: int, world_size: int, numel: int = 1024) -> dict:
    """Worker: the hand-made ring equals dist.all_reduce, and sends 2(N-1)/N of the tensor."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    want = x.clone()
    dist.all_reduce(want)
    with CommCounter() as comm:
        ring_all_reduce(x)
    return {
        "max_error": (x - want).abs().max().item(),
        "sent_bytes": comm.bytes["send"],
        "model_bytes": collective_bytes("all_reduce", numel * 4, world_size),
        "sends": comm.calls["send"],
    }
