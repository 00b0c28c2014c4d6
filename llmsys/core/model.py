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
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ffn_hidden is not None and (not _is_int(self.ffn_hidden) or self.ffn_hidden <= 0):
            raise ValueError(f"ffn_hidden must be a positive integer or None (8/3 rule), got {self.ffn_hidden!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be True or False, got {self.tie_embeddings!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                             f"choose dim as a multiple of n_heads (head_dim = dim / n_heads, which RoPE needs even)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                             f"each KV head serves a whole group of query heads, so pick n_kv_heads dividing n_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} is odd; RoPE rotates pairs of channels, "
                             f"so change dim or n_heads to make head_dim even")

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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def rope_heads(q, k, v, n_heads: int, n_kv_heads: int, cos, sin):
    """Projected q (B, T, nh·hs), k and v (B, T, n_kv·hs) -> heads (B, ·, T, hs), RoPE on q and k.

    Split from the projection so that a layer whose projections are computed another way
    (sharded, gathered over the sequence) shares the rest of attention's front end."""
    B, T, _ = q.shape
    q = q.view(B, T, n_heads, -1).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, n_kv_heads, -1).transpose(1, 2)  # (B, n_kv, T, hs)
    v = v.view(B, T, n_kv_heads, -1).transpose(1, 2)  # (B, n_kv, T, hs)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


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
        return rope_heads(self.wq(x), self.wk(x), self.wv(x), self.n_heads, self.n_kv_heads, cos, sin)

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
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        # checked here, not left to the embedding: on CUDA an out-of-range id is a device-side
        # assert that leaves the whole context unusable
        low, high = torch.stack(torch.aminmax(idx)).tolist() if idx.numel() else (0, 0)  # one device sync
        if low < 0 or high >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.cfg.vocab_size - 1} (vocab_size), got ids from "
                             f"{low} to {high}; encode with the model's own tokenizer")
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
                 generator: torch.Generator | None = None, stop_token: int | None = None,
                 top_p: float = 1.0) -> torch.Tensor:
        """Prompt (B, T) + max_new_tokens tokens, decoded one at a time with a KV cache
        (``sample_rollout``; after a row's ``stop_token`` it repeats the stop token)."""
        if max_new_tokens == 0 and idx.dim() == 2:
            return idx
        return sample_rollout(self, idx, max_new_tokens, temperature, top_k, stop_token, generator,
                              stop_early=False, top_p=top_p).tokens

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


def check_sampling(temperature: float, top_k: int | None, top_p: float = 1.0) -> None:
    """A clear error for a temperature, top_k or top_p the sampler cannot use."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 \
            or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be None (no filter) or an integer >= 1 (1 = greedy), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {top_p!r}")


def sampling_logits(logits, temperature: float, top_k: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """The fp32 logits (B, vocab) that sampling draws from: divided by the temperature (> 0),
    -inf outside the top_k most likely tokens and, for ``top_p`` < 1, outside the smallest set
    of likeliest tokens whose probability reaches top_p (nucleus sampling, Holtzman et al. 2019)."""
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
    return logits


def sample(logits, temperature: float = 0.0, top_k: int | None = None, generator=None,
           top_p: float = 1.0) -> torch.Tensor:
    """One token id per row of logits (B, vocab) -> (B, 1); temperature 0 means argmax."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(f"the generator is on {generator.device} but the logits are on {logits.device}; "
                         f"make it where the model runs: llmsys.core.device.generator(seed, model), "
                         f"or torch.Generator(device={str(logits.device)!r})")
    probs = F.softmax(sampling_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@dataclass
class Rollout:
    """Prompts and their sampled continuations, aligned to *predicted* tokens.

    tokens (B, P+N): prompts, then the sampled tokens (after a row's stop token, the stop token again);
    mask (B, P+N-1): 1 where tokens[:, t+1] was sampled while its row was alive (the stop token
    included), 0 on the prompt and on the padding after a stop;
    logprobs (B, P+N-1): log-prob of tokens[:, t+1] under the distribution it was drawn from
    (temperature, top_k and top_p applied; 0 for greedy picks), 0 off the mask."""

    tokens: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    prompt_len: int

    @property
    def completions(self) -> torch.Tensor:
        """The sampled tokens, (B, N)."""
        return self.tokens[:, self.prompt_len:]

    @property
    def completion_mask(self) -> torch.Tensor:
        """``mask`` over the sampled tokens only, (B, N)."""
        return self.mask[:, self.prompt_len - 1:]


def token_logprobs(model, tokens: torch.Tensor, return_logits: bool = False):
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for every t: (B, T-1), from one forward pass
    (and the fp32 logits (B, T-1, V) with ``return_logits``). ``tokens`` (B, T) move to the model's device."""
    tokens = tokens.to(next(model.parameters()).device)
    logits = model(tokens[:, :-1]).float()  # (B, T-1, V)
    logp = F.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return (logp, logits) if return_logits else logp


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1 (all positions if None);
    0 when the mask is empty, so a fully padded batch contributes nothing."""
    if mask is None:
        return values.mean()
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the values' shape {tuple(values.shape)}")
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1)


@torch.no_grad()
def sample_rollout(model: "Transformer", prompts: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                   top_k: int | None = None, stop_token: int | None = None, generator: torch.Generator | None = None,
                   stop_early: bool = True, top_p: float = 1.0) -> Rollout:
    """Sample up to ``max_new_tokens`` after every prompt of ``prompts`` (B, P) with one KV cache.

    Each row stops at its own ``stop_token`` (kept, then repeated as padding and masked out);
    with ``stop_early`` decoding ends once every row has stopped, so N <= max_new_tokens.
    Under autocast the cache holds K/V in the autocast dtype, as they are computed."""
    check_sampling(temperature, top_k, top_p)
    if prompts.dim() != 2 or prompts.size(1) < 1:
        raise ValueError(f"prompts must be a (B, P) tensor of token ids with P >= 1, got shape {tuple(prompts.shape)}; "
                         f"a single prompt is prompt[None]")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    B, P = prompts.shape
    if P + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len={model.cfg.max_seq_len}; "
                         f"shorten one or build the model with a larger max_seq_len")
    prompts = prompts.to(model.tok_embeddings.weight.device)
    kind = prompts.device.type
    cache_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    cache = model.new_cache(B, max_len=P + max_new_tokens, dtype=cache_dtype)
    logits = model(prompts, cache)[:, -1]  # (B, V)
    alive = torch.ones(B, dtype=torch.bool, device=prompts.device)
    tokens, logprobs, masks = [], [], []
    for step in range(max_new_tokens):
        token = sample(logits, temperature, top_k, generator, top_p)  # (B, 1)
        if temperature == 0:
            logprob = torch.zeros(B, device=prompts.device)  # the argmax is drawn with probability 1
        else:
            logprob = F.log_softmax(sampling_logits(logits, temperature, top_k, top_p), -1).gather(1, token)[:, 0]
        if stop_token is not None:
            token = torch.where(alive[:, None], token, torch.full_like(token, stop_token))
        tokens.append(token)
        logprobs.append(torch.where(alive, logprob, 0.0))
        masks.append(alive)
        if stop_token is not None:
            alive = alive & (token[:, 0] != stop_token)
            if stop_early and not bool(alive.any()):
                break
        if step < max_new_tokens - 1:  # the last token's logits are never needed
            logits = model(token, cache)[:, -1]
    zeros = torch.zeros(B, P - 1, device=prompts.device)
    return Rollout(tokens=torch.cat([prompts, *tokens], dim=1),
                   mask=torch.cat([zeros, torch.stack(masks, 1).float()], dim=1),
                   logprobs=torch.cat([zeros, torch.stack(logprobs, 1)], dim=1),
                   prompt_len=P)


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
