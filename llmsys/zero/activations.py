"""Activation checkpointing, and measuring what it saves (bytes kept for backward) and costs (FLOPs).

A CPU has no ``max_memory_allocated``, so ``LiveBytes`` counts the bytes of the
tensors created inside a ``with`` block that are still alive.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from llmsys.core.model import ModelConfig, Transformer


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

