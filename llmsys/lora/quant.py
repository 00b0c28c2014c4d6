"""4-bit NormalFloat (NF4) quantization, from scratch, as QLoRA stores a frozen backbone.

- The 16 NF4 values are quantiles of a standard normal, rescaled to [-1, 1],
  with an exact zero: 7 values below zero and 8 above (QLoRA §3).
- Blockwise absmax: every block of 64 weights keeps one fp32 scale, its
  largest magnitude; a weight is stored as the index of the nearest NF4 value
  of weight / absmax. Two 4-bit indices share one byte (first in the high nibble).
- Double quantization: the fp32 absmax values are themselves quantized to
  8 bits in blocks of 256 (after subtracting their mean), which cuts the
  scale overhead from 32/64 = 0.5 to 8/64 + 32/(64·256) ≈ 0.127 bits per weight.

Sizes that are not a multiple of the block are zero-padded: a zero never
changes a block's absmax and quantizes to the exact 0 code, and the padding is
cut off again on dequantization. bitsandbytes treats a short last block the
same way, so the codes agree with its ``quantize_4bit`` for every size.

References:
1) QLoRA (Dettmers et al., arXiv 2305.14314), §3 and Appendix E
2) 8-bit optimizers via block-wise quantization (Dettmers et al., arXiv 2110.02861)
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

# NF4 as published (QLoRA Appendix E; identical to bitsandbytes' table). nf4_code_from_quantiles()
# rebuilds it from normal quantiles; the fixed fp32 table is what every implementation rounds to.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
NF4_ZERO_CODE = 7  # the index of the exact 0
BLOCKSIZE = 64
DQ_BLOCKSIZE = 256


def nf4_code(device=None) -> torch.Tensor:
    """The 16 NF4 values, sorted, fp32 (shared: do not modify)."""
    return _code("nf4", str(torch.device(device or "cpu")))


def nf4_code_from_quantiles() -> torch.Tensor:
    """NF4 rebuilt from the normal distribution (QLoRA §3).

    8 positive values are quantiles of N(0, 1) evenly spaced in probability from
    0.5 to ``offset``, 7 negative ones likewise, plus an exact 0; all divided by
    the largest so the range is [-1, 1]. ``offset`` sits halfway between the
    probabilities 1 - 1/(2·16) and 1 - 1/(2·15), which keeps the outermost
    quantile finite (the quantile of probability 1 is infinite).
    """
    offset = 1 - 0.5 * (1 / 32 + 1 / 30)
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])  # 8 values
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])  # 7 values
    values = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return (values / values.abs().max()).float()


@functools.lru_cache(maxsize=None)
def _code(name: str, device: str) -> torch.Tensor:
    # built once per device: dequantization runs on every forward
    values = torch.tensor(NF4_VALUES, dtype=torch.float32) if name == "nf4" else _dynamic_code_8bit()
    return values.to(device)


def dynamic_code_8bit(device=None) -> torch.Tensor:
    """The signed 8-bit dynamic code of double quantization, 256 sorted values (shared: do not modify)."""
    return _code("dynamic8", str(torch.device(device or "cpu")))


def _dynamic_code_8bit() -> torch.Tensor:
    """The signed 8-bit dynamic-tree code that double quantization uses for the absmax values
    (Dettmers 2015/2021; bitsandbytes' ``create_dynamic_map``), 256 sorted values.

    For each decade 10^-6 .. 10^0 it keeps 2^i evenly spaced fractions (more
    resolution for larger magnitudes), for both signs, plus 0 and 1.
    """
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        midpoints = (edges[:-1] + edges[1:]) / 2
        decade = 10.0 ** (i - 6)
        values += (decade * midpoints).tolist() + (-decade * midpoints).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


# ---------------------------------------------------------------------------
# Blockwise absmax quantization onto a code (NF4 or the 8-bit dynamic code)


def _check_blocksize(blocksize: int, name: str = "blocksize") -> None:
    if not isinstance(blocksize, int) or blocksize <= 0 or blocksize % 2:
        raise ValueError(f"{name} must be a positive even integer (two 4-bit codes share a byte), got {blocksize!r}")


def _blocks(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """x flattened and zero-padded to whole blocks, (n_blocks, blocksize), fp32."""
    if not torch.is_floating_point(x):
        raise ValueError(f"can only quantize floating-point tensors, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    flat = x.detach().reshape(-1).float()
    padding = -flat.numel() % blocksize
    return F.pad(flat, (0, padding)).view(-1, blocksize)


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int):
    """Index of the nearest code value of x / absmax, per element, and one absmax per block.

    Returns (codes uint8 (n_blocks·blocksize,) including the zero padding, absmax fp32 (n_blocks,)).
    Ties round down (to the lower code), as in bitsandbytes.
    """
    blocks = _blocks(x, blocksize)  # (n_blocks, blocksize)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    # an all-zero block has absmax 0: any scale works, its values all map to the 0 code
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1)
    midpoints = (code[:-1] + code[1:]) / 2  # decision boundaries between neighbouring code values
    codes = torch.bucketize(scaled.reshape(-1), midpoints.to(scaled.device)).to(torch.uint8)
    return codes, absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """code[index] · block absmax, flat fp32 (padding included)."""
    values = code[codes.long()].view(-1, blocksize)  # (n_blocks, blocksize)
    return (values * absmax[:, None]).reshape(-1)


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: element 2i in the high nibble, 2i+1 in the low one."""
    if codes.numel() % 2:
        codes = F.pad(codes, (0, 1), value=NF4_ZERO_CODE)
    codes = codes.to(torch.uint8)
    return (codes[0::2] << 4) | codes[1::2]


def unpack_4bit(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """The inverse of pack_4bit: (2·bytes,) codes, or the first n."""
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(-1)
    return codes if n is None else codes[:n]


# ---------------------------------------------------------------------------
# NF4, with and without double quantization


def quantize_nf4(x: torch.Tensor, blocksize: int = BLOCKSIZE):
    """x -> (packed uint8 (ceil(padded numel / 2),), absmax fp32 (n_blocks,)); numel is zero-padded to whole blocks."""
    _check_blocksize(blocksize)
    codes, absmax = quantize_blockwise(x, nf4_code(x.device), blocksize)
    return pack_4bit(codes), absmax


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape, blocksize: int = BLOCKSIZE,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NF4 value × block absmax, cut back to ``shape``."""
    _check_blocksize(blocksize)
    shape = torch.Size(shape)
    if absmax.numel() * blocksize != packed.numel() * 2:
        raise ValueError(f"{packed.numel()} packed bytes hold {packed.numel() * 2} codes, but {absmax.numel()} "
                         f"blocks of {blocksize} need {absmax.numel() * blocksize}; was it quantized with blocksize={blocksize}?")
    if shape.numel() > packed.numel() * 2:
        raise ValueError(f"shape {tuple(shape)} needs {shape.numel()} values, only {packed.numel() * 2} are stored")
    values = dequantize_blockwise(unpack_4bit(packed), absmax, nf4_code(packed.device), blocksize)
    return values[: shape.numel()].view(shape).to(dtype)


def double_quantize(absmax: torch.Tensor, blocksize: int = DQ_BLOCKSIZE):
    """The fp32 block scales -> (8-bit codes (n,), fp32 scale per 256 of them, fp32 offset).

    The absmax values are all positive and similar, so their mean is subtracted
    first: the 8-bit dynamic code is symmetric around 0 and would waste half
    its values on a one-signed input.
    """
    _check_blocksize(blocksize, "double-quantization blocksize")
    offset = absmax.float().mean()
    codes, scales = quantize_blockwise(absmax.float() - offset, dynamic_code_8bit(absmax.device), blocksize)
    return codes[: absmax.numel()], scales, offset


def double_dequantize(codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor,
                      blocksize: int = DQ_BLOCKSIZE) -> torch.Tensor:
    n = codes.numel()
    padded = F.pad(codes, (0, scales.numel() * blocksize - n))
    return dequantize_blockwise(padded, scales, dynamic_code_8bit(scales.device), blocksize)[:n] + offset


def bits_per_param(blocksize: int = BLOCKSIZE, double_quant: bool = True, dq_blocksize: int = DQ_BLOCKSIZE) -> float:
    """Storage bits per weight: 4 for the code plus the block scales.

    fp32 scales: 4 + 32/64 = 4.5. Double quantization: 4 + 8/64 + 32/(64·256) = 4.127
    (ignoring one fp32 offset per tensor)."""
    _check_blocksize(blocksize)
    if double_quant:
        return 4 + 8 / blocksize + 32 / (blocksize * dq_blocksize)
    return 4 + 32 / blocksize


class NF4Weight(nn.Module):
    """A frozen weight stored in NF4; its buffers move with ``.to(device)`` and count in ``nbytes``."""

    def __init__(self, weight: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True,
                 dq_blocksize: int = DQ_BLOCKSIZE):
        super().__init__()
        self.shape, self.blocksize, self.dq_blocksize = weight.shape, blocksize, dq_blocksize
        self.double_quant = double_quant
        packed, absmax = quantize_nf4(weight, blocksize)
        self.register_buffer("packed", packed)
        if double_quant:
            codes, scales, offset = double_quantize(absmax, dq_blocksize)
            self.register_buffer("absmax_codes", codes)
            self.register_buffer("absmax_scales", scales)
            self.register_buffer("absmax_offset", offset)
        else:
            self.register_buffer("absmax", absmax)

    def block_absmax(self) -> torch.Tensor:
        if self.double_quant:
            return double_dequantize(self.absmax_codes, self.absmax_scales, self.absmax_offset, self.dq_blocksize)
        return self.absmax

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nf4(self.packed, self.block_absmax(), self.shape, self.blocksize, dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    @property
    def measured_bits_per_param(self) -> float:
        return 8 * self.nbytes / self.shape.numel()

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, blocksize={self.blocksize}, double_quant={self.double_quant}"


class NF4Linear(nn.Module):
    """A frozen linear layer with NF4 weights: dequantize, then an ordinary matmul in the input's dtype.

    Dequantizing on every forward (and backward) is what QLoRA trades for the
    memory: the weights are 4-bit at rest and full precision only transiently.
    """

    def __init__(self, linear: nn.Linear, blocksize: int = BLOCKSIZE, double_quant: bool = True):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"NF4Linear quantizes an nn.Linear, got {type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_nf4 = NF4Weight(linear.weight, blocksize, double_quant)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight_nf4.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def replace_linears(model: nn.Module, skip: tuple[str, ...], make) -> list[str]:
    """Swap every nn.Linear not named in ``skip`` for ``make(linear)``, in place; return the names."""
    names = [name for name, m in model.named_modules()
             if type(m) is nn.Linear and not any(name == s or name.endswith("." + s) for s in skip)]
    if not names:
        raise ValueError(f"no nn.Linear left to quantize in {type(model).__name__} (skip={skip})")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(getattr(parent, child)))
    return names


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ("output",), blocksize: int = BLOCKSIZE,
                     double_quant: bool = True) -> list[str]:
    """Replace every nn.Linear of ``model`` (except names ending in ``skip``) by an NF4Linear, in place.

    QLoRA keeps the LM head in 16 bits; so does the default here. Returns the names replaced."""
    _check_blocksize(blocksize)
    return replace_linears(model, skip, lambda linear: NF4Linear(linear, blocksize, double_quant))


def bnb_linears(model: nn.Module, skip: tuple[str, ...] = ("output",), compute_dtype: torch.dtype = torch.float32,
                double_quant: bool = True) -> list[str]:
    """The same replacement with bitsandbytes' NF4 ``Linear4bit`` (quantized where the model lives; runs on
    CPU with bitsandbytes >= 0.50, with fused CUDA kernels on a GPU). Returns the names replaced."""
    import bitsandbytes as bnb

    def make(old: nn.Linear):
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                                compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type="nf4")
        new.load_state_dict({k: v.detach().cpu() for k, v in old.state_dict().items()})
        return new.to(old.weight.device)  # moving to a device is what quantizes

    return replace_linears(model, skip, make)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (shared tensors once): what the model itself occupies.

    bitsandbytes keeps a 4-bit weight's block scales (and their own scales) in
    ``weight.quant_state`` rather than in buffers; they count too."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        for part in [t, *_quant_state_tensors(getattr(t, "quant_state", None))]:
            if part.data_ptr() not in seen:
                seen.add(part.data_ptr())
                total += part.nbytes
    return total


def _quant_state_tensors(state) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes QuantState, nested double-quantization state included."""
    if state is None:
        return []
    tensors = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    return tensors + _quant_state_tensors(getattr(state, "state2", None))


def nf4_bytes(n_params: float, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> float:
    """Bytes of n_params weights in NF4 (the estimate for NF4Weight.nbytes)."""
    return n_params * bits_per_param(blocksize, double_quant) / 8
