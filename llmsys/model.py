"""A from-scratch Llama-architecture decoder, in one file.

Pre-norm residual blocks with RMSNorm, rotary position embeddings (the
*rotate_half* layout that transformers' Llama uses, so weights convert without
any permutation), a SwiGLU MLP, grouped-query attention, optional tied
embeddings and an explicit, preallocated KV cache.

One ``forward`` serves training (no cache), prefill, one-token decoding and
verifying a block of drafted tokens (speculative decoding): with a cache, the
new tokens sit at positions ``cache.length ..`` and attend to everything
stored before them.

References:
1) Llama 2 / Llama 3 architecture (Meta, arXiv 2307.09288, 2407.21783)
2) RoFormer (arXiv 2104.09864), GLU variants (arXiv 2002.05202), GQA (arXiv 2305.13245)
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int | None = None  # None -> SwiGLU 8/3 rule, rounded up to multiple_of
    multiple_of: int = 32
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0):
            raise ValueError(f"ffn_hidden must be a positive integer or None (8/3 rule), got {self.ffn_hidden!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                             f"choose dim as a multiple of n_heads (head_dim = dim / n_heads, which RoPE needs even)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                             f"each KV head serves a whole group of query heads, so pick n_kv_heads dividing n_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} is odd; RoPE rotates pairs of channels, "
                             f"so change dim or n_heads to make head_dim even")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta and norm_eps must be positive, got {self.rope_theta} and {self.norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        """The SwiGLU width: 8/3·dim keeps the parameter count of a 4·dim GELU MLP."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return self.multiple_of * math.ceil(int(8 * self.dim / 3) / self.multiple_of)

    def _layer_matmul_params(self) -> int:
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)  # wq, wo, wk, wv
        return attention + 3 * self.dim * self.hidden  # w1, w2, w3

    def n_params(self, include_embedding: bool = True) -> int:
        """Parameter count of Transformer(self); without the token embedding table on request
        (with tied embeddings that table is also the head, counted once)."""
        embedding = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        norms = (2 * self.n_layers + 1) * self.dim
        total = embedding + head + norms + self.n_layers * self._layer_matmul_params()
        return total if include_embedding else total - embedding

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Forward FLOPs per token: 2 per matmul weight (layers and LM head; the embedding is a
        lookup) plus attention scores QKᵀ and values PV, 2·2·seq_len·head_dim per head per layer,
        counted over the full seq_len (causal kernels skip about half).

        Training costs about 3x this (forward + backward for activations and weights): the 6N rule."""
        seq_len = self.max_seq_len if seq_len is None else seq_len
        matmul_params = self.n_layers * self._layer_matmul_params() + self.vocab_size * self.dim
        attention = 2 * 2 * self.n_layers * seq_len * self.n_heads * self.head_dim
        return 2 * matmul_params + attention

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V, every layer, every KV head: what one more token of context costs."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_elem

    def memory_bytes(self, bytes_per_param: int = 4) -> int:
        """Weights only (no gradients, optimizer state or activations)."""
        return self.n_params() * bytes_per_param

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}; remove them")
        return cls(**d)


class KVCache:
    """Preallocated keys and values, per layer (B, n_kv_heads, max_len, head_dim).

    ``length`` tokens are valid for the whole batch; positions past it are scratch
    space, so rolling back rejected speculative tokens is just ``truncate``."""

    def __init__(self, n_layers, batch_size, n_kv_heads, max_len, head_dim, device=None, dtype=None):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].size(0)

    @property
    def max_len(self) -> int:
        return self.k[0].size(2)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the new tokens' K/V after the stored ones; return all K/V up to them."""
        start, end = self.length, self.length + k.size(2)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # (B, n_kv, end, hs)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"can only truncate to 0..{self.length} tokens, got {length}")
        self.length = length

    def clone(self) -> "KVCache":
        other = copy.copy(self)
        other.k = [t.clone() for t in self.k]
        other.v = [t.clone() for t in self.v]
        return other


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32 (a bf16 mean of squares loses precision), scale in the input dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float):
    """cos and sin of position·frequency, (T, head_dim), both halves repeated (rotate_half layout).

    Computed per forward in fp32 rather than stored, so the model's only state is its parameters
    (meta-device init and dtype casts cannot corrupt them) and low-precision models keep exact angles."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # (hs/2,)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate channel i with channel i + hs/2 by the position's angle; x (B, nh, T, hs), cos/sin (T, hs)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def attend(q, k, v):
    """Causal attention for T new queries that sit after S - T cached keys; q (B, nh, T, hs), k/v (B, n_kv, S, hs)."""
    T, S = q.size(2), k.size(2)
    if T == S:  # nothing cached before these tokens: ordinary causal attention
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if T == 1:  # one new token may see every stored one
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # query i sits at position S - T + i, so it sees keys 0 .. S - T + i (is_causal would align top-left)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def project_qkv(self, x, cos, sin):
        """Queries, keys and values of x (B, T, dim) with RoPE applied: the one projection every
        attention variant of the course (paged, tensor- or sequence-parallel, drafters) starts from."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, cache: KVCache | None = None):
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, n_kv, length + T, hs)
        y = attend(q, k, v)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, cache: KVCache | None = None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.apply(self._init_weights)
        # each block adds two residual branches; scale their output projections so the
        # residual stream's variance does not grow with depth (GPT-2)
        for name, p in self.named_parameters():
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def new_cache(self, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> KVCache:
        cfg, weight = self.cfg, self.tok_embeddings.weight
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"cache max_len must be in 1..max_seq_len={cfg.max_seq_len}, got {max_len}")
        return KVCache(cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim,
                       device=weight.device if device is None else device,
                       dtype=weight.dtype if dtype is None else dtype)

    def _check_positions(self, idx, cache: KVCache | None):
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"idx must be a (B, T) tensor of token ids with T >= 1, got shape {tuple(idx.shape)}")
        start, T = (cache.length if cache is not None else 0), idx.size(1)
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"positions {start}..{start + T - 1} exceed max_seq_len={self.cfg.max_seq_len}; "
                             f"shorten the input or build the model with a larger max_seq_len")
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"the cache holds {cache.max_len} tokens, {start} used, {T} more requested; "
                             f"allocate a larger one with new_cache(max_len=...) or truncate it")
        if cache is not None and idx.size(0) != cache.batch_size:
            raise ValueError(f"batch of {idx.size(0)} sequences but the cache was made for {cache.batch_size}")

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, return_hidden: bool = False):
        """Logits (B, T, vocab) for tokens idx (B, T); with a cache, idx continues the cached
        sequence and the cache advances by T. With return_hidden, also the final-norm output (B, T, dim)."""
        self._check_positions(idx, cache)
        start, T = (cache.length if cache is not None else 0), idx.size(1)
        x = self.tok_embeddings(idx)  # (B, T, dim)
        positions = torch.arange(start, start + T, device=idx.device)
        cos, sin = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_theta)  # (T, hs)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        if cache is not None:
            cache.length += T
        hidden = self.norm(x)  # (B, T, dim)
        logits = self.output(hidden)  # (B, T, vocab)
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, top_p: float = 1.0) -> torch.Tensor:
        """Prompt (B, T) + max_new_tokens tokens, decoded one at a time with a KV cache."""
        B, T = idx.shape
        if T + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len={self.cfg.max_seq_len}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if max_new_tokens == 0:
            return idx
        cache = self.new_cache(B, max_len=T + max_new_tokens)
        logits = self(idx, cache)[:, -1]  # (B, vocab)
        tokens = [idx]
        for step in range(max_new_tokens):
            tokens.append(sample(logits, temperature, top_k, generator, top_p))  # (B, 1)
            if step < max_new_tokens - 1:  # the last token's logits are never needed
                logits = self(tokens[-1], cache)[:, -1]
        return torch.cat(tokens, dim=1)

    def to_hf(self):
        """The same weights as a transformers LlamaForCausalLM, in fp32."""
        from transformers import LlamaConfig, LlamaForCausalLM

        c = self.cfg
        hf_cfg = LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden,
            num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
            head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
            tie_word_embeddings=c.tie_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        hf = LlamaForCausalLM(hf_cfg)
        hf.load_state_dict({_hf_name(k): v.detach().float().cpu() for k, v in self.state_dict().items()})
        return hf.to(self.tok_embeddings.weight.device).eval()

    @classmethod
    def from_hf(cls, hf_model_or_path) -> "Transformer":
        """Load a LlamaForCausalLM (or a local checkpoint directory of one) into this class, in fp32."""
        hf = hf_model_or_path
        if isinstance(hf, (str, os.PathLike)):
            from transformers import LlamaForCausalLM

            if not os.path.isdir(hf):
                raise ValueError(f"{hf!s} is not a local checkpoint directory (nothing is downloaded)")
            hf = LlamaForCausalLM.from_pretrained(hf, local_files_only=True, dtype=torch.float32)
        model = cls(_config_from_hf(hf.config))
        hf_state = hf.state_dict()
        model.load_state_dict({k: hf_state[_hf_name(k)].float() for k in model.state_dict()})
        return model.to(next(hf.parameters()).device)


def sample(logits, temperature: float = 0.0, top_k: int | None = None, generator=None,
           top_p: float = 1.0) -> torch.Tensor:
    """One token id per row of logits (B, vocab) -> (B, 1); temperature 0 means argmax.
    ``top_p`` < 1 keeps the smallest set of likeliest tokens whose probability reaches top_p
    (nucleus sampling, Holtzman et al. 2019, arXiv 1904.09751)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, vocab)
        probs = F.softmax(sorted_logits, dim=-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the likelier tokens already reach top_p
        drop = torch.empty_like(outside).scatter_(-1, order, outside)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


# our parameter names -> transformers' Llama names (applied in order; ".attention." never matches ".attention_norm")
_HF_RENAMES = [
    ("tok_embeddings", "embed_tokens"),
    (".attention.wq", ".self_attn.q_proj"), (".attention.wk", ".self_attn.k_proj"),
    (".attention.wv", ".self_attn.v_proj"), (".attention.wo", ".self_attn.o_proj"),
    (".feed_forward.w1", ".mlp.gate_proj"), (".feed_forward.w3", ".mlp.up_proj"),
    (".feed_forward.w2", ".mlp.down_proj"),
    (".attention_norm", ".input_layernorm"), (".ffn_norm", ".post_attention_layernorm"),
]


def _hf_name(name: str) -> str:
    if name == "output.weight":
        return "lm_head.weight"
    for ours, theirs in _HF_RENAMES:
        name = name.replace(ours, theirs)
    return "model." + name


def _config_from_hf(c) -> ModelConfig:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    unsupported = {
        "hidden_act": (c.hidden_act, "silu"),
        "attention_bias": (getattr(c, "attention_bias", False), False),
        "mlp_bias": (getattr(c, "mlp_bias", False), False),
        "rope_type": (rope.get("rope_type", "default"), "default"),
        "head_dim": (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                     c.hidden_size // c.num_attention_heads),
    }
    for name, (got, want) in unsupported.items():
        if got != want:
            raise ValueError(f"this decoder supports {name}={want!r} only; the checkpoint has {name}={got!r}")
    return ModelConfig(
        vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        ffn_hidden=c.intermediate_size, max_seq_len=c.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        norm_eps=c.rms_norm_eps, tie_embeddings=bool(c.tie_word_embeddings),
    )
