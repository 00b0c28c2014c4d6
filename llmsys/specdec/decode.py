"""Decoding loops: the baseline, a chain of drafts with rejection sampling, a tree of drafts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmsys.core.model import Transformer, sample
from llmsys.specdec.drafters import Drafter, as_drafter
from llmsys.specdec.suffix import SuffixDrafter
from llmsys.specdec.theory import acceptance_rate
from llmsys.specdec.trees import keep_in_cache, target_cache, tree_attention_mask, tree_depths, tree_forward, tree_size
from llmsys.specdec.verify import accept_reject, greedy_accept, probs


@dataclass
class DecodeStats:
    """What a decoding run did. A round is one target verification call after the prefill."""

    method: str = ""
    new_tokens: int = 0
    target_calls: int = 0  # including the prefill
    draft_calls: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0  # wall time spent drafting (the rest: verifying and bookkeeping)
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
        clock = time.perf_counter()
        draft, q = draft_chain(drafter, state, g, temperature, top_k, generator)  # (g,), (g, V)
        stats.draft_seconds += time.perf_counter() - clock
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
    """Decoding with a static tree of drafts verified in one target pass.

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
    nodes = tree_size(widths)
    method = f"{drafter.name}, tree {'x'.join(map(str, widths))} ({nodes} nodes)"
    return decode_with_trees(target, drafter, prompt, max_new_tokens, lambda state, depth: draft_tree(
        drafter, state, widths[:depth]), len(widths), nodes, method, temperature, top_k, generator)


@torch.no_grad()
def dynamic_tree_decode(target: Transformer, drafter, prompt: torch.Tensor, max_new_tokens: int, depth: int = 6,
                        expand: int = 4, nodes: int = 12, temperature: float = 0.0, top_k: int | None = None,
                        generator: torch.Generator | None = None):
    """EAGLE-2's dynamic draft trees (Li et al., arXiv 2406.16858): the tree takes the shape of
    the drafter's confidence in this context instead of a fixed one.

    Expansion: at each of ``depth`` levels the drafter runs once on the ``expand`` nodes with the
    highest value (the product of draft probabilities along the path from the root, which
    approximates the chance the whole path is accepted) and proposes its ``expand`` best
    children under each. Reranking: of everything proposed, the ``nodes`` of highest value are
    verified in one target call (a child is never worth more than its parent, so they form a
    tree). Verification is ``tree_decode``'s: lossless at any temperature."""
    drafter = as_drafter(drafter)
    for name, value in (("depth", depth), ("expand", expand), ("nodes", nodes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    drafter.check_depth(depth)
    method = f"{drafter.name}, dynamic tree d={depth} k={expand} ({nodes} nodes)"
    return decode_with_trees(target, drafter, prompt, max_new_tokens, lambda state, d: draft_dynamic_tree(
        drafter, state, d, expand, nodes), depth, nodes, method, temperature, top_k, generator)


@torch.no_grad()
def suffix_decode(target: Transformer, drafter: SuffixDrafter, prompt: torch.Tensor, max_new_tokens: int,
                  temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None):
    """Suffix decoding (Oliaro et al., arXiv 2411.04975): each round a draft tree from the
    drafter's suffix tries (no model), verified like ``tree_decode``'s, so lossless at any
    temperature. The output then joins the drafter's workload trie, for the requests after."""
    if not isinstance(drafter, SuffixDrafter):
        raise ValueError(f"suffix_decode drafts with a SuffixDrafter, got {type(drafter).__name__}")
    out, stats = decode_with_trees(target, drafter, prompt, max_new_tokens, drafter.grow, drafter.max_draft_depth,
                                   drafter.max_nodes, f"suffix, up to {drafter.max_nodes} nodes", temperature, top_k,
                                   generator)
    drafter.remember(out[0, prompt.size(1):].tolist())
    return out, stats


def decode_with_trees(target, drafter, prompt, max_new_tokens, grow, depth, nodes, method, temperature, top_k,
                       generator):
    """The rounds of a tree method: grow(state, depth) -> (tokens, parents) of at most ``nodes``
    drafts, verified in one target call, the accepted branch kept."""
    _check_request(target, prompt, max_new_tokens, drafter)
    start = time.perf_counter()
    stats = DecodeStats(method=method)
    state = DecodeState(target, prompt, max_new_tokens, room=nodes + 1)
    drafter.reset(state)
    state.prefill(temperature, top_k, generator)
    while state.remaining > 0:
        round_depth = min(depth, state.remaining - 1)
        clock = time.perf_counter()
        tokens, parents = grow(state, round_depth) if round_depth else ([], [])
        stats.draft_seconds += time.perf_counter() - clock
        # the target's tree: the root (last committed token) as node 0, the drafts below it
        all_tokens = torch.cat([state.root[0], torch.tensor(tokens, dtype=torch.long, device=state.root.device)])
        all_parents = [-1] + [p + 1 for p in parents]
        prefix = state.n - 1
        positions = prefix + torch.tensor(tree_depths(all_parents), device=all_tokens.device)
        mask = tree_attention_mask(all_parents, prefix)
        logits, hidden = tree_forward(target, all_tokens[None], positions, mask, state.cache, return_hidden=True)
        path, next_token = _walk_tree(logits[0], all_tokens, all_parents, temperature, top_k, generator)
        keep_in_cache(state.cache, prefix, path)
        stats.drafted.append(max(tree_depths(all_parents)))
        stats.accepted.append(len(path) - 1)
        state.commit(all_tokens[path[1:]], next_token, hidden[0, path])
        drafter.rollback(state)
    stats.new_tokens, stats.target_calls, stats.draft_calls = max_new_tokens, 1 + stats.rounds, drafter.calls
    stats.seconds = time.perf_counter() - start
    return state.tokens, stats


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


@torch.no_grad()
def draft_dynamic_tree(drafter: "Drafter", state: DecodeState, depth: int, expand: int, nodes: int):
    """EAGLE-2's expand-then-rerank (see ``dynamic_tree_decode``). The drafter only ever sees
    the nodes it expands (its own tree, fed level by level); every proposed node is a
    candidate. Returns (tokens, parents) of the ``nodes`` best candidates, parents first."""
    cand_tokens: list[int] = []
    cand_parents: list[int] = []  # candidate index, -1 under the root
    cand_values = torch.empty(0)  # log of the product of draft probabilities along the path
    fed_tokens: list[int] = []  # the drafter's tree: expanded candidates only
    fed_parents: list[int] = []
    fed_index: dict[int, int] = {}  # candidate -> its index in the drafter's tree
    logits = drafter.begin(state)[None]  # (1, V)
    layer, layer_values = [-1], torch.zeros(1)  # nodes expanded this level (the root first)
    for level in range(depth):
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()  # (len(layer), V)
        top = logp.topk(expand, dim=-1)  # children of every expanded node
        child_values = (layer_values[:, None] + top.values).flatten()
        first = len(cand_tokens)
        cand_tokens += top.indices.flatten().tolist()
        cand_parents += [node for node in layer for _ in range(expand)]
        cand_values = torch.cat([cand_values, child_values])
        if level == depth - 1:
            break
        best = child_values.topk(min(expand, len(child_values))).indices.sort().values  # the next level's frontier
        layer = [first + int(i) for i in best]
        layer_values = child_values[best]
        for node in layer:
            fed_index[node] = len(fed_tokens)
            fed_tokens.append(cand_tokens[node])
            fed_parents.append(fed_index.get(cand_parents[node], -1))
        logits = drafter.extend(fed_tokens, fed_parents, len(layer))
    # rerank: the best `nodes` candidates; a child's value <= its parent's and ties go to the
    # lower index (the parent), so the kept set contains every kept node's ancestors
    values = cand_values.tolist()
    order = sorted(range(len(cand_tokens)), key=lambda i: (-values[i], i))[:nodes]
    kept = sorted(order)
    new_index = {old: new for new, old in enumerate(kept)}
    return [cand_tokens[i] for i in kept], [new_index.get(cand_parents[i], -1) for i in kept]
