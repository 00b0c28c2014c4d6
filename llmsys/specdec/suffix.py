"""Suffix decoding (Oliaro et al., "SuffixDecoding", NeurIPS 2025, arXiv 2411.04975): drafting
without a model, for workloads that repeat themselves. An agent re-emits the code it read, the
tool output it was shown, the JSON it wrote a turn ago; a suffix tree over what has been seen
finds the longest stretch that matches the end of the sequence and proposes what followed it.

Two tries hold every substring (up to ``depth`` tokens) with its count: one per request, over
its prompt and the output so far, and one for the whole workload, over earlier outputs. Each
round the drafter matches the longest suffix of the sequence (up to ``max_match`` tokens) in
both, and grows a draft tree from the matched node, most frequent continuations first. How
far it speculates adapts to the match: a match of m tokens earns at most ``factor`` · m draft
nodes (a long match is likely a copy, a short one a coincidence). The tree is verified in one
target call by ``decode.suffix_decode``; the verification keeps the target's distribution,
whatever the drafts.
"""

from __future__ import annotations

import heapq
import itertools
import math

from llmsys.specdec.drafters import Drafter
from llmsys.specdec.planning import best_tree_size, check_curve


class TrieNode:
    __slots__ = ("children", "count", "depth")

    def __init__(self, depth: int):
        self.children: dict[int, TrieNode] = {}
        self.count = 0
        self.depth = depth


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the sequences added, with its count: a
    suffix tree cut at ``depth``. ``extend`` continues the last sequence, so a request's trie
    grows one committed token at a time in O(depth) each."""

    def __init__(self, depth: int = 32):
        if not isinstance(depth, int) or depth < 2:
            raise ValueError(f"depth must be an integer >= 2 (tokens matched + drafted), got {depth!r}")
        self.depth = depth
        self.root = TrieNode(0)
        self.open: list[TrieNode] = []  # nodes of the suffixes that end at the last token added

    def add(self, tokens) -> None:
        """A new sequence (nothing continues across it)."""
        self.open = []
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for token in tokens:
            token = int(token)
            grown = []
            for node in [self.root, *self.open]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = TrieNode(node.depth + 1)
                child.count += 1
                if child.depth < self.depth:
                    grown.append(child)
            self.open = grown

    def match(self, context: list[int], max_match: int) -> tuple[TrieNode | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_match`` tokens) that has
        been seen followed by something, and its length; (None, 0) when there is none."""
        for m in range(min(max_match, len(context), self.depth - 1), 0, -1):
            node = self.root
            for token in context[-m:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, m
        return None, 0


def draft_from(node: TrieNode, budget: int, max_depth: int) -> tuple[list[int], list[int], list[float]]:
    """The ``budget`` most probable continuations under ``node`` as a tree, best first: a node's
    value is the product of count(child) / count(parent) along its path (the chance that the
    workload continues this way again). Returns (tokens, parents, each node's value); the values
    add up to the expected number of accepted tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    values: list[float] = []
    order = itertools.count()  # ties go to shallower nodes, then lower token ids, then the earlier pushed
    heap = [(-child.count / node.count, 1, token, next(order), child, -1) for token, child in node.children.items()]
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        negative, depth, token, _, child, parent = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        values.append(-negative)
        if depth < max_depth:
            for grand_token, grandchild in child.children.items():
                heapq.heappush(heap, (negative * grandchild.count / child.count, depth + 1, grand_token, next(order),
                                      grandchild, len(tokens) - 1))
    return tokens, parents, values


class SuffixDrafter(Drafter):
    """Drafts trees from a per-request trie and a workload trie (see the module's docstring).
    ``remember(tokens)`` adds a finished output to the workload trie; ``suffix_decode`` calls it."""

    name = "suffix"

    def __init__(self, vocab_size: int, depth: int = 32, max_match: int = 16, factor: float = 2.0,
                 max_nodes: int = 24, max_draft_depth: int = 16, cost_curve: dict[int, float] | None = None):
        super().__init__()
        for label, value in (("max_match", max_match), ("max_nodes", max_nodes), ("max_draft_depth", max_draft_depth)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
        if cost_curve is not None:
            check_curve(cost_curve)
        if not factor > 0:
            raise ValueError(f"factor (draft nodes per matched token) must be > 0, got {factor!r}")
        self.vocab_size, self.max_match, self.factor = vocab_size, max_match, factor
        self.max_nodes, self.max_draft_depth = max_nodes, max_draft_depth
        # the target's measured cost of scoring k tokens in one call ({k: seconds}, ``measure.cost_curves``):
        # with it, each tree keeps the nodes that pay for their place in the call (``planning.best_tree_size``)
        self.cost_curve = cost_curve
        self.workload = SuffixTrie(depth)
        self.request = SuffixTrie(depth)
        self.seen = 0

    def reset(self, state) -> None:
        super().reset(state)
        self.start(state.tokens[0, :state.n].tolist())

    def start(self, prompt) -> None:
        """A new request: its trie starts over ``prompt`` (the workload trie stays)."""
        self.request = SuffixTrie(self.workload.depth)
        self.request.add(prompt)
        self.seen = len(prompt)

    def fork(self, prompt) -> "SuffixDrafter":
        """A drafter for one more request served alongside others (a serving engine keeps one
        per running request): same settings, the same workload trie, its own request trie."""
        twin = SuffixDrafter(self.vocab_size, self.workload.depth, self.max_match, self.factor, self.max_nodes,
                             self.max_draft_depth, self.cost_curve)
        twin.workload = self.workload
        twin.start(prompt)
        return twin

    def grow(self, state, depth: int) -> tuple[list[int], list[int]]:
        """A draft tree of at most ``depth`` levels for the sequence committed so far, cut to the nodes worth
        verifying when the drafter knows the target's cost curve."""
        return self.worth_verifying(*self.scored_draft(state.tokens[0, :state.n].tolist(), depth))

    def worth_verifying(self, tokens: list[int], parents: list[int], chances: list[float]):
        """A scored tree (best node first) without the nodes that cost more than they are expected to save."""
        keep = len(tokens) if self.cost_curve is None else best_tree_size(chances, self.cost_curve)
        return tokens[:keep], parents[:keep]

    def draft(self, sequence: list[int], depth: int, budget: int | None = None) -> tuple[list[int], list[int]]:
        """A draft tree of at most ``depth`` levels and ``budget`` nodes (default ``max_nodes``) after
        ``sequence``, the request's committed tokens: the ones past those already seen join its trie."""
        tokens, parents, _ = self.scored_draft(sequence, depth, budget)
        return tokens, parents

    def scored_draft(self, sequence: list[int], depth: int, budget: int | None = None):
        """``draft``'s tree, best node first, with each node's chance of being accepted as the tries count it:
        (tokens, parents, chances)."""
        self.calls += 1
        self.request.extend(sequence[self.seen:])
        self.seen = len(sequence)
        context = sequence[-self.max_match:]
        limit = self.max_nodes if budget is None else min(budget, self.max_nodes)
        best = ([], [], [])
        for trie in (self.request, self.workload):
            node, matched = trie.match(context, self.max_match)
            if node is None:
                continue
            candidate = draft_from(node, min(limit, math.ceil(self.factor * matched)),
                                   min(depth, self.max_draft_depth))
            if sum(candidate[2]) > sum(best[2]):  # the tree with more tokens expected to be accepted
                best = candidate
        return best

    def remember(self, tokens) -> None:
        self.workload.add(tokens)
