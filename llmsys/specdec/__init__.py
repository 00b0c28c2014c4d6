"""Speculative decoding: a cheap drafter proposes, the target verifies many tokens in one pass.

Decoding one token at a time is memory-bound: every weight is read for one token's
worth of arithmetic. On a GPU, or on a CPU with a model in bf16 too big for its caches,
scoring a few tokens in one forward call costs about as much as scoring one (see
benchmarks/specdec.py). Speculative decoding turns that slack into speed: a drafter
guesses γ tokens, the target scores them all at once, and a rejection rule keeps
exactly the target's output distribution (Leviathan et al., arXiv 2211.17192;
Chen et al., arXiv 2302.01318).

The package, file by file:

- ``theory``: α = Σ min(p, q), expected tokens per target call, speedup with a cost ratio c,
  and the chi-square test the losslessness checks use;
- ``verify``: one verification step, ``accept_reject`` (sampling) and ``greedy_accept``;
- ``trees``: ``tree_attention_mask``, ``tree_forward`` (one target pass over a whole tree of
  drafts), ``keep_in_cache`` (compact the accepted branch);
- ``drafters``: a small model (``ModelDrafter``), Medusa heads, MTP heads and an EAGLE-style
  feature-level head;
- ``suffix``: suffix decoding's tries over the request and the workload, and its drafter;
- ``hybrid``: suffix decoding where the tries expect a long accepted run, a model drafter elsewhere;
- ``decode``: ``autoregressive_decode`` (the baseline), ``speculative_decode`` (a chain of γ
  drafts), ``tree_decode`` (a static tree of drafts), ``dynamic_tree_decode`` (EAGLE-2's
  trees shaped by the drafter's confidence) and ``suffix_decode`` (trees from what the
  workload has already said);
- ``heads``: training heads on the frozen target's hidden states, cached by the zoo (``load_head``);
- ``chat``: drafters for the real chat model (SmolLM2-135M-Instruct), built by the zoo;
- ``eagle_data``: the EAGLE head's self-distilled answers, served by the continuous-batching engine;
- ``measure``: call costs, cost curves, the sampled ceiling and methods measured side by side;
- ``planning``: the dtype, drafter and γ that this machine's measured cost curves favour.

    from llmsys.core import zoo
    from llmsys import specdec
    target, draft = zoo.load("target"), zoo.load("draft")
    out, stats = specdec.speculative_decode(target, draft, prompt, 64, gamma=4, temperature=1.0)
    print(stats.tokens_per_round, stats.acceptance_rate)
    mtp = specdec.load_head(specdec.HEAD_SPECS["mtp"], target, zoo.dataset()[0])  # cached after one training
    out, stats = specdec.tree_decode(target, specdec.make_drafter(mtp, target), prompt, 64, widths=(3, 2, 1))
"""

from llmsys.specdec.decode import (DecodeState, DecodeStats, autoregressive_decode, draft_chain, draft_dynamic_tree,
                                   draft_tree, dynamic_tree_decode, speculative_decode, suffix_decode, tree_decode)
from llmsys.specdec.drafters import (Drafter, EagleDrafter, EagleHead, MedusaDrafter, MedusaHeads, ModelDrafter,
                                     MTPDrafter, MTPHeads, PromptLookupDrafter, as_drafter)
from llmsys.specdec.heads import (HEAD_KINDS, HEAD_SPECS, HeadSpec, frequent_tokens, head_accuracy, head_loss, load_head,
                                  make_drafter, new_head, target_features, train_head)
from llmsys.specdec.hybrid import HybridDrafter
from llmsys.specdec.measure import (call_seconds, cost_curves, format_table, measure_methods, sampled_ceiling,
                                    standard_methods)
from llmsys.specdec.planning import Plan, best_tree_size, call_cost, plan, ridge_point
from llmsys.specdec.suffix import SuffixDrafter, SuffixTrie
from llmsys.specdec.theory import (acceptance_rate, best_gamma, best_gamma_by_position, chi_square_test, expected_speedup, expected_tokens,
                                   expected_tokens_by_position)
from llmsys.specdec.trees import (keep_in_cache, target_cache, tree_ancestors, tree_attention_mask, tree_depths,
                                  tree_forward, tree_size)
from llmsys.specdec.verify import accept_reject, greedy_accept, probs
