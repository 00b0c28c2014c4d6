"""Fully sharded data parallelism (ZeRO-3) from scratch, for any module whose sub-modules you name.

::

    model = FullyShardedDataParallel(my_module, ["blocks.0", "blocks.1"])  # + a root unit for the rest
    optimizer = torch.optim.AdamW(model.parameters())  # this rank's flat shards
    loss_fn(model(x_local), y_local).backward()        # gradients arrive reduce-scattered
    optimizer.step()

Each unit's parameters live only as this rank's slice of its flat buffer
(``units.py``). A unit's forward pre-hook all-gathers the full buffer and points
the modules at views of it; its forward hook lets go of it. Autograd would keep
the full buffer alive for backward (matmuls save their weights), so while the
module runs forward a saved-tensor hook replaces every tensor that lives in a
gathered buffer by a recipe, and backward gathers the unit again when it first
needs it. The gather's backward reduce-scatters the gradient: each rank gets
the mean over ranks of its slice.

The optimizer sees flat slices, so it must treat elements independently (SGD,
Adam, AdamW: the ZeRO paper's setting); ``ShardedOptimizer`` keeps whole
tensors for optimizers that do not. A unit's parameters may only be used
inside its own forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from llmsys.zero.units import (Unit, all_gather_single, reduce_scatter_single, size_and_rank, split_into_units,
                               take_over)


class GatherParams(torch.autograd.Function):
    """Forward: all-gather every rank's shard into the unit's full flat parameters.
    Backward: reduce-scatter the full gradient; each rank gets the mean over ranks of its shard.

    The gradient of an all-gather is a reduce-scatter: every rank used all of
    ``full``, so the gradient of this rank's shard is the sum over ranks of
    their gradients for that slice (divided by N: each rank's loss is a mean
    over its part of the batch).
    """

    @staticmethod
    def forward(ctx, shard, fsdp, unit):
        ctx.fsdp, ctx.unit = fsdp, unit
        return fsdp.gather(unit)

    @staticmethod
    def backward(ctx, grad_full):
        fsdp, unit = ctx.fsdp, ctx.unit
        grad_shard = grad_full.new_empty(unit.shard_numel)
        reduce_scatter_single(grad_shard, grad_full.contiguous(), group=fsdp.group)
        fsdp.forget_regathered(unit)  # the unit's backward is over: free its parameters
        return grad_shard / fsdp.world_size, None, None


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters over the ranks of ``group``, one unit per name in ``unit_names``
    plus a root unit; ``parameters()`` are this rank's shards. Every rank passes the same module
    (same initial weights) and its own equal part of the batch."""

    def __init__(self, module: nn.Module, unit_names, group=None):
        super().__init__()
        self.world_size, self.rank = size_and_rank(group, "FullyShardedDataParallel")
        self.group = group
        self.units = split_into_units(module, unit_names, self.world_size, self.rank)
        self.module = module  # after the split: its parameters are taken over below
        self.shards = nn.ParameterList()
        self._gathered = {}  # storage pointer -> (unit, full) while the unit runs forward
        self._regathered = {}  # unit -> full, gathered again for its backward
        self._in_flight = {}  # unit -> bytes of gathered parameters alive now
        self.peak_in_flight_bytes = 0
        for unit in self.units:
            unit.shard = nn.Parameter(take_over(unit)[unit.lo : unit.hi].clone())
            self.shards.append(unit.shard)
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    # --- gathering and letting go

    def gather(self, unit: Unit) -> torch.Tensor:
        """The unit's full flat parameters for its forward or backward, counted as in flight."""
        full = gather_flat(unit, unit.shard, self.group)
        self._track(unit, full.numel() * full.element_size())
        return full

    def _before_forward(self, unit: Unit, module, args) -> None:
        full = GatherParams.apply(unit.shard, self, unit)
        self._gathered[full.untyped_storage().data_ptr()] = (unit, full)
        unit.attach(full)

    def _after_forward(self, unit: Unit, module, args, output) -> None:
        unit.release()
        for key in [k for k, (u, _) in self._gathered.items() if u is unit]:
            del self._gathered[key]
        self._track(unit, 0)

    # --- what autograd saves for backward

    def _pack(self, tensor: torch.Tensor):
        """A tensor saved for backward that lives in a gathered parameter buffer is saved as a
        recipe (unit, size, stride, offset), so the buffer itself can be freed after forward."""
        entry = self._gathered.get(tensor.untyped_storage().data_ptr())
        if entry is None:
            return tensor
        return (entry[0], tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        unit, size, stride, offset = packed
        if unit not in self._regathered:  # first use in backward: gather the parameters again
            self._regathered[unit] = self.gather(unit)
        return self._regathered[unit].as_strided(size, stride, offset)

    def forget_regathered(self, unit: Unit) -> None:
        self._regathered.pop(unit, None)
        self._track(unit, 0)

    def _track(self, unit: Unit, nbytes: int) -> None:
        self._in_flight[unit] = nbytes
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, sum(self._in_flight.values()))

    # --- full tensors, for checks and checkpoints (collectives: every rank calls them)

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{name: full parameter} as ``module.named_parameters()`` named them before sharding."""
        return unflatten_all(self.units, [gather_flat(unit, unit.shard, self.group) for unit in self.units])

    @torch.no_grad()
    def full_gradients(self) -> dict:
        """{name: averaged gradient} of the last backward."""
        return unflatten_all(self.units, [gather_flat(unit, unit.shard.grad, self.group) for unit in self.units])


def gather_flat(unit: Unit, shard: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather every rank's slice of ``unit`` into a new full flat buffer (outside autograd)."""
    full = shard.detach().new_empty(unit.padded)
    all_gather_single(full, shard.detach().contiguous(), group=group)
    return full


def unflatten_all(units, fulls) -> dict:
    """{parameter name: a copy of its values} from one full flat buffer per unit."""
    out = {}
    for unit, full in zip(units, fulls):
        out.update({k: v.detach().clone() for k, v in unit.unflatten(full).items()})
    return out
