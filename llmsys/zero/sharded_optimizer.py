"""ZeRO-1 for any ``torch.optim`` class: each rank keeps the optimizer state of its own parameters only.

::

    optimizer = ShardedOptimizer(my_module.parameters(), torch.optim.AdamW, lr=1e-3)
    loss_fn(my_module(x_local), y_local).backward()  # plain module: no DDP, the optimizer averages
    optimizer.step()
    optimizer.zero_grad()

Parameters are dealt out whole (largest first, each to the rank holding the
fewest elements so far), as PyTorch's ``ZeroRedundancyOptimizer`` does, so an
optimizer that looks at a whole tensor (Adafactor's row and column statistics,
Muon's orthogonalisation) runs exactly as in one process; slicing flat buffers
(``ZeroEngine``) would only be exact for elementwise ones. A step:

1. reduce-scatter: the gradients, laid out rank by rank in one flat buffer
   (each rank's part padded to the largest), summed; each rank receives its part
   and divides by the world size: the mean gradient of its own parameters;
2. the wrapped optimizer steps those parameters (its state exists only here);
3. all-gather: the updated parameters, in the same layout, to every rank.

A parameter without a gradient (frozen, or unused in this step's forward) is
skipped as ``torch.optim`` skips it: no update, no weight decay, no moment or
step count change. Whether it has one is decided over all ranks (a parameter
used by one rank's part of the batch has a gradient in the full-batch loss), so
each rank's part of the reduce-scatter also carries one "has a gradient" count
per parameter it owns: the owner skips a parameter whose count sums to 0.

That is ZeRO-1's communication, 2(N-1)/N·Ψ per rank on a ring (plus one
element per parameter): the same as DDP's all-reduce, for optimizer state
divided by N.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from llmsys.zero.units import all_gather_single, reduce_scatter_single, size_and_rank


class ShardedOptimizer:
    """``optimizer_class(own parameters, **defaults)`` on each rank, plus the two collectives."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], group=None, **defaults):
        self.world_size, self.rank = size_and_rank(group, "ShardedOptimizer")
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.group = group
        self.param_groups = [{**g, "params": list(g["params"])} for g in groups]
        every = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in every}) != len(every):
            raise ValueError("a parameter appears twice in the parameter groups; pass each once")
        if len({(p.dtype, p.device) for p in every}) > 1:
            raise ValueError("ShardedOptimizer flattens all parameters into one buffer: give it parameters "
                             "of one dtype on one device (one ShardedOptimizer per dtype otherwise)")
        self.owned = partition(every, self.world_size)  # rank -> its parameters, in a fixed order
        # every rank's padded part: its parameters, then one gradient flag per parameter
        self.part_numel = max(sum(p.numel() for p in ps) + len(ps) for ps in self.owned)
        mine = {id(p) for p in self.owned[self.rank]}
        own_groups = [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in self.param_groups]
        own_groups = [g for g in own_groups if g["params"]]
        # a rank that owns nothing (more ranks than parameters) still joins both collectives
        self.optimizer = optimizer_class(own_groups, **defaults) if own_groups else None

    @torch.no_grad()
    def step(self) -> None:
        every = [p for ps in self.owned for p in ps]
        # a missing gradient adds 0 to the sum; its flag (0) tells the owner whether any rank had one
        full = self._layout([p.grad if p.grad is not None else torch.zeros_like(p) for p in every],
                            [p.grad is not None for p in every])
        part = full.new_empty(self.part_numel)
        reduce_scatter_single(part, full, group=self.group)
        part /= self.world_size
        mine = self.owned[self.rank]
        numel = sum(p.numel() for p in mine)
        self._unpack(part, mine, into_grad=True)
        for p, flag in zip(mine, part[numel : numel + len(mine)].tolist()):
            if flag == 0:  # no rank computed a gradient: torch.optim skips a parameter whose grad is None
                p.grad = None
        if self.optimizer is not None:
            self.optimizer.step()
        full = self._layout(every)
        all_gather_single(full, full[self.rank * self.part_numel : (self.rank + 1) * self.part_numel].clone(),
                          group=self.group)
        for r, params in enumerate(self.owned):
            if r != self.rank:
                self._unpack(full[r * self.part_numel : (r + 1) * self.part_numel], params, into_grad=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (step counters left out, as in the ZeRO table)."""
        if self.optimizer is None:
            return 0
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for key, t in s.items() if key != "step" and isinstance(t, torch.Tensor))

    def _layout(self, tensors, flags=None) -> torch.Tensor:
        """``tensors`` (one per parameter, ordered rank by rank) in one flat buffer, each rank's part
        padded; ``flags`` (one bool per parameter, same order) follow each rank's tensors."""
        out = tensors[0].new_zeros(self.world_size * self.part_numel)
        values = iter(tensors)
        marks = iter(flags) if flags is not None else None
        for r, params in enumerate(self.owned):
            offset = r * self.part_numel
            for _ in params:
                t = next(values)
                out[offset : offset + t.numel()] = t.reshape(-1)
                offset += t.numel()
            if marks is not None:
                out[offset : offset + len(params)] = torch.tensor([float(next(marks)) for _ in params],
                                                                  dtype=out.dtype, device=out.device)
        return out

    @staticmethod
    def _unpack(part: torch.Tensor, params, into_grad: bool) -> None:
        offset = 0
        for p in params:
            values = part[offset : offset + p.numel()].view_as(p)
            if into_grad:
                p.grad = values.clone()
            else:
                p.copy_(values)
            offset += p.numel()


def partition(params: list[nn.Parameter], world_size: int) -> list[list[nn.Parameter]]:
    """Whole parameters to ranks, largest first, each to the least loaded rank (ties: lowest rank);
    within a rank, the parameters keep the order they were given in."""
    load, owner = [0] * world_size, {}
    for p in sorted(params, key=lambda p: -p.numel()):
        r = load.index(min(load))
        owner[id(p)] = r
        load[r] += p.numel()
    return [[p for p in params if owner[id(p)] == r] for r in range(world_size)]
