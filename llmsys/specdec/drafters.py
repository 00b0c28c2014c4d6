"""Drafters: a small model, Medusa heads, MTP heads and an EAGLE-style head on the target's features."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core.model import Block, FeedForward, KVCache, ModelConfig, RMSNorm, Transformer
from llmsys.specdec.trees import rope_at, target_cache, tree_attention_mask, tree_block, tree_depths, tree_forward

if TYPE_CHECKING:
    from llmsys.specdec.decode import DecodeState


class Drafter:
    """Proposes continuations of the committed sequence, one tree level per call.

    begin(state) -> logits (V,) for the token after the root (the last committed token);
    extend(tokens, parents, n_new) -> logits (n_new, V) under the last n_new draft nodes
    (``tokens``/``parents`` describe every draft node so far, parents -1 under the root);
    rollback(state) after the verdict, so that the next begin sees only committed tokens."""

    name = "drafter"
    vocab_size: int
    max_seq_len: int | None = None
    max_depth: int | None = None

    def __init__(self):
        self.calls = 0

    def reset(self, state: DecodeState) -> None:
        self.calls, self.prefix = 0, 0

    def check_depth(self, depth: int) -> None:
        if self.max_depth is not None and depth > self.max_depth:
            raise ValueError(f"{self.name} drafts at most {self.max_depth} tokens ahead, asked for {depth}; "
                             f"lower gamma (or the number of tree levels) or train more heads")

    def begin(self, state: DecodeState) -> torch.Tensor:
        raise NotImplementedError

    def extend(self, tokens: list[int], parents: list[int], n_new: int) -> torch.Tensor:
        raise NotImplementedError

    def rollback(self, state: DecodeState) -> None:
        pass


def as_drafter(drafter) -> Drafter:
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, Transformer):
        return ModelDrafter(drafter)
    raise ValueError(f"drafter must be a Transformer or a specdec.Drafter, got {type(drafter).__name__}")


def _is_chain_tail(parents: list[int], n_new: int) -> bool:
    """True when one new node extends a chain: every earlier node is its ancestor, so the
    ordinary causal forward gives the same result as a tree mask."""
    return n_new == 1 and all(p == i - 1 for i, p in enumerate(parents))


class ModelDrafter(Drafter):
    """A small language model with its own KV cache."""

    name = "draft model"

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        self.vocab_size, self.max_seq_len = model.cfg.vocab_size, model.cfg.max_seq_len
        self.cache = None

    def reset(self, state):
        super().reset(state)
        self.cache = target_cache(self.model, state.capacity)

    def begin(self, state):
        self.prefix = state.n  # committed tokens, root included, once caught up
        new = state.tokens[:, self.cache.length:state.n]  # the tokens committed since last round
        self.calls += 1
        return self.model(new, self.cache)[0, -1]

    def extend(self, tokens, parents, n_new):
        self.calls += 1
        new = torch.tensor(tokens[-n_new:], device=self.cache.k[0].device)[None]
        if _is_chain_tail(parents, n_new):
            return self.model(new, self.cache)[0]
        depths = tree_depths(parents)[-n_new:]
        positions = self.prefix + torch.tensor(depths, device=new.device)
        mask = tree_attention_mask(parents, self.prefix, slice(len(parents) - n_new, None))
        return tree_forward(self.model, new, positions, mask, self.cache)[0]

    def rollback(self, state):
        self.cache.truncate(min(self.cache.length, self.prefix))  # drafts go; accepted ones are re-fed


class PromptLookupDrafter(Drafter):
    """Prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding): find
    the last n tokens earlier in the sequence and draft what followed them there. Free (no model),
    and good exactly when the answer copies its prompt (editing, quoting code); a chain drafter.
    Its q is one-hot on the copied token, so sampling accepts a draft x with probability p(x)."""

    name = "prompt lookup"

    def __init__(self, vocab_size: int, ngram: int = 3, max_depth: int | None = None):
        super().__init__()
        if ngram < 1:
            raise ValueError(f"ngram must be >= 1 (tokens matched before copying), got {ngram}")
        self.vocab_size, self.ngram, self.max_depth = vocab_size, ngram, max_depth

    def begin(self, state):
        self.calls += 1
        seq = state.tokens[0, :state.n].tolist()
        self.copy = self._lookup(seq) or [seq[-1]]  # no match: any guess keeps the output exact
        self.device = state.tokens.device
        return self._logits(0)

    def _lookup(self, seq: list[int]) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix (n..1 tokens)."""
        for n in range(min(self.ngram, len(seq) - 1), 0, -1):
            suffix = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == suffix:
                    return seq[start + n:]
        return []

    def _logits(self, depth: int) -> torch.Tensor:
        logits = torch.full((self.vocab_size,), float("-inf"), device=self.device)
        logits[self.copy[min(depth, len(self.copy) - 1)]] = 0.0
        return logits

    def extend(self, tokens, parents, n_new):
        self.calls += 1
        return self._logits(tree_depths(parents)[-1] + 1).expand(n_new, -1)


class MedusaHeads(nn.Module):
    """Medusa-1 (Cai et al., arXiv 2401.10774): K heads on the target's last hidden state;
    head k guesses the token k+1 places after the one the target itself predicts. Each head
    is a residual SiLU block (zero-initialised, so it starts as the identity) followed by the
    target's frozen LM head (Medusa gives each head its own copy; sharing keeps ours small)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.weight = nn.Parameter(torch.zeros(n_heads, dim, dim))
        self.bias = nn.Parameter(torch.zeros(n_heads, dim))

    def forward(self, hidden):
        """hidden (..., dim) -> one state per head (..., n_heads, dim)."""
        h = hidden.unsqueeze(-2)  # (..., 1, dim)
        return h + F.silu(torch.einsum("...d,ked->...ke", hidden, self.weight) + self.bias)


class MTPHeads(nn.Module):
    """Multi-token prediction modules (DeepSeek-V3, arXiv 2412.19437 §2.2), one per depth k:
    h_k = h_{k-1} + FFN(W_k [norm(h_{k-1}); norm(emb(t))]), chained on the token just drafted,
    with the target's embedding and LM head shared and frozen. DeepSeek's module holds a full
    transformer block; ours keeps its MLP and drops attention, so a depth sees only its
    position's state and the token (no extra KV cache to roll back)."""

    def __init__(self, cfg: ModelConfig, depth: int, hidden: int | None = None):
        super().__init__()
        self.depth = depth
        cfg = ModelConfig(**{**cfg.to_dict(), "ffn_hidden": hidden or cfg.dim})  # a narrow MLP: drafting must be cheap
        self.norm_h = nn.ModuleList(RMSNorm(cfg.dim, cfg.norm_eps) for _ in range(depth))
        self.norm_e = nn.ModuleList(RMSNorm(cfg.dim, cfg.norm_eps) for _ in range(depth))
        self.proj = nn.ModuleList(nn.Linear(2 * cfg.dim, cfg.dim, bias=False) for _ in range(depth))
        self.ffn = nn.ModuleList(FeedForward(cfg) for _ in range(depth))
        self.out_norm = nn.ModuleList(RMSNorm(cfg.dim, cfg.norm_eps) for _ in range(depth))

    def step(self, k: int, h: torch.Tensor, token_emb: torch.Tensor):
        """Module k: previous state h (..., dim) and the next token's embedding -> (new state, normed output)."""
        x = self.proj[k](torch.cat([self.norm_h[k](h), self.norm_e[k](token_emb)], dim=-1))
        x = x + self.ffn[k](x)
        return x, self.out_norm[k](x)


class EagleHead(nn.Module):
    """EAGLE (Li et al., arXiv 2401.15077): autoregression at the feature level. Entry i is the
    target's feature f_i with the embedding of the token after it, t_{i+1}; one decoder layer
    (with its own KV cache over the sequence) predicts f_{i+1}, and the target's LM head turns
    that into a distribution for t_{i+2}. Drafting feeds its own predicted features back in.

    With ``vocab`` = K, the head keeps K rows of the target's LM head (the most frequent tokens,
    ``set_vocab``) and drafts only those: a 49k-row head costs a fifth of a SmolLM2 step, and
    a rare token it cannot draft is still produced by the target's verification."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None, vocab: int | None = None):
        super().__init__()
        # one decoder layer shaped like the target's, with a narrow MLP: every draft step reads
        # all of its weights, so its size is the drafting cost
        self.cfg = ModelConfig(**{**cfg.to_dict(), "n_layers": 1, "ffn_hidden": hidden or cfg.dim})
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(self.cfg, 0)
        if vocab is not None:  # frozen rows of the target's head, filled by set_vocab (or a checkpoint)
            self.register_buffer("vocab", torch.zeros(vocab, dtype=torch.long))
            self.register_buffer("head_weight", torch.zeros(vocab, cfg.dim))
        else:
            self.vocab = None

    def set_vocab(self, token_ids: torch.Tensor, target: Transformer) -> None:
        """Keep the target's LM-head rows of ``token_ids`` (K,)."""
        self.vocab.copy_(token_ids)
        self.head_weight.copy_(target.output.weight.detach()[token_ids.to(target.output.weight.device)])

    def logits(self, features: torch.Tensor, target: Transformer) -> torch.Tensor:
        """(..., K) over the kept tokens, or the target's (..., V) without a truncated head."""
        if self.vocab is None:
            return target.output(features.to(target.output.weight.dtype))
        return features @ self.head_weight.T

    def draft_logits(self, features: torch.Tensor, target: Transformer) -> torch.Tensor:
        """(..., V): the kept tokens' logits, -inf for the others (a drafter never proposes them)."""
        if self.vocab is None:
            return self.logits(features, target)
        full = features.new_full((*features.shape[:-1], target.cfg.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, self.logits(features, target))

    def forward(self, features, token_emb, cache: KVCache | None = None, positions=None, mask=None):
        """features, token_emb (1 or B, T, dim) -> predicted next features (B, T, dim).
        Without a mask: causal, after the cached entries. With one: tree nodes at ``positions``."""
        x = self.fc(torch.cat([features, token_emb], dim=-1))
        T, start = x.size(1), (cache.length if cache is not None else 0)
        if mask is None:
            positions = torch.arange(start, start + T, device=x.device)
            x = self.block(x, *rope_at(self.cfg, positions, x.dtype), cache)
        else:
            x = tree_block(self.block, x, *rope_at(self.cfg, positions, x.dtype), cache, mask)
        if cache is not None:
            cache.length += T
        return x

    def new_cache(self, capacity: int, batch_size: int = 1) -> KVCache:
        w = self.fc.weight
        return KVCache(1, batch_size, self.cfg.n_kv_heads, capacity, self.cfg.head_dim, w.device, w.dtype)

    def second_step(self, features, token_emb, predicted):
        """Every position's second draft step at once, as drafting computes it (EAGLE-3's
        "training-time test"). Entries i = 0..T-1 are (f_i, t_{i+1}) from ``features`` and
        ``token_emb`` (B, T, dim); ``predicted`` (B, T, dim) is this head's output on them, the
        guesses of f_{i+1}. Entry (guess of f_{i+1}, t_{i+2}) sits at position i+1 and attends
        the true entries 0..i and itself. Returns (B, T-1, dim): row i guesses f_{i+2}."""
        B, T, _ = features.shape
        x = torch.cat([torch.cat([features, token_emb], -1),
                       torch.cat([predicted[:, :-1], token_emb[:, 1:]], -1)], dim=1)  # (B, 2T-1, 2dim)
        row = torch.arange(T - 1)[:, None]
        mask = torch.zeros(2 * T - 1, 2 * T - 1, dtype=torch.bool)
        mask[:T, :T] = torch.ones(T, T, dtype=torch.bool).tril()  # the true entries: causal
        mask[T:, :T] = torch.arange(T)[None, :] <= row  # guess i+1 sees true entries 0..i
        mask[T + row, T + row] = True  # and itself
        positions = torch.cat([torch.arange(T), torch.arange(1, T)]).to(x.device)
        x = tree_block(self.block, self.fc(x), *rope_at(self.cfg, positions, x.dtype),
                        self.new_cache(2 * T - 1, B), mask)
        return x[:, T:]


class MedusaDrafter(Drafter):
    """Drafts from Medusa heads: one tiny call per round; depth d's guesses ignore the path."""

    name = "Medusa heads"

    def __init__(self, heads: MedusaHeads, target: Transformer):
        super().__init__()
        self.heads, self.target = heads, target
        self.vocab_size, self.max_depth = target.cfg.vocab_size, heads.n_heads

    def begin(self, state):
        self.calls += 1
        h = state.features[state.n - 2]  # the state that predicted the root
        # the root's distribution is the target's own (already sampled); heads give depth 1, 2, ...
        states = self.heads(h)  # (K, dim)
        self.logits = self.target.output(states)  # (K, V)
        # depth-0 drafts: the token after the root, which head 0 (t+2 from h) predicts
        return self.logits[0]

    def extend(self, tokens, parents, n_new):
        depth = tree_depths(parents)[-1] + 1
        return self.logits[depth].expand(n_new, -1)


class MTPDrafter(Drafter):
    """Drafts with MTP modules: depth k runs module k on (state from depth k-1, drafted token)."""

    name = "MTP heads"

    def __init__(self, heads: MTPHeads, target: Transformer):
        super().__init__()
        self.heads, self.target = heads, target
        self.vocab_size, self.max_depth = target.cfg.vocab_size, heads.depth

    def begin(self, state):
        self.calls += 1
        h = state.features[state.n - 2][None]  # (1, dim)
        self.root_state, out = self.heads.step(0, h, self.target.tok_embeddings(state.root[0]))
        self.node_states = []
        return self.target.output(out)[0]

    def extend(self, tokens, parents, n_new):
        self.calls += 1
        new_parents = parents[-n_new:]
        depth = tree_depths(parents)[-1]  # all new nodes share a depth
        h = torch.stack([self.root_state[0] if p < 0 else self.node_states[p] for p in new_parents])
        emb = self.target.tok_embeddings(torch.tensor(tokens[-n_new:], device=h.device))
        states, out = self.heads.step(depth + 1, h, emb)
        self.node_states += list(states)
        return self.target.output(out)


class EagleDrafter(Drafter):
    """Drafts with an EagleHead; its cache holds entries built from the target's true features
    only, and each round's drafted entries (built from predicted features) are rolled back.

    The head may run in another dtype than the target (fp32 beside a bf16 target on a CPU: its
    few MB stay in cache, and one-row bf16 matmuls are slower there than fp32 ones)."""

    name = "EAGLE head"

    def __init__(self, head: EagleHead, target: Transformer):
        super().__init__()
        self.head, self.target = head, target
        self.vocab_size, self.max_seq_len = target.cfg.vocab_size, target.cfg.max_seq_len
        self.dtype = head.fc.weight.dtype

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.tok_embeddings(tokens).to(self.dtype)

    def reset(self, state):
        super().reset(state)
        self.cache = self.head.new_cache(state.capacity)

    def begin(self, state):
        self.calls += 1
        start = self.cache.length  # entries 0 .. start-1 are built; entry j is (f_j, t_{j+1})
        feats = state.features[start:state.n - 1][None].to(self.dtype)
        emb = self._embed(state.tokens[:, start + 1:state.n])
        out = self.head(feats, emb, self.cache)  # (1, L, dim)
        self.prefix = self.cache.length  # n - 1 entries, the root's included
        self.root_feature, self.node_features = out[0, -1], []
        return self.head.draft_logits(out[0, -1], self.target)

    def extend(self, tokens, parents, n_new):
        self.calls += 1
        new_parents = parents[-n_new:]
        feats = torch.stack([self.root_feature if p < 0 else self.node_features[p] for p in new_parents])[None]
        emb = self._embed(torch.tensor(tokens[-n_new:], device=feats.device))[None]
        if _is_chain_tail(parents, n_new):
            out = self.head(feats, emb, self.cache)
        else:
            positions = self.prefix + torch.tensor(tree_depths(parents)[-n_new:], device=feats.device)
            mask = tree_attention_mask(parents, self.prefix, slice(len(parents) - n_new, None))
            out = self.head(feats, emb, self.cache, positions, mask)
        self.node_features += list(out[0])
        return self.head.draft_logits(out[0], self.target)

    def rollback(self, state):
        self.cache.truncate(self.prefix)
