"""KV-cache quantization at 8, 4 and 2 bits, KIVI-style: keys per channel, values per token.

Chapter 9's ``llmsys.serving.kvquant`` stores int8 keys and values; this generalises its axes to
b bits with an asymmetric grid (KIVI's choice; a min and a scale per group, fp16): keys get one
grid per channel per group of ``group`` tokens (outlier channels keep their own range), values
one per token. The cache below keeps K/V as they would be read back (quantized and dequantized),
in full precision storage, so any bit width can be measured; ``bytes_per_token`` counts what the
packed store would hold.

As in a server, the tokens of the chunk being computed attend to each other in full precision and
to everything cached before them as stored: feed chunks of ``group`` tokens, so each chunk's keys
complete one group (KIVI keeps the incomplete group in fp16 the same way).

Reference: KIVI (Liu et al., arXiv 2402.02750) §3; KVQuant (Hooper et al., arXiv 2401.18079).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsys.compress.formats import SCALE_BITS, fake_quantize
from llmsys.core.model import KVCache


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """k (B, H, T, hs), T a multiple of group: each channel's values in a group of tokens share a grid."""
    B, H, T, hs = k.shape
    if T % group:
        raise ValueError(f"keys are quantized in whole groups of {group} tokens, got {T}")
    by_channel = k.reshape(B, H, T // group, group, hs).transpose(-1, -2).reshape(-1, group)  # (…·hs, group)
    q = fake_quantize(by_channel, bits, "channel", symmetric=bits == 8)
    return q.reshape(B, H, T // group, hs, group).transpose(-1, -2).reshape(k.shape)


def quantize_values(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v (B, H, T, hs): one grid per token (per head)."""
    return fake_quantize(v.reshape(-1, v.size(-1)), bits, "channel", symmetric=bits == 8).reshape(v.shape)


def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, bits: int | None, group: int = 32) -> float:
    """Stored K and V bytes per token: b-bit codes plus fp16 grids (scale, and a min below 8 bits);
    ``bits=None`` is the bf16 cache."""
    if bits is None:
        return 2 * n_layers * n_kv_heads * head_dim * 2
    grid = SCALE_BITS * (1 if bits == 8 else 2)
    keys = head_dim * (bits + grid / group)  # a grid per channel per group of tokens
    values = head_dim * bits + grid  # a grid per token
    return n_layers * n_kv_heads * (keys + values) / 8


class FakeQuantizedKVCache(KVCache):
    """A ``KVCache`` whose stored keys and values are as a b-bit KIVI cache returns them (quantized, then
    dequantized into full-precision storage: any bit width, for quality; ``llmsys.serving.QuantizedKVCache``
    stores real int8 codes and scales, for memory)."""

    def __init__(self, model, batch_size: int, max_len: int, bits: int, group: int = 32):
        cfg, w = model.cfg, model.tok_embeddings.weight
        super().__init__(cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim, w.device, w.dtype)
        self.bits, self.group = bits, group

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        start, end = self.length, self.length + k.size(2)
        keys = torch.cat([self.k[layer][:, :, :start], k], dim=2)  # cached as stored, new as computed
        values = torch.cat([self.v[layer][:, :, :start], v], dim=2)
        self.k[layer][:, :, start:end] = quantize_keys(k.float(), self.bits, self.group).to(k.dtype)
        self.v[layer][:, :, start:end] = quantize_values(v.float(), self.bits).to(v.dtype)
        return keys, values


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, bits: int | None, group: int = 32) -> float:
    """exp(mean next-token loss) over windows (n, T + 1), read in chunks of ``group`` tokens through a
    b-bit cache (``bits=None``: the ordinary cache, which gives the full-precision answer)."""
    x, y = windows[:, :-1], windows[:, 1:]
    n, T = x.shape
    if T % group:
        raise ValueError(f"window length {T} must be a multiple of the group ({group})")
    cache = model.new_cache(n, T) if bits is None else FakeQuantizedKVCache(model, n, T, bits, group)
    logits = torch.cat([model(x[:, t:t + group], cache=cache) for t in range(0, T, group)], dim=1)
    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).exp())
