"""Units: the parameters sharded together, in one flat buffer padded to a multiple of the world size.

A unit is a sub-module you name (a transformer block, an MLP) or the root's
leftovers (for a transformer: embeddings, final norm, output head); FSDP's
``fully_shard`` groups parameters the same way. Padding never changes
training: its parameters and gradients stay 0.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core.comm import all_gather_single, reduce_scatter_single  # noqa: F401  (named across torch releases)
from llmsys.zero.estimates import padded_numel


def size_and_rank(group, who: str) -> tuple[int, int]:
    """(world size, rank) in ``group``; a clear error outside a process group."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs a process group: run it inside llmsys.core.dist.launch or torchrun")
    return dist.get_world_size(group), dist.get_rank(group)


class Unit:
    """The parameters of one module (a named sub-module, or the root's leftovers) laid out in one flat buffer.

    ``slots`` lists, for every distinct parameter, its offset and shape in the
    flat buffer and every (module, attribute) that uses it (tied embeddings use
    one parameter twice). Before each forward the modules' parameters are
    pointed at views of the current full buffer, as FSDP does; between forwards
    they hold ``resting[i]`` for slot i: this rank's sharded parameter under
    ``FullyShardedDataParallel`` (so names survive), nothing otherwise.
    """

    def __init__(self, name: str, module: nn.Module, named_params, world_size: int, rank: int):
        self.name, self.module = name, module
        self.slots = []  # (offset, shape, [(module, attr), ...], [parameter names])
        by_param = {}
        offset = 0
        for full_name, owner, attr, param in named_params:
            if id(param) in by_param:  # the same tensor again: one more user
                by_param[id(param)][2].append((owner, attr))
                by_param[id(param)][3].append(full_name)
                continue
            slot = (offset, param.shape, [(owner, attr)], [full_name])
            by_param[id(param)] = slot
            self.slots.append(slot)
            offset += param.numel()
        self.numel = offset
        self.padded = padded_numel(offset, world_size)
        self.shard_numel = self.padded // world_size
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel  # this rank's slice
        self.flat = None  # full buffer (stages 0-2), a leaf that collects the full gradient
        self.shard = None  # this rank's slice, what the optimizer updates
        self.resting = [None] * len(self.slots)  # what each slot's modules hold between forwards

    def flatten(self, params) -> torch.Tensor:
        """Concatenate the unit's parameters (in slot order) and pad with zeros."""
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        return F.pad(flat, (0, self.padded - self.numel))

    def attach(self, full: torch.Tensor) -> None:
        """Make every module parameter a view of ``full`` (autograd flows back into it).

        The view goes into the module's parameter table, where FSDP2 also swaps
        its gathered parameters in: ``module.weight`` and ``named_parameters()``
        see it, and the name stays the same."""
        for offset, shape, users, _ in self.slots:
            view = full[offset : offset + math.prod(shape)].view(shape)
            for owner, attr in users:
                owner._parameters[attr] = view

    def release(self) -> None:
        """Drop the modules' references to the full buffer, so it can be freed."""
        for (_, _, users, _), resting in zip(self.slots, self.resting):
            for owner, attr in users:
                owner._parameters[attr] = resting

    def local_range(self, slot: int) -> tuple[int, int]:
        """The part of slot ``slot`` that lies in this rank's slice, as (start, end) in the slice (may be empty)."""
        offset, shape = self.slots[slot][:2]
        start, end = max(offset, self.lo), min(offset + math.prod(shape), self.hi)
        return start - self.lo, max(start, end) - self.lo

    def unflatten(self, full: torch.Tensor) -> dict:
        """{parameter name: tensor} from a full flat buffer (every name of a tied parameter)."""
        out = {}
        for offset, shape, _, names in self.slots:
            value = full[offset : offset + math.prod(shape)].view(shape)
            out.update({name: value for name in names})
        return out


def split_into_units(module: nn.Module, unit_names, world_size: int, rank: int) -> list[Unit]:
    """One unit per sub-module named in ``unit_names`` (names as in ``module.named_modules()``),
    then a root unit with every parameter outside them (left out when there is none)."""
    modules = dict(module.named_modules(remove_duplicate=False))
    unit_names = list(unit_names)
    for name in unit_names:
        if name not in modules or name == "":
            raise ValueError(f"{name!r} is not a sub-module; name units as module.named_modules() does, "
                             f"e.g. {[n for n in modules if n][:4]}")
    if len(set(unit_names)) != len(unit_names):
        raise ValueError(f"a unit is named twice in {unit_names}")
    for name in unit_names:
        inside = [other for other in unit_names if other.startswith(name + ".")]
        if inside:
            raise ValueError(f"unit {name!r} contains unit {inside[0]!r}: units must not nest")
    owners = {}  # parameter name -> (module, attribute)
    for module_name, sub in modules.items():
        for attr, _ in sub.named_parameters(recurse=False):
            owners[f"{module_name}.{attr}" if module_name else attr] = (sub, attr)
    named = [(name, *owners[name], p) for name, p in module.named_parameters(remove_duplicate=False)]
    frozen = [name for name, _, _, p in named if not p.requires_grad]
    if frozen:
        raise ValueError(f"parameter {frozen[0]} is frozen (requires_grad=False); flat shards train every "
                         "element: make it a buffer, or leave it out of the sharded module")
    if len({(p.dtype, p.device) for *_, p in named}) > 1:
        raise ValueError("the module's parameters differ in dtype or device; one flat buffer needs one of each")
    units, owner_unit = [], {}  # id(parameter) -> the unit that holds it
    for unit_name in unit_names:
        mine = [entry for entry in named if entry[0].startswith(unit_name + ".")]
        units.append(Unit(unit_name, modules[unit_name], mine, world_size, rank))
        for entry in mine:
            _claim(owner_unit, entry, unit_name)
    rest = [entry for entry in named if not any(entry[0].startswith(n + ".") for n in unit_names)]
    for entry in rest:
        _claim(owner_unit, entry, "root")
    if rest:
        units.append(Unit("root", module, rest, world_size, rank))
    return units


def _claim(owner_unit: dict, entry, unit_name: str) -> None:
    """A parameter belongs to one unit: one used in two (tied across units) has no single shard."""
    name, _, _, param = entry
    held_by = owner_unit.setdefault(id(param), unit_name)
    if held_by != unit_name:
        raise ValueError(f"parameter {name} is shared by units {held_by!r} and {unit_name!r}; "
                         "put the modules that share it in one unit")


def current_params(unit: Unit) -> list[torch.Tensor]:
    """The tensors the unit's modules hold now, one per slot (before the flat buffer takes over)."""
    return [getattr(users[0][0], users[0][1]) for _, _, users, _ in unit.slots]


def take_over(unit: Unit) -> torch.Tensor:
    """Copy the unit's parameters into a fresh flat buffer and remove them from their modules:
    the buffer is now the only copy. Returns it (full and padded)."""
    flat = unit.flatten(current_params(unit))
    unit.release()
    return flat
