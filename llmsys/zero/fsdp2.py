"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same model and runs as ``ZeroEngine``.

Parameters become DTensors sharded on dim 0; ``reshard_after_forward=True`` is
ZeRO-3, False keeps each block gathered from forward to backward (ZeRO-2-like,
Llama 3's setting). On GPUs the default mixed-precision policy gathers bf16
copies and reduces gradients in fp32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from llmsys.core import device as _device
from llmsys.core.comm import CommCounter
from llmsys.core.dist import cpu_mesh, device_mesh
from llmsys.zero.checkpoints import load_checkpoint, save_checkpoint
from llmsys.zero.engine import block_names
from llmsys.zero.training import (TrainConfig, adamw, build_model, global_batch, local_batch, mean_over_ranks,
                                  rank_device, train_step)


def shard_with_fsdp2(model: nn.Module, mesh, reshard_after_forward: bool = True,
                     mp_policy: MixedPrecisionPolicy | None = None, unit_names=None) -> nn.Module:
    """``fully_shard`` each sub-module named in ``unit_names``, then the root: one unit each.

    For a ``Transformer`` the default units are its blocks (the root then holds
    embeddings, final norm and head); any other module names its own, as for
    ``FullyShardedDataParallel``.

    reshard_after_forward=True frees each block's gathered parameters after its
    forward and gathers them again in backward (ZeRO-3); False keeps them until
    backward (ZeRO-2-like: more memory, one all-gather fewer; Llama 3's choice).
    """
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for name in block_names(model) if unit_names is None else unit_names:
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    return model


def default_mp_policy(device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction on GPUs; None (fp32 throughout) on the CPU."""
    if device.type == "cuda" and _device.dtype(device) == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def fsdp_setup(world_size: int, config: TrainConfig, reshard_after_forward: bool, mixed_precision: bool):
    """This rank's model, built from ``config`` and wrapped with FSDP2's ``fully_shard``, and its device."""
    device = rank_device()
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
    model, device = fsdp_setup(world_size, config, reshard_after_forward, mixed_precision=False)
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
    model, device = fsdp_setup(world_size, config, reshard_after_forward, mixed_precision)
    optimizer = adamw(model.parameters(), config)
    start = load_checkpoint(resume_from, model, optimizer) if resume_from else 0
    if start > config.steps:
        raise ValueError(f"the checkpoint is at step {start}, past steps={config.steps}; raise steps")
    losses, comm = [], CommCounter()
    for step in range(start, config.steps):
        x, y = (local_batch(t, rank, world_size).to(device) for t in global_batch(config, step, tokens))
        counting = comm if step == config.steps - 1 else contextlib.nullcontext()
        with counting:
            loss = train_step(model, optimizer, x, y)
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

