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
tokens, and a drafting sequence's chunk leaves the batched decode path for a chunk of its
own under a tree mask. While the step is memory-bound the drafts cost little; once every
token costs its own compute, a rejected draft is pure loss. So with ``costs`` measured on
the engine's own steps (``step_costs``: B one-token decodes, and the same B sequences each
carrying a chain of drafts) a sequence verifies only the draft tokens whose expected
saving (each one's chance of being accepted, as the suffix tries count how often the
workload continued this way, times plain decoding's cost per token at this batch) most
exceeds their cost: a fixed cost for drafting at all, a cost per token, and the drafter's
own time (``StepCosts.worth_keeping``). Small batches draft freely, a compute-bound batch
not at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmsys.core.timing import median_seconds
from llmsys.serving.blocks import blocks_for
from llmsys.serving.paged import Chunk, PagedKVCache, paged_forward
from llmsys.serving.sampling import needs_draw
from llmsys.serving.scheduler import is_decode
from llmsys.specdec.planning import call_cost
from llmsys.specdec.suffix import SuffixDrafter

DRAFTERS = ("suffix", "prompt lookup")
MATCH = 8  # the longest context suffix the tries match: their depth is this plus the deepest draft


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


@dataclass(frozen=True)
class StepCosts:
    """Measured costs of the engine's steps, at one context length: ``plain`` {B: seconds of a step of B
    one-token decodes}; ``per_drafter`` {B: seconds a sequence adds to such a step by carrying drafts at all
    (its chunk leaves the batched decode path)}; ``per_draft`` {B: seconds each draft token adds}."""
    plain: dict
    per_drafter: dict
    per_draft: dict

    def __post_init__(self):
        for name, curve in (("plain", self.plain), ("per_drafter", self.per_drafter), ("per_draft", self.per_draft)):
            if (len(curve) < 2 or any(not isinstance(b, int) or b < 1 for b in curve)
                    or any(not isinstance(s, (int, float)) for s in curve.values())):
                raise ValueError(f"{name} must map at least two batch sizes >= 1 to seconds, got {curve!r}")

    def worth_keeping(self, batch: int, chances: list[float], drafting: float = 0.0) -> int:
        """How many of a sequence's draft tokens (best first, each with its chance of being accepted) to verify
        in a step of ``batch`` tokens: the count that most exceeds its cost, where each kept token is expected to
        save ``chance`` × plain decoding's cost per token and costs ``per_draft`` plus ``drafting`` seconds, and
        any draft at all costs ``per_drafter``; 0 when no count pays."""
        per_token = call_cost(self.plain, batch) / batch
        cost = max(call_cost(self.per_draft, batch), 0.0) + drafting
        best, gain, net = 0, -max(call_cost(self.per_drafter, batch), 0.0), 0.0
        for k, chance in enumerate(chances, start=1):
            gain += chance * per_token - cost
            if gain > net:
                best, net = k, gain
        return best


def step_costs(model, context: int = 256, sizes=(1, 2, 4, 8, 16, 32), drafts: int = 8, block_size: int = 16,
               reps: int = 3) -> StepCosts:
    """The engine's step costs on this machine: B one-token decodes after ``context`` tokens, then the same B
    sequences each verifying a chain of 1 and of ``drafts`` draft tokens (a chunk of its own under a tree mask,
    as the engine runs them), CPU time on a CPU (steady on a shared machine), wall time on a GPU."""
    per_sequence = blocks_for(context + 1 + drafts, block_size)
    cache = PagedKVCache(model, per_sequence * max(sizes), block_size)
    chain = [-1] + list(range(drafts))  # the root, then each draft under the one before

    def seconds(batch: int, depth: int) -> float:
        chunks = [Chunk([1] * (1 + depth), context, list(range(i * per_sequence, (i + 1) * per_sequence)),
                        chain[:1 + depth] if depth else None) for i in range(batch)]
        return median_seconds(lambda: paged_forward(model, cache, chunks), reps=reps, device=cache.device,
                              clock="cpu")

    plain = {b: seconds(b, 0) for b in sizes}
    one = {b: (seconds(b, 1) - plain[b]) / b for b in sizes}  # per sequence: switching + one token
    many = {b: (seconds(b, drafts) - plain[b]) / b for b in sizes}  # switching + ``drafts`` tokens
    per_draft = {b: (many[b] - one[b]) / (drafts - 1) for b in sizes}
    return StepCosts(plain, {b: one[b] - per_draft[b] for b in sizes}, per_draft)


@dataclass(frozen=True)
class Speculation:
    """How the engine speculates. ``gamma``: the deepest draft (prompt lookup: the chain's length);
    ``nodes``: the most draft tokens per request per step (suffix trees); ``costs``: the engine's
    step costs on this machine (``step_costs``), which decide which draft tokens pay (None: all)."""
    drafter: str = "suffix"
    gamma: int = 8
    nodes: int = 16
    costs: StepCosts | None = field(default=None, hash=False)

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        for name, value in (("gamma", self.gamma), ("nodes", self.nodes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.costs is not None and not isinstance(self.costs, StepCosts):
            raise ValueError(f"costs must be a StepCosts (serving.step_costs) or None, got {self.costs!r}")


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)


class Speculator:
    """The engine's drafting state: one drafter per running request, the workload trie, counters."""

    def __init__(self, spec: Speculation, vocab_size: int):
        self.spec = spec
        self.workload = SuffixDrafter(vocab_size, depth=MATCH + spec.gamma, max_match=MATCH, max_nodes=spec.nodes,
                                      max_draft_depth=spec.gamma)
        self.drafters: dict[int, SuffixDrafter] = {}  # by sequence key
        self.switched_off = 0  # decodes left without drafts because none of their draft tokens would pay
        self.drafting_seconds, self.drafted_tokens = 0.0, 0  # the drafters' own CPU time, and the tokens it gave

    def drafts(self, plan, blocks, cache, max_seq_len: int, acceptance: float) -> list[Draft]:
        """Drafts for a planned step's greedy decodes, as many tokens as each output, the context, the step costs
        (``propose``) and free blocks allow; their blocks are made ready here (the plan has the decoded token's).
        ``acceptance``: the engine's share of draft tokens kept so far, for prompt lookup chains."""
        batch = sum(n for _, n in plan.chunks) + len(plan.padding)  # tokens the step computes without drafts
        drafts = [Draft() for _ in plan.chunks]
        for i, (seq, n) in enumerate(plan.chunks):
            if needs_draw(seq) or seq.request.logprobs is not None or not is_decode(seq, n):
                continue  # plain greedy decodes only
            room = max_seq_len - len(seq.tokens)  # a node takes a slot
            draft = self.propose(seq, seq.tokens, seq.request.max_tokens - len(seq.output) - 1, room, batch,
                                 acceptance)
            if draft.tokens and blocks.can_prepare(seq.key, seq.num_computed, 1 + len(draft.tokens)):
                cache.copy_blocks(blocks.prepare(seq.key, seq.num_computed, 1 + len(draft.tokens)))
                drafts[i] = draft
        return drafts

    @staticmethod
    def keep_agreed(seq, n: int, draft: Draft, target: list[int], when: float, cache, blocks) -> tuple[int, list[int]]:
        """After a step that computed ``n`` tokens of ``seq`` and verified ``draft`` (``target``: the target's
        argmax at the root and every node): keep the drafts it agrees with, their keys and values moved right
        after the root, and give the blocks that held only rejected drafts back. Returns (drafts kept, the
        target's own tokens that follow them)."""
        path, new = walk_greedy(draft.tokens, draft.parents, target, seq.request.stop_ids)
        kept, first = len(path), seq.num_computed + n
        cache.move_slots(blocks.table(seq.key), [first + i for i in path], list(range(first, first + kept)))
        blocks.truncate(seq.key, first + kept + 1)
        seq.tokens += new[:kept]
        seq.output += new[:kept]
        seq.token_times += [when] * kept
        return kept, new[kept:]

    def propose(self, seq, tokens: list[int], depth: int, room: int, batch: int, acceptance: float) -> Draft:
        """A draft of at most ``depth`` levels and ``room`` tokens after ``tokens`` (the sequence's committed tokens
        and the root), keeping the tokens worth verifying in a step of ``batch`` tokens given each one's chance of
        being accepted (the suffix tries' count, or ``acceptance`` per level of a prompt lookup chain):
        ``StepCosts.worth_keeping``. Best tokens come first, so a kept token's parent is kept."""
        limit = min(room, self.spec.nodes if self.spec.drafter == "suffix" else self.spec.gamma)
        depth = min(depth, self.spec.gamma, limit)
        if depth < 1:
            return Draft()
        if self.spec.drafter == "prompt lookup":
            chain = prompt_lookup(tokens, depth)
            drafted, parents, chances = chain, list(range(-1, len(chain) - 1)), [acceptance ** (i + 1)
                                                                                 for i in range(len(chain))]
        else:
            start = time.process_time()
            drafter = self.drafters.get(seq.key)
            if drafter is None:
                drafter = self.drafters[seq.key] = self.workload.fork(tokens)
            drafted, parents, chances = drafter.scored_draft(tokens, depth, limit)
            self.drafting_seconds += time.process_time() - start
            self.drafted_tokens += len(drafted)
        keep = len(drafted)
        if self.spec.costs is not None:
            # the drafter's own time per token counts too: at large batches it is one of a step's largest extras
            keep = self.spec.costs.worth_keeping(batch, chances, self.drafting_seconds / max(self.drafted_tokens, 1))
            self.switched_off += keep == 0 < len(drafted)
        return Draft(drafted[:keep], parents[:keep])

    def finish(self, seq) -> None:
        """A request ended: its output joins the workload trie (suffix decoding), its drafter goes."""
        self.drafters.pop(seq.key, None)
        if self.spec.drafter == "suffix" and seq.status == "finished":
            self.workload.remember(seq.output)
