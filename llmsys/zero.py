"""ZeRO-1, ZeRO-2 and ZeRO-3 by hand on torch.distributed, then PyTorch's FSDP2.

Data parallel training keeps on every rank the parameters, the gradients and
the optimizer state. ZeRO (Rajbhandari et al., arXiv 1910.02054) splits them
into N shards, one per rank:

- ZeRO-1 shards the optimizer state: every rank still computes full gradients,
  reduce-scatters them (each rank gets the sum for its shard), runs AdamW on
  its shard of the parameters and all-gathers the updated shards.
- ZeRO-2 also shards the gradients: a unit's gradient is reduce-scattered as
  soon as backward has produced it, and the full gradient is freed.
- ZeRO-3 also shards the parameters: a unit's parameters are all-gathered just
  before its forward, freed after it, gathered again for its backward.

Here a *unit* is one transformer block, plus one unit for the rest of the
model (embeddings, final norm, output head): the same grouping as FSDP2 with
``fully_shard`` on every block and then on the root. Each unit's parameters
live in one flat fp32 buffer, padded with zeros to a multiple of the world
size so that every rank owns an equal, contiguous slice. Padding never
changes training (its parameters and gradients stay 0) and is counted in the
bytes reported: at most N - 1 elements per unit.

Everything here trains in fp32 without a master copy, so the byte constants
of the ZeRO table change: a parameter costs 4 bytes, its gradient 4, AdamW's
m and v 8 (K = 8), 16 bytes per parameter in all, the same total as
mixed-precision Adam (2 + 2 + 12) split differently. ``FP32_ADAMW`` and
``MIXED_ADAMW`` hold both sets for ``llmsys.accounting.zero_bytes_per_device``.

Communication per rank and step, for Ψ bytes of parameters on a ring of N ranks:
DP all-reduces the gradients, 2(N-1)/N·Ψ; ZeRO-1/2 reduce-scatter the gradients
and all-gather the parameters, the same 2(N-1)/N·Ψ; ZeRO-3 all-gathers the
parameters twice (forward and backward) and reduce-scatters the gradients,
3(N-1)/N·Ψ, 1.5× DP. The ZeRO paper's 2Ψ and 3Ψ are the large-N limits.

The rest of the module: FSDP2 on the same model (``shard_with_fsdp2``,
``train_fsdp``), distributed checkpoints written atomically
(``save_checkpoint``, ``load_checkpoint``), activation checkpointing with its
measured memory and compute (``checkpoint_blocks``, ``LiveBytes``,
``activation_checkpointing_cost``), and the script behind
``torchrun --nproc-per-node=N -m llmsys.zero``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from llmsys import accounting
from llmsys import device as _device
from llmsys.dist import CommCounter, cpu_mesh, device_mesh, torchrun_main
from llmsys.model import ModelConfig, Transformer

STAGES = (0, 1, 2, 3)  # 0 is plain data parallelism (DDP)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

# Bytes per parameter: (param, grad, K = optimizer state incl. any fp32 master copy).
FP32_ADAMW = dict(param_bytes=4, grad_bytes=4, k=8)  # this module: fp32 weights, no master copy
MIXED_ADAMW = dict(param_bytes=2, grad_bytes=2, k=12)  # the ZeRO paper: bf16/fp16 + fp32 master, m, v


# -----------------------------------------------------------------------------
# Estimates


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``: every rank owns an equal slice."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return math.ceil(numel / world_size) * world_size


def state_bytes_estimate(n_params: float, world_size: int, stage: int, param_bytes: float = 4,
                         grad_bytes: float = 4, k: float = 8) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state under ``stage`` (the ZeRO table).

    The three entries sum to ``accounting.zero_bytes_per_device`` with the same constants;
    the defaults are this module's fp32 AdamW (4 + 4 + 8).
    """
    _check_stage(stage)
    n = world_size
    out = {
        "params": param_bytes * n_params / (n if stage >= 3 else 1),
        "grads": grad_bytes * n_params / (n if stage >= 2 else 1),
        "optimizer": k * n_params / (n if stage >= 1 else 1),
    }
    return out


def comm_bytes_estimate(n_params: float, world_size: int, stage: int, bytes_per_param: float = 4) -> float:
    """Bytes one rank sends per step on a ring: ``accounting.zero_comm_bytes_per_rank`` (2Ψ or 3Ψ,
    the large-N figure) times (N-1)/N, the share a ring sends of every collective."""
    _check_stage(stage)
    n = world_size
    return accounting.zero_comm_bytes_per_rank(n_params, stage, bytes_per_param) * (n - 1) / n


def memory_per_rank(n_params: float, world_size: int, stage: int, precision: str = "bf16", batch: int = 1,
                    seq: int = 2048, hidden: int = 4096, layers: int = 32, heads: int = 32,
                    recompute: str = "none") -> dict:
    """Bytes one rank holds while training: the ZeRO model states plus activations.

    ``precision`` "bf16"/"fp16": mixed-precision AdamW (2 + 2 + K=12); "fp32": 4 + 4 + K=8.
    Activations: ``layers`` × ``accounting.activation_bytes_per_layer`` (Korthikanti et al., 16-bit;
    doubled for fp32) for the rank's own micro-batch: data parallelism and ZeRO do not shard them.
    """
    constants = FP32_ADAMW if precision == "fp32" else MIXED_ADAMW
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    states = state_bytes_estimate(n_params, world_size, stage, **constants)
    per_layer = accounting.activation_bytes_per_layer(seq, batch, hidden, heads, recompute=recompute)
    return {**states, "activations": layers * per_layer * (2 if precision == "fp32" else 1)}


def plot_memory_per_rank(n_params: float, world_size: int, precision: str = "bf16", batch: int = 1,
                         seq: int = 2048, hidden: int = 4096, layers: int = 32, heads: int = 32,
                         recompute: str = "none", hbm_gb: float | None = 80, ax=None):
    """Stacked bars, one per stage (DDP, ZeRO-1/2/3), of ``memory_per_rank`` in GB."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.8))
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}
    bottoms = [0.0] * len(STAGES)
    bars = [memory_per_rank(n_params, world_size, stage, precision, batch, seq, hidden, layers, heads, recompute)
            for stage in STAGES]
    names = [STAGE_NAMES[stage] for stage in STAGES]
    for key, color in colors.items():
        values = [b[key] / accounting.GB for b in bars]
        ax.bar(names, values, bottom=bottoms, color=color, label=key)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:.1f}", ha="center", va="bottom")
    if hbm_gb:
        ax.axhline(hbm_gb, color="black", linestyle="--", linewidth=1)
        ax.text(len(STAGES) - 0.5, hbm_gb, f" {hbm_gb:g} GB", va="bottom", ha="right")
    ax.set_ylabel("GB per rank")
    ax.set_title(f"{n_params / 1e9:g}B params, {world_size} ranks, {precision}, batch {batch} x {seq}")
    ax.legend(loc="upper right", fontsize=8)
    return ax


def mixed_precision_state_bytes(model: Transformer, x: torch.Tensor, y: torch.Tensor, lr: float = 1e-3) -> dict:
    """Run one mixed-precision AdamW step on ``model`` and return the bytes it holds, by category.

    bf16 weights and gradients for forward and backward; AdamW updates an fp32
    master copy with fp32 m and v; the new master weights are rounded back to
    bf16. (The fp32 copy of a gradient made for the update is transient, as in
    fused implementations, and not counted.) The model itself is left untouched.
    """
    master = [p.detach().float().clone() for p in model.parameters()]
    half = Transformer(model.cfg).to(x.device)
    half.load_state_dict(model.state_dict())
    half.to(torch.bfloat16)
    loss = F.cross_entropy(half(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    for w, p in zip(master, half.parameters()):
        w.grad = p.grad.float()
    optimizer = torch.optim.AdamW(master, lr=lr)
    optimizer.step()
    with torch.no_grad():
        for w, p in zip(master, half.parameters()):
            p.copy_(w)
            w.grad = None
    state = [t for s in optimizer.state.values() for key, t in s.items() if key != "step"]
    return {
        "bf16 params": _storage_bytes(half.parameters()),
        "bf16 grads": _storage_bytes(p.grad for p in half.parameters()),
        "fp32 master": _storage_bytes(master),
        "fp32 AdamW m, v": _storage_bytes(state),
    }


def _check_stage(stage) -> None:
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES} (0 = plain data parallel), got {stage!r}")


# -----------------------------------------------------------------------------
# Units: parameters sharded together, in one flat padded buffer


class Unit:
    """The parameters of one module (a block, or the root's leftovers) laid out in one flat buffer.

    ``slots`` lists, for every distinct parameter, its offset and shape in the
    flat buffer and every (module, attribute) that uses it (tied embeddings use
    one parameter twice). The modules keep no ``nn.Parameter``: before each
    forward the engine points their attributes at views of the current full
    buffer, as FSDP does.
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

    def flatten(self, params) -> torch.Tensor:
        """Concatenate the unit's parameters (in slot order) and pad with zeros."""
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        return F.pad(flat, (0, self.padded - self.numel))

    def attach(self, full: torch.Tensor) -> None:
        """Make every module attribute a view of ``full`` (autograd flows back into it)."""
        for offset, shape, users, _ in self.slots:
            view = full[offset : offset + math.prod(shape)].view(shape)
            for owner, attr in users:
                setattr(owner, attr, view)

    def release(self) -> None:
        """Drop the modules' references to the full buffer, so it can be freed."""
        for _, _, users, _ in self.slots:
            for owner, attr in users:
                setattr(owner, attr, None)

    def unflatten(self, full: torch.Tensor) -> dict:
        """{parameter name: tensor} from a full flat buffer (every name of a tied parameter)."""
        out = {}
        for offset, shape, _, names in self.slots:
            value = full[offset : offset + math.prod(shape)].view(shape)
            out.update({name: value for name in names})
        return out


def _units(model: Transformer, world_size: int, rank: int) -> list[Unit]:
    """One unit per block, then the root unit with every parameter outside the blocks."""
    owners = {}  # parameter name -> (module, attribute)
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            owners[f"{module_name}.{attr}" if module_name else attr] = (module, attr)
    named = [(name, *owners[name], p) for name, p in model.named_parameters(remove_duplicate=False)]
    units, taken = [], set()
    for i, block in enumerate(model.layers):
        prefix = f"layers.{i}."
        mine = [entry for entry in named if entry[0].startswith(prefix)]
        units.append(Unit(f"layers.{i}", block, mine, world_size, rank))
        taken.update(id(entry[3]) for entry in mine)
    rest = [entry for entry in named if id(entry[3]) not in taken]
    units.append(Unit("root", model, rest, world_size, rank))
    return units


# -----------------------------------------------------------------------------
# The two collectives of ZeRO-3, as one autograd function


class GatherParams(torch.autograd.Function):
    """Forward: all-gather every rank's shard into the unit's full flat parameters.
    Backward: reduce-scatter the full gradient; each rank gets the mean over ranks of its shard.

    The gradient of an all-gather is a reduce-scatter: every rank used all of
    ``full``, so the gradient of this rank's shard is the sum over ranks of
    their gradients for that slice (divided by N: each rank's loss is a mean
    over its part of the batch).
    """

    @staticmethod
    def forward(ctx, shard, engine, unit):
        ctx.engine, ctx.unit = engine, unit
        full = shard.new_empty(unit.padded)
        dist.all_gather_single(full, shard.contiguous(), group=engine.group)
        engine._track(unit, full.numel() * full.element_size())
        return full

    @staticmethod
    def backward(ctx, grad_full):
        engine, unit = ctx.engine, ctx.unit
        grad_shard = grad_full.new_empty(unit.shard_numel)
        dist.reduce_scatter_single(grad_shard, grad_full.contiguous(), group=engine.group)
        engine._forget_regathered(unit)  # the unit's backward is over: free its parameters
        return grad_shard / engine.world_size, None, None


# -----------------------------------------------------------------------------
# The engine


class ZeroEngine:
    """Train ``model`` with data parallelism at ZeRO ``stage`` (0 = DDP, 1, 2, 3) on the current group.

    Every rank builds the same model (same seed) and passes its own part of the
    batch to ``train_step``; the update equals single-process AdamW on the full
    batch. AdamW is elementwise, so AdamW on a slice of the flat parameters is
    exactly AdamW on those parameters: ``torch.optim.AdamW`` runs unchanged on
    each rank's shard.

    The engine takes the parameters out of the model (``model.parameters()`` is
    empty afterwards): its modules see them only while they run forward.
    """

    def __init__(self, model: Transformer, stage: int, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, group=None):
        _check_stage(stage)
        if not dist.is_initialized():
            raise RuntimeError("ZeroEngine needs a process group: run it inside llmsys.dist.launch or torchrun")
        self.model, self.stage, self.group = model, stage, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.units = _units(model, self.world_size, self.rank)
        self._gathered = {}  # ZeRO-3: storage pointer -> (unit, full) while the unit runs forward
        self._regathered = {}  # ZeRO-3: unit -> full, gathered again for its backward
        self._in_flight = {}  # unit -> bytes of gathered parameters alive now
        self.peak_in_flight_bytes = 0

        for unit in self.units:
            flat = unit.flatten(_current_params(unit))
            for _, _, users, _ in unit.slots:  # the flat buffer is now the only copy
                for owner, attr in users:
                    owner._parameters.pop(attr, None)
            unit.release()
            if stage == 3:  # keep only this rank's slice
                unit.shard = nn.Parameter(flat[unit.lo : unit.hi].clone())
            else:
                unit.flat = flat.requires_grad_()
                # stage 0 updates everything; stages 1-2 a Parameter that aliases this rank's slice
                unit.shard = unit.flat if stage == 0 else nn.Parameter(unit.flat.detach()[unit.lo : unit.hi])
            if stage == 2:
                unit.flat.register_post_accumulate_grad_hook(functools.partial(self._reduce_scatter_now, unit))
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))
        self.optimizer = torch.optim.AdamW([u.shard for u in self.units], lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay, foreach=False)

    # --- one step

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, backward, gradient reduction, AdamW on the shard, parameter gather; returns the local loss."""
        loss = self.forward_loss(x, y)
        self.backward_and_step(loss)
        return loss.detach()

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local mean cross-entropy; under ZeRO-3 no gathered parameter outlives its unit's forward."""
        frees_params = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        with frees_params if self.stage == 3 else contextlib.nullcontext():
            logits = self.model(x)
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def backward_and_step(self, loss: torch.Tensor) -> None:
        for unit in self.units:  # gradients are fresh every step (no accumulation)
            unit.shard.grad = None
            if unit.flat is not None:
                unit.flat.grad = None
        loss.backward()  # ZeRO-2 and ZeRO-3 reduce-scatter each unit's gradient during backward
        if self.stage in (0, 1):
            self._reduce_full_gradients()
        self.optimizer.step()
        if self.stage in (1, 2):
            self._gather_updated_params()

    def _reduce_full_gradients(self) -> None:
        n = self.world_size
        for unit in self.units:
            grad = unit.flat.grad
            if self.stage == 0:  # DDP: every rank gets the whole summed gradient
                dist.all_reduce(grad, group=self.group)
                grad /= n
            else:  # ZeRO-1: in place, each rank's slice receives the sum for that slice
                owned = grad[unit.lo : unit.hi]
                dist.reduce_scatter_single(owned, grad, group=self.group)
                owned /= n
                unit.shard.grad = owned  # the rest of grad holds partial sums, never read

    def _reduce_scatter_now(self, unit: Unit, flat: torch.Tensor) -> None:
        """ZeRO-2: the unit's full gradient is complete; keep only this rank's reduced slice."""
        shard_grad = flat.grad.new_empty(unit.shard_numel)
        dist.reduce_scatter_single(shard_grad, flat.grad, group=self.group)
        unit.shard.grad = shard_grad / self.world_size
        flat.grad = None

    @torch.no_grad()
    def _gather_updated_params(self) -> None:
        for unit in self.units:
            dist.all_gather_single(unit.flat.detach(), unit.shard.detach().clone(), group=self.group)

    # --- forward hooks: point the modules at the full parameters, then let go of them

    def _before_forward(self, unit: Unit, module, args) -> None:
        if self.stage < 3:
            unit.attach(unit.flat)
            return
        full = GatherParams.apply(unit.shard, self, unit)
        self._gathered[full.untyped_storage().data_ptr()] = (unit, full)
        unit.attach(full)

    def _after_forward(self, unit: Unit, module, args, output) -> None:
        unit.release()
        if self.stage == 3:
            for key in [k for k, (u, _) in self._gathered.items() if u is unit]:
                del self._gathered[key]
            self._track(unit, 0)

    # --- ZeRO-3: what autograd saves for backward

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
            with torch.no_grad():
                full = unit.shard.detach().new_empty(unit.padded)
                dist.all_gather_single(full, unit.shard.detach(), group=self.group)
            self._regathered[unit] = full
            self._track(unit, full.numel() * full.element_size())
        return self._regathered[unit].as_strided(size, stride, offset)

    def _forget_regathered(self, unit: Unit) -> None:
        self._regathered.pop(unit, None)
        self._track(unit, 0)

    def _track(self, unit: Unit, nbytes: int) -> None:
        self._in_flight[unit] = nbytes
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, sum(self._in_flight.values()))

    # --- what a rank holds

    def state_bytes(self) -> dict:
        """Bytes this rank holds between steps: parameters, gradients, optimizer state (m, v).

        Measured from the storages actually allocated (views of one buffer count once);
        AdamW's step counters (one scalar per tensor) are left out, as in the ZeRO table.
        """
        params, grads = [], []
        for unit in self.units:
            params += [unit.flat, unit.shard]
            grads += [unit.flat.grad if unit.flat is not None else None, unit.shard.grad]
        state = [t for s in self.optimizer.state.values() for key, t in s.items() if key != "step"]
        return {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
                "optimizer": _storage_bytes(state)}

    def padded_params(self) -> int:
        return sum(unit.padded for unit in self.units)

    @torch.no_grad()
    def full_gradients(self) -> dict:
        """{name: averaged gradient} of the last step, gathered from the shards; a collective (stages 1-3)."""
        out = {}
        for unit in self.units:
            full = unit.flat.grad if self.stage == 0 else unit.shard.grad.new_empty(unit.padded)
            if self.stage > 0:
                dist.all_gather_single(full, unit.shard.grad.contiguous(), group=self.group)
            out.update({k: v.detach().clone() for k, v in unit.unflatten(full).items()})
        return out

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{name: full parameter} as in ``model.named_parameters()``; a collective under ZeRO-3."""
        out = {}
        for unit in self.units:
            full = unit.flat
            if self.stage == 3:
                full = unit.shard.new_empty(unit.padded)
                dist.all_gather_single(full, unit.shard.detach(), group=self.group)
            out.update({k: v.detach().clone() for k, v in unit.unflatten(full).items()})
        return out


def _current_params(unit: Unit) -> list[torch.Tensor]:
    return [getattr(users[0][0], users[0][1]) for _, _, users, _ in unit.slots]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped)."""
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# -----------------------------------------------------------------------------
# Runs: the same data and model on 1 or N processes


def tiny_model_config(**overrides) -> ModelConfig:
    """A model small enough to train on several CPU processes in a second (≈ 28k parameters),
    with tied embeddings like the zoo's models."""
    base = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, tie_embeddings=True)
    return ModelConfig(**{**base, **overrides})


@dataclass
class TrainConfig:
    """One training run; ``batch_size`` is the global batch, split evenly over the ranks."""

    model: ModelConfig = field(default_factory=tiny_model_config)
    steps: int = 3
    batch_size: int = 4
    seq_len: int = 16
    lr: float = 1e-2
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}")


def build_model(config: TrainConfig, device=None) -> Transformer:
    """The same initial weights on every rank and in the single-process reference."""
    torch.manual_seed(config.seed)
    return Transformer(config.model).to(device or "cpu")


def global_batch(config: TrainConfig, step: int, tokens: torch.Tensor | None = None):
    """The full batch of ``step`` (x, y), each (batch_size, seq_len): the same on every rank.

    Windows of ``tokens`` when given (e.g. ``zoo.dataset()[0]``), else random token ids.
    """
    gen = torch.Generator().manual_seed(config.seed * 100_003 + step)
    B, T = config.batch_size, config.seq_len
    if tokens is None:
        ids = torch.randint(config.model.vocab_size, (B, T + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]
    if len(tokens) <= T + 1:
        raise ValueError(f"need more than seq_len + 1 = {T + 1} tokens, got {len(tokens)}")
    starts = torch.randint(len(tokens) - T - 1, (B,), generator=gen).tolist()
    windows = torch.stack([tokens[s : s + T + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def local_batch(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal part of a global batch (rows rank·B/N .. (rank+1)·B/N)."""
    if x.size(0) % world_size:
        raise ValueError(
            f"the global batch of {x.size(0)} sequences does not split evenly over {world_size} ranks; "
            f"choose batch_size as a multiple of the world size (e.g. {world_size * max(1, x.size(0) // world_size)})"
        )
    per_rank = x.size(0) // world_size
    return x[rank * per_rank : (rank + 1) * per_rank]


def _rank_device():
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_over_ranks(value: torch.Tensor, group=None) -> float:
    """The global mean of a per-rank mean (equal batch shares): what a single process would print."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def train_single_process(config: TrainConfig, tokens: torch.Tensor | None = None) -> dict:
    """The reference: plain AdamW on the full batch in one process. Returns losses and parameters."""
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
                                  weight_decay=config.weight_decay, foreach=False)
    losses = []
    for step in range(config.steps):
        x, y = global_batch(config, step, tokens)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "params": params, "grads": grads}  # grads: of the last step


def train_zero(rank: int, world_size: int, stage: int, config: TrainConfig, tokens: torch.Tensor | None = None,
               verbose: bool = False) -> dict:
    """Train with ``ZeroEngine`` at ``stage`` on this rank; meant for ``launch`` or torchrun.

    Returns the global losses, the final full parameters, the bytes this rank
    holds, and the collectives of the last step (counted by ``CommCounter``).
    """
    device = _rank_device()
    model = build_model(config, device)
    n_params = sum(p.numel() for p in model.parameters())
    engine = ZeroEngine(model, stage, lr=config.lr, betas=config.betas, eps=config.eps,
                        weight_decay=config.weight_decay)
    losses = []
    for step in range(config.steps):
        x, y = (local_batch(t, rank, world_size).to(device) for t in global_batch(config, step, tokens))
        counting = CommCounter() if step == config.steps - 1 else contextlib.nullcontext()
        with counting as comm:
            loss = engine.train_step(x, y)
        losses.append(mean_over_ranks(loss))
        if verbose and rank == 0:
            print(f"{STAGE_NAMES[stage]} step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return {
        "losses": losses,
        "params": {k: v.cpu() for k, v in engine.full_parameters().items()},
        "grads": {k: v.cpu() for k, v in engine.full_gradients().items()},  # of the last step
        "state_bytes": engine.state_bytes(),
        "peak_in_flight_bytes": engine.peak_in_flight_bytes,
        "n_params": n_params,
        "padded_params": engine.padded_params(),
        "calls": dict(comm.calls),
        "comm_bytes": dict(comm.bytes),
        "ring_bytes": dict(comm.ring_bytes),
    }


# -----------------------------------------------------------------------------
# FSDP2


def shard_with_fsdp2(model: Transformer, mesh, reshard_after_forward: bool = True,
                     mp_policy: MixedPrecisionPolicy | None = None) -> Transformer:
    """``fully_shard`` every block, then the root (embeddings, final norm, head): one unit each.

    reshard_after_forward=True frees each block's gathered parameters after its
    forward and gathers them again in backward (ZeRO-3); False keeps them until
    backward (ZeRO-2-like: more memory, one all-gather fewer; Llama 3's choice).
    """
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def default_mp_policy(device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction on GPUs; None (fp32 throughout) on the CPU."""
    if device.type == "cuda" and _device.dtype(device) == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def _fsdp_setup(world_size: int, config: TrainConfig, reshard_after_forward: bool, mixed_precision: bool):
    device = _rank_device()
    model = build_model(config, device)
    mesh = device_mesh((world_size,), ("dp",)) if device.type == "cuda" else cpu_mesh((world_size,), ("dp",))
    policy = default_mp_policy(device) if mixed_precision else None
    return shard_with_fsdp2(model, mesh, reshard_after_forward, policy), device


def fsdp_gradients(rank: int, world_size: int, config: TrainConfig, reshard_after_forward: bool = True,
                   tokens: torch.Tensor | None = None) -> dict:
    """One FSDP2 backward on this rank's part of batch 0; returns {name: full gradient}.

    Must equal the single-process gradient of the full-batch mean loss: FSDP2
    averages the reduce-scattered gradients (ReduceOp.AVG, which gloo summed
    without dividing in pytorch#162338; this is the regression check).
    """
    model, device = _fsdp_setup(world_size, config, reshard_after_forward, mixed_precision=False)
    x, y = (local_batch(t, rank, world_size).to(device) for t in global_batch(config, 0, tokens))
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters(remove_duplicate=False)}


def single_process_gradients(config: TrainConfig, tokens: torch.Tensor | None = None) -> dict:
    """The reference for ``fsdp_gradients``: full batch 0, one process."""
    model = build_model(config)
    x, y = global_batch(config, 0, tokens)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}


def train_fsdp(rank: int, world_size: int, config: TrainConfig, reshard_after_forward: bool = True,
               save_to: str | None = None, resume_from: str | None = None, tokens: torch.Tensor | None = None,
               mixed_precision: bool = True, verbose: bool = False) -> dict:
    """Train with FSDP2 for steps [start, config.steps), where start comes from ``resume_from``.

    ``save_to``: write a distributed checkpoint there after the last step. A
    checkpoint saved with one world size resumes with another: each rank reads
    the slices it now owns. ``mixed_precision`` only takes effect on GPUs.
    """
    model, device = _fsdp_setup(world_size, config, reshard_after_forward, mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
                                  weight_decay=config.weight_decay, foreach=False)
    start = load_checkpoint(resume_from, model, optimizer) if resume_from else 0
    if start > config.steps:
        raise ValueError(f"the checkpoint is at step {start}, past steps={config.steps}; raise steps")
    losses, comm = [], CommCounter()
    for step in range(start, config.steps):
        x, y = (local_batch(t, rank, world_size).to(device) for t in global_batch(config, step, tokens))
        counting = comm if step == config.steps - 1 else contextlib.nullcontext()
        with counting:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        losses.append(mean_over_ranks(loss))
        if verbose and rank == 0:
            print(f"FSDP2 step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    if save_to:
        save_checkpoint(save_to, model, optimizer, step=config.steps)
    local = [p.to_local() for p in model.parameters()]
    params = {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters(remove_duplicate=False)}
    return {
        "start": start,
        "losses": losses,
        "params": params,
        "param_bytes": sum(t.numel() * t.element_size() for t in local),
        "calls": dict(comm.calls),
        "comm_bytes": dict(comm.bytes),
        "ring_bytes": dict(comm.ring_bytes),
    }


# -----------------------------------------------------------------------------
# Distributed checkpoints, written atomically

COMPLETE = "COMPLETE"  # written last: a checkpoint folder without it is not a checkpoint


def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
    """Save model and optimizer state with torch.distributed.checkpoint; every rank calls this.

    Each rank writes its own shards into ``<path>.partial``; once all ranks are
    done, rank 0 marks it complete and renames it to ``path`` (replacing an older
    checkpoint there only then). A run that dies midway leaves ``path`` as it was.
    ``path`` must be on a filesystem every rank sees (one machine, or a shared disk).
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of a run that died
        partial.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=str(partial))
    dist.barrier()  # every rank has written its files
    if dist.get_rank() == 0:
        (partial / COMPLETE).write_text(f"step {step}, world size {dist.get_world_size()}\n")
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint written by ``save_checkpoint`` (any world size) into a sharded model; returns its step."""
    path = Path(path)
    if not (path / COMPLETE).exists():
        why = "does not exist" if not path.exists() else f"has no {COMPLETE} marker (an interrupted save?)"
        raise FileNotFoundError(f"no complete checkpoint at {path}: the folder {why}; "
                                "save one with save_checkpoint, or point resume_from at a finished one")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=True))
    return int(state["step"])


# -----------------------------------------------------------------------------
# Activation checkpointing, and measuring what it saves


def checkpoint_blocks(model: Transformer) -> Transformer:
    """Recompute each block in backward instead of keeping its activations (non-reentrant
    ``torch.utils.checkpoint``): only each block's input is kept from forward."""
    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


class LiveBytes(TorchDispatchMode):
    """Bytes of tensors created inside the ``with`` block that are still alive: ``now`` and ``peak``.

    Every op's outputs are registered by storage; a weak reference notices
    when a storage is freed. What existed before the block (parameters, inputs)
    is not counted, so for a training step the peak is activations, gradients
    and temporaries: what a CPU has no ``max_memory_allocated`` for.
    """

    def __init__(self):
        super().__init__()
        self._live = {}  # storage pointer -> (weak reference, bytes)
        self.peak = 0

    @property
    def now(self) -> int:
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        return sum(nbytes for _, nbytes in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors([args, list(kwargs.values())])}
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs:  # a view or an in-place result: no new memory
                continue
            if key not in self._live or self._live[key][0].expired():
                self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.now)
        return out


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def activation_checkpointing_cost(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """One forward + backward of ``Transformer(config)`` with and without ``checkpoint_blocks``.

    Returns, for "plain" and "checkpointed": ``kept`` (bytes created in forward
    still alive when it ends: what is kept for backward), ``peak`` (peak bytes
    over forward and backward) and ``flops`` (counted by FlopCounterMode); and
    ``same_grads``: whether both give the same gradients (they must).
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    out, grads = {}, {}
    for name in ("plain", "checkpointed"):
        torch.manual_seed(seed)
        model = Transformer(config)
        if name == "checkpointed":
            checkpoint_blocks(model)
        with LiveBytes() as mem:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            kept = mem.now
            loss.backward()
        grads[name] = [p.grad for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        with FlopCounterMode(display=False) as flops:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        out[name] = {"kept": kept, "peak": mem.peak, "flops": flops.get_total_flops()}
    out["same_grads"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads.values()))
    return out


def recompute_flops_estimate(config: ModelConfig, seq_len: int, include_attention: bool = True) -> float:
    """Compute with checkpointed blocks / without: forward 1 + backward 2, plus each block's forward again.

    Non-reentrant checkpointing stops recomputing as soon as it has regenerated
    every tensor backward needs, so a block's last matmul (the SwiGLU's w2,
    whose output nothing saves) is not run again. From the FLOPs of
    ``ModelConfig.flops_per_token``; ``include_attention=False`` leaves out the
    attention scores, which FlopCounterMode does not count for the CPU's
    attention kernel.
    """
    cfg = config
    attention = 2 * 2 * seq_len * cfg.n_heads * cfg.head_dim  # per token per layer: QK^T and PV
    forward = cfg.flops_per_token(seq_len) - (0 if include_attention else cfg.n_layers * attention)
    per_block = 2 * (cfg._layer_matmul_params() - cfg.dim * cfg.hidden) + (attention if include_attention else 0)
    return 1 + cfg.n_layers * per_block / (3 * forward)


# -----------------------------------------------------------------------------
# python -m llmsys.zero / torchrun --nproc-per-node=N -m llmsys.zero


def run_from_command_line(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """What each rank runs for ``python -m llmsys.zero``: train, then report bytes against the formulas."""
    from llmsys import zoo  # only the script needs the corpus

    spec = zoo.SPECS[args.model]
    config = TrainConfig(model=spec.config, steps=args.steps, batch_size=args.batch_size * world_size,
                         seq_len=args.seq_len, lr=args.lr, weight_decay=0.1)
    tokens = zoo.dataset()[0] if args.data == "zoo" else None
    if rank == 0:
        print(f"{world_size} rank(s) on {dist.get_backend()}, model {args.model!r} "
              f"({config.model.n_params():,} parameters), stage {args.stage}, {args.steps} steps", flush=True)
    if args.stage == "fsdp":
        result = train_fsdp(rank, world_size, config, reshard_after_forward=not args.no_reshard, tokens=tokens,
                            verbose=True)
        result.pop("params")
        if rank == 0:
            psi = 4 * config.model.n_params()
            print(f"parameter shard on rank 0: {accounting.human_bytes(result['param_bytes'])} "
                  f"(model {accounting.human_bytes(psi)} fp32 / {world_size} ranks)")
    else:
        stage = int(args.stage)
        result = train_zero(rank, world_size, stage, config, tokens=tokens, verbose=True)
        result.pop("params")
        if rank == 0:
            estimate = state_bytes_estimate(result["n_params"], world_size, stage)
            for key, value in result["state_bytes"].items():
                print(f"{key:<10} held {accounting.human_bytes(value):>10}   formula "
                      f"{accounting.human_bytes(estimate[key]):>10}   ratio {value / estimate[key]:.4f}")
    if rank == 0:
        ring = sum(result["ring_bytes"].values())
        estimate = comm_bytes_estimate(config.model.n_params(), world_size, 3 if args.stage in ("3", "fsdp") else 0)
        print(f"sent per step (ring model): {accounting.human_bytes(ring)}   "
              f"formula {accounting.human_bytes(estimate)}   calls {result['calls']}", flush=True)
    return {"losses": result["losses"]}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m llmsys.zero",
        description="Sharded data-parallel training of a zoo model. Under torchrun: one process per GPU "
                    "(NCCL, bf16 for FSDP2). As plain python: $LLMSYS_WORLD_SIZE (default 2) gloo processes.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", choices=["0", "1", "2", "3", "fsdp"], default="fsdp",
                        help="0 = DDP, 1-3 = ZeRO by hand (fp32), fsdp = PyTorch FSDP2 (default)")
    parser.add_argument("--no-reshard", action="store_true", help="FSDP2 with reshard_after_forward=False")
    parser.add_argument("--model", choices=["tiny", "draft", "target"], default="target")
    parser.add_argument("--data", choices=["zoo", "random"], default="zoo",
                        help="windows of the zoo corpus, or random tokens (no tokenizer needed)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default: min(128, the model's max_seq_len)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    from llmsys.zoo import SPECS

    max_len = SPECS[args.model].config.max_seq_len
    args.seq_len = min(128, max_len) if args.seq_len is None else args.seq_len
    if args.steps < 1 or args.batch_size < 1 or not 1 <= args.seq_len <= max_len:
        parser.error(f"--steps and --batch-size must be >= 1, and --seq-len in 1..{max_len} for --model {args.model}")
    return torchrun_main(functools.partial(run_from_command_line, args=args))


if __name__ == "__main__":
    main()
