"""Speculative decoding: a cheap drafter proposes, the target verifies many tokens in one pass.

Decoding one token at a time is memory-bound: every weight is read for one token's
worth of arithmetic. On a GPU, scoring a few dozen tokens in one forward call costs
about as much as scoring one (on one CPU core a handful already costs 1.5-2x; see
benchmarks/specdec.py). Speculative decoding turns that slack into speed: a drafter
guesses γ tokens, the target scores them all at once, and a rejection rule keeps
exactly the target's output distribution (Leviathan et al., arXiv 2211.17192;
Chen et al., arXiv 2302.01318).

The pieces, top to bottom:

- theory: α = Σ min(p, q), expected tokens per target call, speedup with a cost ratio c;
- the verification step: ``accept_reject`` (sampling) and ``greedy_accept`` (temperature 0);
- token trees: ``tree_attention_mask``, ``tree_forward`` (one target pass over a whole
  tree of drafts), ``keep_in_cache`` (compact the accepted branch);
- drafters: a small model (``ModelDrafter``), and Medusa heads, MTP heads and an EAGLE-style
  feature-level head trained here on the frozen target's hidden states (``load_head``);
- decoding loops: ``autoregressive_decode`` (the baseline), ``speculative_decode``
  (a chain of γ drafts, rejection sampling) and ``tree_decode`` (a tree of drafts).

    from llmsys import zoo, specdec
    target, draft = zoo.load("target"), zoo.load("draft")
    out, stats = specdec.speculative_decode(target, draft, prompt, 64, gamma=4, temperature=1.0)
    print(stats.tokens_per_round, stats.acceptance_rate)
    mtp = specdec.load_head(specdec.HEAD_SPECS["mtp"], target, zoo.dataset()[0])  # cached after one training
    out, stats = specdec.tree_decode(target, specdec.make_drafter(mtp, target), prompt, 64, widths=(3, 2, 1))
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.model import Block, FeedForward, KVCache, ModelConfig, RMSNorm, Transformer, apply_rope, rope_tables, sample

# ---------------------------------------------------------------------------- theory


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α = Σₓ min(p(x), q(x)) = 1 - TV(p, q) over the last dimension: the chance that a draft
    token x ~ q survives the test u < p(x)/q(x)."""
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(-1)


def _check_theory_args(alpha: float, gamma: int, cost_ratio: float = 0.0):
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is an acceptance probability and must be in [0, 1], got {alpha}")
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {gamma!r}")
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio c = draft step time / target step time must be >= 0, got {cost_ratio}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens produced per target call, E = (1 - α^(γ+1)) / (1 - α) (Leviathan et al., eq. 1),
    assuming every draft token is accepted with the same probability α."""
    _check_theory_args(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)  # the limit: every draft and the bonus token
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Walltime improvement over target-only decoding (Leviathan et al., Thm 3.8): a round costs
    γ draft steps plus one target call, γc + 1 target-step units, and yields E tokens."""
    _check_theory_args(alpha, gamma, cost_ratio)
    return expected_tokens(alpha, gamma) / (gamma * cost_ratio + 1)


def expected_tokens_by_position(alphas) -> float:
    """Tokens per target call when draft position k is accepted with its own probability α_k
    (given the ones before it were): 1 + Σ_k Π_{j≤k} α_j. Constant α gives expected_tokens."""
    total, survive = 1.0, 1.0
    for alpha in alphas:
        _check_theory_args(float(alpha), 1)
        survive *= float(alpha)
        total += survive
    return total


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int = 16) -> int:
    """The γ in 1..max_gamma with the largest expected speedup."""
    return max(range(1, max_gamma + 1), key=lambda g: expected_speedup(alpha, g, cost_ratio))


# ---------------------------------------------------------------------------- one verification step


def probs(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None) -> torch.Tensor:
    """The distribution that ``llmsys.model.sample`` draws from: softmax(logits / T) over the
    top_k logits, and a one-hot argmax at temperature 0. Last dimension = vocabulary."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).float()
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.softmax(logits, dim=-1)


def accept_reject(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None = None):
    """One round of speculative sampling, batched over B independent rounds.

    p (B, γ+1, V): the target's distribution at each draft position and one past the last;
    q (B, γ, V): the drafter's distributions; draft (B, γ): tokens drawn from q.
    Draft i is accepted with probability min(1, p(x)/q(x)); at the first rejection the next
    token is drawn from norm(max(0, p - q)), and when all γ pass, a bonus token from p.
    Returns (n_accepted (B,), next_token (B,)): keep draft[:n], then append next_token.
    The output is distributed exactly as p, whatever q is."""
    B, gamma, V = q.shape
    if p.shape != (B, gamma + 1, V) or draft.shape != (B, gamma):
        raise ValueError(f"need p (B, γ+1, V), q (B, γ, V), draft (B, γ); got {tuple(p.shape)}, "
                         f"{tuple(q.shape)}, {tuple(draft.shape)}")
    p_x = p[:, :gamma].gather(-1, draft[..., None]).squeeze(-1)  # (B, γ)
    q_x = q.gather(-1, draft[..., None]).squeeze(-1)  # (B, γ), > 0: x was drawn from q
    u = torch.rand(B, gamma, generator=generator, device=p.device)
    accepted = u * q_x < p_x  # u < p/q, without dividing by zero
    n = accepted.long().cumprod(-1).sum(-1)  # (B,) length of the leading run of acceptances
    # where the run stopped: residual of p over q there, or p itself after the last draft (q = 0)
    q_padded = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # (B, γ+1, V)
    at_stop = n[:, None, None].expand(B, 1, V)
    p_n, q_n = p.gather(1, at_stop).squeeze(1), q_padded.gather(1, at_stop).squeeze(1)  # (B, V)
    residual = (p_n - q_n).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # a rejection where p == q has probability 0; rounding can still get there, so fall back to p
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    return n, next_token


def greedy_accept(target_tokens: torch.Tensor, draft: torch.Tensor):
    """Temperature 0: keep drafts while they equal the target's argmax, then append the target's
    token at the first mismatch (or the bonus). target_tokens (B, γ+1), draft (B, γ)."""
    n = (draft == target_tokens[:, :-1]).long().cumprod(-1).sum(-1)  # (B,)
    return n, target_tokens.gather(1, n[:, None]).squeeze(1)


# ---------------------------------------------------------------------------- token trees


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


def _tree_block(block: Block, x, cos, sin, cache: KVCache, mask):
    """One decoder block over tree nodes: the model's own weights, attention under ``mask``
    instead of the causal one. Writes the nodes' K/V after the cached ones (cache.length is
    advanced by the caller, once every layer has written)."""
    attn, (B, T, _) = block.attention, x.shape
    h = block.attention_norm(x)
    q = attn.wq(h).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)  # (B, nh, T, hs)
    k = attn.wk(h).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
    v = attn.wv(h).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = cache.update(attn.layer_idx, k, v)  # (B, n_kv, length + T, hs)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), enable_gqa=True)
    x = x + attn.wo(y.transpose(1, 2).reshape(B, T, -1))
    return x + block.feed_forward(block.ffn_norm(x))


def _rope(cfg: ModelConfig, positions: torch.Tensor, dtype):
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
    cos, sin = _rope(model.cfg, positions, x.dtype)
    for layer in model.layers:
        x = _tree_block(layer, x, cos, sin, cache, mask)
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


# ---------------------------------------------------------------------------- decoding state and statistics


@dataclass
class DecodeStats:
    """What a decoding run did. A round is one target verification call after the prefill."""

    method: str = ""
    new_tokens: int = 0
    target_calls: int = 0  # including the prefill
    draft_calls: int = 0
    seconds: float = 0.0
    drafted: list[int] = field(default_factory=list)  # per round: draft depth γ
    accepted: list[int] = field(default_factory=list)  # per round: drafts kept
    predicted_accept: list[float] = field(default_factory=list)  # Σ min(p, q) at each position reached

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tokens_per_round(self) -> float:
        """Tokens per verification call (accepted drafts + the target's own token)."""
        return (sum(self.accepted) + self.rounds) / max(1, self.rounds)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(1, self.rounds)

    @property
    def reached(self) -> int:
        """Draft positions whose verdict was read: all up to and including the first rejection."""
        return sum(min(k + 1, g) for k, g in zip(self.accepted, self.drafted))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts reached: the measured α."""
        return sum(self.accepted) / max(1, self.reached)

    @property
    def predicted_acceptance(self) -> float:
        """Mean of Σ min(p, q) = 1 - TV(p, q) over the same positions: α from the distributions."""
        return sum(self.predicted_accept) / max(1, len(self.predicted_accept))

    def acceptance_by_position(self) -> list[float]:
        """Fraction accepted at draft position i among rounds that reached it."""
        out = []
        for i in range(max(self.drafted, default=0)):
            reached = [k for k, g in zip(self.accepted, self.drafted) if g > i and k >= i]
            out.append(sum(k > i for k in reached) / len(reached) if reached else float("nan"))
        return out

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    def summary(self) -> dict:
        return {"method": self.method, "new_tokens": self.new_tokens, "target_calls": self.target_calls,
                "rounds": self.rounds, "tokens_per_round": self.tokens_per_round,
                "mean_accepted": self.mean_accepted, "acceptance_rate": self.acceptance_rate,
                "tokens_per_second": self.tokens_per_second}


class DecodeState:
    """The committed sequence and what the target knows about it.

    Invariant between rounds: the target's cache holds tokens[:n-1]; the last committed token
    tokens[n-1] was sampled from the target but not yet fed to it (the *root* of the next
    round's drafts); features[:n-1] are the target's final hidden states at those positions."""

    def __init__(self, target: Transformer, prompt: torch.Tensor, max_new_tokens: int, room: int = 0):
        self.target = target
        self.total = prompt.size(1) + max_new_tokens
        dev, dtype = target.tok_embeddings.weight.device, target.tok_embeddings.weight.dtype
        # room: extra cache entries for tree nodes beyond the final length
        self.capacity = self.total + room
        self.cache = target_cache(target, self.capacity)
        self.tokens = torch.zeros(1, self.total, dtype=torch.long, device=dev)
        self.features = torch.zeros(self.total, target.cfg.dim, dtype=dtype, device=dev)
        self.n = prompt.size(1)
        self.tokens[:, :self.n] = prompt

    @property
    def remaining(self) -> int:
        return self.total - self.n

    @property
    def root(self) -> torch.Tensor:
        return self.tokens[:, self.n - 1:self.n]  # (1, 1)

    def prefill(self, temperature, top_k, generator):
        """Feed the prompt, sample the first token: the state enters its invariant."""
        logits, hidden = self.target(self.tokens[:, :self.n], self.cache, return_hidden=True)
        self.features[:self.n] = hidden[0]
        self.append(sample(logits[:, -1], temperature, top_k, generator))

    def append(self, new_tokens: torch.Tensor):
        k = new_tokens.numel()
        self.tokens[0, self.n:self.n + k] = new_tokens.reshape(-1)
        self.n += k

    def commit(self, accepted_drafts: torch.Tensor, next_token: torch.Tensor, hidden: torch.Tensor):
        """After a round: hidden (k+1, dim) are the target's states at the root and the k accepted
        drafts; the cache already holds exactly those positions."""
        self.features[self.n - 1:self.n + accepted_drafts.numel()] = hidden
        self.append(torch.cat([accepted_drafts.reshape(-1), next_token.reshape(-1)]))


def target_cache(model: Transformer, capacity: int) -> KVCache:
    """A KV cache with room for tree nodes beyond the context (they are dropped after each round)."""
    w = model.tok_embeddings.weight
    return KVCache(model.cfg.n_layers, 1, model.cfg.n_kv_heads, capacity, model.cfg.head_dim, w.device, w.dtype)


def _check_request(target: Transformer, prompt: torch.Tensor, max_new_tokens: int, drafter=None):
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.size(0) != 1 or prompt.size(1) < 1:
        shape = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        raise ValueError(f"prompt must be a (1, T) tensor of token ids with T >= 1 (one sequence: accepted lengths "
                         f"differ per sequence), got {shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    context = target.cfg.max_seq_len
    if drafter is not None and drafter.max_seq_len is not None:
        context = min(context, drafter.max_seq_len)
    if prompt.size(1) + max_new_tokens > context:
        raise ValueError(f"prompt ({prompt.size(1)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                         f"of {context} tokens; shorten the prompt or ask for fewer tokens")
    if int(prompt.max()) >= target.cfg.vocab_size or int(prompt.min()) < 0:
        raise ValueError(f"prompt token ids must be in 0..{target.cfg.vocab_size - 1}")
    if drafter is not None and drafter.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"the drafter's vocabulary ({drafter.vocab_size} tokens) differs from the target's "
                         f"({target.cfg.vocab_size}); drafts are compared token by token, so both must share "
                         f"one tokenizer")


def _check_gamma(gamma):
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {gamma!r}")


# ---------------------------------------------------------------------------- decoding loops


@torch.no_grad()
def autoregressive_decode(target: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                          top_k: int | None = None, generator: torch.Generator | None = None):
    """The baseline: one target call per token with a KV cache. Returns (tokens (1, T+new), stats)."""
    _check_request(target, prompt, max_new_tokens)
    start = time.perf_counter()
    stats = DecodeStats(method="target only")
    state = DecodeState(target, prompt, max_new_tokens)
    state.prefill(temperature, top_k, generator)
    while state.remaining > 0:
        logits = target(state.root, state.cache)[:, -1]
        state.append(sample(logits, temperature, top_k, generator))
        stats.drafted.append(0)
        stats.accepted.append(0)
    stats.new_tokens, stats.target_calls = max_new_tokens, 1 + stats.rounds
    stats.seconds = time.perf_counter() - start
    return state.tokens, stats


@torch.no_grad()
def speculative_decode(target: Transformer, drafter, prompt: torch.Tensor, max_new_tokens: int, gamma: int = 4,
                       temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None):
    """Speculative sampling with a chain of γ drafts per round: lossless for any drafter.

    ``drafter`` is a Transformer (wrapped in ModelDrafter) or any Drafter. Each round the
    drafter samples γ tokens, the target scores root + drafts in one call, ``accept_reject``
    (``greedy_accept`` at temperature 0) keeps a prefix, and both caches roll back to it."""
    drafter = as_drafter(drafter)
    _check_gamma(gamma)
    drafter.check_depth(gamma)
    _check_request(target, prompt, max_new_tokens, drafter)
    start = time.perf_counter()
    stats = DecodeStats(method=f"{drafter.name}, chain γ={gamma}")
    state = DecodeState(target, prompt, max_new_tokens)
    drafter.reset(state)
    state.prefill(temperature, top_k, generator)
    while state.remaining > 0:
        g = min(gamma, state.remaining - 1)  # never draft past the requested length
        draft, q = draft_chain(drafter, state, g, temperature, top_k, generator)  # (g,), (g, V)
        logits, hidden = target(torch.cat([state.root, draft[None]], dim=1), state.cache, return_hidden=True)
        if temperature == 0:
            n, next_token = greedy_accept(logits[0].argmax(-1)[None], draft[None])
            k = int(n)
            stats.predicted_accept += [1.0] * min(k, g) + [0.0] * (k < g)  # Σ min(p, q) of one-hot p, q
        else:
            p = probs(logits[0], temperature, top_k)  # (g+1, V)
            n, next_token = accept_reject(p[None], q[None], draft[None], generator)
            k = int(n)
            stats.predicted_accept += acceptance_rate(p[:min(k + 1, g)], q[:min(k + 1, g)]).tolist()
        state.cache.truncate(state.n - 1 + k + 1)  # root + accepted drafts stay
        stats.drafted.append(g)
        stats.accepted.append(k)
        state.commit(draft[:k], next_token, hidden[0, :k + 1])
        drafter.rollback(state)
    stats.new_tokens, stats.target_calls, stats.draft_calls = max_new_tokens, 1 + stats.rounds, drafter.calls
    stats.seconds = time.perf_counter() - start
    return state.tokens, stats


@torch.no_grad()
def tree_decode(target: Transformer, drafter, prompt: torch.Tensor, max_new_tokens: int, widths=(3, 2, 1),
                temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None):
    """Decoding with a tree of drafts verified in one target pass.

    The drafter expands the widths[d] most likely tokens under every node of depth d (a
    deterministic tree). The target scores root + all nodes at once under a tree attention
    mask; then, from the root, the target *samples* its next token and, if that token is one
    of the node's children, moves down to it and samples again. Every emitted token is a
    sample from the target's own distribution given the tokens before it, so this is lossless
    at any temperature; the tree only decides how many of them one call yields."""
    drafter = as_drafter(drafter)
    widths = tuple(widths)
    if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be a non-empty sequence of integers >= 1 (children per node at each depth), "
                         f"got {widths}")
    drafter.check_depth(len(widths))
    _check_request(target, prompt, max_new_tokens, drafter)
    start = time.perf_counter()
    room = tree_size(widths) + 1
    stats = DecodeStats(method=f"{drafter.name}, tree {'x'.join(map(str, widths))} ({room - 1} nodes)")
    state = DecodeState(target, prompt, max_new_tokens, room=room)
    drafter.reset(state)
    state.prefill(temperature, top_k, generator)
    while state.remaining > 0:
        depth = min(len(widths), state.remaining - 1)
        tokens, parents = draft_tree(drafter, state, widths[:depth]) if depth else ([], [])
        # the target's tree: the root (last committed token) as node 0, the drafts below it
        all_tokens = torch.cat([state.root[0], torch.tensor(tokens, dtype=torch.long, device=state.root.device)])
        all_parents = [-1] + [p + 1 for p in parents]
        prefix = state.n - 1
        positions = prefix + torch.tensor(tree_depths(all_parents), device=all_tokens.device)
        mask = tree_attention_mask(all_parents, prefix)
        logits, hidden = tree_forward(target, all_tokens[None], positions, mask, state.cache, return_hidden=True)
        path, next_token = _walk_tree(logits[0], all_tokens, all_parents, temperature, top_k, generator)
        keep_in_cache(state.cache, prefix, path)
        stats.drafted.append(depth)
        stats.accepted.append(len(path) - 1)
        state.commit(all_tokens[path[1:]], next_token, hidden[0, path])
        drafter.rollback(state)
    stats.new_tokens, stats.target_calls, stats.draft_calls = max_new_tokens, 1 + stats.rounds, drafter.calls
    stats.seconds = time.perf_counter() - start
    return state.tokens, stats


def tree_size(widths) -> int:
    """Nodes in a tree where every node at depth d has widths[d] children: Σ_d Π_{j≤d} w_j."""
    size, level = 0, 1
    for w in widths:
        level *= w
        size += level
    return size


def _walk_tree(logits, tokens, parents, temperature, top_k, generator):
    """From the root, sample the target's token at the current node; follow the child drafted
    with that token, or stop. Returns (path of node indices, the token sampled last)."""
    children: list[dict[int, int]] = [{} for _ in parents]
    for i, (parent, token) in enumerate(zip(parents, tokens.tolist())):
        if parent >= 0:
            children[parent][token] = i
    node, path = 0, [0]
    while True:
        token = sample(logits[node:node + 1], temperature, top_k, generator)  # (1, 1)
        child = children[node].get(int(token))
        if child is None:
            return path, token
        node = child
        path.append(node)


def draft_chain(drafter: "Drafter", state: DecodeState, gamma: int, temperature: float, top_k, generator):
    """γ draft tokens, each drawn from the drafter's distribution q given the ones before it.
    Returns tokens (γ,) and q (γ, V); at temperature 0, argmax tokens and one-hot q."""
    tokens, qs = [], []
    if gamma == 0:
        dev = state.tokens.device
        return torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, drafter.vocab_size, device=dev)
    logits = drafter.begin(state)
    for i in range(gamma):
        if temperature == 0:  # one-hot q: only the argmax matters, so skip building it
            tokens.append(int(logits.argmax()))
        else:
            q = probs(logits, temperature, top_k)  # (V,)
            tokens.append(int(torch.multinomial(q, 1, generator=generator)))
            qs.append(q)
        if i < gamma - 1:
            logits = drafter.extend(tokens, list(range(-1, i)), 1)[0]
    q = torch.stack(qs) if qs else F.one_hot(torch.tensor(tokens), drafter.vocab_size).float()
    return torch.tensor(tokens, device=state.tokens.device), q.to(state.tokens.device)


def draft_tree(drafter: "Drafter", state: DecodeState, widths) -> tuple[list[int], list[int]]:
    """Grow a tree level by level: the top widths[d] tokens under every node of depth d, one
    drafter call per level. Returns (tokens, parents) with parents -1 under the root."""
    tokens: list[int] = []
    parents: list[int] = []
    logits = drafter.begin(state)[None]  # (1, V): the root's
    frontier = [-1]
    for level, width in enumerate(widths):
        top = logits.topk(width, dim=-1).indices.tolist()  # (len(frontier), width)
        first = len(tokens)
        for node, children in zip(frontier, top):
            tokens += children
            parents += [node] * width
        frontier = list(range(first, len(tokens)))
        if level < len(widths) - 1:
            logits = drafter.extend(tokens, parents, len(frontier))
    return tokens, parents


# ---------------------------------------------------------------------------- drafters


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
    that into a distribution for t_{i+2}. Drafting feeds its own predicted features back in."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        # one decoder layer shaped like the target's, with a narrow MLP: every draft step reads
        # all of its weights, so its size is the drafting cost
        self.cfg = ModelConfig(**{**cfg.to_dict(), "n_layers": 1, "ffn_hidden": hidden or cfg.dim})
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(self.cfg, 0)

    def forward(self, features, token_emb, cache: KVCache | None = None, positions=None, mask=None):
        """features, token_emb (1 or B, T, dim) -> predicted next features (B, T, dim).
        Without a mask: causal, after the cached entries. With one: tree nodes at ``positions``."""
        x = self.fc(torch.cat([features, token_emb], dim=-1))
        T, start = x.size(1), (cache.length if cache is not None else 0)
        if mask is None:
            positions = torch.arange(start, start + T, device=x.device)
            x = self.block(x, *_rope(self.cfg, positions, x.dtype), cache)
        else:
            x = _tree_block(self.block, x, *_rope(self.cfg, positions, x.dtype), cache, mask)
        if cache is not None:
            cache.length += T
        return x

    def new_cache(self, capacity: int) -> KVCache:
        w = self.fc.weight
        return KVCache(1, 1, self.cfg.n_kv_heads, capacity, self.cfg.head_dim, w.device, w.dtype)


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
    only, and each round's drafted entries (built from predicted features) are rolled back."""

    name = "EAGLE head"

    def __init__(self, head: EagleHead, target: Transformer):
        super().__init__()
        self.head, self.target = head, target
        self.vocab_size, self.max_seq_len = target.cfg.vocab_size, target.cfg.max_seq_len

    def reset(self, state):
        super().reset(state)
        self.cache = self.head.new_cache(state.capacity)

    def begin(self, state):
        self.calls += 1
        start = self.cache.length  # entries 0 .. start-1 are built; entry j is (f_j, t_{j+1})
        feats = state.features[start:state.n - 1][None]
        emb = self.target.tok_embeddings(state.tokens[:, start + 1:state.n])
        out = self.head(feats, emb, self.cache)  # (1, L, dim)
        self.prefix = self.cache.length  # n - 1 entries, the root's included
        self.root_feature, self.node_features = out[0, -1], []
        return self.target.output(out[0, -1])

    def extend(self, tokens, parents, n_new):
        self.calls += 1
        new_parents = parents[-n_new:]
        feats = torch.stack([self.root_feature if p < 0 else self.node_features[p] for p in new_parents])[None]
        emb = self.target.tok_embeddings(torch.tensor(tokens[-n_new:], device=feats.device))[None]
        if _is_chain_tail(parents, n_new):
            out = self.head(feats, emb, self.cache)
        else:
            positions = self.prefix + torch.tensor(tree_depths(parents)[-n_new:], device=feats.device)
            mask = tree_attention_mask(parents, self.prefix, slice(len(parents) - n_new, None))
            out = self.head(feats, emb, self.cache, positions, mask)
        self.node_features += list(out[0])
        return self.target.output(out[0])

    def rollback(self, state):
        self.cache.truncate(self.prefix)


# ---------------------------------------------------------------------------- training heads on the target


@dataclass(frozen=True)
class HeadSpec:
    """How a drafting head is built and trained on a frozen target."""

    kind: str  # "medusa", "mtp" or "eagle"
    depth: int = 4  # Medusa heads / MTP modules: how far ahead it can draft (EAGLE: unlimited)
    steps: int = 200
    batch_size: int = 8  # windows per step
    seq_len: int = 128
    lr: float = 3e-3
    n_windows: int = 96  # windows of training text whose target features are computed once
    seed: int = 0

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose one of {HEAD_KINDS}")
        for name in ("depth", "steps", "batch_size", "seq_len", "n_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"HeadSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.depth + 2 > self.seq_len:
            raise ValueError(f"seq_len={self.seq_len} is too short to train depth {self.depth}: need depth + 2 tokens")


HEAD_KINDS = ("medusa", "mtp", "eagle")
HEADS_FORMAT = 1
# what the notebook and the benchmark train on the zoo target: about a minute of CPU in all, once
HEAD_SPECS = {
    "medusa": HeadSpec("medusa", depth=4, steps=120),
    "mtp": HeadSpec("mtp", depth=4, steps=120),
    "eagle": HeadSpec("eagle", steps=200),
}  # bump when the way heads are trained changes: cached heads are retrained


def new_head(spec: HeadSpec, target: Transformer) -> nn.Module:
    if spec.kind == "medusa":
        return MedusaHeads(target.cfg.dim, spec.depth)
    if spec.kind == "mtp":
        return MTPHeads(target.cfg, spec.depth)
    return EagleHead(target.cfg)


def make_drafter(head: nn.Module, target: Transformer) -> Drafter:
    """The Drafter that drafts with a trained head."""
    if isinstance(head, MedusaHeads):
        return MedusaDrafter(head, target)
    if isinstance(head, MTPHeads):
        return MTPDrafter(head, target)
    if isinstance(head, EagleHead):
        return EagleDrafter(head, target)
    raise ValueError(f"no drafter for a {type(head).__name__}; expected MedusaHeads, MTPHeads or EagleHead")


@torch.no_grad()
def target_features(target: Transformer, ids: torch.Tensor, n_windows: int, seq_len: int, seed: int = 0):
    """Random windows of ``ids`` (N, T) and the target's final hidden states on them (N, T, dim):
    the heads train on these, so the target runs once, not once per step."""
    if len(ids) <= seq_len:
        raise ValueError(f"need more than seq_len={seq_len} training tokens, got {len(ids)}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(ids) - seq_len, (n_windows,), generator=gen).tolist()
    dev = target.tok_embeddings.weight.device
    tokens = torch.stack([ids[s:s + seq_len] for s in starts]).long().to(dev)
    features = torch.cat([target(chunk, return_hidden=True)[1] for chunk in tokens.split(16)])
    return tokens, features


def _soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's own distribution (self-distillation): the heads learn
    to predict what the target would say, which is what verification accepts."""
    return -(F.softmax(target_logits.float(), -1) * F.log_softmax(logits.float(), -1)).sum(-1).mean()


def head_loss(head: nn.Module, target: Transformer, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Training loss on windows tokens (B, T) with target features (B, T, dim).

    The target's logits at position j, output(f_j), are its distribution for t_{j+1}."""
    with torch.no_grad():
        target_logits = target.output(features)  # (B, T, V)
    if isinstance(head, MedusaHeads):  # head k at position i guesses t_{i+k+2}: the target's at i+k+1
        states = head(features)  # (B, T, K, dim)
        losses = [_soft_ce(target.output(states[:, :-(k + 1), k]), target_logits[:, k + 1:])
                  for k in range(head.n_heads)]
        return sum(losses) / len(losses)
    emb = target.tok_embeddings(tokens).detach()
    if isinstance(head, MTPHeads):  # module k at i sees t_{i+k+1}, guesses t_{i+k+2}
        h, losses = features, []
        for k in range(head.depth):
            h, out = head.step(k, h[:, :-1], emb[:, k + 1:])
            losses.append(_soft_ce(target.output(out), target_logits[:, k + 1:]))
        return sum(losses) / len(losses)
    # EAGLE: entry (f_i, t_{i+1}) predicts f_{i+1}; regression on features plus the token loss.
    # Noise on the input features mimics the error of the head's own predicted features.
    noisy = features[:, :-1] + 0.1 * (torch.rand_like(features[:, :-1]) - 0.5)
    predicted = head(noisy, emb[:, 1:])
    regression = F.smooth_l1_loss(predicted, features[:, 1:])
    return regression + 0.5 * _soft_ce(target.output(predicted), target_logits[:, 1:])


def train_head(spec: HeadSpec, target: Transformer, train_ids: torch.Tensor, progress: bool = False) -> nn.Module:
    """Train a drafting head on the frozen target's hidden states (AdamW, cosine schedule)."""
    from tqdm.auto import tqdm

    key = (_fingerprint(target, train_ids, None), spec.n_windows, spec.seq_len, spec.seed)
    if key not in _FEATURES:  # the heads of one target share its features: compute them once
        _FEATURES.clear()
        _FEATURES[key] = target_features(target, train_ids, spec.n_windows, spec.seq_len, spec.seed)
    tokens, features = _FEATURES[key]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        head = new_head(spec, target).to(features.device)
    for p in target.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    optimizer = torch.optim.AdamW(head.parameters(), lr=spec.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, spec.steps, eta_min=spec.lr * 0.1)
    head.train()
    try:
        for _ in tqdm(range(spec.steps), desc=f"train {spec.kind}", disable=not progress, leave=False):
            rows = torch.randint(len(tokens), (spec.batch_size,), generator=gen).to(tokens.device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))  # the EAGLE noise
                loss = head_loss(head, target, tokens[rows], features[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        for p in target.parameters():
            p.requires_grad_(True)
    return head.eval()


_FEATURES: dict = {}  # the last target_features computed for training, by fingerprint


def _fingerprint(target: Transformer, train_ids: torch.Tensor, spec: HeadSpec | None) -> str:
    """Hash of the target's weights, the training tokens and the spec: what a trained head depends on."""
    h = hashlib.sha256()
    for name, t in sorted(target.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    h.update(train_ids.cpu().numpy().tobytes())
    h.update(repr((HEADS_FORMAT, target.cfg.to_dict(), asdict(spec) if spec else None)).encode())
    return h.hexdigest()[:20]


def load_head(spec: HeadSpec, target: Transformer, train_ids: torch.Tensor, progress: bool = True) -> nn.Module:
    """A head for this target: loaded from ``cache_dir()/specdec`` if trained before (same
    target weights, data and spec), else trained now and cached."""
    from llmsys.cache import atomic_write_bytes, cache_dir

    path = cache_dir() / "specdec" / f"{spec.kind}-{_fingerprint(target, train_ids, spec)}.pt"
    dev = target.tok_embeddings.weight.device
    if path.exists():
        try:
            head = new_head(spec, target)
            head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return head.to(dev).eval()
        except Exception:  # a damaged file: train again and overwrite it
            pass
    head = train_head(spec, target, train_ids, progress=progress)
    buffer = io.BytesIO()
    torch.save({k: v.cpu() for k, v in head.state_dict().items()}, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    return head


@torch.no_grad()
def head_accuracy(head: nn.Module, target: Transformer, tokens: torch.Tensor, features: torch.Tensor) -> list[float]:
    """Top-1 agreement with the target's argmax at each draft depth, on held-out windows
    (teacher-forced: depth k sees the true tokens before it)."""
    target_top = target.output(features).argmax(-1)  # (B, T)
    if isinstance(head, MedusaHeads):
        states = head(features)
        return [(target.output(states[:, :-(k + 1), k]).argmax(-1) == target_top[:, k + 1:]).float().mean().item()
                for k in range(head.n_heads)]
    emb = target.tok_embeddings(tokens)
    if isinstance(head, MTPHeads):
        h, out_acc = features, []
        for k in range(head.depth):
            h, out = head.step(k, h[:, :-1], emb[:, k + 1:])
            out_acc.append((target.output(out).argmax(-1) == target_top[:, k + 1:]).float().mean().item())
        return out_acc
    predicted = head(features[:, :-1], emb[:, 1:])
    return [(target.output(predicted).argmax(-1) == target_top[:, 1:]).float().mean().item()]


# ---------------------------------------------------------------------------- measuring methods side by side


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def call_seconds(model: Transformer, context: int, new_tokens: int, repeats: int = 30) -> float:
    """Median time of one forward over ``new_tokens`` tokens after ``context`` cached ones: CPU
    time of this process on a CPU (robust to other processes sharing the cores), wall time on a GPU."""
    dev = model.tok_embeddings.weight.device
    cache = model.new_cache(1)
    model(torch.zeros(1, context, dtype=torch.long, device=dev), cache)
    x = torch.zeros(1, new_tokens, dtype=torch.long, device=dev)
    clock = time.perf_counter if dev.type == "cuda" else time.process_time
    times = []
    for i in range(repeats + 5):  # the first few calls warm caches and allocators: not timed
        _sync()
        start = clock()
        model(x, cache)
        _sync()
        if i >= 5:
            times.append(clock() - start)
        cache.truncate(context)
    times.sort()
    return times[len(times) // 2]


def measure_methods(methods: dict, prompts: list, new_tokens: int, temperature: float = 0.0, reference=None,
                    warmup: bool = True) -> list[dict]:
    """Run every decoding method on every prompt, round-robin (so that a machine shared with
    other work slows them all alike), and total what they did.

    ``methods`` maps a name to fn(prompt, new_tokens, temperature, generator) -> (tokens, stats);
    ``reference`` (optional) holds the expected output per prompt, for the lossless check.
    Each row: wall and CPU seconds, tokens/s by both clocks, tokens per target call, acceptance,
    and 'exact' (outputs equal to the reference, or None)."""
    rows = {name: {"method": name, "wall": 0.0, "cpu": 0.0, "rounds": 0, "accepted": 0, "reached": 0,
                   "exact": True if reference is not None else None} for name in methods}
    if warmup:
        for fn in methods.values():
            fn(prompts[0], min(8, new_tokens), temperature, torch.Generator().manual_seed(0))
    for i, prompt in enumerate(prompts):
        for name, fn in methods.items():
            row = rows[name]
            _sync()
            wall, cpu = time.perf_counter(), time.process_time()
            out, stats = fn(prompt, new_tokens, temperature, torch.Generator().manual_seed(i))
            _sync()
            row["wall"] += time.perf_counter() - wall
            row["cpu"] += time.process_time() - cpu
            row["rounds"] += stats.rounds
            row["accepted"] += sum(stats.accepted)
            row["reached"] += stats.reached
            if reference is not None:
                row["exact"] &= torch.equal(out.cpu(), reference[i].cpu())
    tokens = new_tokens * len(prompts)
    for row in rows.values():
        row["tok_s_wall"], row["tok_s_cpu"] = tokens / row["wall"], tokens / row["cpu"]
        row["tokens_per_call"] = (row["accepted"] + row["rounds"]) / max(1, row["rounds"])
        row["acceptance"] = row["accepted"] / row["reached"] if row["reached"] else float("nan")
    return list(rows.values())


def format_table(rows: list[dict], title: str = "") -> str:
    """The rows of ``measure_methods`` as text, speedups relative to the first row."""
    base = rows[0]
    lines = [title] if title else []
    lines.append(f"{'method':<30} {'tok/s wall':>10} {'speedup':>8} {'tok/s cpu':>10} {'speedup':>8} "
                 f"{'tok/call':>9} {'accept':>7} {'lossless':>9}")
    for r in rows:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        accept = "-" if r["acceptance"] != r["acceptance"] else f"{r['acceptance']:.2f}"
        lines.append(f"{r['method']:<30} {r['tok_s_wall']:>10.1f} {r['tok_s_wall'] / base['tok_s_wall']:>7.2f}x "
                     f"{r['tok_s_cpu']:>10.1f} {r['tok_s_cpu'] / base['tok_s_cpu']:>7.2f}x "
                     f"{r['tokens_per_call']:>9.2f} {accept:>7} {exact:>9}")
    return "\n".join(lines)


def standard_methods(target: Transformer, draft: Transformer | None = None, heads: dict | None = None,
                     gamma: int = 4, widths=(3, 2, 1)) -> dict:
    """Target-only decoding plus a chain and a tree for every drafter given: name -> fn."""
    methods = {"target only": lambda p, n, t, g: autoregressive_decode(target, p, n, t, generator=g)}
    drafters = {}
    if draft is not None:
        drafters["draft model"] = lambda: ModelDrafter(draft)
    for kind, head in (heads or {}).items():
        drafters[{"medusa": "Medusa heads", "mtp": "MTP heads", "eagle": "EAGLE head"}.get(kind, kind)] = (
            lambda head=head: make_drafter(head, target))
    label = "x".join(map(str, widths))
    for name, make in drafters.items():
        g = min(gamma, make().max_depth or gamma)
        methods[f"{name}, chain γ={g}"] = (
            lambda p, n, t, gen, make=make, g=g: speculative_decode(target, make(), p, n, g, t, generator=gen))
        methods[f"{name}, tree {label}"] = (
            lambda p, n, t, gen, make=make: tree_decode(target, make(), p, n, widths, t, generator=gen))
    return methods


# ---------------------------------------------------------------------------- checking losslessness


def chi_square_test(counts: torch.Tensor, probs_expected: torch.Tensor, min_expected: float = 5.0):
    """Pearson's goodness-of-fit test of observed ``counts`` against a distribution.

    Cells expected to hold fewer than ``min_expected`` samples are pooled into one (the
    chi-square approximation needs a handful per cell). Returns (statistic, degrees of
    freedom, p-value); a p-value below a threshold a rejects 'these samples come from the
    distribution' and, when they do, happens with probability a (the false-alarm rate)."""
    counts, probs_expected = counts.double().flatten(), probs_expected.double().flatten()
    if counts.shape != probs_expected.shape:
        raise ValueError(f"counts and probabilities need one entry per cell, "
                         f"got {counts.numel()} and {probs_expected.numel()}")
    n = counts.sum()
    expected = n * probs_expected / probs_expected.sum()
    small = expected < min_expected
    if small.any():  # pool the small cells
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    if (counts[~keep] > 0).any():
        return float("inf"), int(keep.sum()) - 1, 0.0  # a sample where the distribution has no mass
    counts, expected = counts[keep], expected[keep]
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    if df < 1:
        return float(statistic), df, 1.0
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), statistic / 2)
    return float(statistic), df, float(p_value)
