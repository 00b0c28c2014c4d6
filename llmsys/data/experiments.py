"""The chapter's data experiments, shared by the notebook (small) and benchmarks/eval.py (larger).
Each returns plain data."""

from __future__ import annotations

import dataclasses
import time

from llmsys.core import zoo
from llmsys.data import corpora, minhash, mixing, quality


def dedup_experiment(n_docs: int, n_near: int, n_exact: int, threshold: float = 0.7,
                     find=minhash.near_duplicates) -> dict:
    """Planted duplicates among corpus paragraphs: MinHash + LSH (``find``, with near_duplicates'
    signature) vs the exact all-pairs truth, with each true pair's exact Jaccard."""
    docs, planted = corpora.with_planted_duplicates(corpora.prose_documents()[:n_docs], n_near, n_exact)
    start = time.perf_counter()
    found = find(docs, threshold)
    lsh_s = time.perf_counter() - start
    start = time.perf_counter()
    truth = minhash.exact_pairs(docs, threshold)
    all_pairs_s = time.perf_counter() - start
    precision, recall = minhash.precision_recall(found, truth)
    natural = truth - planted
    return {"documents": len(docs), "planted": len(planted), "true_pairs": len(truth), "natural_pairs": len(natural),
            "found": len(found), "precision": precision, "recall": recall,
            "recall_planted": minhash.precision_recall(found, planted)[1],
            "exact_groups": len(minhash.exact_duplicates(docs)),
            "true_jaccards": sorted(minhash.jaccard(*(minhash.shingles(minhash.normalize(docs[k])) for k in pair))
                                    for pair in truth),
            "seconds": {"minhash+lsh": lsh_s, "all pairs": all_pairs_s}}


def duplication_experiment(n_passages: int = 8, repeat_share: float = 0.25, passage_len: int = 64, steps: int = 300,
                           seed: int = 0) -> dict:
    """Two tiny models on the same token budget: unique text vs ``repeat_share`` of it spent on
    copies of a few passages. Held-out loss and how much of the passages each reproduces."""
    train, val = zoo.dataset()
    stream, passages = mixing.with_repeats(train, n_passages, passage_len, repeat_share, seed)
    spec = dataclasses.replace(mixing.TINY, steps=steps)
    out = {"repeat_share": repeat_share, "n_passages": n_passages, "steps": steps}
    for name, ids in (("unique", train), ("with repeats", stream)):
        model, losses = mixing.train_and_measure(ids, {"held-out": val}, spec, desc=name)
        out[name] = {"val_loss": losses["held-out"], "memorized": mixing.memorized(model, passages)}
    return out


def quality_experiment(model, tok, n_each: int, n_tokens: int = 64) -> dict:
    """Gopher rules and perplexity under the real model on prose, code and four kinds of junk."""
    from llmsys.evaluation.uncertainty import auroc

    prose = corpora.prose_documents(min_words=50)
    classes = {"prose": prose[:n_each], "code": corpora.code_documents(max_docs=n_each),
               **corpora.low_quality_documents(prose, n_each)}
    out = {"gopher_pass": {}, "median_perplexity": {}, "perplexity": {}}
    for name, docs in classes.items():
        out["gopher_pass"][name] = sum(not quality.gopher_failures(d) for d in docs) / len(docs)
        ppl = quality.perplexities(model, tok.encode, docs, n_tokens)
        out["perplexity"][name] = ppl
        out["median_perplexity"][name] = sorted(ppl)[len(ppl) // 2]
    good = out["perplexity"]["prose"]
    out["auroc_junk_vs_prose"] = {name: auroc(out["perplexity"][name] + good, [1] * len(out["perplexity"][name]) + [0] * len(good))
                                  for name in classes if name not in ("prose", "code")}
    return out


def mixing_experiment(fit_shares=(0.1, 0.3, 0.7, 0.9), held_out: float = 0.5, n_tokens: int = 60_000) -> dict:
    """Tiny models at several code shares, a mixing law fitted per domain, and its prediction
    for ``held_out`` against a run at that share."""
    data = mixing.domains()
    runs = mixing.mixing_runs(data, [*fit_shares, held_out], n_tokens)
    fit_runs, check = runs[:-1], runs[-1]
    out = {"runs": runs, "held_out_share": held_out, "laws": {}, "predicted": {}, "measured": {}}
    for domain in ("prose", "code"):
        own = [r["code_share"] if domain == "code" else 1 - r["code_share"] for r in fit_runs]  # r_i: the domain's own share
        law = mixing.fit_mixing_law(own, [r[domain] for r in fit_runs])
        share = held_out if domain == "code" else 1 - held_out
        out["laws"][domain] = law
        out["predicted"][domain] = mixing.predict(law, share)
        out["measured"][domain] = check[domain]
    return out
