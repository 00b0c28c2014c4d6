"""What ZeRO should cost: bytes per rank held and sent, per stage (ZeRO, arXiv 1910.02054, Fig. 1),
with activations on top, and one mixed-precision AdamW step measured category by category."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmsys.core import accounting
from llmsys.core.model import Transformer

STAGES = (0, 1, 2, 3)  # 0 is plain data parallelism (DDP)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

# Bytes per parameter: (param, grad, K = optimizer state incl. any fp32 master copy).
FP32_ADAMW = dict(param_bytes=4, grad_bytes=4, k=8)  # this module: fp32 weights, no master copy
MIXED_ADAMW = dict(param_bytes=2, grad_bytes=2, k=12)  # the ZeRO paper: bf16/fp16 + fp32 master, m, v


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
    check_stage(stage)
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
    check_stage(stage)
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
        "bf16 params": storage_bytes(half.parameters()),
        "bf16 grads": storage_bytes(p.grad for p in half.parameters()),
        "fp32 master": storage_bytes(master),
        "fp32 AdamW m, v": storage_bytes(state),
    }


def check_stage(stage) -> None:
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES} (0 = plain data parallel), got {stage!r}")



def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped): views of one buffer count once."""
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
