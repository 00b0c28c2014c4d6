"""The chapter's evaluation experiments, shared by the notebook (small) and benchmarks/eval.py (larger).
Each returns plain data: numbers, lists and dicts."""

from __future__ import annotations

import hashlib
import inspect

import torch

from llmsys.core import zoo
from llmsys.evaluation import calibration, contamination, scoring, tasks, uncertainty


def calibration_experiment(model, tok, n_dev: int, n_test: int, num_fewshot: int = 1, n_bins: int = 10,
                           progress: bool = True) -> dict:
    """Score the docstring task's dev and test items; fit T on dev; ECE, NLL before/after on test."""
    task = tasks.docstring_task()
    shots = task.split("train")[:num_fewshot]
    dev = scoring.score_mc(model, tok.encode, task.split("dev")[:n_dev], shots, progress)
    test = scoring.score_mc(model, tok.encode, task.split("test")[:n_test], shots, progress)
    table = calibration.calibration_table(dev.logits(), dev.gold, test.logits(), test.gold, n_bins)
    diagrams = {}
    for row in table:
        conf, correct = calibration.confidence_and_correct(test.logits(), test.gold, row["T"])
        diagrams[row["method"]] = calibration.reliability(conf, correct, n_bins).__dict__
    return {"sizes": task.sizes(), "dev": dev.metrics(), "test": test.metrics(), "table": table,
            "reliability": diagrams, "chance": 1 / len(task.items[0].choices),
            "dev_loglik": dev.loglik, "dev_gold": dev.gold, "test_loglik": test.loglik, "test_gold": test.gold}


def hallucination_experiment(model, tok, n_real: int, n_fake: int, n_samples: int = 4, progress: bool = True) -> dict:
    """Ask about real and made-up functions; AUROC of each detector for "made-up" and for "answer wrong"."""
    task = tasks.module_task()
    pool = task.split("test") + task.split("dev")
    items = [i for i in pool if i.real][:n_real] + [i for i in pool if not i.real][:n_fake]
    rows = uncertainty.detect(model, tok, [(i.question, i.answer_start) for i in items], tasks.same_answer,
                              n_samples=n_samples, progress=progress)
    wrong = [not tasks.is_correct(i, r["answer"]) for i, r in zip(items, rows)]
    fake = [not i.real for i in items]
    detectors = list(rows[0]["scores"])
    out = {"n_real": n_real, "n_fake": n_fake, "accuracy_on_real": 1 - sum(w for w, f in zip(wrong, fake) if not f) / max(1, n_real),
           "answers": [{"name": i.name, "real": i.real, "answer": r["answer"], "samples": r["samples"], "wrong": w}
                       for i, r, w in zip(items, rows, wrong)], "auroc": {}}
    for target, labels in (("made-up name", fake), ("wrong answer", wrong)):
        if 0 < sum(labels) < len(labels):
            out["auroc"][target] = {d: uncertainty.auroc([r["scores"][d] for r in rows], labels) for d in detectors}
    return out


def contamination_experiment(repeats: int = 16, k: float = 0.2, seed: int = 0) -> dict:
    """A tiny zoo-style model trained on the corpus plus, for half of the docstring task's test
    items, the item with its answer (``repeats`` copies): the contamination GPT-3's analysis looks
    for. Accuracy on contaminated vs clean items (the inflation), and how well 13-gram overlap
    (with the training text) and Min-K% Prob (with the model only) tell them apart."""
    import random

    from llmsys.data import mixing

    tok = zoo.tokenizer()
    items = tasks.docstring_task().split("test")
    leaked = {i.id for i in items if int(hashlib.sha256(i.id.encode()).hexdigest(), 16) % 2}
    answered = {i.id: i.prompt + scoring.TARGET_DELIMITER + i.choices[i.gold] for i in items}
    train, _ = zoo.dataset()
    blocks = list(train.split(mixing.BLOCK)) + [torch.tensor(tok.encode(answered[i] + "\n\n")) for i in sorted(leaked)] * repeats
    random.Random(seed).shuffle(blocks)
    model, _ = zoo.train(mixing.TINY, torch.cat(blocks), progress=False, desc="contaminated")
    result = scoring.score_mc(model, tok.encode, items)
    hits = [p == g for p, g in zip(result.predictions(), result.gold)]
    labels = [i.id in leaked for i in items]
    acc = {name: sum(h for h, l in zip(hits, labels) if l == want) / sum(l == want for l in labels)
           for name, want in (("contaminated", True), ("clean", False))}
    index = contamination.NgramIndex([tok.decode(b.tolist()) for b in blocks])
    overlap = [index.overlap(answered[i.id]) for i in items]
    n_tokens = min(len(tok.encode(answered[i.id])) for i in items)
    min_k = contamination.min_k_scores(model, tok.encode, [answered[i.id] for i in items], n_tokens, k)
    return {"items": len(items), "contaminated": len(leaked), "repeats": repeats, "acc": acc,
            "inflation": acc["contaminated"] - acc["clean"], "chance": 1 / len(items[0].choices),
            "auroc": {"13-gram overlap": uncertainty.auroc(overlap, labels),
                      f"Min-{int(k * 100)}% Prob": uncertainty.auroc(min_k, labels)}}


def recent_texts() -> list[str]:
    """Docstrings of this library: text written after SmolLM2 was trained."""
    from llmsys.core import model as model_module
    from llmsys.data import minhash, mixing, quality

    out = []
    for module in (calibration, contamination, scoring, uncertainty, minhash, mixing, quality, model_module, zoo):
        out.append(inspect.getdoc(module))
        out += [inspect.getdoc(obj) for _, obj in inspect.getmembers(module, inspect.isfunction)
                if obj.__module__ == module.__name__ and inspect.getdoc(obj)]
    return [" ".join(t.split()) for t in out if t]


def pretrained_min_k_experiment(model, tok, n_texts: int, n_tokens: int = 48, k: float = 0.2) -> dict:
    """Min-K% Prob of the real model on Python's help text (likely in its training data) vs this
    library's docstrings (written after it). The two differ in topic and style too: read the AUROC
    as an upper bound on what membership alone explains."""
    from llmsys.data import corpora

    old = [t for t in corpora.prose_documents() if len(tok.encode(t)) >= n_tokens][:n_texts]
    new = [t for t in recent_texts() if len(tok.encode(t)) >= n_tokens][:n_texts]
    scores_old = contamination.min_k_scores(model, tok.encode, old, n_tokens, k)
    scores_new = contamination.min_k_scores(model, tok.encode, new, n_tokens, k)
    return {"n_python_docs": len(old), "n_new_docs": len(new),
            "mean_min_k": {"python docs": float(torch.tensor(scores_old).mean()), "new docstrings": float(torch.tensor(scores_new).mean())},
            "auroc": uncertainty.auroc(scores_old + scores_new, [1] * len(old) + [0] * len(new))}
