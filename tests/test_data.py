"""Chapter 11, data: MinHash and LSH against datasketch and their error bounds, exact dedup,
quality rules, data mixing."""

import math
import random

import datasketch
import numpy as np
import pytest
import torch

from llmsys.data import corpora, minhash, mixing, quality


def random_pair(rng: random.Random, n_shared: int, n_only: int) -> tuple[set, set]:
    """Two sets with exactly known Jaccard n_shared / (n_shared + 2 n_only)."""
    words = [f"w{rng.getrandbits(40)}" for _ in range(n_shared + 2 * n_only)]
    shared = words[:n_shared]
    return set(shared + words[n_shared:n_shared + n_only]), set(shared + words[n_shared + n_only:])


def test_signatures_equal_datasketch():
    rng = random.Random(0)
    for seed in (1, 7):
        ours = minhash.MinHasher(num_perm=64, seed=seed)
        for _ in range(5):
            items, _ = random_pair(rng, 50, 10)
            theirs = datasketch.MinHash(num_perm=64, seed=seed, scheme="affine32")
            theirs.update_batch([s.encode() for s in items])
            assert np.array_equal(ours.signature(items), theirs.hashvalues)  # integer arithmetic: exactly equal
    empty = datasketch.MinHash(num_perm=64, scheme="affine32")
    assert np.array_equal(minhash.MinHasher(64).signature(set()), empty.hashvalues)
    with pytest.raises(ValueError, match="odd"):
        minhash.MinHasher(perms=(np.array([2], dtype=np.uint32), np.array([0], dtype=np.uint32)))


def test_minhash_estimate_within_its_error_bound():
    """|estimate − J| ≤ 4 standard errors √(J(1−J)/k) for 40 pairs; the average error shrinks like 1/√k."""
    rng = random.Random(1)
    pairs = [random_pair(rng, rng.randrange(10, 200), rng.randrange(5, 100)) for _ in range(40)]
    errors = {}
    for k in (64, 256):
        hasher = minhash.MinHasher(num_perm=k)
        errors[k] = []
        for a, b in pairs:
            j = minhash.jaccard(a, b)
            est = minhash.estimate_jaccard(hasher.signature(a), hasher.signature(b))
            assert abs(est - j) <= 4 * minhash.standard_error(j, k) + 1e-12, (j, est, k)
            errors[k].append(abs(est - j))
    assert np.mean(errors[256]) < np.mean(errors[64])


def test_lsh_candidates_equal_datasketch_and_follow_the_s_curve():
    rng = random.Random(2)
    bands, rows = 16, 4
    hasher = minhash.MinHasher(num_perm=bands * rows)
    ours, theirs = minhash.LSH(bands, rows), datasketch.MinHashLSH(num_perm=bands * rows, params=(bands, rows))
    docs = {}
    for i in range(30):
        a, b = random_pair(rng, 60, rng.randrange(5, 60))
        docs[f"a{i}"], docs[f"b{i}"] = a, b
    sigs = {key: hasher.signature(items) for key, items in docs.items()}
    for key, sig in sigs.items():
        ours.insert(key, sig)
        theirs.insert(key, datasketch.MinHash(num_perm=bands * rows, hashvalues=sig, scheme="affine32"))
    for key, sig in sigs.items():
        assert ours.query(sig) == set(theirs.query(datasketch.MinHash(num_perm=bands * rows, hashvalues=sig,
                                                                       scheme="affine32")))
    # P[candidate] = 1 − (1 − J^r)^b: 300 independent pairs at J = 1/2 (each with its own hash seed)
    hits = 0
    for seed in range(300):
        a, b = random_pair(rng, 40, 20)
        h = minhash.MinHasher(num_perm=bands * rows, seed=seed)
        lsh = minhash.LSH(bands, rows)
        lsh.insert("a", h.signature(a))
        hits += "a" in lsh.query(h.signature(b))
    p = minhash.candidate_probability(0.5, bands, rows)
    assert abs(hits / 300 - p) <= 4 * math.sqrt(p * (1 - p) / 300)


def test_dedup_finds_planted_duplicates():
    docs = corpora.prose_documents()[:150]
    planted_docs, planted = corpora.with_planted_duplicates(docs, n_near=12, n_exact=4)
    exact = minhash.exact_duplicates(planted_docs)
    exact_pairs = {tuple(sorted(g[:2])) for g in exact}
    copies = {p for p in planted if p[1] >= len(docs) + 12}  # the upper-cased, re-spaced copies
    assert copies <= exact_pairs <= planted  # (an edited copy may have drawn no edit)
    truth = minhash.exact_pairs(planted_docs, 0.7)
    found = minhash.near_duplicates(planted_docs, 0.7)
    precision, recall = minhash.precision_recall(found, truth)
    assert precision >= 0.9 and recall >= 0.9
    assert minhash.precision_recall(found, planted)[1] >= 0.9


def test_dedup_experiment_runs_the_given_finder_and_reports_each_true_pairs_jaccard():
    from llmsys.data import experiments

    seen = []
    run = experiments.dedup_experiment(60, 6, 2, find=lambda docs, threshold: seen.append(len(docs)) or set())
    assert seen == [68] and run["found"] == 0 and run["recall"] == 0.0 and run["precision"] == 1.0
    assert len(run["true_jaccards"]) == run["true_pairs"] and min(run["true_jaccards"]) >= 0.7
    assert max(run["true_jaccards"]) == 1.0  # the upper-cased copies are equal after normalize


def test_gopher_rules_each_catch_their_case():
    prose = corpora.prose_documents()[0]
    assert quality.gopher_failures(prose) == []
    passing = [d for d in corpora.prose_documents() if not quality.gopher_failures(d)]
    junk = corpora.low_quality_documents(passing, n_each=5)
    assert all("duplicate lines" in quality.gopher_failures(d) for d in junk["boilerplate"])
    assert all("word count" in quality.gopher_failures(d) for d in junk["fragment"])
    assert all("symbol ratio" in quality.gopher_failures(d) for d in junk["symbols"])
    # only the rules on how lines start and end see word order (a shuffled "-" may open the line)
    assert all(set(quality.gopher_failures(d)) <= {"bullet lines", "ellipsis lines"} for d in junk["word salad"])
    assert "stop words" in quality.gopher_failures(" ".join(["python"] * 60))
    assert "mean word length" in quality.gopher_failures(" ".join(["a b"] * 40))


def test_mixing_law_fit_recovers_a_known_law_and_mixtures_hold_their_shares():
    shares = [0.1, 0.3, 0.5, 0.7, 0.9]
    law = {"c": 2.0, "k": 1.5, "t": -2.5}
    fit = mixing.fit_mixing_law(shares, [mixing.predict(law, r) for r in shares])
    assert fit["t"] == pytest.approx(-2.5, abs=0.011) and fit["c"] == pytest.approx(2.0, abs=0.02)
    assert mixing.predict(fit, 0.6) == pytest.approx(mixing.predict(law, 0.6), abs=1e-3)
    train = {"a": torch.zeros(20 * mixing.BLOCK, dtype=torch.long), "b": torch.ones(20 * mixing.BLOCK, dtype=torch.long)}
    stream = mixing.mixture(train, {"a": 0.25, "b": 0.75}, 16 * mixing.BLOCK)
    assert stream.float().mean().item() == 0.75
    with pytest.raises(ValueError, match="sum to 1"):
        mixing.mixture(train, {"a": 0.5, "b": 0.6}, 16 * mixing.BLOCK)


def test_with_repeats_keeps_the_budget_and_repeats_the_passages():
    train = torch.arange(64 * 100)
    stream, passages = mixing.with_repeats(train, n_passages=4, passage_len=64, repeat_share=0.2)
    assert len(stream) == len(train)
    blocks = stream.view(-1, 64)
    copies = sum(int((blocks == p).all(1).sum()) for p in passages)
    assert copies == 4 * (int(0.2 * len(train)) // (64 * 4))
