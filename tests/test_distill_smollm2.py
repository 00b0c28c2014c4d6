"""On SmolLM2: the healed student continued by on-policy distillation or more sequence-level KD at equal
compute. The FLOP accounting (a counter that forgets the teacher's work must fail here), the measurements,
the benchmark at its tiny size feeding the claim, and the claim's paired rule."""

import dataclasses
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from llmsys import distill
from llmsys.course import claims
from llmsys.distill import chat, continuation, equal_compute

TINY = continuation.Setup(budget_steps=2, batch_size=2, answer_tokens=4, points=2, eval_prompts=2, eval_samples=1)


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return continuation.load(TINY, progress=False)


def check_accounting(run: dict, models) -> None:
    """The run's FLOPs are the written-out cost of each of its steps (at the answer length that step
    sampled), and it stopped at the first step that reached the budget."""
    P, B = models.train.size(1), TINY.batch_size
    costs = [equal_compute.sequence_step_flops(continuation.METHODS[run["method"]], models.healed, models.teacher,
                                               B, P, n) for n in run["answer_lengths"]]
    spent = run["compute"]["flops"]
    assert spent == pytest.approx(sum(costs), rel=1e-9), (spent, sum(costs))
    assert run["budget_flops"] <= spent < run["budget_flops"] + costs[-1]
    assert [p["flops"] for p in run["curve"]] == sorted(p["flops"] for p in run["curve"])
    assert run["curve"][-1]["flops"] == spent and len(run["curve"]) == TINY.points + 1


def test_both_methods_spend_the_same_budget_counting_the_teacher(models):
    before = {k: v.clone() for k, v in chat.trained_state(models.healed).items()}
    runs = {m: continuation.run_method(m, TINY, models, seed=0) for m in TINY.methods}
    for run in runs.values():
        check_accounting(run, models)
    seq, on = runs["seq_kd"]["compute"], runs["on_policy"]["compute"]
    assert seq["teacher_tokens"] > 0 and seq["student_tokens"] == 0  # the teacher wrote every answer
    assert on["teacher_tokens"] > 0 and on["student_tokens"] > 0  # the student wrote, the teacher scored
    after = chat.trained_state(models.healed)
    assert all(torch.equal(before[k], after[k]) for k in before)  # each run trains a copy: the start is shared
    trained = runs["on_policy"]["curve"][-1]
    assert trained["reverse_kl"] >= 0 and trained[continuation.TASK] <= 0
    assert len(trained["teacher_logprob_by_position"]) <= TINY.answer_tokens


@pytest.mark.parametrize("forgotten, method", [("generate", "seq_kd"), ("score", "on_policy")])
def test_forgetting_the_teachers_work_fails_the_accounting(forgotten, method, models, monkeypatch):
    """A counter that lets the teacher's decoding (sequence-level KD) or its scoring (on-policy) cost nothing."""
    original = getattr(distill.Compute, forgotten)

    def without_teacher(self, model, *args, **kwargs):
        if not kwargs.get("teacher", args[-1]):  # ``teacher`` is the last argument, by position or by name
            original(self, model, *args, **kwargs)

    monkeypatch.setattr(distill.Compute, forgotten, without_teacher)
    run = continuation.run_method(method, TINY, models, seed=0)
    with pytest.raises(AssertionError):
        check_accounting(run, models)


def test_the_teacher_scored_on_its_own_answers_has_no_reverse_kl(models):
    scores = chat.own_sample_scores(models.teacher, models.teacher, models.held_out, 4, models.stop_token)
    assert scores["reverse_kl"] == pytest.approx(0.0, abs=1e-4)
    assert scores[continuation.TASK] < 0 and len(scores["teacher_logprob_by_position"]) <= 4


def test_the_benchmark_at_its_tiny_size_feeds_the_claim(tmp_path, models, monkeypatch):
    monkeypatch.setattr(continuation, "load", lambda setup, progress=True: models)  # loaded once for the file
    spec = importlib.util.spec_from_file_location(
        "distill_smollm2_benchmark", Path(__file__).resolve().parent.parent / "benchmarks" / "distill_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path, tuning = tmp_path / "distill_smollm2.json", tmp_path / "tuning.json"
    sizes = ["--budget-steps", "1", "--batch-size", "2", "--answer-tokens", "4", "--eval-prompts", "2",
             "--eval-samples", "1", "--points", "1"]
    assert module.main(["--seeds", "0", *sizes, "--lrs", "1e-4", "3e-4", "--json", str(tuning)]) == 0  # tuning only
    assert len(json.loads(tuning.read_text())["tuning"]) == 4
    assert module.main(["--seeds", "2", *sizes, "--tuning-from", str(tuning), "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["complete"] and result["command"].startswith("python benchmarks/distill_smollm2.py")
    assert {"machine", "when", "tuning", "curves", "runs", "summary", "teacher", "start"} <= set(result)
    assert result["tuning"] == json.loads(tuning.read_text())["tuning"]
    assert {r["lr"] for r in result["runs"]} <= {1e-4, 3e-4}
    assert len(result["runs"]) == 4 and set(result["curves"]) == {"seq_kd", "on_policy"}
    evidence = claims.on_policy_after_healing(result)
    assert evidence.seeds == 2 and evidence.low <= evidence.value <= evidence.high
    assert result["summary"][continuation.TASK]["on_policy - seq_kd"] == pytest.approx(
        [evidence.value, evidence.low, evidence.high])
    with pytest.raises(SystemExit):
        module.main(["--seeds", "2", "--batch-size", "0", "--json", str(path)])
    with pytest.raises(SystemExit):  # tuned at other sizes
        module.main(["--seeds", "2", *sizes[:-1], "2", "--tuning-from", str(tuning), "--json", str(path)])


def stored_result(gain: float, noise: float, seed_spread: float, seeds: int = 5) -> dict:
    """Runs whose task measure varies a lot from seed to seed (shared by both methods) and by ``gain``
    plus ``noise`` between them."""
    rng = random.Random(0)
    runs = []
    for seed in range(seeds):
        base = -3 + rng.gauss(0, seed_spread)
        for method, value in (("seq_kd", base), ("on_policy", base + gain + rng.gauss(0, noise))):
            runs.append({"method": method, "seed": seed, "curve": [{continuation.TASK: -5.0},
                                                                   {continuation.TASK: value}]})
    return {"when": "2026-01-01", "machine": "test", "runs": runs}


@pytest.mark.parametrize("gain, noise, verdict", [(0.2, 0.02, claims.SHOWN), (0.01, 0.2, claims.NOT_SHOWN),
                                                  (-0.2, 0.02, claims.NOT_SHOWN)])
def test_claim_is_shown_only_when_the_paired_interval_favours_on_policy(gain, noise, verdict):
    """Seeds that differ far more than the methods do (seed_spread 1.0): pairing by seed still shows a
    consistent gain, where an unpaired interval would drown it."""
    claim = claims.BY_KEY["on-policy-after-healing"]
    evidence = claims.on_policy_after_healing(stored_result(gain, noise, seed_spread=1.0))
    assert evidence.seeds == 5 and evidence.low < evidence.value < evidence.high
    judged = claims.judge(dataclasses.replace(claim, evidence=lambda: evidence))
    assert judged.verdict == verdict, judged.reason
    if verdict == claims.NOT_SHOWN:
        assert "the claim needs" in judged.reason  # the reason is printed


def test_setup_says_what_to_change():
    with pytest.raises(ValueError, match="methods"):
        continuation.Setup(methods=("word_kd",))
    with pytest.raises(ValueError, match="learning rate"):
        continuation.Setup(lr={"seq_kd": 1e-3})
    with pytest.raises(ValueError, match="budget_steps"):
        continuation.Setup(budget_steps=0)


def test_tuning_picks_the_lowest_finite_reverse_kl_and_flags_an_edge(monkeypatch):
    """The lowest reverse KL at the end of the budget wins, not the highest task measure (a collapsed
    student can win that); a diverged (NaN) run never wins; a best rate at either end of the sweep is flagged."""
    end = {"seq_kd": {1e-4: (-6.0, 2.5), 1e-3: (-7.0, 2.2), 1e-2: (float("nan"), float("nan"))},
           "on_policy": {1e-4: (-6.0, 2.4), 1e-3: (-6.5, 2.1), 1e-2: (-3.0, 3.0)}}  # 1e-2: collapsed

    def fake_run(method, setup, models, seed, start_point=None, progress=False):
        task, kl = end[method][setup.lr[method]]
        return {"curve": [{}, {continuation.TASK: task, "reverse_kl": kl, "entropy": 1.0}]}

    monkeypatch.setattr(continuation, "run_method", fake_run)
    tuned, rows = continuation.tune(continuation.Setup(), [1e-4, 1e-3, 1e-2], seed=1000, models=object())
    assert tuned.lr == {"seq_kd": 1e-3, "on_policy": 1e-3} and not any(r["edge"] for r in rows)
    edge_rows = [r for r in rows if r["lr"] != 1e-4 or r["method"] == "seq_kd"]  # on-policy's best is now its smallest
    assert {r["method"] for r in continuation.choose(continuation.Setup(), edge_rows)[1] if r["edge"]} == {"on_policy"}
    with pytest.raises(ValueError, match="learning rates"):
        continuation.tune(continuation.Setup(), [], seed=1000, models=object())
    with pytest.raises(ValueError, match="on_policy"):
        continuation.choose(continuation.Setup(), [r for r in rows if r["method"] == "seq_kd"])
