"""Suffix decoding: the tries count substrings, drafts follow the most frequent continuations,
and decoding with them keeps the target's output exactly (greedy) and in distribution (sampled)."""

import pytest
import torch

from llmsys import specdec as sd
from test_specdec import make_model, perturbed_copy  # tests/ is on sys.path: pytest puts it there

FALSE_ALARM = 1e-4


def repeating_prompt():
    """30 tokens: a random stretch of 10, another, then the first again (a copy to draft from)."""
    return torch.cat([torch.randint(0, 40, (1, 10), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 1)], 1)


def path_count(trie, tokens):
    node = trie.root
    for t in tokens:
        node = node.children.get(t)
        if node is None:
            return 0
    return node.count


def test_the_trie_counts_every_substring_up_to_its_depth():
    trie = sd.SuffixTrie(depth=3)
    trie.add([1, 2, 3, 1, 2, 4])
    assert path_count(trie, [1, 2]) == 2 and path_count(trie, [1]) == 2 and path_count(trie, [2, 3, 1]) == 1
    assert path_count(trie, [1, 2, 3, 1]) == 0  # deeper than depth 3
    assert sorted(trie.root.children[1].children[2].children) == [3, 4]
    streamed = sd.SuffixTrie(depth=3)
    streamed.add([1, 2])
    streamed.extend([3, 1])
    streamed.extend([2, 4])
    for sub in ([1, 2], [2, 3, 1], [3, 1, 2], [2, 4], [1, 2, 4]):
        assert path_count(streamed, sub) == path_count(trie, sub), sub
    trie.add([9, 1])  # a new sequence: nothing continues across the boundary
    assert path_count(trie, [4, 9]) == 0 and path_count(trie, [9, 1]) == 1


def test_match_finds_the_longest_suffix_seen_with_a_continuation():
    trie = sd.SuffixTrie(depth=8)
    trie.add([5, 6, 7, 8, 1, 6, 7, 9])
    node, length = trie.match([0, 5, 6, 7], max_match=4)
    assert length == 3 and list(node.children) == [8]
    node, length = trie.match([3, 6, 7], max_match=4)
    assert length == 2 and sorted(node.children) == [8, 9]
    assert trie.match([4, 4], max_match=4) == (None, 0)


def test_drafts_are_the_most_frequent_continuations_within_the_budget():
    trie = sd.SuffixTrie(depth=8)
    for seq in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5]):
        trie.add(seq)
    tokens, parents, chances = sd.suffix.draft_from(trie.root.children[1], budget=3, max_depth=4)
    # P(2) = 3/4 first, then P(2, 3) = 3/4 · 2/3 = 1/2, then P(5) = P(2, 4) = 1/4: the shallower first
    assert tokens == [2, 3, 5] and parents == [-1, 0, -1]
    assert chances == pytest.approx([0.75, 0.5, 0.25])
    tokens, parents, _ = sd.suffix.draft_from(trie.root.children[1], budget=10, max_depth=1)
    assert tokens == [2, 5] and parents == [-1, -1]


def test_forked_drafters_share_the_workload_trie_and_keep_their_own_request_trie():
    root = sd.SuffixDrafter(40, max_nodes=8)
    root.remember([5, 6, 7, 8, 9])  # an earlier output of the workload
    one, two = root.fork([1, 2, 3, 1, 2]), root.fork([4, 4])
    assert one.workload is two.workload is root.workload
    assert one.draft([1, 2, 3, 1, 2], depth=4)[0][0] == 3  # its own prompt: 1 2 was followed by 3
    assert two.draft([4, 4, 5, 6], depth=4) == ([7, 8, 9], [-1, 0, 1])  # the workload's output continues it
    assert len(two.draft([4, 4, 5, 6], depth=4, budget=2)[0]) == 2  # at most ``budget`` nodes
    assert one.draft([1, 2, 3, 1, 2, 9, 9], depth=1)[0] == [9]  # committed tokens join its trie: 9 was followed by 9


def test_greedy_suffix_decoding_equals_target_greedy_and_learns_from_the_workload():
    target = make_model(max_seq_len=160)
    drafter = sd.SuffixDrafter(40, max_nodes=12)
    prompt = repeating_prompt()
    want = target.generate(prompt, 40)
    first, stats_first = sd.suffix_decode(target, drafter, prompt, 40)
    assert torch.equal(first, want)
    second, stats_second = sd.suffix_decode(target, drafter, prompt, 40)  # the first answer is in the workload trie
    assert torch.equal(second, want)
    assert stats_second.rounds < stats_first.rounds and stats_second.rounds <= 40 // 8


def test_sampled_suffix_decoding_follows_the_target_distribution():
    """4 new tokens from a 4-token vocabulary, 600 runs with one drafter whose workload trie
    learns from every output: the joint of the first two tokens matches the target's."""
    V, new, runs = 4, 4, 600
    target = make_model(vocab=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, seed=10, sharpness=3.0)
    prompt = torch.tensor([[1, 3, 0]])
    drafter = sd.SuffixDrafter(V, max_match=3, max_nodes=6)
    gen = torch.Generator().manual_seed(0)
    samples, accepted, drafted = [], 0, 0
    for _ in range(runs):
        out, stats = sd.suffix_decode(target, drafter, prompt, new, temperature=1.0, generator=gen)
        samples.append(out[0, 3:5])
        accepted, drafted = accepted + sum(stats.accepted), drafted + sum(stats.drafted)
    samples = torch.stack(samples)
    with torch.no_grad():
        conts = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        seqs = torch.cat([prompt.expand(len(conts), -1), conts], 1)
        logp = torch.log_softmax(target(seqs[:, :-1]).float(), -1)[:, 2:].gather(-1, conts[..., None]).squeeze(-1)
    joint = logp.sum(-1).exp()
    counts = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V)
    assert sd.chi_square_test(counts, joint)[2] > FALSE_ALARM
    assert 0 < accepted < drafted  # drafts were both kept and rejected


def test_a_cost_curve_keeps_the_trees_that_pay_and_the_output_stays_exact():
    """Where scoring k tokens costs k steps no draft pays: plain decoding, no tree verified. Where k tokens cost
    one step every tree is kept whole. Both reproduce the target's greedy output."""
    target = make_model(max_seq_len=160)
    prompt = repeating_prompt()
    want = target.generate(prompt, 40)
    drafted = {}
    for name, curve in (("linear", {1: 1.0, 2: 2.0, 16: 16.0}), ("flat", {1: 1.0, 16: 1.0})):
        drafter = sd.SuffixDrafter(40, max_nodes=12, cost_curve=curve)
        drafter.remember(want[0, prompt.size(1):].tolist())  # a workload that has seen this answer
        out, stats = sd.suffix_decode(target, drafter, prompt, 40)
        assert torch.equal(out, want)
        drafted[name] = sum(stats.drafted)
    assert drafted["linear"] == 0 and drafted["flat"] > 0


def test_the_hybrid_drafts_from_the_tries_on_a_copy_and_from_the_model_elsewhere():
    target = make_model(max_seq_len=160)
    hybrid = sd.HybridDrafter(40, sd.ModelDrafter(perturbed_copy(target, 0.05)), dynamic=(3, 2, 6), max_nodes=12)
    prompt = repeating_prompt()
    want = target.generate(prompt, 40)
    out, stats = sd.suffix_decode(target, hybrid, prompt, 40)
    assert torch.equal(out, want)
    assert 0 < hybrid.model_rounds < stats.rounds  # both sources drafted
    assert sum(stats.accepted) > 0



def test_worth_verifying_keeps_the_best_prefix_of_the_tree():
    drafter = sd.SuffixDrafter(40, cost_curve={1: 1.0, 2: 1.0, 4: 1.4})  # 2 nodes: 2.0 tokens per step, 3: 1.79
    assert drafter.worth_verifying([5, 6, 7], [-1, 0, -1], [0.9, 0.5, 0.1]) == ([5, 6], [-1, 0])


def test_the_hybrid_drafts_the_model_tree_and_cuts_the_suffix_tree():
    target = make_model(max_seq_len=160)
    prompt = repeating_prompt()
    want = target.generate(prompt, 40)
    # the tries are never enough: every round is the model's, and a model equal to the target is always right
    hybrid = sd.HybridDrafter(40, sd.ModelDrafter(target), dynamic=(3, 2, 6), max_nodes=12, min_expected=1e9)
    out, stats = sd.suffix_decode(target, hybrid, prompt, 40)
    assert torch.equal(out, want) and hybrid.model_rounds == stats.rounds
    assert stats.accepted == stats.drafted and stats.draft_calls >= 3 * stats.rounds  # the model's calls count
    # where no draft pays (a linear curve) the tries' trees are cut to nothing: only model rounds draft
    hybrid = sd.HybridDrafter(40, sd.ModelDrafter(target), dynamic=(3, 2, 6), max_nodes=12,
                              cost_curve={1: 1.0, 2: 2.0, 16: 16.0})
    out, stats = sd.suffix_decode(target, hybrid, prompt, 40)
    assert torch.equal(out, want) and 0 < hybrid.model_rounds < stats.rounds
    assert sum(d > 0 for d in stats.drafted) == hybrid.model_rounds

def test_sampled_hybrid_decoding_follows_the_target_distribution():
    """As for suffix decoding: the joint of the first two sampled tokens matches the target's, with a
    draft model that disagrees with it often (its own seed)."""
    V, new, runs = 4, 4, 400
    target = make_model(vocab=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, seed=10, sharpness=3.0)
    draft = make_model(vocab=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, seed=11, sharpness=3.0)
    prompt = torch.tensor([[1, 3, 0]])
    hybrid = sd.HybridDrafter(V, sd.ModelDrafter(draft), dynamic=(2, 2, 4), max_match=3, max_nodes=6)
    gen = torch.Generator().manual_seed(0)
    samples, model_rounds = [], 0
    for _ in range(runs):
        out, _ = sd.suffix_decode(target, hybrid, prompt, new, temperature=1.0, generator=gen)
        samples.append(out[0, 3:5])
        model_rounds += hybrid.model_rounds
    samples = torch.stack(samples)
    with torch.no_grad():
        conts = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        seqs = torch.cat([prompt.expand(len(conts), -1), conts], 1)
        logp = torch.log_softmax(target(seqs[:, :-1]).float(), -1)[:, 2:].gather(-1, conts[..., None]).squeeze(-1)
    counts = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V)
    assert sd.chi_square_test(counts, logp.sum(-1).exp())[2] > FALSE_ALARM
    assert model_rounds > 0


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="depth"):
        sd.SuffixTrie(depth=1)
    with pytest.raises(ValueError, match="factor"):
        sd.SuffixDrafter(40, factor=0)
    with pytest.raises(ValueError, match="max_nodes"):
        sd.SuffixDrafter(40, max_nodes=0)
    with pytest.raises(ValueError, match="min_expected"):
        sd.HybridDrafter(40, sd.PromptLookupDrafter(40), min_expected=0)
    for dynamic in ((6, 4, 30), (6, 4), (6.0, 4, 12)):
        with pytest.raises(ValueError, match="nodes <= max_nodes"):
            sd.HybridDrafter(40, sd.PromptLookupDrafter(40), dynamic=dynamic)
    with pytest.raises(ValueError, match="one request at a time"):
        sd.HybridDrafter(40, sd.PromptLookupDrafter(40)).fork([1, 2, 3])
    with pytest.raises(ValueError, match="cost curve"):
        sd.SuffixDrafter(40, cost_curve={1: 1.0})
    with pytest.raises(ValueError, match="SuffixDrafter"):
        sd.suffix_decode(make_model(), sd.PromptLookupDrafter(40), torch.tensor([[1, 2]]), 4)
