"""``ZeroEngine``: one Transformer trained with data parallelism at ZeRO stage 0 (DDP), 1, 2 or 3.

Stage 0 is ``DistributedDataParallel`` and stage 3 ``FullyShardedDataParallel``
(both work on any module); stages 1 and 2 keep each unit's full parameters in
one flat buffer and give AdamW only this rank's slice of it:

- ZeRO-1: backward fills the full gradient; it is reduce-scattered (each rank
  gets the sum for its slice), AdamW updates the slice, and the updated slices
  are all-gathered back into every rank's full buffer.
- ZeRO-2: the same, but each unit's gradient is reduce-scattered as soon as
  backward has produced it, and the full gradient is freed.

AdamW is elementwise, so AdamW on a slice of the flat parameters is exactly
AdamW on those parameters.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core.model import Transformer
from llmsys.zero.ddp import DistributedDataParallel
from llmsys.zero.estimates import check_stage, storage_bytes
from llmsys.zero.fsdp import FullyShardedDataParallel, gather_flat, unflatten_all
from llmsys.zero.units import (Unit, all_gather_single, reduce_scatter_single, size_and_rank, split_into_units,
                               take_over)


def block_names(model: Transformer) -> list[str]:
    """The Transformer's units: one per block (the root unit holds embeddings, final norm and head)."""
    return [f"layers.{i}" for i in range(len(model.layers))]


class ZeroEngine:
    """Train ``model`` with data parallelism at ZeRO ``stage`` (0 = DDP, 1, 2, 3) on the current group.

    Every rank builds the same model (same seed) and passes its own part of the
    batch to ``train_step``; the update equals single-process AdamW on the full
    batch. At stages 1 and 2 the engine takes the parameters out of the model
    (``model.parameters()`` is empty afterwards): its modules see them only
    while they run forward. At stage 3 the model keeps its parameter names,
    each holding this rank's part of the parameter (as FSDP2 does).
    """

    def __init__(self, model: Transformer, stage: int, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, group=None):
        check_stage(stage)
        self.world_size, self.rank = size_and_rank(group, "ZeroEngine")
        self.model, self.stage, self.group = model, stage, group
        if stage == 0:
            self.wrapped, self.units = DistributedDataParallel(model, group=group), []
        elif stage == 3:
            self.wrapped = FullyShardedDataParallel(model, block_names(model), group)
            self.units = self.wrapped.units
        else:
            self.wrapped = model
            self.units = split_into_units(model, block_names(model), self.world_size, self.rank)
            for unit in self.units:
                unit.flat = take_over(unit).requires_grad_()
                unit.shard = nn.Parameter(unit.flat.detach()[unit.lo : unit.hi])  # aliases this rank's slice
                if stage == 2:
                    unit.flat.register_post_accumulate_grad_hook(functools.partial(self._reduce_scatter_now, unit))
                unit.module.register_forward_pre_hook(lambda module, args, unit=unit: unit.attach(unit.flat))
                unit.module.register_forward_hook(lambda module, args, output, unit=unit: unit.release())
        params = self.wrapped.parameters() if stage in (0, 3) else [unit.shard for unit in self.units]
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           foreach=False)

    @property
    def peak_in_flight_bytes(self) -> int:
        """ZeRO-3: the most bytes of gathered parameters alive at once (0 at the other stages)."""
        return self.wrapped.peak_in_flight_bytes if self.stage == 3 else 0

    # --- one step

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, backward, gradient reduction, AdamW on the shard, parameter gather; returns the local loss."""
        loss = self.forward_loss(x, y)
        self.backward_and_step(loss)
        return loss.detach()

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local mean cross-entropy; under ZeRO-3 no gathered parameter outlives its unit's forward."""
        return F.cross_entropy(self.wrapped(x).flatten(0, 1), y.flatten())

    def backward_and_step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # gradients are fresh every step (no accumulation)
        for unit in self.units:
            if unit.flat is not None:
                unit.flat.grad = None
        loss.backward()  # DDP all-reduces, ZeRO-2 and ZeRO-3 reduce-scatter during backward
        if self.stage == 1:
            self._reduce_scatter_full_gradients()
        self.optimizer.step()
        if self.stage in (1, 2):
            self._gather_updated_params()

    def _reduce_scatter_full_gradients(self) -> None:
        """ZeRO-1, in place: each rank's slice of the full gradient receives the sum for that slice."""
        for unit in self.units:
            grad = unit.flat.grad
            owned = grad[unit.lo : unit.hi]
            reduce_scatter_single(owned, grad, group=self.group)
            owned /= self.world_size
            unit.shard.grad = owned  # the rest of grad holds partial sums, never read

    def _reduce_scatter_now(self, unit: Unit, flat: torch.Tensor) -> None:
        """ZeRO-2: the unit's full gradient is complete; keep only this rank's reduced slice."""
        shard_grad = flat.grad.new_empty(unit.shard_numel)
        reduce_scatter_single(shard_grad, flat.grad, group=self.group)
        unit.shard.grad = shard_grad / self.world_size
        flat.grad = None

    @torch.no_grad()
    def _gather_updated_params(self) -> None:
        for unit in self.units:
            all_gather_single(unit.flat.detach(), unit.shard.detach().clone(), group=self.group)

    # --- what a rank holds

    def state_bytes(self) -> dict:
        """Bytes this rank holds between steps: parameters, gradients, optimizer state (m, v).

        Measured from the storages actually allocated (views of one buffer count once);
        AdamW's step counters (one scalar per tensor) are left out, as in the ZeRO table.
        """
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        params += [unit.flat for unit in self.units]
        grads = [t.grad if t is not None else None for t in params]
        state = [t for s in self.optimizer.state.values() for key, t in s.items() if key != "step"]
        return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(state)}

    def padded_params(self) -> int:
        """Parameters including the padding that makes each unit split evenly."""
        if self.stage == 0:
            return sum(p.numel() for p in self.model.parameters())
        return sum(unit.padded for unit in self.units)

    @torch.no_grad()
    def full_gradients(self) -> dict:
        """{name: averaged gradient} of the last step, gathered from the shards; a collective (stages 1-3)."""
        if self.stage == 0:
            return {k: p.grad.clone() for k, p in self.model.named_parameters(remove_duplicate=False)}
        if self.stage == 3:
            return self.wrapped.full_gradients()
        return unflatten_all(self.units, [gather_flat(unit, unit.shard.grad, self.group) for unit in self.units])

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{name: full parameter} as in ``model.named_parameters()``; a collective under ZeRO-3."""
        if self.stage == 0:
            return {k: p.detach().clone() for k, p in self.model.named_parameters(remove_duplicate=False)}
        if self.stage == 3:
            return self.wrapped.full_parameters()
        return unflatten_all(self.units, [unit.flat for unit in self.units])
