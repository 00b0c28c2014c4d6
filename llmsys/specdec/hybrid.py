"""A hybrid drafter: suffix decoding where the workload repeats itself, a model drafter elsewhere.

Suffix decoding drafts for free but only where the sequence matches something seen before (an
agent re-emitting the code it read); between such stretches it has nothing to say. A trained
head (EAGLE) drafts anywhere, for a few percent of a step per level. Each round the hybrid asks
the tries first: when the tokens they expect to be accepted (the sum of their nodes' chances)
reach ``min_expected``, their tree is verified; otherwise the model drafter grows an EAGLE-2
dynamic tree. The model drafter's cache catches up on the rounds it sat out when next asked.

    hybrid = HybridDrafter(target.cfg.vocab_size, EagleDrafter(head, target))
    out, stats = suffix_decode(target, hybrid, prompt, 128, temperature=1.0)
"""

from __future__ import annotations

from llmsys.specdec.decode import draft_dynamic_tree
from llmsys.specdec.drafters import Drafter
from llmsys.specdec.suffix import SuffixDrafter


class HybridDrafter(SuffixDrafter):
    """``SuffixDrafter``'s tries, with ``model`` (any ``Drafter``) drafting a dynamic tree of ``dynamic`` =
    (depth, nodes expanded per level, nodes verified) where the tries expect fewer than ``min_expected`` tokens."""

    name = "hybrid"

    def __init__(self, vocab_size: int, model: Drafter, dynamic: tuple[int, int, int] = (6, 4, 12),
                 min_expected: float = 1.0, **suffix_settings):
        super().__init__(vocab_size, **suffix_settings)
        if (not isinstance(dynamic, tuple) or len(dynamic) != 3
                or any(not isinstance(v, int) or v < 1 for v in dynamic) or dynamic[2] > self.max_nodes):
            raise ValueError(f"dynamic = (depth, expand, nodes) must be >= 1 with nodes <= max_nodes "
                             f"({self.max_nodes}), got {dynamic!r}")
        if not min_expected > 0:
            raise ValueError(f"min_expected (tokens the tries must expect to draft instead of the model) must be "
                             f"> 0, got {min_expected!r}")
        self.model, self.dynamic, self.min_expected = model, dynamic, min_expected
        self.model_rounds = 0  # rounds the model drafted

    def reset(self, state) -> None:
        super().reset(state)
        self.model.reset(state)
        self.model_rounds = 0

    def grow(self, state, depth: int) -> tuple[list[int], list[int]]:
        tokens, parents, chances = self.scored_draft(state.tokens[0, :state.n].tolist(), depth)
        if sum(chances) >= self.min_expected:
            return self.worth_verifying(tokens, parents, chances)
        self.model_rounds += 1
        model_depth, expand, nodes = self.dynamic
        before = self.model.calls
        tree = draft_dynamic_tree(self.model, state, min(depth, model_depth), expand, nodes)
        self.calls += self.model.calls - before  # the round's drafting calls are the model's too
        return tree

    def fork(self, prompt):
        raise ValueError("a HybridDrafter drafts for one request at a time (its model drafter holds that request's "
                         "cache); a serving engine forks a SuffixDrafter per request")

    def rollback(self, state) -> None:
        super().rollback(state)
        self.model.rollback(state)
