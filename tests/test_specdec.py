"""Speculative decoding: the theory formulas, the lossless accept/reject step, greedy exactness,
KV rollback, tree attention against per-branch verification, drafting heads, bad input.

Statistical tests are seeded (deterministic) and use a false-alarm rate of 1e-4 each: a correct
implementation would fail one with that probability over random seeds."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from llmsys import specdec as sd
from llmsys.core import cache, zoo
from llmsys.core.model import ModelConfig, Transformer

FALSE_ALARM = 1e-4


def make_model(vocab=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, seed=0, sharpness=8.0):
    """A random model with peaked next-token distributions (scaled LM head), so that greedy
    paths are stable and draft/target disagreements are frequent but not universal."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      max_seq_len=max_seq_len)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.output.weight.mul_(sharpness)
    return model


def perturbed_copy(model, noise, seed=1):
    """A draft that mostly agrees with the target: its weights plus noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return draft


@pytest.fixture(scope="module")
def pair():
    target = make_model(seed=0)
    return target, perturbed_copy(target, 0.3)


def prompt_of(n, vocab=40, seed=3):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- theory


def test_expected_tokens_matches_geometric_sum_and_reference_example():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for gamma in (1, 4, 7):
            assert sd.expected_tokens(alpha, gamma) == pytest.approx(sum(alpha ** i for i in range(gamma + 1)))
    assert sd.expected_tokens(1.0, 5) == 6
    # Leviathan et al. 2023, eq. 1 and Thm 3.8: α 0.8, γ 4, c 0.05 -> E = 3.36, speedup 2.80
    assert round(sd.expected_tokens(0.8, 4), 2) == 3.36
    assert round(sd.expected_speedup(0.8, 4, 0.05), 2) == 2.80


def test_expected_tokens_by_position_generalises_the_constant_alpha_formula():
    assert sd.expected_tokens_by_position([0.7] * 5) == pytest.approx(sd.expected_tokens(0.7, 5))
    assert sd.expected_tokens_by_position([0.5, 0.4, 0.0, 0.9]) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    assert sd.expected_tokens_by_position([]) == 1


def test_some_gamma_helps_exactly_when_alpha_exceeds_c():
    for alpha in (0.1, 0.4, 0.7, 0.95):
        for c in (0.05, 0.3, 0.6, 0.9):
            best = sd.best_gamma(alpha, c)
            assert (sd.expected_speedup(alpha, best, c) > 1) == (alpha > c)
            assert all(sd.expected_speedup(alpha, g, c) <= sd.expected_speedup(alpha, best, c) for g in range(1, 17))


def test_acceptance_rate_is_one_minus_total_variation():
    gen = torch.Generator().manual_seed(0)
    p, q = F.softmax(torch.randn(5, 10, generator=gen), -1), F.softmax(torch.randn(5, 10, generator=gen), -1)
    torch.testing.assert_close(sd.acceptance_rate(p, q), 1 - 0.5 * (p - q).abs().sum(-1))


# ----------------------------------------------------------------------------- the accept/reject step


def test_accept_reject_hand_made_cases():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])  # target sure of 1, then 2, then 0
    # drafts equal to the target's certain tokens are always kept, then the bonus from p
    n, nxt = sd.accept_reject(p, p[:, :2], torch.tensor([[1, 2]]))
    assert (int(n), int(nxt)) == (2, 0)
    # a draft where p is 0 is always rejected and replaced by a sample of norm(max(0, p - q)) = p's token
    q = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    n, nxt = sd.accept_reject(p, q, torch.tensor([[0, 2]]))
    assert (int(n), int(nxt)) == (0, 1)
    # first accepted, second rejected: the residual at position 1
    p2 = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    q2 = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    n, nxt = sd.accept_reject(p2.expand(200, -1, -1), q2.expand(200, -1, -1), torch.tensor([[1, 2]]).expand(200, -1),
                              torch.Generator().manual_seed(0))
    assert (n == 1).all() and set(nxt.tolist()) == {0, 1}


def test_accept_reject_with_one_hot_distributions_is_the_greedy_check():
    gen = torch.Generator().manual_seed(0)
    target_top = torch.randint(0, 4, (500, 4), generator=gen)
    other = torch.randint(0, 4, (500, 3), generator=gen)
    draft = torch.where(torch.rand(500, 3, generator=gen) < 0.7, target_top[:, :3], other)
    n_greedy, next_greedy = sd.greedy_accept(target_top, draft)
    n, nxt = sd.accept_reject(F.one_hot(target_top, 4).float(), F.one_hot(draft, 4).float(), draft, gen)
    assert torch.equal(n, n_greedy) and torch.equal(nxt, next_greedy)
    # greedy verification: (draft == target).cumprod().sum() tokens, then the target's token
    assert torch.equal(n_greedy, (draft == target_top[:, :3]).long().cumprod(-1).sum(-1))


def _synthetic(V=8, gamma=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = F.softmax(2 * torch.randn(gamma + 1, V, generator=gen), -1)
    q = F.softmax(2 * torch.randn(gamma, V, generator=gen), -1)
    return p, q, gen


def _output_tokens(draft, n, nxt, position):
    """The token emitted at ``position`` of a round, for rounds that got that far."""
    reached = n >= position
    token = torch.where(n[reached] > position, draft[reached, min(position, draft.size(1) - 1)], nxt[reached])
    return token


def _position_pvalues(p, q, gen, N, resample=sd.accept_reject):
    gamma, V = q.shape
    draft = torch.multinomial(q, N, replacement=True, generator=gen).T  # (N, γ), each column from its q
    n, nxt = resample(p.expand(N, -1, -1), q.expand(N, -1, -1), draft, gen)
    pvalues = []
    for j in range(gamma + 1):
        tokens = _output_tokens(draft, n, nxt, j)
        pvalues.append(sd.chi_square_test(torch.bincount(tokens, minlength=V), p[j])[2])
    return pvalues, n, draft


def test_accept_reject_output_is_distributed_as_the_target():
    """Lossless: at every position j a round reaches, the emitted token ~ p_j (chi-square over
    200k vectorised rounds, 4 positions, 1e-4 false alarms each)."""
    p, q, gen = _synthetic()
    pvalues, n, draft = _position_pvalues(p, q, gen, 200_000)
    assert min(pvalues) > FALSE_ALARM, pvalues
    # measured acceptance of the first draft = Σ min(p, q) = 1 - TV, within 4.5 standard errors
    alpha = float(sd.acceptance_rate(p[0], q[0]))
    rate = (n >= 1).double().mean().item()
    assert abs(rate - alpha) < 4.5 * math.sqrt(alpha * (1 - alpha) / len(n))


def test_distribution_test_detects_a_wrong_resampling_rule():
    """The same test must fail for a plausible bug: resampling from p instead of the residual."""
    def resample_from_p(p, q, draft, generator):
        n, _ = sd.accept_reject(p, q, draft, generator)
        p_n = p.gather(1, n[:, None, None].expand(-1, 1, p.size(-1))).squeeze(1)
        return n, torch.multinomial(p_n, 1, generator=generator).squeeze(-1)

    p, q, gen = _synthetic()
    pvalues, _, _ = _position_pvalues(p, q, gen, 200_000, resample=resample_from_p)
    assert pvalues[0] < FALSE_ALARM


def test_chi_square_p_value_matches_closed_form_for_two_degrees_of_freedom():
    # df = 2: the survival function is exp(-x/2)
    counts, probs = torch.tensor([30.0, 50.0, 20.0]), torch.tensor([0.3, 0.4, 0.3])
    statistic, df, pvalue = sd.chi_square_test(counts, probs)
    assert df == 2 and statistic == pytest.approx((0 + 100 / 40 + 100 / 30))
    assert pvalue == pytest.approx(math.exp(-statistic / 2))


# ----------------------------------------------------------------------------- decoding: greedy and rollback


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_decoding_equals_target_greedy(pair, gamma):
    target, draft = pair
    for prompt_len, new in [(1, 20), (7, 33)]:
        prompt = prompt_of(prompt_len)
        want = target.generate(prompt, new)
        got, stats = sd.speculative_decode(target, draft, prompt, new, gamma=gamma)
        assert torch.equal(got, want)
        assert stats.new_tokens == new and 0 < stats.acceptance_rate < 1  # some drafts rejected: rollback exercised
        # every round yields accepted + 1 tokens; the prefill yields one
        assert sum(stats.accepted) + stats.rounds + 1 == new


def test_greedy_tree_decoding_equals_target_greedy(pair):
    target, draft = pair
    prompt = prompt_of(5)
    want = target.generate(prompt, 30)
    for widths in [(1,), (2, 2), (3, 2, 1)]:
        got, stats = sd.tree_decode(target, draft, prompt, 30, widths=widths)
        assert torch.equal(got, want), widths
        assert stats.rounds < 29  # the tree saved target calls


def test_greedy_dynamic_tree_decoding_equals_target_greedy(pair):
    target, draft = pair
    prompt = prompt_of(5)
    want = target.generate(prompt, 30)
    for depth, expand, nodes in [(1, 1, 1), (3, 2, 4), (5, 3, 9)]:
        got, stats = sd.dynamic_tree_decode(target, draft, prompt, 30, depth, expand, nodes)
        assert torch.equal(got, want), (depth, expand, nodes)
        assert max(stats.drafted) <= depth
    assert stats.rounds < 29  # the tree saved target calls


def test_dynamic_tree_keeps_the_most_probable_paths_and_their_ancestors(pair):
    """EAGLE-2's rerank, checked by enumeration: with expand = every token of a 3-token
    vocabulary, the kept nodes are exactly the `nodes` most probable paths under the drafter
    (product of its probabilities), and each kept node's parent is kept before it."""
    draft = make_model(vocab=3, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, seed=4, sharpness=2.0)
    target = make_model(vocab=3, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, seed=5)
    prompt = torch.tensor([[0, 2, 1]])
    state = sd.DecodeState(target, prompt, 8, room=20)
    drafter = sd.ModelDrafter(draft)
    drafter.reset(state)
    state.prefill(0.0, None, None)
    tokens, parents = sd.draft_dynamic_tree(drafter, state, depth=2, expand=3, nodes=5)
    assert all(p < i for i, p in enumerate(parents))
    paths = sd.tree_ancestors(parents)
    kept = {tuple(tokens[j] for j in path) for path in paths}
    with torch.no_grad():  # every path of depth 1 and 2, scored by the drafter from scratch
        seq = state.tokens[:, :state.n]
        logp1 = F.log_softmax(draft(seq)[0, -1], -1)
        scores = {(a,): float(logp1[a]) for a in range(3)}
        for a in range(3):
            logp2 = F.log_softmax(draft(torch.cat([seq, torch.tensor([[a]])], 1))[0, -1], -1)
            scores.update({(a, b): float(logp1[a] + logp2[b]) for b in range(3)})
    best = sorted(scores, key=lambda path: (-scores[path], len(path)))[:5]
    assert kept == set(best)


def test_self_drafting_accepts_everything(pair):
    target, _ = pair
    got, stats = sd.speculative_decode(target, target, prompt_of(4), 21, gamma=4)
    assert stats.acceptance_rate == 1.0 and stats.accepted == [4] * 4
    assert torch.equal(got, target.generate(prompt_of(4), 21))


def test_draft_caches_hold_exactly_the_committed_prefix_after_rollback(pair):
    """After decoding, the drafter's cache equals a fresh prefill of the committed tokens."""
    target, draft = pair
    drafter = sd.ModelDrafter(draft)
    out, stats = sd.speculative_decode(target, drafter, prompt_of(6), 25, gamma=3, temperature=1.0,
                                       generator=torch.Generator().manual_seed(0))
    assert 0 < stats.acceptance_rate < 1
    L = drafter.cache.length
    assert 0 < L < out.size(1)
    fresh = draft.new_cache(1)
    draft(out[:, :L], fresh)
    for layer in range(draft.cfg.n_layers):
        torch.testing.assert_close(drafter.cache.k[layer][:, :, :L], fresh.k[layer][:, :, :L])
        torch.testing.assert_close(drafter.cache.v[layer][:, :, :L], fresh.v[layer][:, :, :L])


def test_target_cache_rollback_by_truncate(pair):
    """The target verifies root + 3 drafts; keeping 1 of them must leave the cache as if only
    root + that draft had been fed: the next token's logits equal a full recomputation."""
    target, _ = pair
    seq = prompt_of(10)
    cache = target.new_cache(1)
    target(seq[:, :6], cache)  # committed prefix; seq[5] is ... fed; pretend seq[6] is the root
    target(seq[:, 6:10], cache)  # root + 3 drafts
    cache.truncate(6 + 2)  # root + 1 accepted draft
    new_token = torch.tensor([[7]])
    got = target(new_token, cache)[0, -1]
    want = target(torch.cat([seq[:, :8], new_token], dim=1))[0, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- decoding: sampling is lossless


def _exact_joint(target, prompt, new, vocab):
    """The target's probability of every continuation of ``new`` tokens, by enumeration."""
    conts = torch.cartesian_prod(*[torch.arange(vocab)] * new) if new > 1 else torch.arange(vocab)[:, None]
    seqs = torch.cat([prompt.expand(len(conts), -1), conts], dim=1)
    logp = F.log_softmax(target(seqs[:, :-1]).float(), -1)  # (N, T-1, V)
    T = prompt.size(1)
    picked = logp[:, T - 1:].gather(-1, conts[..., None]).squeeze(-1)  # (N, new)
    return conts, picked.sum(-1).exp()


@pytest.mark.parametrize("method", ["chain", "tree", "dynamic tree", "prompt lookup", "truncated EAGLE"])
def test_sampled_continuations_follow_the_target_distribution(method):
    """4 new tokens from a 4-token vocabulary, 800 runs of the real decoding loop (prefill,
    drafting, verification, rollback of both caches): the joint of the first two and of the
    last two tokens match the target's exact distribution."""
    V, new, runs = 4, 4, 800
    target = make_model(vocab=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, seed=10, sharpness=3.0)
    draft = make_model(vocab=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, seed=11, sharpness=3.0)
    prompt = torch.tensor([[1, 3, 0]])
    gen = torch.Generator().manual_seed(0)
    if method == "prompt lookup":  # one-hot q: a draft x is kept with probability p(x)
        draft = sd.PromptLookupDrafter(V, ngram=2)
    elif method == "truncated EAGLE":  # q is 0 outside the kept rows
        torch.manual_seed(0)
        draft = sd.new_head(sd.HeadSpec("eagle", vocab=2), target)
        draft.set_vocab(torch.tensor([1, 2]), target)
        draft = sd.EagleDrafter(draft, target)
    samples, rates = [], []
    for _ in range(runs):
        if method == "tree":
            out, stats = sd.tree_decode(target, draft, prompt, new, widths=(2, 2), temperature=1.0, generator=gen)
        elif method == "dynamic tree":
            out, stats = sd.dynamic_tree_decode(target, draft, prompt, new, depth=3, expand=2, nodes=4,
                                                temperature=1.0, generator=gen)
        else:
            out, stats = sd.speculative_decode(target, draft, prompt, new, gamma=2, temperature=1.0, generator=gen)
        samples.append(out[0, 3:])
        rates.append(stats.acceptance_rate)
    samples = torch.stack(samples)  # (runs, new)
    conts, joint = _exact_joint(target, prompt, new, V)
    joint = joint.detach().view(*[V] * new)
    first, last = joint.sum((2, 3)), joint.sum((0, 1))
    counts_first = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V)
    counts_last = torch.bincount(samples[:, 2] * V + samples[:, 3], minlength=V * V)
    assert sd.chi_square_test(counts_first, first)[2] > FALSE_ALARM
    assert sd.chi_square_test(counts_last, last)[2] > FALSE_ALARM
    assert 0.05 < sum(rates) / runs < 0.95  # acceptances and rejections both happened


def test_measured_acceptance_matches_one_minus_tv_in_decoding(pair):
    target, draft = pair
    gen = torch.Generator().manual_seed(1)
    accepted = reached = 0
    predicted = []
    for seed in range(4):
        _, stats = sd.speculative_decode(target, draft, prompt_of(3, seed=seed), 60, gamma=3, temperature=1.0,
                                         generator=gen)
        accepted, reached = accepted + sum(stats.accepted), reached + stats.reached
        predicted += stats.predicted_accept
    assert len(predicted) == reached
    alpha = sum(predicted) / reached
    # each reached position is accepted with probability Σ min(p, q) given its context
    assert abs(accepted / reached - alpha) < 4.5 * math.sqrt(0.25 / reached)


def test_acceptance_by_position_counts():
    stats = sd.DecodeStats(drafted=[3, 3, 3, 2], accepted=[0, 3, 1, 2])
    # position 0: reached by all 4 rounds, accepted in 3; position 1: reached by the 3 with k >= 1,
    # accepted in the 2 with k >= 2; position 2: reached only by round 2 (γ = 3, k = 3), accepted
    assert stats.acceptance_by_position() == [3 / 4, 2 / 3, 1.0]
    assert stats.reached == 1 + 3 + 2 + 2 and stats.acceptance_rate == 6 / 8
    assert stats.tokens_per_round == (6 + 4) / 4


# ----------------------------------------------------------------------------- token trees


def test_tree_attention_mask_hand_made():
    parents = [-1, 0, 0, 1, -1]
    want = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(sd.tree_attention_mask(parents), want)
    with_prefix = sd.tree_attention_mask(parents, prefix_len=2)
    assert with_prefix[:, :2].all() and torch.equal(with_prefix[:, 2:], want)
    assert torch.equal(sd.tree_attention_mask(parents, 2, slice(3, None)), with_prefix[3:])
    assert sd.tree_depths(parents) == [0, 1, 1, 2, 0]
    chain = sd.tree_attention_mask([-1, 0, 1, 2])
    assert torch.equal(chain, torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="parent"):
        sd.tree_attention_mask([0])


def test_tree_forward_equals_verifying_each_branch_separately(pair):
    target, _ = pair
    gen = torch.Generator().manual_seed(5)
    prefix = prompt_of(9)
    parents = [-1, 0, 0, 1, 1, 2, -1, 6, 3]
    tokens = torch.randint(0, 40, (1, len(parents)), generator=gen)
    cache = sd.target_cache(target, 40)
    target(prefix, cache)
    positions = 9 + torch.tensor(sd.tree_depths(parents))
    logits, hidden = sd.tree_forward(target, tokens, positions, sd.tree_attention_mask(parents, 9), cache,
                                     return_hidden=True)
    ancestors = sd.tree_ancestors(parents)
    for node, chain in enumerate(ancestors):
        branch = torch.cat([prefix, tokens[:, chain]], dim=1)
        want_logits, want_hidden = target(branch, return_hidden=True)
        torch.testing.assert_close(logits[0, node], want_logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[0, node], want_hidden[0, -1], atol=1e-4, rtol=1e-4)
    # keep one branch: the cache becomes that of prefix + branch, so decoding continues exactly
    sd.keep_in_cache(cache, 9, ancestors[8])
    assert cache.length == 9 + len(ancestors[8])
    nxt = torch.tensor([[11]])
    got = target(nxt, cache)[0, -1]
    want = target(torch.cat([prefix, tokens[:, ancestors[8]], nxt], dim=1))[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_tree_forward_rejects_a_mask_of_the_wrong_shape(pair):
    target, _ = pair
    cache = sd.target_cache(target, 20)
    with pytest.raises(ValueError, match="mask"):
        sd.tree_forward(target, torch.zeros(1, 3, dtype=torch.long), torch.arange(3),
                        torch.ones(3, 4, dtype=torch.bool), cache)


def test_tree_size():
    assert sd.tree_size((3, 2, 1)) == 3 + 6 + 6
    assert sd.tree_size((1, 1, 1, 1)) == 4


# ----------------------------------------------------------------------------- drafting heads


def _periodic_target(V=12):
    """A target that has learnt 'next = current + 1 (mod V)', so every head has a sure answer."""
    target = make_model(vocab=V, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64, seed=4, sharpness=1.0)
    ids = torch.arange(2000) % V
    opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    target.train()
    for _ in range(60):
        starts = torch.randint(0, 1900, (8,), generator=gen)
        x = torch.stack([ids[s:s + 33] for s in starts.tolist()])
        loss = F.cross_entropy(target(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target.eval(), ids


@pytest.fixture(scope="module")
def periodic():
    return _periodic_target()


@pytest.mark.parametrize("kind", sd.HEAD_KINDS)
def test_trained_heads_draft_what_the_target_says(periodic, kind):
    """Heads trained on the target's hidden states (labels aligned depth by depth) predict the
    target's own continuation: greedy drafts are almost all accepted, outputs stay exact."""
    target, ids = periodic
    spec = sd.HeadSpec(kind, depth=3, steps=60, batch_size=8, seq_len=24, lr=1e-2, n_windows=32)
    head = sd.train_head(spec, target, ids)
    prompt = torch.tensor([[0, 1, 2, 3]])
    want = target.generate(prompt, 24)
    got, stats = sd.speculative_decode(target, sd.make_drafter(head, target), prompt, 24, gamma=3)
    assert torch.equal(got, want)
    assert stats.acceptance_rate > 0.9, stats.summary()
    got, stats = sd.tree_decode(target, sd.make_drafter(head, target), prompt, 24, widths=(2, 2, 1))
    assert torch.equal(got, want) and stats.tokens_per_round > 3.5
    if kind != "eagle":
        return
    got, stats = sd.dynamic_tree_decode(target, sd.make_drafter(head, target), prompt, 24, depth=4, expand=2, nodes=6)
    assert torch.equal(got, want) and stats.tokens_per_round > 3.5


@pytest.mark.parametrize("kind", sd.HEAD_KINDS)
def test_untrained_heads_keep_outputs_exact(pair, kind):
    """Whatever a head drafts, greedy output is the target's and sampling checks pass through."""
    target, _ = pair
    torch.manual_seed(0)
    head = sd.new_head(sd.HeadSpec(kind, depth=3), target)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05)
    drafter = sd.make_drafter(head, target)
    prompt = prompt_of(5)
    got, _ = sd.speculative_decode(target, drafter, prompt, 20, gamma=3)
    assert torch.equal(got, target.generate(prompt, 20))
    got, _ = sd.tree_decode(target, drafter, prompt, 20, widths=(3, 2))
    assert torch.equal(got, target.generate(prompt, 20))
    if kind == "eagle":
        got, _ = sd.dynamic_tree_decode(target, drafter, prompt, 20, depth=4, expand=3, nodes=7)
        assert torch.equal(got, target.generate(prompt, 20))


def test_eagle_cache_holds_only_true_features_after_rollback(periodic):
    target, ids = periodic
    head = sd.train_head(sd.HeadSpec("eagle", steps=5, seq_len=24, n_windows=8), target, ids)
    drafter = sd.EagleDrafter(head, target)
    prompt = torch.tensor([[5, 2, 9]])
    out, _ = sd.speculative_decode(target, drafter, prompt, 20, gamma=3, temperature=1.0,
                                   generator=torch.Generator().manual_seed(0))
    L = drafter.cache.length
    _, hidden = target(out, return_hidden=True)
    fresh = head.new_cache(64)
    head(hidden[:, :L], target.tok_embeddings(out[:, 1:L + 1]), fresh)
    torch.testing.assert_close(drafter.cache.k[0][:, :, :L], fresh.k[0][:, :, :L], atol=1e-5, rtol=1e-4)


def test_eagle_second_step_is_what_drafting_computes(pair):
    """Training's second step at every position equals drafting's: true entries 0..i in the
    cache, then the entry built from the head's own guess of f_{i+1}."""
    target, _ = pair
    head = sd.new_head(sd.HeadSpec("eagle"), target)
    g = torch.Generator().manual_seed(0)
    features, emb = torch.randn(2, 7, target.cfg.dim, generator=g), torch.randn(2, 7, target.cfg.dim, generator=g)
    with torch.no_grad():
        predicted = head(features, emb)
        both = head.second_step(features, emb, predicted)
        for i in range(6):
            cache = head.new_cache(16, batch_size=2)
            head(features[:, :i + 1], emb[:, :i + 1], cache)
            drafted = head(predicted[:, i:i + 1], emb[:, i + 1:i + 2], cache)
            torch.testing.assert_close(both[:, i], drafted[:, 0], atol=1e-5, rtol=1e-5)


def test_fp32_eagle_head_drafts_for_a_bf16_target(periodic):
    """A truncated head keeps its own dtype: the target's bf16 features and embeddings are cast
    to fp32 on the way in, so its draft equals the fp32 head run by hand on those features."""
    target, ids = periodic
    head = sd.train_head(sd.HeadSpec("eagle", steps=5, seq_len=24, n_windows=8, vocab=8), target, ids)
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    prompt = torch.tensor([[5, 2, 9, 4]])
    state = sd.DecodeState(bf16, prompt, 6)
    drafter = sd.EagleDrafter(head, bf16)
    drafter.reset(state)
    state.prefill(0.0, None, None)
    with torch.no_grad():
        got = drafter.begin(state)
        feats = state.features[:state.n - 1].float()[None]
        emb = bf16.tok_embeddings(state.tokens[:, 1:state.n]).float()
        want = head.draft_logits(head(feats, emb)[0, -1], target)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_load_head_caches_training(periodic, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSYS_CACHE", str(tmp_path))
    target, ids = periodic
    spec = sd.HeadSpec("medusa", depth=2, steps=3, seq_len=16, n_windows=4)
    first = sd.load_head(spec, target, ids, progress=False)
    entries = list((tmp_path / "zoo").glob("medusa-head-*/head.pt"))
    assert len(entries) == 1
    entries[0].write_bytes(b"damaged")  # detected by the zoo's checksum: trained again, not half-loaded
    with pytest.warns(cache.CacheWarning):
        second = sd.load_head(spec, target, ids, progress=False)
    third = sd.load_head(spec, target, ids, progress=False)
    for a, b, c in zip(first.state_dict().values(), second.state_dict().values(), third.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_head_training_lowers_the_loss(periodic):
    target, ids = periodic
    tokens, features = sd.target_features(target, ids, 8, 24)
    spec = sd.HeadSpec("mtp", depth=2, steps=40, seq_len=24, n_windows=16, lr=1e-2)
    torch.manual_seed(0)
    before = sd.head_loss(sd.new_head(spec, target), target, tokens, features).item()
    after = sd.head_loss(sd.train_head(spec, target, ids), target, tokens, features).item()
    assert after < 0.5 * before


# ----------------------------------------------------------------------------- bad input


def test_bad_input_raises_clear_errors(pair):
    target, draft = pair
    prompt = prompt_of(4)
    other_vocab = make_model(vocab=41, dim=16, n_layers=1, n_heads=2, n_kv_heads=1)
    with pytest.raises(ValueError, match="vocabulary"):
        sd.speculative_decode(target, other_vocab, prompt, 5)
    with pytest.raises(ValueError, match="gamma"):
        sd.speculative_decode(target, draft, prompt, 5, gamma=0)
    with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
        sd.dynamic_tree_decode(target, draft, prompt, 5, nodes=0)
    with pytest.raises(ValueError, match="gamma"):
        sd.expected_tokens(0.5, 0)
    with pytest.raises(ValueError, match="exceeds the context"):
        sd.speculative_decode(target, draft, prompt_of(60), 10)
    with pytest.raises(ValueError, match="exceeds the context"):
        sd.autoregressive_decode(target, prompt_of(65), 1)
    with pytest.raises(ValueError, match="one sequence"):
        sd.speculative_decode(target, draft, torch.zeros(2, 3, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="widths"):
        sd.tree_decode(target, draft, prompt, 5, widths=(2, 0))
    with pytest.raises(ValueError, match="alpha"):
        sd.expected_speedup(1.5, 2, 0.1)
    medusa = sd.make_drafter(sd.new_head(sd.HeadSpec("medusa", depth=2), target), target)
    with pytest.raises(ValueError, match="at most 2 tokens ahead"):
        sd.speculative_decode(target, medusa, prompt, 5, gamma=3)
    with pytest.raises(ValueError, match="head kind"):
        sd.HeadSpec("lookahead")


def test_measure_methods_reports_every_method_and_the_lossless_check(pair):
    target, draft = pair
    prompts = [prompt_of(4, seed=s) for s in range(2)]
    methods = sd.standard_methods(target, draft, widths=(2, 1))
    assert list(methods) == ["target only", "draft model, chain γ=4", "draft model, tree 2x1"]
    reference = [target.generate(p, 12) for p in prompts]
    rows = sd.measure_methods(methods, prompts, 12, 0.0, reference)
    assert [r["method"] for r in rows] == list(methods) and all(r["exact"] for r in rows)
    assert rows[0]["tokens_per_call"] == 1 and rows[1]["tokens_per_call"] > 1
    wrong = [torch.zeros_like(r) for r in reference]
    assert not any(r["exact"] for r in sd.measure_methods(methods, prompts, 12, 0.0, wrong, warmup=False))
    assert "target only" in sd.format_table(rows)


def test_autoregressive_baseline_matches_generate(pair):
    target, _ = pair
    prompt = prompt_of(4)
    out, stats = sd.autoregressive_decode(target, prompt, 15)
    assert torch.equal(out, target.generate(prompt, 15)) and stats.target_calls == 15
    out, _ = sd.autoregressive_decode(target, prompt, 15, temperature=0.8, generator=torch.Generator().manual_seed(2))
    want = target.generate(prompt, 15, temperature=0.8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------- drafters for the real chat model


def test_frequent_tokens_ranks_by_count_then_lower_id():
    ids = torch.tensor([5, 5, 5, 2, 2, 7, 7, 1])
    assert sd.frequent_tokens(ids, 3, 10).tolist() == [2, 5, 7]
    assert sd.frequent_tokens(ids, 5, 10).tolist() == [0, 1, 2, 5, 7]
    with pytest.raises(ValueError, match="rows"):
        sd.frequent_tokens(ids, 11, 10)


def test_truncated_eagle_head_scores_exactly_its_rows_of_the_target_head(pair):
    target, _ = pair
    head = sd.new_head(sd.HeadSpec("eagle", vocab=7), target)
    keep = torch.tensor([0, 3, 4, 9, 10, 20, 39])
    head.set_vocab(keep, target)
    x = torch.randn(2, 5, target.cfg.dim)
    with torch.no_grad():
        torch.testing.assert_close(head.logits(x, target), target.output(x)[..., keep])
        drafted = head.draft_logits(x, target)
    assert torch.equal(drafted[..., keep], head.logits(x, target).detach())
    assert int(torch.isinf(drafted).sum()) == 2 * 5 * (target.cfg.vocab_size - len(keep))
    with pytest.raises(ValueError, match="truncated LM head"):
        sd.HeadSpec("mtp", vocab=8)


def test_prompt_lookup_copies_what_followed_the_last_match(pair):
    lookup = sd.PromptLookupDrafter(40, ngram=3)
    assert lookup._lookup([1, 2, 3, 9, 1, 2]) == [3, 9, 1, 2]  # no earlier [9, 1, 2]; [1, 2] at the start
    assert lookup._lookup([4, 5, 6]) == []
    target, _ = pair
    prompt = torch.cat([prompt_of(8, seed=5)] * 3, dim=1)  # a repeated phrase: copying pays
    got, stats = sd.speculative_decode(target, lookup, prompt, 20, gamma=4)
    assert torch.equal(got, target.generate(prompt, 20))
    with pytest.raises(ValueError, match="ngram"):
        sd.PromptLookupDrafter(40, ngram=0)


def test_self_distilled_records_the_targets_greedy_answers_and_hidden_states(pair):
    from llmsys.specdec import chat

    target, _ = pair
    prompts = [prompt_of(4, seed=1), prompt_of(5, seed=2), prompt_of(4, seed=3)]
    padded = torch.cat([F.pad(p, (5 - p.size(1), 0), value=7) for p in prompts])  # to the longest prompt
    tokens, features = chat.self_distilled(target, padded, 6, batch_size=2, progress=False)
    assert tokens.shape == (3, 10) and features.shape == (3, 10, target.cfg.dim)
    for row in range(3):
        assert torch.equal(tokens[row], target.generate(padded[row:row + 1], 6)[0, :10])
        _, hidden = target(tokens[row][None], return_hidden=True)
        torch.testing.assert_close(features[row], hidden[0], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def smollm2():
    return zoo.load(zoo.PRETRAINED, device="cpu"), zoo.tokenizer(zoo.PRETRAINED)


def test_speculative_decoding_of_smollm2_reproduces_its_greedy_answer(smollm2):
    """The real model in fp32: a chain and a tree of EAGLE drafts (an untrained truncated head:
    the output must not depend on the drafter) and prompt lookup give the target's own tokens.
    Token equality is exact because no step is a near-tie: the gap between the two best logits
    stays far above the rounding by which a k-token call and a one-token call may differ."""
    from llmsys.core import pretrained
    from llmsys.specdec import chat

    target, tok = smollm2
    prompt = pretrained.chat_ids(tok, chat.EVAL_PROMPTS[0])
    want = target.generate(prompt, 24)
    with torch.no_grad():
        top2 = target(want[:, :-1])[0, prompt.size(1) - 1:].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    torch.manual_seed(0)
    head = sd.new_head(sd.HeadSpec("eagle", vocab=512), target)
    head.set_vocab(sd.frequent_tokens(want, 512, target.cfg.vocab_size), target)
    got, _ = sd.speculative_decode(target, sd.EagleDrafter(head, target), prompt, 24, gamma=4)
    assert torch.equal(got, want)
    got, _ = sd.tree_decode(target, sd.EagleDrafter(head, target), prompt, 24, widths=(2, 2))
    assert torch.equal(got, want)
    got, _ = sd.dynamic_tree_decode(target, sd.EagleDrafter(head, target), prompt, 24, depth=4, expand=3, nodes=8)
    assert torch.equal(got, want)
    got, stats = sd.speculative_decode(target, sd.PromptLookupDrafter(target.cfg.vocab_size), prompt, 24, gamma=4)
    assert torch.equal(got, want)
