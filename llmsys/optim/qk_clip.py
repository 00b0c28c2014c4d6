"""Chapter 8: QK-clip. Rescale W_q and W_k of any attention head whose largest logit went
past τ (Kimi K2, arXiv 2507.20534: QK-Clip and MuonClip)."""

from __future__ import annotations

import math

import torch


def attention_logits(attention, x, cos, sin) -> torch.Tensor:
    """The causal attention logits q·k/√d of every head, (B, n_heads, T, T), -inf above the diagonal.

    x is the attention block's input (after its norm), (B, T, dim); cos/sin the rotary tables for its positions."""
    T = x.size(1)
    nh, nkv, hs = attention.n_heads, attention.n_kv_heads, attention.head_dim
    q, k, _ = attention.project_qkv(x, cos, sin)  # (B, nh, T, hs), (B, nkv, T, hs)
    k = k.repeat_interleave(nh // nkv, dim=1)  # query head h reads KV head h // group (as SDPA's GQA)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def head_max_logits(attention, x, cos, sin) -> torch.Tensor:
    """Per query head, the largest attention logit over batch and (causal) positions: (n_heads,)."""
    return attention_logits(attention, x, cos, sin).amax(dim=(0, 2, 3))


class MaxLogitTracker:
    """While active, every forward of a ``llmsys.core.model.Transformer`` (without a KV cache) records
    each layer's per-head max attention logit; ``max_logits`` is (n_layers, n_heads),
    the running max since the last ``reset()``. Costs one extra QKᵀ per layer."""

    def __init__(self, model):
        self.model = model
        self.n_layers, self.n_heads = model.cfg.n_layers, model.cfg.n_heads
        self.handles = []
        self.reset()

    def reset(self):
        self.max_logits = torch.full((self.n_layers, self.n_heads), float("-inf"))

    def _hook(self, layer_idx):
        def hook(attention, args):
            x, cos, sin = args[:3]
            if len(args) > 3 and args[3] is not None:
                raise ValueError("MaxLogitTracker tracks training forwards; call the model without a KV cache")
            with torch.no_grad():
                m = head_max_logits(attention, x, cos, sin).float().cpu()
            self.max_logits[layer_idx] = torch.maximum(self.max_logits[layer_idx], m)
        return hook

    def __enter__(self):
        for i, layer in enumerate(self.model.layers):
            self.handles.append(layer.attention.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


@torch.no_grad()
def attention_inputs(model, idx) -> list[tuple]:
    """Each layer's attention input (x, cos, sin) on token ids idx, to recompute logits on the same inputs
    (after clipping layer 0, layer 1 sees a different residual stream in a fresh forward)."""
    inputs = []
    handles = [layer.attention.register_forward_pre_hook(lambda m, args: inputs.append(args[:3]))
               for layer in model.layers]
    try:
        model(idx)
    finally:
        for h in handles:
            h.remove()
    return inputs


@torch.no_grad()
def max_logits_from_inputs(model, inputs) -> torch.Tensor:
    """(n_layers, n_heads) max logits of the model's current W_q, W_k on stored attention inputs."""
    return torch.stack([head_max_logits(layer.attention, *args).float().cpu()
                        for layer, args in zip(model.layers, inputs)])


@torch.no_grad()
def attention_max_logits(model, idx) -> torch.Tensor:
    """(n_layers, n_heads) max attention logit of ``model`` on token ids ``idx`` (B, T)."""
    with MaxLogitTracker(model) as tracker:
        model(idx)
    return tracker.max_logits


@torch.no_grad()
def qk_clip_(model, max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Scale the query/key weights of every head whose max logit S exceeded τ so that S becomes τ.

    γ_h = min(1, τ/S_h). With one key head per query head (MHA) the head's rows of
    W_q and W_k are both multiplied by √γ_h, as in Kimi K2. With grouped-query
    attention a key head is shared by several query heads, and scaling it would also
    shrink heads that never exceeded τ, so W_q^h alone is multiplied by γ_h and W_k
    is left alone: the same choice K2 makes for MLA's shared rotary key. Either way
    every logit of head h scales by exactly γ_h and other heads are untouched.
    Returns γ, (n_layers, n_heads)."""
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    cfg = model.cfg
    if tuple(max_logits.shape) != (cfg.n_layers, cfg.n_heads):
        raise ValueError(f"max_logits must be (n_layers, n_heads) = {(cfg.n_layers, cfg.n_heads)}, "
                         f"got {tuple(max_logits.shape)}; get it from attention_max_logits or MaxLogitTracker")
    gamma = (tau / max_logits.double()).clamp(max=1.0)  # S ≤ τ (or -inf) -> 1
    hs, shared_keys = cfg.head_dim, cfg.n_kv_heads < cfg.n_heads
    for layer, g_layer in zip(model.layers, gamma):
        attn = layer.attention
        for h in (g_layer < 1).nonzero().flatten().tolist():
            rows = slice(h * hs, (h + 1) * hs)  # head h's output rows of W_q (and of W_k in MHA)
            g = g_layer[h].item()
            if shared_keys:
                attn.wq.weight[rows] *= g
            else:
                attn.wq.weight[rows] *= math.sqrt(g)
                attn.wk.weight[rows] *= math.sqrt(g)
    return gamma.float()


def mla_clip_factors(gamma: float) -> dict[str, float]:
    """K2's QK-clip for multi-head latent attention: per-head parts share √γ, the rotary query
    part takes all of γ, and the rotary key, shared by every head, is left alone."""
    root = math.sqrt(gamma)
    return {"q_nope": root, "k_nope": root, "q_rope": gamma, "k_rope": 1.0}

