"""Weight-only int8 and int4 linear layers on torch's CPU kernels, for decoding speed.

Decoding one token reads every weight once and does 2 FLOPs per weight: its arithmetic
intensity is about 1 FLOP/byte in bf16, far below any CPU's or GPU's ridge point, so its time is
the weight bytes divided by the memory bandwidth. Storing weights in 8 or 4 bits and widening
them inside the matmul kernel (never in memory) cuts those bytes 2× or about 4×.

- int8: ``torch.ops.aten._weight_int8pack_mm(x, w_int8 (out, in), scales (out,))``, one scale per
  output channel (symmetric).
- int4: ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)``, codes
  q in 0..15 per group of input channels, w = (q - 8)·scale + zero; our asymmetric grid
  w = q·scale + min is the same with zero = min + 8·scale.

Both are the kernels torchao's weight-only quantization dispatches to on the CPU. Activations
are bf16. ``to_weight_only`` swaps a model's linears in place (the tied LM head too).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from llmsys.compress.formats import grouped, rtn_codes, rtn_scales
from llmsys.lora.quant import replace_linears


def has_cpu_kernels() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm") and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale, _ = rtn_scales(w, 8, symmetric=True)  # (out, 1)
        self.register_buffer("codes", rtn_codes(w, scale, None, 8).to(torch.int8))  # (out, in)
        self.register_buffer("scales", scale[:, 0].to(torch.bfloat16))

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    def forward(self, x):
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.codes, self.scales)
        return y.reshape(*shape[:-1], -1)


class Int4WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear, group: int = 32):
        super().__init__()
        w = linear.weight.detach().float()
        out_features, in_features = w.shape
        groups = grouped(w, group)  # (out·in/group, group)
        scale, low = rtn_scales(groups, 4, symmetric=False)
        codes = rtn_codes(groups, scale, low, 4).view(out_features, in_features)
        self.group = group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        zero = low + 8 * scale  # the kernel's w = (q - 8)·scale + zero
        scales_and_zeros = torch.stack([scale.view(out_features, -1).T, zero.view(out_features, -1).T], dim=-1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())  # (in/g, out, 2)

    def forward(self, x):
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed,
                                                       self.group, self.scales_and_zeros)
        return y.reshape(*shape[:-1], -1)


def to_weight_only(model: nn.Module, bits: int, group: int = 32) -> list[str]:
    """Replace every nn.Linear (LM head included) by an int8 or int4 weight-only linear, in place.
    The model should be in bf16 (norms, embeddings and activations)."""
    if not has_cpu_kernels():
        raise RuntimeError(f"torch {torch.__version__} has no CPU weight-only int8/int4 kernels; "
                           f"use torch >= 2.6 or measure bf16 only")
    if bits == 8:
        return replace_linears(model, (), Int8WeightOnlyLinear)
    if bits == 4:
        return replace_linears(model, (), lambda linear: Int4WeightOnlyLinear(linear, group))
    raise ValueError(f"weight-only kernels exist for 8 and 4 bits, got {bits}")
