"""Speculative decoding inside the engine: drafts per request, verified in the batched step.

A greedy request's decode step may carry drafts after the token sampled last step:
a chain (prompt lookup) or a tree (suffix decoding, chapter 4's ``specdec.suffix``).
The target scores the root and every draft in the same flat batch (one chunk, under
a tree attention mask), follows the drafts while they equal its own argmax and adds
its token at the first mismatch (``walk_greedy``), so the output is exactly greedy
decoding's. The keys and values of the accepted branch are moved to consecutive
positions and the blocks that held only rejected drafts go back to the pool.

Drafters:
- prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's n-gram speculator): find
  the latest earlier occurrence of the sequence's last n tokens (n = 3, then 2, then 1)
  and propose the γ tokens that followed it. No model, so servers offer it for any model.
- suffix decoding (Oliaro et al., arXiv 2411.04975): each running request keeps its own
  ``SuffixDrafter`` (a trie over its prompt and output) sharing one workload trie with
  the others, which learns every finished output; agents re-emit what they have seen.

When speculation stops paying: a step of B decodes with d drafts each computes B·(1 + d)
tokens. While the step is memory-bound that costs about as much as B tokens; once every
token costs its own compute, a rejected draft is pure loss. So with a ``cost_curve`` of the
engine's own steps (``step_cost_curve``: B one-token decodes at a context) a step drafts
only while a draft token's expected saving, the acceptance rate so far times plain decoding's
cost per token at this batch, is at least what it adds to the step (``specdec.draft_budget``):
small batches draft freely, a compute-bound batch not at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmsys.core.timing import median_seconds
from llmsys.serving.blocks import blocks_for
from llmsys.serving.paged import Chunk, PagedKVCache, paged_forward
from llmsys.specdec.planning import draft_budget, ridge_point
from llmsys.specdec.suffix import SuffixDrafter

DRAFTERS = ("suffix", "prompt lookup")


def prompt_lookup(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest matching suffix n-gram: the latest
    occurrence with k tokens after it, else the latest one (a match just before the end has few)."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix, found = tokens[-n:], None
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first, excluding the suffix itself
            if tokens[start:start + n] == suffix:
                found = found or tokens[start + n:start + n + k]
                if start + n + k <= len(tokens):
                    return tokens[start + n:start + n + k]
        if found:
            return found
    return []


def walk_greedy(drafts: list[int], parents: list[int], target: list[int], stop_ids=()) -> tuple[list[int], list[int]]:
    """Greedy verification of a draft tree (parents[i]: node i's parent, -1 under the root; a chain is
    [-1, 0, 1, ...]). ``target``: the target's argmax at the root, then at every node. From the root, move to
    the child drafted with the target's token while there is one; then add the target's own token; cut after
    a stop token. Returns (accepted node indices, root to leaf; new tokens)."""
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, drafts))}
    path, node = [], -1
    while (child := children.get((node, target[node + 1]))) is not None:
        path.append(child)
        node = child
    new = [drafts[i] for i in path] + [target[node + 1]]
    for i, t in enumerate(new):
        if t in stop_ids:
            return path[:i + 1], new[:i + 1]
    return path, new


def step_cost_curve(model, context: int = 512, sizes=(1, 2, 4, 8, 16, 32, 64, 128), block_size: int = 16,
                    reps: int = 3) -> dict[int, float]:
    """{B: seconds of one engine step of B one-token decodes, each after ``context`` cached tokens}: the cost of
    the engine's own batched steps (per-sequence attention and bookkeeping included, which one sequence scoring
    B tokens does not pay), the curve ``Speculation.cost_curve`` wants."""
    per_sequence = blocks_for(context + 1, block_size)
    cache = PagedKVCache(model, per_sequence * max(sizes), block_size)
    curve = {}
    for b in sizes:
        chunks = [Chunk([1], context, list(range(i * per_sequence, (i + 1) * per_sequence))) for i in range(b)]
        curve[b] = median_seconds(lambda: paged_forward(model, cache, chunks), reps=reps, device=cache.device)
    return curve


@dataclass(frozen=True)
class Speculation:
    """How the engine speculates. ``gamma``: the deepest draft (prompt lookup: the chain's length);
    ``nodes``: the most draft tokens per request per step (suffix trees); ``cost_curve``:
    {tokens per step: seconds} of the engine's steps on this machine (``step_cost_curve``), which
    decides how many draft tokens a step may add (None: no limit)."""
    drafter: str = "suffix"
    gamma: int = 8
    nodes: int = 16
    cost_curve: dict | None = field(default=None, hash=False)

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        for name, value in (("gamma", self.gamma), ("nodes", self.nodes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.cost_curve is not None:
            ridge_point(self.cost_curve)  # checks the curve


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)


class Speculator:
    """The engine's drafting state: one drafter per running request, the workload trie, counters."""

    def __init__(self, spec: Speculation, vocab_size: int):
        self.spec = spec
        self.workload = SuffixDrafter(vocab_size, max_nodes=spec.nodes, max_draft_depth=spec.gamma)
        self.drafters: dict[int, SuffixDrafter] = {}  # by sequence key
        self.switched_off = 0  # decodes left without drafts because the step had reached the ridge point

    def budget(self, planned_tokens: int, accepted: int, drafted: int) -> float:
        """Draft tokens a step that computes ``planned_tokens`` tokens may add, at the acceptance rate so far
        (``accepted`` of ``drafted``, with one kept and one rejected assumed before any)."""
        if self.spec.cost_curve is None:
            return math.inf
        return draft_budget(self.spec.cost_curve, max(planned_tokens, 1), (accepted + 1) / (drafted + 2))

    def propose(self, seq, tokens: list[int], depth: int, budget: float) -> Draft:
        """A draft of at most ``budget`` tokens and ``depth`` levels after ``tokens`` (the sequence's committed
        tokens and the root)."""
        if budget < 1:
            self.switched_off += 1
            return Draft()
        limit = int(min(budget, self.spec.nodes if self.spec.drafter == "suffix" else self.spec.gamma))
        depth = min(depth, self.spec.gamma, limit)
        if depth < 1:
            return Draft()
        if self.spec.drafter == "prompt lookup":
            chain = prompt_lookup(tokens, depth)
            return Draft(chain, list(range(-1, len(chain) - 1)))
        drafter = self.drafters.get(seq.key)
        if drafter is None:
            drafter = self.drafters[seq.key] = self.workload.fork(tokens)
        return Draft(*drafter.draft(tokens, depth, limit))

    def finish(self, seq) -> None:
        """A request ended: its output joins the workload trie (suffix decoding), its drafter goes."""
        self.drafters.pop(seq.key, None)
        if self.spec.drafter == "suffix" and seq.status == "finished":
            self.workload.remember(seq.output)
