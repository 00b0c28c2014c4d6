"""Number formats for weights: integer grids with per-tensor, per-channel or per-group scales,
fp8, NF4 (chapter 3's ``llmsys.lora.quant``) and GGUF's Q8_0 / Q4_1 blocks read straight from a file.

Round-to-nearest (RTN) on an integer grid, for a group of weights g:

- symmetric: s = max|g| / (2^(b-1) - 1), q = round(w / s) in [-(2^(b-1) - 1), 2^(b-1) - 1], w ≈ s·q
- asymmetric: s = (max g - min g) / (2^b - 1), q = round((w - min g) / s) in [0, 2^b - 1], w ≈ s·q + min g
  (a float offset, as GGUF's Q4_1 stores it, so the grid covers [min, max] exactly)

Either way no weight is clipped, so |w - ŵ| ≤ s / 2: the error bound the tests check.
The scales cost bits too: ``bits_per_weight`` counts them.

References: GPTQ (Frantar et al., arXiv 2210.17323) and AWQ (Lin et al., arXiv 2306.00978) use
group-wise RTN as their baseline; ggml's ``block_q8_0`` / ``block_q4_1`` (llama.cpp ggml-common.h);
FP8 formats for deep learning (Micikevicius et al., arXiv 2209.05433).
"""

from __future__ import annotations

import numpy as np
import torch

from llmsys.lora import quant

SCALE_BITS = 16  # fp16 scales (and offsets), as GGUF and most GPU kernels store them


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 2 to 8, got {bits!r}")


def grouped(w: torch.Tensor, granularity) -> torch.Tensor:
    """w (out, in) viewed as (groups, group_size): one scale per row of the result.

    granularity: "tensor" (one group), "channel" (one per output row) or an int group size along
    the input dimension (which must divide it)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(w.shape)}")
    if granularity == "tensor":
        return w.reshape(1, -1)
    if granularity == "channel":
        return w
    if not isinstance(granularity, int) or granularity <= 0 or w.size(1) % granularity:
        raise ValueError(f"granularity must be 'tensor', 'channel' or a group size dividing the input "
                         f"dimension {w.size(1)}, got {granularity!r}")
    return w.reshape(-1, granularity)


def rtn_scales(groups: torch.Tensor, bits: int, symmetric: bool):
    """(scale, offset) per group (n, 1) for rows of ``groups`` (n, size); offset is None when symmetric."""
    _check_bits(bits)
    if symmetric:
        absmax = groups.abs().amax(dim=1, keepdim=True)
        scale = absmax / (2 ** (bits - 1) - 1)
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    low, high = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scale = (high - low) / (2**bits - 1)
    return torch.where(scale > 0, scale, torch.ones_like(scale)), low


def rtn_codes(groups: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Integer codes of ``groups`` on the grid (scale, offset), as int32."""
    if offset is None:
        qmax = 2 ** (bits - 1) - 1
        return torch.clamp(torch.round(groups / scale), -qmax, qmax).to(torch.int32)
    return torch.clamp(torch.round((groups - offset) / scale), 0, 2**bits - 1).to(torch.int32)


def rtn_dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    values = codes.to(scale.dtype) * scale
    return values if offset is None else values + offset


def check_granularity(granularity) -> None:
    """A group size need not divide the input dimension: the last group of each row is then shorter
    (GPTQ's and AWQ's g128 on a 576-wide input: four groups of 128 and one of 64)."""
    if granularity in ("tensor", "channel"):
        return
    if not isinstance(granularity, int) or isinstance(granularity, bool) or granularity <= 0:
        raise ValueError(f"granularity must be 'tensor', 'channel' or a positive group size, got {granularity!r}")


def fake_quantize(w: torch.Tensor, bits: int, granularity=128, symmetric: bool = True) -> torch.Tensor:
    """RTN: w quantized and dequantized (same shape and dtype), computed in fp32."""
    check_granularity(granularity)
    if isinstance(granularity, int) and w.dim() == 2 and w.size(1) % granularity:
        full = w.size(1) // granularity * granularity  # whole groups, then one shorter group per row
        head = [fake_quantize(w[:, :full], bits, granularity, symmetric)] if full else []
        return torch.cat(head + [fake_quantize(w[:, full:], bits, w.size(1) - full, symmetric)], dim=1)
    groups = grouped(w.detach().float(), granularity)
    scale, offset = rtn_scales(groups, bits, symmetric)
    return rtn_dequantize(rtn_codes(groups, scale, offset, bits), scale, offset).reshape(w.shape).to(w.dtype)


def bits_per_weight(bits: int, granularity=128, symmetric: bool = True, shape=(4096, 4096)) -> float:
    """Storage bits per weight: the codes plus fp16 scales (and offsets when asymmetric), for a
    weight of ``shape`` (out, in); a group size that does not divide ``in`` leaves a shorter last group."""
    _check_bits(bits)
    out_features, in_features = shape
    check_granularity(granularity)
    groups_per_row = {"tensor": 1 / out_features, "channel": 1}.get(granularity)
    if groups_per_row is None:
        groups_per_row = -(-in_features // granularity)
    return bits + SCALE_BITS * (1 if symmetric else 2) * groups_per_row / in_features


# ---------------------------------------------------------------------------- fp8


def fp8_fake_quantize(w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, granularity="channel") -> torch.Tensor:
    """w scaled so each group's absmax lands on the format's largest value, cast to fp8 and back."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    groups = grouped(w.detach().float(), granularity)
    absmax = groups.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / torch.finfo(dtype).max, torch.ones_like(absmax))
    return ((groups / scale).to(dtype).float() * scale).reshape(w.shape).to(w.dtype)


def fp8_mantissa_bits(dtype: torch.dtype) -> int:
    return {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]


# ---------------------------------------------------------------------------- NF4 (chapter 3)


def nf4_fake_quantize(w: torch.Tensor, blocksize: int = quant.BLOCKSIZE) -> torch.Tensor:
    """QLoRA's NF4 with blockwise absmax, quantized and dequantized by ``llmsys.lora.quant``."""
    packed, absmax = quant.quantize_nf4(w, blocksize)
    return quant.dequantize_nf4(packed, absmax, w.shape, blocksize, w.dtype)


# ---------------------------------------------------------------------------- GGUF blocks

# ggml block layouts: (weights per block, bytes per block)
GGUF_BLOCKS = {"Q8_0": (32, 2 + 32), "Q4_1": (32, 2 + 2 + 16), "F32": (1, 4), "F16": (1, 2)}


def gguf_bits_per_weight(kind: str) -> float:
    n, nbytes = GGUF_BLOCKS[kind]
    return 8 * nbytes / n


def decode_gguf_blocks(raw: np.ndarray, kind: str, shape) -> torch.Tensor:
    """Weights (shape) from a GGUF tensor's raw bytes, fp32.

    Q8_0: fp16 d, 32 int8 q; w = d·q.  Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit q (low nibbles are
    weights 0-15, high nibbles 16-31); w = d·q + m."""
    if kind not in GGUF_BLOCKS:
        raise ValueError(f"no decoder for GGUF type {kind}; known: {', '.join(GGUF_BLOCKS)}")
    n, nbytes = GGUF_BLOCKS[kind]
    data = np.ascontiguousarray(raw).view(np.uint8)
    if kind in ("F32", "F16"):
        values = data.view(np.float32 if kind == "F32" else np.float16).astype(np.float32)
        return torch.from_numpy(values.copy()).reshape(shape)
    blocks = data.reshape(-1, nbytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (n_blocks, 1)
    if kind == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        values = d * q
    else:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        packed = blocks[:, 4:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)  # (n_blocks, 32)
        values = d * q + m
    return torch.from_numpy(values).reshape(shape)


def read_gguf(path, names=None) -> dict[str, tuple[str, torch.Tensor]]:
    """{tensor name: (block type, fp32 weights)} of a GGUF file (``names`` picks a subset).

    Shapes are GGUF's reversed order turned back into torch's (out, in). llama.cpp stores the rows
    of attn_q / attn_k permuted for its RoPE layout (transformers' loader permutes them back);
    the other weights match the model's tensors as they are."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        if names is not None and t.name not in names:
            continue
        kind = t.tensor_type.name
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = (kind, decode_gguf_blocks(t.data, kind, shape))
    return out
