"""Token trees: attention masks, one target pass over a whole tree of drafts, and keeping
the accepted branch in the KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsys.core.model import Block, KVCache, ModelConfig, Transformer, rope_tables


def tree_ancestors(parents: list[int]) -> list[list[int]]:
    """For each node, itself and its ancestors (root first). parents[i] is the index of node i's
    parent, or -1 when node i hangs directly off the committed sequence; parents come first."""
    ancestors: list[list[int]] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must be -1 or an earlier node's index")
        ancestors.append((ancestors[parent] if parent >= 0 else []) + [i])
    return ancestors


def tree_depths(parents: list[int]) -> list[int]:
    """0 for the nodes right after the committed sequence, parent's depth + 1 below."""
    return [len(chain) - 1 for chain in tree_ancestors(parents)]


def tree_attention_mask(parents: list[int], prefix_len: int = 0, rows: slice | None = None) -> torch.Tensor:
    """Boolean mask (M, prefix_len + M) for a tree of M draft nodes after prefix_len cached tokens:
    node i sees every prefix token, itself and its ancestors, nothing else. A chain gives the
    causal mask. ``rows`` picks the rows of the nodes being computed now."""
    ancestors = tree_ancestors(parents)
    selected = range(len(parents))[rows] if rows is not None else range(len(parents))
    mask = torch.zeros(len(selected), prefix_len + len(parents), dtype=torch.bool)
    mask[:, :prefix_len] = True
    row_idx = [r for r, i in enumerate(selected) for _ in ancestors[i]]
    col_idx = [prefix_len + j for i in selected for j in ancestors[i]]
    mask[row_idx, col_idx] = True
    return mask


def tree_block(block: Block, x, cos, sin, cache: KVCache, mask):
    """One decoder block over tree nodes: the model's own weights, attention under ``mask``
    instead of the causal one. Writes the nodes' K/V after the cached ones (cache.length is
    advanced by the caller, once every layer has written)."""
    attn, (B, T, _) = block.attention, x.shape
    q, k, v = attn.project_qkv(block.attention_norm(x), cos, sin)  # (B, nh, T, hs), (B, n_kv, T, hs) x2
    k, v = cache.update(attn.layer_idx, k, v)  # (B, n_kv, length + T, hs)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), enable_gqa=True)
    x = x + attn.wo(y.transpose(1, 2).reshape(B, T, -1))
    return x + block.feed_forward(block.ffn_norm(x))


def rope_at(cfg: ModelConfig, positions: torch.Tensor, dtype):
    """cos and sin of RoPE at ``positions`` (tree nodes sit at their depth, not their index), in ``dtype``."""
    cos, sin = rope_tables(cfg.head_dim, positions, cfg.rope_theta)
    return cos.to(dtype), sin.to(dtype)


def tree_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 cache: KVCache, return_hidden: bool = False):
    """The model over T tree nodes in one pass: tokens (1, T) at their own positions (T,), each
    attending as ``mask`` (T, cache.length + T) says. Appends the nodes' K/V to the cache;
    ``keep_in_cache`` then keeps the accepted branch. Returns logits (1, T, V) [, hidden]."""
    T = tokens.size(1)
    if mask.shape != (T, cache.length + T):
        raise ValueError(f"mask must be (T, cache.length + T) = ({T}, {cache.length + T}), got {tuple(mask.shape)}")
    if cache.length + T > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} entries, {cache.length} used, {T} tree nodes more requested")
    if int(positions.max()) >= model.cfg.max_seq_len:
        raise ValueError(f"tree positions reach {int(positions.max())}, beyond max_seq_len={model.cfg.max_seq_len}")
    x = model.tok_embeddings(tokens)  # (1, T, dim)
    cos, sin = rope_at(model.cfg, positions, x.dtype)
    for layer in model.layers:
        x = tree_block(layer, x, cos, sin, cache, mask)
    cache.length += T
    hidden = model.norm(x)
    logits = model.output(hidden)
    return (logits, hidden) if return_hidden else logits


def keep_in_cache(cache: KVCache, start: int, keep: list[int]) -> None:
    """Keep entries start + keep[i] (ascending) as start + i and drop the rest: after tree
    verification, the accepted branch becomes an ordinary contiguous prefix."""
    if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and (keep[0] < 0 or start + keep[-1] >= cache.length)):
        raise ValueError(f"keep must be ascending indices into the {cache.length - start} entries after {start}, "
                         f"got {keep}")
    src = torch.tensor(keep, device=cache.k[0].device) + start
    for buffers in (cache.k, cache.v):
        for t in buffers:
            t[:, :, start:start + len(keep)] = t[:, :, src]  # indexing copies before the write
    cache.length = start + len(keep)


def tree_size(widths) -> int:
    """Nodes in a tree where every node at depth d has widths[d] children: Σ_d Π_{j≤d} w_j."""
    size, level = 0, 1
    for w in widths:
        level *= w
        size += level
    return size


def target_cache(model: Transformer, capacity: int) -> KVCache:
    """A KV cache with room for tree nodes beyond the context (they are dropped after each round)."""
    w = model.tok_embeddings.weight
    return KVCache(model.cfg.n_layers, 1, model.cfg.n_kv_heads, capacity, model.cfg.head_dim, w.device, w.dtype)
