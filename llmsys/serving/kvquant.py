"""int8 KV-cache quantization: keys per channel, values per token (KIVI's axes).

Keys have a few channels with large magnitudes in every token (outlier
channels), so each channel gets its own scale, shared by a group of
``group`` consecutive tokens; values have no such channels and are quantized
one token at a time. Both symmetric: q = round(x / s), s = absmax / 127,
stored as int8 with fp16 scales. The newest keys wait in full precision until
their group is complete (KIVI's residual), since a per-channel scale needs all
the group's tokens.

``QuantizedKVCache`` is a drop-in ``KVCache`` for ``Transformer``. As in a
server, the tokens being computed attend to themselves in full precision and
to everything cached before them as stored (int8, dequantized); decoding
token by token through it therefore gives the quality an int8 cache delivers.
Like ``KVCache`` it can be cloned and truncated (speculative decoding rolls back
rejected tokens): the full-precision keys of the last completed group are kept,
so a rollback into that group restores exactly the state a cache that never saw
the rejected tokens would have.

Reference: KIVI (Liu et al., arXiv 2402.02750): 2-bit, group 32, residual in fp16.
"""

from __future__ import annotations

import copy

import torch

from llmsys.core.model import KVCache

QMAX = 127
SCALE_DTYPE = torch.float16


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    # an all-zero slice gets scale 1 (any scale reproduces zeros); fp16 storage, as a server keeps it
    return torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax)).to(SCALE_DTYPE)


def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x / scale.to(x.dtype)), -QMAX, QMAX).to(torch.int8)


def quantize_keys(k: torch.Tensor, group: int = 16):
    """k (..., T, hs) with T a multiple of ``group`` -> (int8 like k, scales (..., T/group, hs)):
    one scale per channel per group of tokens."""
    T, hs = k.shape[-2:]
    if T % group:
        raise ValueError(f"keys are quantized in whole groups of {group} tokens, got {T}; "
                         f"keep the rest in full precision")
    grouped = k.reshape(*k.shape[:-2], T // group, group, hs)
    scale = _scale(grouped.abs().amax(dim=-2))  # (..., G, hs)
    return _round(grouped, scale.unsqueeze(-2)).reshape(k.shape), scale


def dequantize_keys(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    T, hs = q.shape[-2:]
    if T == 0:
        return q.to(dtype)
    group = T // scale.size(-2)
    grouped = q.reshape(*q.shape[:-2], T // group, group, hs).to(dtype)
    return (grouped * scale.unsqueeze(-2).to(dtype)).reshape(q.shape)


def quantize_values(v: torch.Tensor):
    """v (..., T, hs) -> (int8 like v, scales (..., T)): one scale per token."""
    scale = _scale(v.abs().amax(dim=-1))  # (..., T)
    return _round(v, scale.unsqueeze(-1)), scale


def dequantize_values(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.unsqueeze(-1).to(dtype)


def kv_bytes_per_token_int8(n_layers: int, n_kv_heads: int, head_dim: int, group: int = 16) -> float:
    """int8 keys and values plus fp16 scales (keys: one per channel per group; values: one per token)."""
    per_layer_head = 2 * head_dim + 2 * head_dim / group + 2  # int8 K and V, key scales, value scale
    return n_layers * n_kv_heads * per_layer_head


class QuantizedKVCache(KVCache):
    """A ``KVCache`` that stores int8 keys (per channel, groups of ``group`` tokens) and values (per token)."""

    def __init__(self, n_layers, batch_size, n_kv_heads, max_len, head_dim, group: int = 16, device=None,
                 dtype=torch.float32):
        if max_len % group:
            raise ValueError(f"max_len={max_len} must be a multiple of the key group ({group})")
        self.group, self.dtype, self.length = group, dtype, 0
        B, H, L = batch_size, n_kv_heads, n_layers

        def per_layer(*shape, dtype):
            return [torch.zeros(*shape, dtype=dtype, device=device) for _ in range(L)]

        self.k_q = per_layer(B, H, max_len, head_dim, dtype=torch.int8)
        self.v_q = per_layer(B, H, max_len, head_dim, dtype=torch.int8)
        self.k_scale = per_layer(B, H, max_len // group, head_dim, dtype=SCALE_DTYPE)  # per channel, per group
        self.v_scale = per_layer(B, H, max_len, dtype=SCALE_DTYPE)  # per token
        # keys of the current, incomplete group, in full precision until it fills up
        self.k_residual = per_layer(B, H, group, head_dim, dtype=dtype)
        # and of the last completed group, so that a rollback into it can reopen it exactly
        self.k_previous = per_layer(B, H, group, head_dim, dtype=dtype)
        self.previous_start: int | None = None  # where that group starts; None: not held

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, group: int = 16) -> "QuantizedKVCache":
        cfg, w = model.cfg, model.tok_embeddings.weight
        max_len = cfg.max_seq_len if max_len is None else max_len
        max_len = -(-max_len // group) * group
        return cls(cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim, group, w.device, w.dtype)

    @property
    def batch_size(self) -> int:
        return self.k_q[0].size(0)

    @property
    def max_len(self) -> int:
        return self.k_q[0].size(2)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored cache (int8 K/V and fp16 scales); the residual group is working space."""
        return sum(t.nbytes for t in self.k_q + self.v_q + self.k_scale + self.v_scale)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the new tokens' keys and values; return what attention reads: the cached tokens
        as stored (dequantized int8, or the full-precision residual keys), then the new ones as computed."""
        start, end, g = self.length, self.length + k.size(2), self.group
        done = start // g * g  # keys already quantized (whole groups)
        residual = self.k_residual[layer][:, :, :start - done]
        cached_k = dequantize_keys(self.k_q[layer][:, :, :done], self.k_scale[layer][:, :, :done // g], k.dtype)
        cached_v = dequantize_values(self.v_q[layer][:, :, :start], self.v_scale[layer][:, :, :start], v.dtype)
        keys = torch.cat([cached_k, residual, k], dim=2)  # (B, n_kv, end, hs)
        values = torch.cat([cached_v, v], dim=2)
        # values: quantized token by token; keys: every group completed now, the rest waits
        self.v_q[layer][:, :, start:end], self.v_scale[layer][:, :, start:end] = quantize_values(v)
        pending = keys[:, :, done:]
        full = (end - done) // g * g
        if full:
            kq, ks = quantize_keys(pending[:, :, :full], g)
            self.k_q[layer][:, :, done:done + full] = kq
            self.k_scale[layer][:, :, done // g:(done + full) // g] = ks
            self.k_previous[layer].copy_(pending[:, :, full - g:full])
            self.previous_start = done + full - g
        self.k_residual[layer][:, :, :end - done - full] = pending[:, :, full:]
        return keys, values

    @property
    def rollback_floor(self) -> int:
        """The shortest length ``truncate`` can restore exactly: the start of the last completed
        key group whose full-precision keys are held, else the start of the current one."""
        current = self.length // self.group * self.group
        return self.previous_start if self.previous_start is not None else current

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"can only truncate to 0..{self.length} tokens, got {length}")
        if length < self.rollback_floor:
            raise ValueError(f"cannot roll back to {length} tokens: keys before {self.rollback_floor} are held "
                             f"only as int8 groups of {self.group}; roll back at most to {self.rollback_floor} "
                             f"(use a larger group for deeper rollbacks)")
        done = self.length // self.group * self.group
        if length < done:  # reopen the last completed group: its keys go back to full precision
            for residual, previous in zip(self.k_residual, self.k_previous):
                residual.copy_(previous)
            self.previous_start = None
        self.length = length

    def clone(self) -> "QuantizedKVCache":
        other = copy.copy(self)
        for name in ("k_q", "v_q", "k_scale", "v_scale", "k_residual", "k_previous"):
            setattr(other, name, [t.clone() for t in getattr(self, name)])
        return other


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, quantized: bool = False, group: int = 16,
               max_windows: int | None = None) -> float:
    """exp(mean next-token loss) over consecutive windows of ``ids``.

    With ``quantized``, the windows are decoded token by token through an int8 cache, so every
    prediction reads its context from the quantized store, as it would in serving; without, one
    forward pass (the same predictions from full-precision keys and values)."""
    n = (len(ids) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"need more than seq_len={seq_len} tokens, got {len(ids)}")
    dev = model.tok_embeddings.weight.device
    x = ids[:n * seq_len].view(n, seq_len).to(dev)
    y = ids[1:n * seq_len + 1].view(n, seq_len).to(dev)
    if quantized:
        cache = QuantizedKVCache.for_model(model, n, seq_len, group)
        logits = torch.cat([model(x[:, t:t + 1], cache=cache) for t in range(seq_len)], dim=1)
    else:
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    return float(loss.exp())
