"""Chapter 11, evaluation: tasks, log-likelihood scoring (equal to lm-evaluation-harness),
calibration, uncertainty, contamination."""

import math

import pytest
import torch
import torch.nn.functional as F

from llmsys.core import cache, zoo
from llmsys.evaluation import calibration, contamination, scoring, tasks, uncertainty
from llmsys.core.model import token_logprobs

# ---------------------------------------------------------------- tasks


def test_docstring_task_is_deterministic_split_and_checked_by_code():
    a, b = tasks.docstring_task(), tasks.docstring_task()
    assert a.items == b.items and len(a.items) >= 200
    sizes = a.sizes()
    assert sum(sizes.values()) == len(a.items) and min(sizes.values()) >= 30
    for item in a.items:
        assert tasks.verify_docstring_item(item), item  # the gold name's docstring, and no distractor's
        assert len(set(item.choices)) == 4 and item.split == tasks.split_of(item.id)


def test_module_task_real_names_exist_and_made_up_ones_do_not():
    task = tasks.module_task(n_real=30, n_fake=30)
    assert task.items == tasks.module_task(n_real=30, n_fake=30).items
    real = [i for i in task.items if i.real]
    fake = [i for i in task.items if not i.real]
    assert len(real) == len(fake) == 30
    assert all(tasks.defined_anywhere(i.name) for i in real)
    assert not any(tasks.defined_anywhere(i.name) for i in fake)
    join = next(i for i in real if i.name == "join")
    assert tasks.is_correct(join, "os.path`") and tasks.is_correct(join, "posixpath") is False
    assert not tasks.is_correct(fake[0], "math")
    assert tasks.same_answer("posixpath", "os.path` in Python") and not tasks.same_answer("os", "os.path")
    with pytest.raises(ValueError, match="split must be one of"):
        task.split("validation")


# ---------------------------------------------------------------- scoring


def test_encode_pair_moves_trailing_space_to_the_continuation():
    tok = zoo.tokenizer()
    context, continuation = scoring.encode_pair(tok.encode, "Answer: ", "yes")
    assert context == tok.encode("Answer:") and context + continuation == tok.encode("Answer: yes")
    with pytest.raises(ValueError, match="context is empty"):
        scoring.encode_pair(tok.encode, "", "yes")


def test_loglikelihoods_equal_a_plain_forward_pass():
    """Shared context + cached continuations give the log-probabilities of one full forward per request."""
    model, tok = zoo.load("draft", device="cpu"), zoo.tokenizer()
    context = tok.encode("The for statement is used to iterate over")
    continuations = [tok.encode(" the elements of a sequence"), tok.encode(" x"), tok.encode(" lists and dicts")]
    got = scoring.loglikelihoods(model, [(context, c) for c in continuations])
    for (ll, greedy), cont in zip(got, continuations):
        ids = torch.tensor([context + cont])
        with torch.no_grad():
            lp = F.log_softmax(model(ids[:, :-1]).float(), dim=-1)[0, len(context) - 1:]
        target = torch.tensor(cont)
        assert ll == pytest.approx(lp.gather(-1, target[:, None]).sum().item(), abs=1e-4)
        assert greedy == bool((lp.argmax(-1) == target).all())
    with pytest.raises(ValueError, match="max_seq_len"):
        scoring.loglikelihoods(model, [(context * 40, continuations[0])])


def test_acc_and_acc_norm_follow_the_harness_definitions():
    result = scoring.MCResult(loglik=[[-4.0, -5.0], [-3.0, -3.0]], gold=[1, 1], choices=[("ab", "abcdefgh"), ("x", "y")])
    # item 1: -4/2 = -2 < -5/8 = -0.625, so only acc_norm picks the long gold; item 2: a tie goes to the first
    assert result.predictions() == [0, 0] and result.predictions("chars") == [1, 0]
    assert result.metrics() == {"acc": 0.0, "acc_norm": 0.5, "acc_bytes": 0.5, "n": 2}


def test_scores_equal_lm_evaluation_harness_on_the_same_items():
    """40 test items, one few-shot example, SmolLM2 in fp32: the harness's own HFLM (transformers'
    Llama) and our Transformer give the same log-likelihoods to 1e-3 and the same acc / acc_norm."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tok = zoo.load("smollm2", device="cpu"), zoo.tokenizer("smollm2")
    task = tasks.docstring_task()
    items, shots = task.split("test")[:40], task.split("train")[:1]
    ours = scoring.score_mc(model, tok.encode, items, shots)
    folder = scoring.write_harness_task(items, cache.cache_dir() / "lm_eval_tasks" / "docmc_test", "llmsys_docmc",
                                        num_fewshot=1, fewshot_items=shots)
    out = lm_eval.simple_evaluate(model=HFLM(pretrained=model.to_hf(), tokenizer=tok, batch_size=16),
                                  tasks=["llmsys_docmc"], task_manager=TaskManager(include_path=str(folder)),
                                  num_fewshot=1, log_samples=True)
    samples = sorted(out["samples"]["llmsys_docmc"], key=lambda s: s["doc_id"])
    theirs = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    torch.testing.assert_close(torch.tensor(ours.loglik), torch.tensor(theirs), rtol=0, atol=1e-3)
    metrics = ours.metrics()
    assert metrics["acc"] == pytest.approx(out["results"]["llmsys_docmc"]["acc,none"])
    assert metrics["acc_norm"] == pytest.approx(out["results"]["llmsys_docmc"]["acc_norm,none"])


# ---------------------------------------------------------------- calibration


def test_ece_on_known_cases():
    assert calibration.ece([1.0, 1.0, 1.0], [1, 1, 1]) == 0.0
    assert calibration.ece([0.75] * 4, [1, 1, 1, 0]) == pytest.approx(0.0)  # 75% sure, right 3 times in 4
    assert calibration.ece([0.9] * 10, [0] * 10) == pytest.approx(0.9)
    # two bins: (0.2, 0.2, wrong, right) -> gap |0.5 - 0.2|; (0.95 x 2, right, right) -> gap 0.05
    assert calibration.ece([0.2, 0.2, 0.95, 0.95], [0, 1, 1, 1]) == pytest.approx(0.5 * 0.3 + 0.5 * 0.05)
    r = calibration.reliability([0.0, 0.1, 0.15, 1.0], [0, 0, 1, 1], n_bins=10)
    assert r.count == [2, 1, 0, 0, 0, 0, 0, 0, 0, 1]  # 0.1 belongs to (0, 0.1], 0.0 to the first bin
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        calibration.ece([1.5], [1])


def test_temperature_scaling_lowers_nll_on_held_out_data():
    gen = torch.Generator().manual_seed(0)
    true_logits = torch.randn(4000, 4, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(F.softmax(true_logits, -1), 1, generator=gen)[:, 0]
    overconfident = 3.0 * true_logits  # what the model reports
    dev, test = slice(0, 2000), slice(2000, 4000)
    t = calibration.fit_temperature(overconfident[dev], labels[dev])
    assert t == pytest.approx(3.0, rel=0.1)
    before, after = calibration.calibration_table(overconfident[dev], labels[dev], overconfident[test], labels[test])
    assert after["nll"] < before["nll"] and after["ece"] < before["ece"]
    assert after["acc"] == before["acc"]  # dividing by T > 0 never changes the argmax


# ---------------------------------------------------------------- uncertainty


def test_auroc_equals_the_pair_count():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 6, (60,), generator=gen).double()  # many ties
    labels = torch.rand(60, generator=gen) < 0.4
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert uncertainty.auroc(scores, labels) == pytest.approx(pairs.mean().item())
    assert uncertainty.auroc([0.1, 0.2, 0.9, 0.8], [0, 0, 1, 1]) == 1.0
    with pytest.raises(ValueError, match="both classes"):
        uncertainty.auroc([0.1, 0.2], [1, 1])


def test_semantic_entropy_and_self_consistency():
    same = tasks.same_answer
    assert uncertainty.semantic_entropy(["os.path", "posixpath", "os.path`"], same) == pytest.approx(0.0)
    assert uncertainty.semantic_entropy(["math", "json", "re", "os"], same) == pytest.approx(math.log(4))
    assert uncertainty.clusters(["math", "json", "math."], same) == [[0, 2], [1]]
    assert uncertainty.disagreement("math", ["math", "cmath", "json", "math`"], same) == 0.5


# ---------------------------------------------------------------- contamination


def test_thirteen_gram_overlap_flags_copied_text():
    train = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat all day long"
    index = contamination.NgramIndex([train])
    copied = "The quick brown fox jumps over the lazy dog, while the cat sleeps on the warm mat!"
    assert index.flagged(copied) and index.overlap(copied) == 1.0  # case and punctuation do not hide it
    assert not index.flagged("the quick brown fox jumps over the lazy dog")  # fewer than 13 words
    assert not index.flagged("a slow red fox walks under the busy dog while the cat sleeps on a mat")


def test_min_k_prob_is_the_mean_of_the_lowest_fraction():
    lp = torch.tensor([[-0.1, -5.0, -0.2, -3.0, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8]])
    assert contamination.min_k_prob(lp, 0.2).item() == pytest.approx(-4.0)
    assert contamination.min_k_prob(lp, 1.0).item() == pytest.approx(lp.mean().item())
    model, tok = zoo.load("draft", device="cpu"), zoo.tokenizer()
    text = zoo.corpus()[:2000]
    ids = torch.tensor([tok.encode(text)[:48]])
    with torch.no_grad():
        full = F.log_softmax(model(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(token_logprobs(model, ids), full)
    with pytest.raises(ValueError, match="fewer than n_tokens"):
        contamination.min_k_scores(model, tok.encode, ["short"], n_tokens=48)

