"""A task where exposure bias matters: multi-digit addition written digit by digit.

Both operands and the sum are written least-significant digit first ("4725+1903=" is
5274 + 3091, answer "56380" is 08365), the order in which a carry is computed, so a small
transformer can learn it position by position. Every answer digit depends on a carry that
the earlier digits decided, and one wrong digit makes the whole answer wrong: with a share p
of digits right, about p^9 of the 9-digit answers are. A model may also read the carry off
its own previous digit, and then a slip spreads to the digits after it; comparing accuracy on
the model's own prefix with accuracy on the true prefix (``equal_compute.measure``) shows
whether it does.

A teacher is trained on the true sums to near-perfect accuracy and cached with
``cache.entry`` (``load_teacher``); a student with one of its three layers (``student``)
learns from it by ``llmsys.distill``'s methods (``llmsys.distill.equal_compute`` runs them at
equal compute).
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmsys.core import cache
from llmsys.core.model import ModelConfig, Transformer
from llmsys.rl.tokenizers import CharTokenizer

FORMAT_VERSION = 1  # bump when the way a cached teacher is built changes


class Addition:
    """Sums of two ``digits``-digit numbers, digits least-significant first.

    ``problems(n, generator)`` draws operands (n, digits) each; ``prompts`` and ``answers`` turn
    them into token ids of fixed width, so a whole batch is sampled at once; ``position_correct``
    checks completions digit by digit and ``exact_match`` whole."""

    def __init__(self, digits: int = 8):
        if not isinstance(digits, int) or not 1 <= digits <= 30:
            raise ValueError(f"digits must be an integer in 1..30, got {digits!r}")
        self.digits = digits
        self.tokenizer = CharTokenizer("0123456789+=")
        self.prompt_len = 2 * digits + 2  # a, "+", b, "="
        self.answer_len = digits + 1  # the sum has one more digit (a leading 0 when there is no carry out)

    def problems(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (n, digits) tensors of operand digits, least-significant first."""
        return (torch.randint(10, (n, self.digits), generator=generator),
                torch.randint(10, (n, self.digits), generator=generator))

    def answer_digits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(n, digits + 1): the digits of a + b, least-significant first, by the school algorithm."""
        out, carry = [], torch.zeros(a.shape[0], dtype=torch.long)
        for i in range(self.digits):
            total = a[:, i] + b[:, i] + carry
            out.append(total % 10)
            carry = total // 10
        return torch.stack(out + [carry], dim=1)

    def prompts(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(n, prompt_len) token ids of "a+b=" (digit d is the token of the character d)."""
        digit = self.digit_ids()
        n = a.shape[0]
        plus, equals = (torch.full((n, 1), self.tokenizer.ids[c]) for c in "+=")
        return torch.cat([digit[a], plus, digit[b], equals], dim=1)

    def answers(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(n, answer_len) token ids of the true sum."""
        return self.digit_ids()[self.answer_digits(a, b)]

    def digit_ids(self) -> torch.Tensor:
        return torch.tensor([self.tokenizer.ids[str(d)] for d in range(10)])

    def position_correct(self, completions: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """(n, answer_len) booleans: is each written token the true digit at its place."""
        if completions.shape != answers.shape:
            raise ValueError(f"completions {tuple(completions.shape)} and answers {tuple(answers.shape)} must have the "
                             f"same shape: pass exactly answer_len={self.answer_len} generated tokens per problem")
        return completions.to(answers.device) == answers

    def exact_match(self, completions: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """(n,) booleans: every digit right (one slip anywhere makes the sum wrong)."""
        return self.position_correct(completions, answers).all(dim=1)

    def text(self, tokens) -> str:
        return self.tokenizer.decode(tokens)


@dataclass(frozen=True)
class TeacherSpec:
    """The teacher: trained on true sums (cross-entropy on the answer digits) until it is near perfect."""

    digits: int = 8
    dim: int = 96
    n_layers: int = 3
    n_heads: int = 4
    steps: int = 1500
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0

    def config(self) -> ModelConfig:
        return model_config(self.digits, self.dim, self.n_layers, self.n_heads)


@dataclass(frozen=True)
class StudentSpec:
    """The student keeps the teacher's layers ``keep`` (its embedding, norm and head too) and drops the
    rest, the initialisation of DistilBERT (Sanh et al. 2019) and Minitron (Muralidharan et al. 2024),
    as chapter 5's SmolLM2 student (``distill.chat.layer_dropped``). With the first of 3 layers it
    writes about a third of the digits right and almost no whole sum; distillation heals it. A student
    trained from nothing instead sits at chance for hundreds of steps before any digit comes right."""

    keep: tuple[int, ...] = (0,)


def model_config(digits: int, dim: int, n_layers: int, n_heads: int) -> ModelConfig:
    task = Addition(digits)
    return ModelConfig(vocab_size=task.tokenizer.vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_heads, max_seq_len=task.prompt_len + task.answer_len, tie_embeddings=True)


def supervised_step(model: Transformer, optimizer, task: Addition, batch_size: int, generator) -> float:
    """One step of cross-entropy on true sums, answer digits only (the prompt is given, not learned)."""
    a, b = task.problems(batch_size, generator)
    dev = model.tok_embeddings.weight.device
    tokens = torch.cat([task.prompts(a, b), task.answers(a, b)], dim=1).to(dev)
    logits = model(tokens[:, :-1])[:, task.prompt_len - 1:]  # (B, answer_len, V): the positions that predict answers
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, task.prompt_len:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def train_teacher(spec: TeacherSpec, device=None, progress: bool = True) -> Transformer:
    """A teacher trained from scratch on true sums: AdamW with a warm-up and cosine decay."""
    from tqdm.auto import tqdm

    task = Addition(spec.digits)
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
        torch.manual_seed(spec.seed)
        model = Transformer(spec.config()).to(device or "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    model.train()
    for step in tqdm(range(spec.steps), desc="addition teacher", disable=not progress):
        warm = min(1.0, (step + 1) / max(1, spec.steps // 20))
        for group in optimizer.param_groups:
            group["lr"] = spec.lr * warm * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
        supervised_step(model, optimizer, task, spec.batch_size, generator)
    return model.eval()


@torch.no_grad()
def greedy_accuracy(model: Transformer, task: Addition, a: torch.Tensor, b: torch.Tensor) -> dict:
    """Greedy answers to (a, b): {"exact": share of whole sums right, "per_position": (answer_len,) share right at each place}."""
    from llmsys.core.model import sample_rollout

    rollout = sample_rollout(model, task.prompts(a, b), task.answer_len, temperature=0.0)
    correct = task.position_correct(rollout.tokens[:, task.prompt_len:].cpu(), task.answers(a, b))
    return {"exact": correct.all(1).float().mean().item(), "per_position": correct.float().mean(0).tolist()}


NAME = "addition-teacher"  # the default teacher's entry; any other spec gets its hash in the name


def entry_name(spec: TeacherSpec | None = None) -> str:
    spec = spec or TeacherSpec()
    return NAME if spec == TeacherSpec() else f"{NAME}-{spec_hash(spec)[:12]}"


def spec_hash(spec: TeacherSpec | None = None) -> str:
    spec = spec or TeacherSpec()
    return cache.spec_hash({"spec": asdict(spec), "version": FORMAT_VERSION, "format": cache.FORMAT_VERSION})


def load_teacher(spec: TeacherSpec | None = None, device=None, progress: bool = True, force: bool = False):
    """(teacher, task): the addition teacher, trained on first use (the default: 5-10 CPU minutes; the zoo
    builds it with chapter 5's entries) and cached by ``cache.entry``; its held-out greedy accuracy is in
    the entry's manifest. Eval mode."""
    spec = spec or TeacherSpec()
    task = Addition(spec.digits)

    def build(folder: Path, show_progress: bool) -> dict:
        start = time.perf_counter()
        model = train_teacher(spec, device, show_progress)
        held_out = task.problems(1024, torch.Generator().manual_seed(10_000 + spec.seed))
        metrics = {**greedy_accuracy(model, task, *held_out), "params": model.cfg.n_params(),
                   "build_seconds": time.perf_counter() - start}
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, folder / "model.pt")
        return {"spec": asdict(spec), "metrics": metrics}

    def parse(folder: Path, manifest: dict, files: dict[str, bytes]) -> Transformer:
        with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep it off the caller's RNG
            model = Transformer(spec.config())
        model.load_state_dict(torch.load(io.BytesIO(files["model.pt"]), weights_only=True))
        return model

    model = cache.entry(entry_name(spec), spec_hash(spec), build, parse, force=force, progress=progress)
    return model.to(device or "cpu").eval(), task


def student(teacher: Transformer, spec: StudentSpec | None = None) -> Transformer:
    """A new student: the teacher's layers ``spec.keep`` (``distill.chat.layer_dropped``), in eval mode."""
    from llmsys.distill.chat import layer_dropped

    return layer_dropped(teacher, (spec or StudentSpec()).keep)
