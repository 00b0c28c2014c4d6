"""Fully sharded data parallelism (ZeRO-3) from scratch, for any module whose sub-modules you name.

::

    model = FullyShardedDataParallel(my_module, ["blocks.0", "blocks.1"])  # + a root unit for the rest
    optimizer = torch.optim.AdamW(model.parameters())  # this rank's shards, under their own names
    loss_fn(model(x_local), y_local).backward()        # gradients arrive reduce-scattered
    optimizer.step()

Each unit's parameters live only as this rank's slice of its flat buffer
(``units.py``). As in FSDP2 (``torch.distributed.fsdp.fully_shard``) every
parameter keeps its name: ``named_parameters()`` and ``state_dict()`` of the
module (and of the wrapper, without a prefix) give, per name, the 1-D part of
that parameter which lies in this rank's slice (a view of it: empty where the
rank holds none of it). ``full_parameters()`` gathers the whole tensors.

A unit's forward pre-hook all-gathers the full buffer and points the modules
at views of it; its forward hook lets go of it. Autograd would keep the full
buffer alive for backward (matmuls save their weights), so while the module
runs forward a saved-tensor hook replaces every tensor that lives in a
gathered buffer by a recipe, and backward gathers the unit again when it first
needs it. The gather's backward reduce-scatters the gradient: each rank gets
the mean over ranks of its slice.

Mixed precision takes FSDP2's ``MixedPrecisionPolicy``: the fp32 shards are the
master weights the optimizer updates; each is cast to ``param_dtype`` before the
all-gather (half the bytes sent for bf16), so forward and backward compute in
it; gradients are cast to ``reduce_dtype`` (default: ``param_dtype``) for the
reduce-scatter and back to fp32 for the optimizer. ``cast_forward_inputs``
casts floating-point inputs of every unit to ``param_dtype``; ``output_dtype``
casts the model's output.

The optimizer sees flat slices, so it must treat elements independently (SGD,
Adam, AdamW: the ZeRO paper's setting); ``ShardedOptimizer`` keeps whole
tensors for optimizers that do not. A unit's parameters may only be used
inside its own forward.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from llmsys.zero.units import (Unit, all_gather_single, reduce_scatter_single, size_and_rank, split_into_units,
                               take_over)


class GatherParams(torch.autograd.Function):
    """Forward: all-gather every rank's shard (cast to the compute dtype) into the unit's full flat parameters.
    Backward: reduce-scatter the full gradient in the reduce dtype; each rank's sharded parameters get
    the mean over ranks of their part of it, in their own dtype.

    The gradient of an all-gather is a reduce-scatter: every rank used all of
    ``full``, so the gradient of this rank's shard is the sum over ranks of
    their gradients for that slice (divided by N: each rank's loss is a mean
    over its part of the batch). The sharded parameters are inputs only so that
    autograd calls this backward; it writes their ``.grad`` itself, as views of
    one flat gradient shard (as FSDP2 does), and returns None for them.
    """

    @staticmethod
    def forward(ctx, fsdp, unit, *sharded_params):
        ctx.fsdp, ctx.unit = fsdp, unit
        return fsdp.gather(unit)

    @staticmethod
    def backward(ctx, grad_full):
        fsdp, unit = ctx.fsdp, ctx.unit
        grad_full = grad_full.to(fsdp.reduce_dtype or grad_full.dtype).contiguous()
        grad_shard = grad_full.new_empty(unit.shard_numel)
        reduce_scatter_single(grad_shard, grad_full, group=fsdp.group)
        fsdp.forget_regathered(unit)  # the unit's backward is over: free its parameters
        grad_shard = (grad_shard / fsdp.world_size).to(unit.shard.dtype)
        for i, param in enumerate(unit.resting):
            start, end = unit.local_range(i)
            grad = grad_shard[start:end]
            param.grad = grad if param.grad is None else param.grad + grad
        return (None, None, *(None for _ in unit.resting))


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters over the ranks of ``group``, one unit per name in ``unit_names``
    plus a root unit; ``parameters()`` are this rank's shards, named as before. Every rank passes the
    same module (same initial weights) and its own equal part of the batch; ``mp_policy`` is FSDP2's."""

    def __init__(self, module: nn.Module, unit_names, group=None, mp_policy: MixedPrecisionPolicy | None = None):
        super().__init__()
        self.world_size, self.rank = size_and_rank(group, "FullyShardedDataParallel")
        self.group = group
        policy = mp_policy or MixedPrecisionPolicy()
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, e.g. "
                            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
        self.mp_policy = policy
        self.units = split_into_units(module, unit_names, self.world_size, self.rank)
        self.param_dtype = policy.param_dtype  # None: compute in the master dtype
        self.reduce_dtype = policy.reduce_dtype or policy.param_dtype  # FSDP2's default: reduce as computed
        self.module = module  # after the split: its parameters are taken over below
        self._gathered = {}  # storage pointer -> (unit, full) while the unit runs forward
        self._regathered = {}  # unit -> full, gathered again for its backward
        self._in_flight = {}  # unit -> bytes of gathered parameters alive now
        self.peak_in_flight_bytes = 0
        for unit in self.units:
            unit.shard = take_over(unit)[unit.lo : unit.hi].clone()  # the fp32 master shard
            unit.resting = [nn.Parameter(unit.shard[slice(*unit.local_range(i))]) for i in range(len(unit.slots))]
            unit.release()  # the modules now hold their sharded parameters, under their names
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        return cast_floats(out, self.mp_policy.output_dtype)

    # --- the same names as the module (FSDP2 shards in place, so there is no wrapper prefix)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The module's state dict: per name, this rank's part of the parameter (a 1-D view)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Copy this rank's parts back in place (``assign=True`` would detach them from the flat shards)."""
        if assign:
            raise ValueError("assign=True would replace the sharded views; load with assign=False")
        return self.module.load_state_dict(state_dict, strict=strict)

    # --- gathering and letting go

    def gather(self, unit: Unit) -> torch.Tensor:
        """The unit's full flat parameters in the compute dtype, for its forward or backward, counted as in
        flight. The shard is cast before the all-gather, as FSDP2 does: fewer bytes on the wire."""
        full = gather_flat(unit, unit.shard.to(self.param_dtype or unit.shard.dtype), self.group)
        self._track(unit, full.numel() * full.element_size())
        return full

    def _before_forward(self, unit: Unit, module, args, kwargs):
        full = GatherParams.apply(self, unit, *unit.resting)
        self._gathered[full.untyped_storage().data_ptr()] = (unit, full)
        unit.attach(full)
        if self.mp_policy.cast_forward_inputs and self.param_dtype is not None:
            return cast_floats(args, self.param_dtype), cast_floats(kwargs, self.param_dtype)
        return None

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
        """{name: averaged gradient} of the last backward (zeros for a parameter without one)."""
        fulls = []
        for unit in self.units:
            grad_shard = torch.zeros_like(unit.shard)
            for i, param in enumerate(unit.resting):
                if param.grad is not None:
                    grad_shard[slice(*unit.local_range(i))] = param.grad
            fulls.append(gather_flat(unit, grad_shard, self.group))
        return unflatten_all(self.units, fulls)


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


def cast_floats(value, dtype: torch.dtype | None):
    """``value`` with every floating-point tensor in it (nested in tuples, lists, dicts) cast to ``dtype``."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        items = [cast_floats(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple, or not
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps a dict subclass (transformers' ModelOutput) and its attributes
        for k, v in value.items():
            out[k] = cast_floats(v, dtype)
        return out
    return value
