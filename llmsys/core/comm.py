"""What ranks send: the one-tensor collectives under the name this torch has, and a counter.

- ``all_gather_single`` / ``reduce_scatter_single`` call whichever name this torch gives
  the one-tensor collectives (torch 2.13's ``*_single``, older ``*_tensor`` or ``_*_base``).
- ``CommCounter`` counts, per rank, how many bytes each collective is given and how many a
  ring algorithm would send (``llmsys.core.accounting.collective_bytes``, the cost model).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from llmsys.core.accounting import collective_bytes

# -----------------------------------------------------------------------------
# one-tensor collectives under the name this torch has

# Newest name first: torch 2.13 added the *_single names and deprecated the
# *_tensor ones (torch >= 1.13); the underscored ones are older still.
_RENAMED = {
    "all_gather_single": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
    "reduce_scatter_single": ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
}


def _renamed(name: str):
    for found in _RENAMED[name]:
        if hasattr(dist, found):
            return getattr(dist, found)
    raise RuntimeError(f"this torch ({torch.__version__}) has none of torch.distributed.{_RENAMED[name]}; "
                       "install torch >= 2.6")


def collective_names() -> dict[str, str]:
    """Which torch.distributed function each helper below calls with this torch."""
    return {name: _renamed(name).__name__ for name in _RENAMED}


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``input`` into ``output`` (world_size x input, concatenated along dim 0)."""
    return _renamed("all_gather_single")(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce ``input`` (world_size x output) over ranks; this rank keeps its slice in ``output``."""
    return _renamed("reduce_scatter_single")(output, input, op=op, group=group, async_op=async_op)


# -----------------------------------------------------------------------------
# the collective counter


def _nbytes(value) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(value):
    """The ProcessGroup behind a c10d op's group argument (boxed object or name)."""
    if isinstance(value, str):
        return dist.distributed_c10d._resolve_process_group(value)
    if isinstance(value, torch.ScriptObject):
        return dist.ProcessGroup.unbox(value)
    return value


# Every collective reaches the dispatcher as one of these ops: torch.distributed's
# eager functions as c10d ops, FSDP2 / DTensor / functional collectives as
# _c10d_functional ops. Each entry: (collective, argument holding the payload,
# how the payload relates to the "full" size: "full" as is, "shard" × group size).
_OPS = {
    "c10d::allreduce_": ("all_reduce", "tensors", "full"),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors", "full"),
    "c10d::broadcast_": ("broadcast", "tensors", "full"),
    "c10d::reduce_": ("reduce", "tensors", "full"),
    "c10d::allgather_": ("all_gather", "output_tensors", "full"),
    "c10d::allgather_coalesced_": ("all_gather", "output_lists", "full"),
    "c10d::_allgather_base_": ("all_gather", "output_tensor", "full"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "outputs", "full"),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors", "full"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor", "full"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", "full"),
    "c10d::alltoall_": ("all_to_all", "input_tensors", "full"),
    "c10d::alltoall_base_": ("all_to_all", "input", "full"),
    "c10d::send": ("send", "tensors", "full"),
    "c10d::recv_": ("recv", "tensors", "full"),
    "c10d::recv_any_source_": ("recv", "tensors", "full"),
    "_c10d_functional::all_reduce": ("all_reduce", "input", "full"),
    "_c10d_functional::all_reduce_": ("all_reduce", "input", "full"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs", "full"),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs", "full"),
    "_c10d_functional::broadcast": ("broadcast", "input", "full"),
    "_c10d_functional::broadcast_": ("broadcast", "input", "full"),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input", "shard"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input", "shard"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs", "shard"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input", "full"),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input", "full"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", "full"),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input", "full"),
    "_c10d_functional::isend": ("send", "tensor", "full"),
    "_c10d_functional::irecv": ("recv", "tensor", "full"),
}


class CommCounter(TorchDispatchMode):
    """Count the collectives this rank runs, and their bytes, inside a ``with`` block.

    ::

        with CommCounter() as comm:
            dist.all_reduce(grad)
        comm.calls["all_reduce"], comm.bytes["all_reduce"], comm.ring_bytes["all_reduce"]

    Keys are collectives (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
    ``"all_to_all"``, ``"broadcast"``, ``"reduce"``, ``"send"``, ``"recv"``),
    whichever function issued them. Two numbers per call:

    - ``bytes``: the payload, the tensor size the call was given: the input
      of all_reduce / broadcast / send / recv / all_to_all, the *full* output of
      an all-gather, the *full* input of a reduce-scatter;
    - ``ring_bytes``: what a ring algorithm sends per rank (``llmsys.core.accounting.collective_bytes``);
      all_to_all counts exactly the input bytes that leave this rank, so
      uneven splits are exact.

    How: a TorchDispatchMode sees every op on this thread. Eager
    ``torch.distributed`` calls reach the dispatcher as ``torch.ops.c10d.*``
    and FSDP2 / DTensor / functional collectives as ``torch.ops._c10d_functional.*``,
    so one mechanism counts both, whatever name the caller imported. gather,
    scatter and barrier are not counted.

    Why bytes and not time: gloo's own algorithms differ from the ring (it
    implements reduce-scatter via all-reduce), so wall-clock timing of gloo
    collectives does not reflect a collective's algorithmic volume.
    """

    def __init__(self):
        super().__init__()
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.ring_bytes = defaultdict(float)
        self.records = []  # (collective, payload bytes, ring bytes, group size), in call order

    def total_ring_bytes(self) -> float:
        return sum(self.ring_bytes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        name = func._schema.name
        if name != "_c10d_functional::batch_p2p_ops" and name not in _OPS:
            return
        group = _group(named.get("process_group", named.get("group_name")))
        n = group.size()
        if name == "_c10d_functional::batch_p2p_ops":
            for op, tensor in zip(named["op_list"], named["tensors"]):
                self._add("send" if op == "isend" else "recv", _nbytes(tensor), n)
            return
        kind, argument, relation = _OPS[name]
        payload = _nbytes(named[argument]) * (n if relation == "shard" else 1)
        if kind == "all_to_all":
            sent = float(payload - _bytes_kept_home(named, argument, group.rank(), n))
        else:
            sent = collective_bytes(kind, payload, n)
        self._add(kind, payload, n, sent)

    def _add(self, kind, payload, n, sent=None) -> None:
        sent = collective_bytes(kind, payload, n) if sent is None else sent
        self.calls[kind] += 1
        self.bytes[kind] += payload
        self.ring_bytes[kind] += sent
        self.records.append((kind, payload, sent, n))

    def __str__(self) -> str:
        lines = [f"{'collective':<15}{'calls':>7}{'payload B':>14}{'ring B':>14}"]
        for kind in self.calls:
            lines.append(f"{kind:<15}{self.calls[kind]:>7}{self.bytes[kind]:>14,}{self.ring_bytes[kind]:>14,.0f}")
        return "\n".join(lines)


def _bytes_kept_home(named, argument, rank, n) -> float:
    """The part of an all_to_all input that this rank sends to itself."""
    if argument == "input_tensors":  # one tensor per destination rank
        return _nbytes(named[argument][rank])
    tensor = named[argument]
    splits = list(named.get("input_split_sizes") or [])
    if not splits or tensor.shape[0] == 0:
        return _nbytes(tensor) / n  # even split along dim 0
    row_bytes = _nbytes(tensor) // tensor.shape[0]
    return splits[rank] * row_bytes
