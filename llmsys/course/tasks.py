"""The labs' tuning tasks: each measures a student's choice with the reference implementation.

A lab's graded check names one of these in ``measure(tasks.<task>, choice, ...)``;
the grader runs it in a clean process of its own, on the student's choice and
on the solution's, and compares the two (``llmsys.course.grading.measurements``
says how to declare a new one). In a notebook the same call measures here, so a
student sees what the grader will see. Every task validates its choice first:
a bad one gets a ``ValueError`` that says what to change.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys import distill, lora, rl
from llmsys.compress import measure as compression
from llmsys.core import zoo
from llmsys.core.model import ModelConfig, Transformer
from llmsys.core.timing import cpu_seconds
from llmsys.course.grading.measurements import tuning_task
from llmsys.parallel.planner import LLAMA3_8B, LLAMA3_70B, RECOMPUTE, Cluster, Layout, estimate
from llmsys.zero import LiveBytes, checkpoint_blocks

# ---------------------------------------------------------------- lab 01: a training step in a memory budget

STEP_CONFIG = ModelConfig(vocab_size=256, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, max_seq_len=128,
                          tie_embeddings=True)
STEP_BATCH, STEP_SEQ = 16, 128


def step_batch(step: int):
    """The global batch (inputs, targets) of a step: random tokens, the same everywhere."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(STEP_CONFIG.vocab_size, (STEP_BATCH, STEP_SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def accumulated_step(model, optimizer, step: int, micro_batch: int) -> None:
    """One optimizer step on the global batch, as STEP_BATCH / micro_batch accumulated passes."""
    x, y = step_batch(step)
    optimizer.zero_grad(set_to_none=True)
    for i in range(0, STEP_BATCH, micro_batch):
        loss = F.cross_entropy(model(x[i : i + micro_batch]).flatten(0, 1), y[i : i + micro_batch].flatten())
        (loss * micro_batch / STEP_BATCH).backward()
    optimizer.step()


@tuning_task
def step_budget(setting: dict) -> tuple[int, float]:
    """(peak bytes one step allocates, tokens per CPU second of the fastest of three steps) for
    ``{"checkpointing": bool, "micro_batch": int}``, on one thread."""
    if not isinstance(setting, dict) or set(setting) != {"checkpointing", "micro_batch"}:
        raise ValueError(f"the setting is a dict with the keys checkpointing and micro_batch, got {setting!r}")
    checkpointing, micro_batch = setting["checkpointing"], setting["micro_batch"]
    if not isinstance(checkpointing, bool) or micro_batch not in (1, 2, 4, 8, 16) or isinstance(micro_batch, bool):
        raise ValueError(f"checkpointing is True or False and micro_batch divides {STEP_BATCH}; "
                         f"got {checkpointing!r}, {micro_batch!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread: the same work costs the same on a loaded machine
    try:
        torch.manual_seed(0)
        model = Transformer(STEP_CONFIG)
        if checkpointing:
            checkpoint_blocks(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        accumulated_step(model, optimizer, 0, micro_batch)  # AdamW's state exists from here on
        optimizer.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            accumulated_step(model, optimizer, 1, micro_batch)
        seconds = []
        for step in (2, 3, 4):  # the fastest of three: a busy machine only ever adds time
            start = cpu_seconds()
            accumulated_step(model, optimizer, step, micro_batch)
            seconds.append(cpu_seconds() - start)
    finally:
        torch.set_num_threads(threads)
    return live.peak, STEP_BATCH * STEP_SEQ / max(min(seconds), 1e-6)


# ---------------------------------------------------------------- lab 02: a parallel layout for a cluster

LAYOUT_PROBLEMS = {  # name: (model, GPUs, sequence length, tokens per global batch)
    "70B on 64 GPUs, 8k": (LLAMA3_70B, 64, 8192, 2 * 2**20),
    "8B on 32 GPUs, 32k": (LLAMA3_8B, 32, 32768, 2**20),
}
LAYOUT_CLUSTER = Cluster(gpu="H100 SXM", gpus_per_node=8)  # NVLink in a node, one 400 Gb/s NIC per GPU


def layout_estimate(problem: str, layout: Layout, recompute: str, chunks: int):
    """The planner's cost model (``estimate``, ZeRO-2) for a layout on one of LAYOUT_PROBLEMS."""
    cfg, gpus, seq_len, batch_tokens = LAYOUT_PROBLEMS[problem]
    layout.check(gpus)
    return estimate(cfg, layout, seq_len, batch_tokens, LAYOUT_CLUSTER, recompute, zero_stage=2, chunks=chunks)


@tuning_task
def layout_step_time(choice: dict, problem: str) -> tuple[bool, float]:
    """(fits in memory, modelled seconds per step) of ``{"tp", "cp", "pp", "dp", "recompute", "chunks"}``."""
    keys = {"tp", "cp", "pp", "dp", "recompute", "chunks"}
    if not isinstance(choice, dict) or set(choice) != keys:
        raise ValueError(f"the choice is a dict with the keys {sorted(keys)}, got {choice!r}")
    if choice["recompute"] not in RECOMPUTE or not isinstance(choice["chunks"], int) or choice["chunks"] < 1:
        raise ValueError(f"recompute is one of {sorted(RECOMPUTE)} and chunks a positive int, "
                         f"got {choice['recompute']!r}, {choice['chunks']!r}")
    layout = Layout(**{k: choice[k] for k in ("tp", "cp", "pp", "dp")})
    est = layout_estimate(problem, layout, choice["recompute"], choice["chunks"])
    return est.fits, est.step_time


# ---------------------------------------------------------------- lab 03: LoRA's rank, alpha and lr in a budget

LORA_STEPS, LORA_BATCH, LORA_SEQ = 30, 8, 64  # a short fine-tune: about 3 CPU seconds on one thread


@functools.cache
def python_source_split() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids of ``lora.domain_text()``: Python source, new to the zoo's target model."""
    return zoo.split(torch.tensor(zoo.tokenizer().encode(lora.domain_text())))


@tuning_task
def lora_held_out_loss(choice: dict) -> tuple[float, int]:
    """(held-out loss, adapter state bytes) after LORA_STEPS steps of LoRA on every linear layer of the zoo's
    target model, fine-tuned on Python source with ``{"r": int, "alpha": float, "lr": float}`` (``lora.run_method``).

    The bytes are those the adapters hold after the last step: their weights and gradients and AdamW's
    state, measured from the tensors (``lora.optimizer_state_bytes``)."""
    if not isinstance(choice, dict) or set(choice) != {"r", "alpha", "lr"}:
        raise ValueError(f"the choice is a dict with the keys r, alpha and lr, got {choice!r}")
    r, alpha, lr = choice["r"], choice["alpha"], choice["lr"]
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= 64:
        raise ValueError(f"r is an int in 1..64, got {r!r}")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (alpha, lr))
    if not numbers or not (alpha > 0 and 0 < lr <= 1):
        raise ValueError(f"alpha > 0 and 0 < lr <= 1 are finite numbers, got {alpha!r}, {lr!r}")
    train_ids, held_out = python_source_split()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = lora.run_method("lora", zoo.load("target"), train_ids, LORA_STEPS, LORA_BATCH, LORA_SEQ, seed=0,
                                 eval_sets={"held-out": held_out}, r=r, alpha=float(alpha), lr=float(lr))
    finally:
        torch.set_num_threads(threads)
    adapter_bytes = 4 * result["trainable"] + result["grad_bytes"] + result["optimizer_bytes"]
    return result["held-out loss"], adapter_bytes


# ---------------------------------------------------------------- lab 07: AdamW's learning rate and weight decay


@functools.cache
def noisy_classes(seed: int = 0):
    """(train, validation): 1000 and 2000 points in 32 dimensions, labels from a noisy linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 10, generator=gen)
    x = torch.randn(3000, 32, generator=gen)
    y = (x @ teacher + 2.0 * torch.randn(3000, 10, generator=gen)).argmax(-1)
    return (x[:1000], y[:1000]), (x[1000:], y[1000:])


@tuning_task
def adamw_held_out_loss(choice: dict, steps: int = 100) -> float:
    """Held-out cross-entropy of an MLP after ``steps`` full-batch AdamW steps with
    ``{"lr": float, "weight_decay": float}`` (one thread: the same numbers everywhere)."""
    if not isinstance(choice, dict) or set(choice) != {"lr", "weight_decay"}:
        raise ValueError(f"the choice is a dict with the keys lr and weight_decay, got {choice!r}")
    lr, weight_decay = choice["lr"], choice["weight_decay"]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (lr, weight_decay))
    if not numbers or not (lr > 0 and weight_decay >= 0):
        raise ValueError(f"need finite numbers with lr > 0 and weight_decay >= 0, got {lr!r}, {weight_decay!r}")
    (x, y), (x_val, y_val) = noisy_classes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=float(lr), weight_decay=float(weight_decay), foreach=False)
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            return F.cross_entropy(model(x_val), y_val).item()
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- lab 05: a student distilled on-policy


@tuning_task
def held_out_reverse_kl(student_weights: dict, config: dict, teacher_weights: dict, prompts: torch.Tensor,
                        max_new_tokens: int) -> float:
    """The student's exact reverse KL to the teacher on held-out prompts (``distill.evaluate_reverse_kl``),
    for the student's weights after its training: two models of ``config`` (a ``ModelConfig`` as a dict)."""
    if not (isinstance(prompts, torch.Tensor) and prompts.dim() == 2 and prompts.numel() <= 4096
            and isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= 64):
        raise ValueError("held-out prompts are a (B, P) tensor of at most 4096 tokens and max_new_tokens is 1..64")
    config = ModelConfig(**config)
    if config.dim > 512 or config.n_layers > 8 or config.vocab_size > 4096 or config.max_seq_len > 1024:
        raise ValueError(f"this evaluation is for tiny models (dim <= 512, 8 layers, 4096 tokens), got {config}")
    models = []
    for name, weights in (("student", student_weights), ("teacher", teacher_weights)):
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise ValueError(f"the {name}'s weights are its state_dict(), names to tensors; got {type(weights).__name__}")
        model = Transformer(config)
        model.load_state_dict(weights)  # strict: the same architecture, every weight given
        models.append(model.eval())
    return distill.evaluate_reverse_kl(*models, prompts, max_new_tokens)


# ---------------------------------------------------------------- lab 06: a GRPO trainer on a sample budget


class FirstDigit:
    """Prompt: a digit. Reward 1 when the completion starts with it, else 0."""

    shift = 0

    def prompt(self, problem):
        return str(problem)

    def reward(self, problem, completion):
        return 1.0 if completion.startswith(str((problem + self.shift) % 10)) else 0.0

    def sample(self, n, generator, split="train"):
        return [generator.randrange(10) for _ in range(n)]


class NextDigit(FirstDigit):
    """Prompt: a digit. Reward 1 when the completion starts with the next digit (9 -> 0)."""

    shift = 1


DIGIT_TASKS = {"FirstDigit": FirstDigit, "NextDigit": NextDigit}


def fresh_policy(seed: int = 0) -> Transformer:
    """A tiny policy over the characters of ``rl.CharTokenizer``, at its initial weights."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=rl.CharTokenizer().vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                         max_seq_len=16, tie_embeddings=True)
    return Transformer(config).eval()


def pass_rate(policy, task) -> float:
    """The share of 8 samples per digit, 4 times each, that the task pays."""
    return rl.evaluate(policy, rl.CharTokenizer(), task, list(range(10)) * 4, samples_per_problem=8,
                       max_new_tokens=3)["pass_rate"]


@tuning_task
def digit_pass_rate(policy_weights: dict, task: str) -> float:
    """``pass_rate`` on ``DIGIT_TASKS[task]`` of a policy given by its trained weights (its state_dict())."""
    if task not in DIGIT_TASKS:
        raise ValueError(f"the task is one of {sorted(DIGIT_TASKS)}, got {task!r}")
    if not isinstance(policy_weights, dict) or not all(isinstance(t, torch.Tensor) for t in policy_weights.values()):
        raise ValueError(f"the policy's weights are its state_dict(), names to tensors; got {type(policy_weights)}")
    policy = fresh_policy()
    policy.load_state_dict(policy_weights)  # strict: the same architecture, every weight given
    return pass_rate(policy, DIGIT_TASKS[task]())


# ---------------------------------------------------------------- lab 10: bits, group and method in a byte budget

QUANT_METHODS = ("rtn", "gptq", "awq", "awq+gptq")
QUANT_GROUPS = (16, 32, 64, 128, "channel")


def spread_windows(ids: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """n windows (n, seq_len + 1) spread evenly over ``ids``, so every topic of the text is in them."""
    stride = (len(ids) - 1) // (seq_len + 1) // n
    return torch.stack([ids[i * stride * (seq_len + 1):][: seq_len + 1] for i in range(n)])


@tuning_task
def quantized_perplexity(choice: dict) -> tuple[float, float]:
    """(held-out perplexity, weight bytes) of the zoo's target model with every decoder linear quantized by
    ``{"method": one of QUANT_METHODS, "bits": 2..8, "group": one of QUANT_GROUPS}`` (symmetric grids,
    ``compression.quantized_copy``, calibrated on 16 training windows); bytes by ``compression.weight_bytes``:
    codes and fp16 scales for the linears, the tied embedding / LM head and the norms in 16 bits."""
    if not isinstance(choice, dict) or set(choice) != {"method", "bits", "group"}:
        raise ValueError(f"the choice is a dict with the keys method, bits and group, got {choice!r}")
    method, bits, group = choice["method"], choice["bits"], choice["group"]
    if method not in QUANT_METHODS or group not in QUANT_GROUPS or isinstance(group, bool):
        raise ValueError(f"method is one of {QUANT_METHODS} and group one of {QUANT_GROUPS}, got {method!r}, {group!r}")
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits is an int in 2..8, got {bits!r}")
    train_ids, held_out_ids = zoo.dataset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = zoo.load("target").eval()
        calib = spread_windows(train_ids, 16, 128)[:, :-1]
        quantized = compression.quantized_copy(model, method, bits, group, symmetric=True, calib=calib)
        perplexity = compression.perplexity(quantized, spread_windows(held_out_ids, 32, 128))
    finally:
        torch.set_num_threads(threads)
    return perplexity, compression.weight_bytes(model, compression.linear_bits(model, bits, group))


# ---------------------------------------------------------------- lab 09: a scheduler's knobs for goodput

SERVE_CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=512)
SERVE_SLO = {"ttft_s": 0.1, "tpot_s": 0.008}  # on the cost-model clock below
SERVE_BLOCKS, SERVE_BLOCK_SIZE = 96, 16


@tuning_task
def serving_goodput(choice: dict) -> tuple[float, float]:
    """(goodput: requests per second that meet both SLOs, share of requests meeting them) of the
    engine serving a fixed Poisson trace (48 requests, prompts of 16-320 tokens, 32 output tokens on
    average) with ``{"token_budget": tokens per step, "max_batch": sequences running at once}``,
    chunked prefill and prefix caching, on a reproducible clock (``linear_cost``: 2 ms a step plus
    50 µs a token), so the number depends on the schedule alone, not on the machine."""
    from llmsys.serving import Engine, SchedulerConfig, linear_cost, make_trace

    if not isinstance(choice, dict) or set(choice) != {"token_budget", "max_batch"}:
        raise ValueError(f"the choice is a dict with the keys token_budget and max_batch, got {choice!r}")
    budget, batch = choice["token_budget"], choice["max_batch"]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in (budget, batch)) or not (
            16 <= budget <= 4096 and 1 <= batch <= 64):
        raise ValueError(f"token_budget is an int in 16..4096 and max_batch an int in 1..64, got {budget!r}, {batch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Transformer(SERVE_CONFIG).eval()
    trace = make_trace(48, vocab_size=SERVE_CONFIG.vocab_size, max_seq_len=SERVE_CONFIG.max_seq_len, seed=0, rate=150.0,
                       prompt_len=(16, 320), mean_output=32, output_len=(2, 96))
    config = SchedulerConfig(max_batch=batch, chunked_prefill=True, token_budget=budget, prefix_caching=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = Engine(model, SERVE_BLOCKS, SERVE_BLOCK_SIZE, config, clock=linear_cost()).run(trace)
    finally:
        torch.set_num_threads(threads)
    done = [r for r in report.results if r.status == "finished"]
    good = [r for r in done if r.ttft <= SERVE_SLO["ttft_s"] and (r.tpot is None or r.tpot <= SERVE_SLO["tpot_s"])]
    elapsed = max(r.finish_time for r in done) - min(r.arrival for r in report.results)
    return len(good) / elapsed, len(good) / len(report.results)
