"""After healing, more sequence-level KD or on-policy distillation? SmolLM2's student at equal compute.

The student is the zoo's layer-dropped SmolLM2-135M-Instruct healed by sequence-level KD
(``distill.chat``: 6 of 30 layers, trained on the teacher's greedy answers), loaded once and shared
by every run. On-policy distillation needs a student whose own samples are worth scoring; an
untrained 6-layer student writes noise, which is why the healing comes first (as Minitron and
GKD start from a supervised student). Each seed then continues one copy of it per method on the
same fresh training prompts (``chat.chat_prompts``: Python's help topics), until each has spent
the same FLOP budget counted by ``distill.Compute`` (``equal_compute.train_to_budget``, the loop the
addition experiment uses):

- **more sequence-level KD**: the teacher samples an answer to each prompt (its generation is
  counted) and the student trains on it with cross-entropy;
- **on-policy** (GKD with β = 1, Agarwal et al. 2024): the student samples, the teacher scores its
  samples in one forward pass (counted), the student descends the exact reverse KL over the
  vocabulary at every sampled position.

At the start and at ``points`` evenly spaced shares of the budget it measures the student on the
held-out chat prompts (``chat.own_sample_scores``, the same sampling seed for every run): the
reverse KL to the teacher per token of the student's own answers, and the task measure, the
teacher's log-prob per token of those answers (how likely the teacher finds what the student
writes when it runs on its own prefixes, where errors compound), by answer position too, and the
student's entropy. Learning rates are tuned per method on a seed of their own (``tune``), by the
reverse KL: the task measure alone rewards a student that collapses onto one likely answer (``choose``).

    from llmsys.distill import continuation
    result = continuation.run_seeds(continuation.Setup(), seeds=range(5))
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field

import torch

from llmsys.core.stats import mean_interval
from llmsys.distill import chat, equal_compute

METHODS = {"seq_kd": None, "on_policy": "full"}  # method -> distill.on_policy_step's signal (None: seq-KD)
LABELS = {"seq_kd": "more sequence-level KD", "on_policy": "on-policy (GKD β=1)"}
TASK = "teacher_logprob"  # the task measure: the teacher's log-prob per token of the student's own answers
EVAL_SEED = 10_000  # the held-out answers are sampled with this seed in every run: differences are the models'


@dataclass(frozen=True)
class Setup:
    """The budget (in sequence-level KD steps' worth of FLOPs, at full answer length), the batch, the
    answer length, each method's learning rate, how many shares of the budget to measure at, and
    the held-out prompts (the first ``eval_prompts`` of chat's held-out questions, each answered
    ``eval_samples`` times)."""

    budget_steps: int = 10
    batch_size: int = 8
    answer_tokens: int = 32
    lr: dict = field(default_factory=lambda: {"seq_kd": 3e-4, "on_policy": 3e-4})
    points: int = 3
    eval_prompts: int = 18
    eval_samples: int = 2
    methods: tuple[str, ...] = ("seq_kd", "on_policy")

    def __post_init__(self):
        if set(self.methods) - set(METHODS) or not self.methods:
            raise ValueError(f"methods must be some of {tuple(METHODS)}, got {self.methods!r}")
        if set(self.methods) - set(self.lr):
            raise ValueError(f"lr has no learning rate for {sorted(set(self.methods) - set(self.lr))}: give one per method")
        sizes = (self.budget_steps, self.batch_size, self.answer_tokens, self.points, self.eval_prompts, self.eval_samples)
        if min(sizes) < 1:
            raise ValueError("budget_steps, batch_size, answer_tokens, points, eval_prompts and eval_samples must be >= 1")


@dataclass
class Models:
    """What every run shares: the teacher, the healed student (embedding frozen: it is the teacher's),
    the training prompts (N, P), the held-out prompts (rows, P) and the stop token."""

    teacher: torch.nn.Module
    healed: torch.nn.Module
    train: torch.Tensor
    held_out: torch.Tensor
    stop_token: int


def load(setup: Setup, progress: bool = True) -> Models:
    """The zoo's teacher and seq-KD student (built on first use: minutes), and the prompts."""
    from llmsys.core import zoo

    teacher, tok = zoo.load(zoo.PRETRAINED), zoo.tokenizer(zoo.PRETRAINED)
    healed = chat.load_students(teacher, progress=progress)["seq_kd"]
    chat.freeze_embedding(healed)
    dev = teacher.tok_embeddings.weight.device
    held_out = chat.chat_prompts(tok, "heldout")[: setup.eval_prompts].repeat(setup.eval_samples, 1)
    return Models(teacher, healed, chat.chat_prompts(tok, "train").to(dev), held_out.to(dev), tok.eos_token_id)


def measure(model, models: Models, setup: Setup) -> dict:
    return chat.own_sample_scores(model, models.teacher, models.held_out, setup.answer_tokens, models.stop_token,
                                  EVAL_SEED)


def budget_flops(setup: Setup, models: Models) -> float:
    """``budget_steps`` steps of sequence-level KD whose answers all run to ``answer_tokens``."""
    return setup.budget_steps * equal_compute.sequence_step_flops(
        None, models.healed, models.teacher, setup.batch_size, models.train.size(1), setup.answer_tokens)


def fresh_prompts(models: Models, batch_size: int, seed: int):
    """Batches of training prompts, each prompt once before any repeats (a new order per pass): the
    same batches for every method of a seed. Returns a function giving the next (B, P) batch."""
    order = torch.Generator().manual_seed(seed)
    n = len(models.train)
    if batch_size > n:
        raise ValueError(f"batch_size {batch_size} exceeds the {n} training prompts")

    def batches():
        while True:
            for rows in torch.randperm(n, generator=order).split(batch_size):
                if len(rows) == batch_size:
                    yield models.train[rows.to(models.train.device)]

    return batches().__next__


def run_method(method: str, setup: Setup, models: Models, seed: int, start_point: dict | None = None,
               progress: bool = False) -> dict:
    """Continue a copy of the healed student with ``method`` until it has spent the budget; ``seed``
    draws the prompts' order and the samples. ``start_point``: the healed student's measurement,
    when already made. Returns {"method", "seed", "lr", **equal_compute.train_to_budget's result}."""
    model = copy.deepcopy(models.healed)
    run = equal_compute.train_to_budget(
        model, models.teacher, METHODS[method], fresh_prompts(models, setup.batch_size, seed), setup.answer_tokens,
        budget_flops(setup, models), setup.lr[method], seed, setup.points, lambda: measure(model, models, setup),
        stop_token=models.stop_token, start_point=start_point, progress=progress, desc=f"{method} seed {seed}")
    return {"method": method, "seed": seed, "lr": setup.lr[method], **run}


def run_seeds(setup: Setup, seeds, models: Models | None = None, progress: bool = True, on_run=None) -> dict:
    """Every method on every seed (seed by seed, so a stopped sweep pairs the methods on the seeds it
    finished); ``on_run(result)`` after each run. Returns {"setup", "teacher" (its own answers scored
    the same way: the task measure's ceiling), "start" (the healed student), "runs"}."""
    from tqdm.auto import tqdm

    models = models or load(setup, progress)
    start = measure(models.healed, models, setup)
    result = {"setup": asdict(setup), "budget_flops": budget_flops(setup, models),
              "teacher": measure(models.teacher, models, setup), "start": start, "runs": []}
    plan = [(seed, method) for seed in seeds for method in setup.methods]
    for seed, method in tqdm(plan, desc="continuation runs", disable=not progress):
        result["runs"].append(run_method(method, setup, models, seed, start, progress))
        if on_run is not None:
            on_run(result)
    return result


def tune(setup: Setup, lrs, seed: int, models: Models | None = None, progress: bool = True) -> tuple[Setup, list[dict]]:
    """Each method's learning rate chosen from ``lrs`` on a tuning seed (apart from the reported seeds).
    Returns the setup with those rates and one row per run tried, {"method", "lr", TASK, "reverse_kl",
    "entropy", "edge"} (``choose``)."""
    from tqdm.auto import tqdm

    if not lrs or min(lrs) <= 0:
        raise ValueError(f"lrs must be positive learning rates to try, got {lrs!r}")
    models = models or load(setup, progress)
    trial_setup = dataclasses.replace(setup, points=1)  # only the end of the budget is compared
    rows = []
    for method, lr in tqdm([(m, lr) for m in setup.methods for lr in lrs], desc="tuning", disable=not progress):
        trial = dataclasses.replace(trial_setup, lr={**setup.lr, method: lr})
        end = run_method(method, trial, models, seed, start_point={})["curve"][-1]  # the start is not compared
        rows.append({"method": method, "lr": lr, **{k: end.get(k) for k in (TASK, "reverse_kl", "entropy")}})
    return choose(setup, rows)


def choose(setup: Setup, rows: list[dict]) -> tuple[Setup, list[dict]]:
    """Each method's rate from tuning ``rows``: the lowest reverse KL on the student's own answers at the
    end of the budget (how close to the teacher it is where it runs), not the task measure, which a
    student collapsing onto one likely answer wins (on the tuning seed on-policy at 1e-3 did: entropy
    near 0, teacher log-prob up, reverse KL up). A diverged (NaN) run never wins. Marks each row
    "edge" when its method's best rate is the smallest or largest tried (a wider sweep may do better)."""
    missing = set(setup.methods) - {r["method"] for r in rows}
    if missing:
        raise ValueError(f"the tuning rows have no run of {sorted(missing)}: tune every method of the setup")
    score = (lambda r: r["reverse_kl"] if math.isfinite(r["reverse_kl"]) else math.inf)
    best = {m: min((r for r in rows if r["method"] == m), key=score)["lr"] for m in setup.methods}
    for row in rows:
        tried = [r["lr"] for r in rows if r["method"] == row["method"]]
        row["edge"] = len(tried) > 1 and best[row["method"]] in (min(tried), max(tried))
    return dataclasses.replace(setup, lr={**setup.lr, **best}), rows


def summary(result: dict) -> dict:
    """Per measurement (the task measure, the reverse KL): each method's seeds at the end of the budget,
    mean and 95% t interval, and the paired difference on-policy − more seq-KD, with its interval."""

    out = {}
    for key in (TASK, "reverse_kl"):
        out[key] = {m: mean_interval(v) for m in result["setup"]["methods"] if (v := equal_compute.finals(result, m, key))}
        paired = paired_difference(result, key)
        if paired is not None:
            out[key]["on_policy - seq_kd"] = paired[:3]
    return out


def paired_difference(result: dict, key: str = TASK) -> tuple[float, float, float, int] | None:
    """On-policy − more seq-KD in ``key`` at the end of the budget, seed by seed over the seeds both
    methods finished: (mean, 95% t interval low, high, seeds); None under two seeds."""

    by = {m: {r["seed"]: r["curve"][-1][key] for r in result["runs"] if r["method"] == m} for m in ("on_policy", "seq_kd")}
    seeds = sorted(by["on_policy"].keys() & by["seq_kd"].keys())
    if len(seeds) < 2:
        return None
    return (*mean_interval([by["on_policy"][s] - by["seq_kd"][s] for s in seeds]), len(seeds))


def curves(result: dict) -> dict:
    """Per method the seed means of the measurements at each share of the budget (quality vs compute)."""
    return equal_compute.curves(result, scalars=(TASK, "reverse_kl"), lists=("teacher_logprob_by_position",))
