"""On-policy distillation vs sequence-level KD at equal compute, over seeds, on addition.

The teacher (``addition.load_teacher``) is near perfect; the student starts as its first layer
(``addition.student``: it gets a third of the digits right, no whole sums). Each seed (the
training sums drawn and the samples) trains one copy of it per method until it has spent the
same FLOP budget, counted by ``distill.Compute``: the teacher's generation (sequence-level KD: the teacher writes every
answer it teaches, one token at a time), the teacher's scoring (on-policy: one forward pass
over the student's samples), the student's sampling and the student's training. A run stops
at the first step that reaches the budget, so the methods' totals differ by less than a step.

At evenly spaced points of the budget it measures the student on held-out sums: greedy exact
match, accuracy at every answer position on its own prefix (greedy) and on the true prefix
(teacher forcing: the gap between the two is exposure bias), and the reverse KL(π_S‖π_T) on
its own samples (``distill.evaluate_reverse_kl``).

    from llmsys.distill import equal_compute
    result = equal_compute.run_seeds(equal_compute.Setup(), seeds=[0, 1])
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from dataclasses import asdict, dataclass, field

import torch

from llmsys import distill
from llmsys.core import device
from llmsys.distill.addition import (
    Addition,
    StudentSpec,
    TeacherSpec,
    greedy_accuracy,
    load_teacher,
    student,
)

# method -> the signal of distill.on_policy_step, or None for sequence-level KD
METHODS = {"seq_kd": None, "on_policy": "dense", "full_kl": "full"}
LABELS = {"seq_kd": "sequence-level KD", "on_policy": "on-policy, sampled-token KL",
          "full_kl": "on-policy, full-vocab KL (GKD β=1)"}


@dataclass(frozen=True)
class Setup:
    """One experiment: the teacher, the student, the budget (in sequence-level KD steps' worth of FLOPs),
    the batch, each method's learning rate, and how often and on how many held-out sums to measure."""

    teacher: TeacherSpec = field(default_factory=TeacherSpec)
    student: StudentSpec = field(default_factory=StudentSpec)
    budget_steps: int = 150  # the FLOP budget is what this many sequence-level KD steps cost
    batch_size: int = 64
    # the default: one rate for every method; ``tune`` picks each method's own on a tuning seed
    lr: dict = field(default_factory=lambda: {"seq_kd": 1e-3, "on_policy": 1e-3, "full_kl": 1e-3})
    methods: tuple[str, ...] = ("seq_kd", "on_policy", "full_kl")
    points: int = 5  # measurements along the budget (plus one before training)
    eval_problems: int = 256

    def __post_init__(self):
        unknown = set(self.methods) - set(METHODS)
        if unknown or not self.methods:
            raise ValueError(f"methods must be some of {tuple(METHODS)}, got {self.methods!r}")
        missing = set(self.methods) - set(self.lr)
        if missing:
            raise ValueError(f"lr has no learning rate for {sorted(missing)}: give one per method")
        if self.budget_steps < 1 or self.batch_size < 1 or self.points < 1 or self.eval_problems < 1:
            raise ValueError("budget_steps, batch_size, points and eval_problems must all be >= 1")


def step_flops(method: str, student_model, teacher, task: Addition, batch_size: int) -> float:
    """The FLOPs ``distill.Compute`` should count for one training step of ``method`` on ``task``."""
    return sequence_step_flops(METHODS[method], student_model, teacher, batch_size, task.prompt_len, task.answer_len)


def sequence_step_flops(signal: str | None, student_model, teacher, B: int, P: int, N: int) -> float:
    """One step on B prompts of P tokens with N answer tokens each, written out (``signal``: None for
    sequence-level KD, else on-policy): each model's forward is 2N per token (``flops_per_token``),
    training 3× that."""
    f_s, f_t = student_model.cfg.flops_per_token, teacher.cfg.flops_per_token
    train = 3 * B * (P + N - 1) * f_s(P + N - 1)
    if signal is None:  # the teacher writes the answers: a prefill and N decode steps over P + N tokens
        return B * (P + N) * f_t(P + N) + train
    return B * (P + N) * f_s(P + N) + B * (P + N - 1) * f_t(P + N - 1) + train  # student samples, teacher scores


def budget_flops(setup: Setup, student_model, teacher, task: Addition) -> float:
    return setup.budget_steps * step_flops("seq_kd", student_model, teacher, task, setup.batch_size)


@torch.no_grad()
def measure(model, teacher, task: Addition, a: torch.Tensor, b: torch.Tensor, seed: int) -> dict:
    """Greedy exact match and per-position accuracy on the student's own prefix, per-position accuracy
    on the true prefix, and the reverse KL on the student's own samples."""
    own = greedy_accuracy(model, task, a, b)
    prompts, answers = task.prompts(a, b), task.answers(a, b)
    tokens = torch.cat([prompts, answers], dim=1).to(model.tok_embeddings.weight.device)
    predicted = model(tokens[:, :-1])[:, task.prompt_len - 1:].argmax(-1).cpu()  # (n, answer_len), true prefixes
    forced = task.position_correct(predicted, answers).float().mean(0).tolist()
    kl = distill.evaluate_reverse_kl(model, teacher, prompts.to(tokens.device), task.answer_len, seed=seed)
    return {"exact": own["exact"], "per_position": own["per_position"], "forced_per_position": forced,
            "reverse_kl": kl}


def run_method(method: str, setup: Setup, teacher, start, task: Addition, seed: int, held_out,
               progress: bool = False) -> dict:
    """Train a copy of the student ``start`` with ``method`` until it has spent the budget; ``seed``
    draws the training sums and the samples.

    Returns {"method", "seed", "steps", "compute": Compute's counts, "curve": [measurement + "flops"]}."""
    model = copy.deepcopy(start).to(_device_of(teacher)).eval()
    problems = torch.Generator().manual_seed(seed)  # the same training sums for every method of a seed
    run = train_to_budget(model, teacher, METHODS[method],
                          lambda: task.prompts(*task.problems(setup.batch_size, problems)).to(_device_of(model)),
                          task.answer_len, budget_flops(setup, model, teacher, task), setup.lr[method], seed,
                          setup.points, lambda: measure(model, teacher, task, *held_out, seed + 1),
                          progress=progress, desc=f"{method} seed {seed}")
    return {"method": method, "seed": seed, "lr": setup.lr[method], **run}


def train_to_budget(model, teacher, signal: str | None, next_prompts, answer_len: int, budget: float, lr: float,
                    seed: int, points: int, record, stop_token: int | None = None, start_point: dict | None = None,
                    progress: bool = False, desc: str = "") -> dict:
    """Train ``model`` in place until it has spent ``budget`` FLOPs: each step on ``next_prompts()``
    (B, P), by sequence-level KD on the teacher's samples (``signal`` None) or on-policy with
    ``distill.on_policy_step``'s ``signal``; ``seed`` draws the samples. ``record()`` measures the
    model at the start (``start_point`` instead, when it is known) and at the first step reaching each
    of ``points`` evenly spaced shares of the budget. Only parameters that require grad train.

    Returns {"steps", "budget_flops", "compute": Compute's counts, "answer_lengths" (tokens sampled at
    each step), "curve": [{"flops", "step", **record()}]}."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sampler = device.generator(seed, model)
    compute, curve, lengths = distill.Compute(), [], []
    checkpoints = [budget * k / points for k in range(1, points + 1)]
    curve.append({"flops": 0.0, "step": 0, **(start_point if start_point is not None else record())})
    bar = tqdm(total=round(budget), desc=desc, disable=not progress, leave=False, unit="FLOP", unit_scale=True)
    while compute.flops < budget:
        prompts = next_prompts()
        before, calls = compute.flops, compute.sequential_calls
        if signal is None:
            rollout = distill.teacher_rollouts(teacher, prompts, answer_len, stop_token=stop_token, generator=sampler,
                                               compute=compute)
            distill.sequence_kd_step(model, optimizer, rollout, compute)
        else:
            distill.on_policy_step(model, teacher, optimizer, prompts, answer_len, signal=signal,
                                   stop_token=stop_token, generator=sampler, compute=compute)
        lengths.append(compute.sequential_calls - calls)
        bar.update(min(round(compute.flops - before), bar.total - bar.n))  # the last step overshoots the budget
        while checkpoints and compute.flops >= checkpoints[0]:
            checkpoints.pop(0)
            curve.append({"flops": compute.flops, "step": len(lengths), **record()})
    bar.close()
    return {"steps": len(lengths), "budget_flops": budget, "compute": asdict(compute), "answer_lengths": lengths,
            "curve": curve}


def held_out_problems(setup: Setup, task: Addition):
    """The same held-out sums for every seed and method (a seed of their own, apart from training)."""
    return task.problems(setup.eval_problems, torch.Generator().manual_seed(10_000))


def run_seeds(setup: Setup, seeds, progress: bool = True, on_run=None) -> dict:
    """Every method of ``setup`` on every seed (seed by seed, so a stopped sweep compares the methods
    on the same seeds). ``on_run(result)`` is called after each run. Returns {"setup", "teacher" and
    "start" (their measurements), "runs"}."""
    from tqdm.auto import tqdm

    teacher, task = load_teacher(setup.teacher, progress=progress)
    start = student(teacher, setup.student)
    held_out = held_out_problems(setup, task)
    result = {"setup": asdict(setup), "teacher": measure(teacher, teacher, task, *held_out, 0),
              "start": measure(start, teacher, task, *held_out, 1), "runs": []}
    plan = [(seed, method) for seed in seeds for method in setup.methods]
    for seed, method in tqdm(plan, desc="distillation runs", disable=not progress):
        result["runs"].append(run_method(method, setup, teacher, start, task, seed, held_out))
        if on_run is not None:
            on_run(result)
    return result


def tune(setup: Setup, lrs, seed: int, progress: bool = True) -> tuple[Setup, list[dict]]:
    """Each method's learning rate chosen from ``lrs`` on a tuning seed (keep it apart from the reported
    seeds): the highest exact match at the end of the budget, then the lowest reverse KL. Returns the
    setup with those rates and one row per run tried, {"method", "lr", "exact", "reverse_kl"}."""
    from tqdm.auto import tqdm

    if not lrs or min(lrs) <= 0:
        raise ValueError(f"lrs must be positive learning rates to try, got {lrs!r}")
    teacher, task = load_teacher(setup.teacher, progress=progress)
    start, held_out = student(teacher, setup.student), held_out_problems(setup, task)
    rows = []
    for method, lr in tqdm([(m, lr) for m in setup.methods for lr in lrs], desc="tuning", disable=not progress):
        trial = dataclasses.replace(setup, lr={**setup.lr, method: lr})
        end = run_method(method, trial, teacher, start, task, seed, held_out)["curve"][-1]
        rows.append({"method": method, "lr": lr, "exact": end["exact"], "reverse_kl": end["reverse_kl"]})
    best = {m: max((r for r in rows if r["method"] == m), key=lambda r: (r["exact"], -r["reverse_kl"]))["lr"]
            for m in setup.methods}
    return dataclasses.replace(setup, lr={**setup.lr, **best}), rows


def curves(result: dict, scalars=("exact", "reverse_kl"), lists=("per_position", "forced_per_position")) -> dict:
    """Per method, the seed mean of each measurement at each point of the budget: {method: [{"flops",
    *scalars, *lists}]} (flops: the mean spent at that point; a list is averaged element by element)."""
    out = {}
    for method in result["setup"]["methods"]:
        runs = [r["curve"] for r in result["runs"] if r["method"] == method]
        if not runs:
            continue
        points = min(len(c) for c in runs)
        out[method] = [{key: statistics.fmean(c[i][key] for c in runs) for key in ("flops", *scalars)}
                       | {key: [statistics.fmean(vals) for vals in zip(*(c[i][key] for c in runs))] for key in lists}
                       for i in range(points)]
    return out


def finals(result: dict, method: str, key: str = "exact") -> list[float]:
    """``key`` at the end of the budget, one value per seed, in seed order."""
    runs = sorted((r for r in result["runs"] if r["method"] == method), key=lambda r: r["seed"])
    return [r["curve"][-1][key] for r in runs]


def _device_of(model) -> torch.device:
    return next(model.parameters()).device
