"""Layer-by-layer calibration: the statistics of every linear layer's inputs, block by block.

Quantizing or pruning block i changes what block i + 1 sees, so the methods of this chapter
(GPTQ, AWQ, SmoothQuant, Wanda) run sequentially, as GPTQ's reference does: the calibration
hidden states pass through block i, the statistics of its linear layers' inputs are taken, the
block is compressed, and its compressed output feeds block i + 1. Only one block's activations
live in memory at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from llmsys.compress.gptq import Hessian
from llmsys.core.model import Block, Transformer, rope_tables

# the linear layers of a block, grouped by the input they share
SHARED_INPUTS = {
    "attention_norm": ("attention.wq", "attention.wk", "attention.wv"),
    "attention_out": ("attention.wo",),
    "ffn_norm": ("feed_forward.w1", "feed_forward.w3"),
    "ffn_hidden": ("feed_forward.w2",),
}
LINEARS = tuple(name for names in SHARED_INPUTS.values() for name in names)


@dataclass
class InputStats:
    """What the methods need to know about a linear layer's inputs x (n, in)."""

    hessian: Hessian
    absmax: torch.Tensor  # (in,) max |x_j|: SmoothQuant
    abs_sum: torch.Tensor  # (in,) Σ |x_j|: AWQ's activation scale
    square_sum: torch.Tensor  # (in,) Σ x_j²: Wanda's ‖X_j‖
    samples: list = field(default_factory=list)  # a few input rows, to score AWQ's scales
    max_samples: int = 512

    @classmethod
    def empty(cls, in_features: int, max_samples: int = 512) -> "InputStats":
        zeros = torch.zeros(in_features, dtype=torch.float64)
        return cls(Hessian(in_features), zeros.clone(), zeros.clone(), zeros.clone(), [], max_samples)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.size(-1)).double()  # (n, in)
        self.hessian.add(x)
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=0))
        self.abs_sum += x.abs().sum(dim=0)
        self.square_sum += x.pow(2).sum(dim=0)
        kept = sum(s.size(0) for s in self.samples)
        if kept < self.max_samples:
            # every 8th token: samples spread over the calibration windows
            self.samples.append(x[::8][: self.max_samples - kept].float())

    @property
    def count(self) -> int:
        return self.hessian.count

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / self.count

    @property
    def column_norm(self) -> torch.Tensor:
        """‖X_j‖ over the calibration tokens (Wanda)."""
        return self.square_sum.sqrt()

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.samples)


def block_input_stats(block: Block, hidden: torch.Tensor, cos, sin, batch: int = 4) -> dict[str, InputStats]:
    """Statistics of every linear layer's inputs in ``block`` for hidden states (N, T, dim); linears
    that share an input share one ``InputStats`` (taken once)."""
    stats, handles = {}, []
    for names in SHARED_INPUTS.values():
        linear = block.get_submodule(names[0])
        shared = InputStats.empty(linear.in_features)
        stats.update({name: shared for name in names})
        handles.append(linear.register_forward_pre_hook(lambda m, args, s=shared: s.add(args[0])))
    try:
        run_block(block, hidden, cos, sin, batch)
    finally:
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def run_block(block: Block, hidden: torch.Tensor, cos, sin, batch: int = 4) -> torch.Tensor:
    return torch.cat([block(hidden[i:i + batch], cos, sin) for i in range(0, hidden.size(0), batch)])


@torch.no_grad()
def sequential(model: Transformer, calib_ids: torch.Tensor, compress_block, progress: bool = True,
               desc: str = "calibrate", n_blocks: int | None = None) -> list:
    """For each block in order: statistics of its inputs, ``compress_block(index, block, stats)``
    (which changes the block in place), then the compressed block's output feeds the next one.

    calib_ids (N, T) token windows; ``n_blocks`` stops after the first n. Returns what
    compress_block returned, per block."""
    from tqdm.auto import tqdm

    dtype = model.tok_embeddings.weight.dtype
    hidden = model.tok_embeddings(calib_ids.to(model.tok_embeddings.weight.device))  # (N, T, dim)
    positions = torch.arange(calib_ids.size(1), device=hidden.device)
    cos, sin = (t.to(dtype) for t in rope_tables(model.cfg.head_dim, positions, model.cfg.rope_theta))
    results = []
    for index, block in enumerate(tqdm(model.layers[:n_blocks], desc=desc, disable=not progress, leave=False)):
        stats = block_input_stats(block, hidden, cos, sin)
        results.append(compress_block(index, block, stats))
        hidden = run_block(block, hidden, cos, sin)
    return results


def block_linears(block: nn.Module) -> dict[str, nn.Linear]:
    return {name: block.get_submodule(name) for name in LINEARS}


# where the inverse of an input scale s can be folded, per group of linears that share an input:
# (the module producing the input, the attribute holding the factor along the input channels)
FOLD_TARGETS = {"attention_norm": "attention_norm.weight", "ffn_norm": "ffn_norm.weight",
                "ffn_hidden": "feed_forward.w3.weight"}


@torch.no_grad()
def fold_input_scale(block: Block, group: str, s: torch.Tensor) -> None:
    """Divide the shared input of ``group``'s linears by s (in the op that produces it) and multiply
    their weight columns by s: W x = (W diag s)(x / s), so the block computes the same function.

    RMSNorm's weight scales its output per channel; the SwiGLU hidden silu(w1 x) * (w3 x) is linear
    in w3's rows. The attention output has no such producer under grouped-query attention (a value
    channel feeds several heads' outputs), so ``attention_out`` cannot be folded."""
    if group not in FOLD_TARGETS:
        raise ValueError(f"no op to fold a scale into for {group!r}; foldable: {', '.join(FOLD_TARGETS)}")
    producer = block.get_parameter(FOLD_TARGETS[group])
    s = s.to(producer.dtype)
    producer.div_(s[:, None] if producer.dim() == 2 else s)
    for name in SHARED_INPUTS[group]:
        block.get_submodule(name).weight.mul_(s[None, :])
