"""Knowledge distillation, from soft labels to on-policy distillation.

A teacher (the zoo's *target*) teaches a smaller student (the zoo's *draft*),
which shares its tokenizer. The chapter walks through four ideas:

1. **Soft labels** (Hinton et al. 2015): match the teacher's whole next-token
   distribution, softened by a temperature, not only its argmax
   (``soft_labels``, ``word_kd_loss``). **Sequence-level KD** (Kim & Rush
   2016): let the teacher write text and train the student on it with plain
   cross-entropy (``teacher_rollouts``, ``sequence_kd_step``).
2. **Which KL.** Forward KL(teacher‖student) is an expectation under the
   teacher: the student is punished wherever the teacher has mass, so it covers
   every mode. Reverse KL(student‖teacher) is an expectation under the
   student: it is punished only where it puts mass, so it may pick one mode
   and sit on it. The generalized JSD of GKD (arXiv 2306.13649) interpolates
   with ``beta`` (``forward_kl``, ``reverse_kl``, ``generalized_jsd``,
   ``fit_gaussian``).
3. **Exposure bias.** Trained on teacher prefixes, the student is tested on its
   own: ``exposure_bias`` measures both per position.
4. **On-policy distillation** (GKD; Thinking Machines' tinker-cookbook): the
   student samples, the teacher scores each sampled token, and the per-token
   reverse KL log π_S(x_t) − log π_T(x_t) is a dense reward; advantage_t =
   −coef·reverse_kl_t with no sum over later tokens, trained with an
   importance-sampling policy-gradient loss (``sample_rollouts``,
   ``llmsys.core.model.token_logprobs``, ``reverse_kl_advantages``, ``importance_sampling_loss``,
   ``on_policy_step``). ``Compute`` counts what every method spends, so
   ``train`` can compare them at equal compute.

All log-probabilities are aligned to *predicted* tokens: for ``tokens`` of
shape (B, T), position t of a (B, T-1) tensor is about ``tokens[:, t+1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmsys.core import device
from llmsys.core.model import Rollout, masked_mean, sample_rollout, token_logprobs

# ---------------------------------------------------------------- soft labels


def soft_labels(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(logits / temperature): a higher temperature lifts the small
    probabilities (the "dark knowledge" of which wrong answers are less wrong)."""
    _check_temperature(temperature)
    return F.softmax(logits.float() / temperature, dim=-1)


def word_kd_loss(student_logits, teacher_logits, temperature: float = 1.0, mask=None) -> torch.Tensor:
    """Word-level KD: τ²·KL(p_T^τ ‖ p_S^τ) per position, averaged over the positions in ``mask``.

    The τ² keeps the gradient's size independent of τ: d/dz_S of the KL is
    (p_S^τ − p_T^τ)/τ, so without it a soft target would barely train."""
    _check_temperature(temperature)
    kl = forward_kl(student_logits / temperature, teacher_logits / temperature)
    return temperature**2 * masked_mean(kl, mask)


# ---------------------------------------------------------------- divergences over the vocabulary


def forward_kl(student_logits, teacher_logits) -> torch.Tensor:
    """KL(p_T ‖ p_S) per position, summed over the vocabulary: shape (...,).

    Mode-covering: wherever the teacher has mass the student pays for missing it."""
    _check_same_shape(student_logits, teacher_logits)
    s, t = F.log_softmax(student_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1)


def reverse_kl(student_logits, teacher_logits) -> torch.Tensor:
    """KL(p_S ‖ p_T) per position, summed over the vocabulary: shape (...,).

    Mode-seeking: the student pays only where it puts mass itself."""
    _check_same_shape(student_logits, teacher_logits)
    s, t = F.log_softmax(student_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1)
    return (s.exp() * (s - t)).sum(-1)


def generalized_jsd(student_logits, teacher_logits, beta: float = 0.5, temperature: float = 1.0, mask=None):
    """The generalized Jensen-Shannon divergence of GKD, averaged over the positions in ``mask``.

    With m = β·p_T + (1−β)·p_S: β·KL(p_T‖m) + (1−β)·KL(p_S‖m). The end points are
    defined as the limits' *directions*, as TRL does: β = 0 is forward
    KL(p_T‖p_S) and β = 1 is reverse KL(p_S‖p_T) (the mixture formula itself
    shrinks to 0 at both ends)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")
    _check_temperature(temperature)
    s_logits, t_logits = student_logits / temperature, teacher_logits / temperature
    if beta == 0:
        return masked_mean(forward_kl(s_logits, t_logits), mask)
    if beta == 1:
        return masked_mean(reverse_kl(s_logits, t_logits), mask)
    s, t = F.log_softmax(s_logits.float(), -1), F.log_softmax(t_logits.float(), -1)
    log_m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)
    kl_t = (t.exp() * (t - log_m)).sum(-1)
    kl_s = (s.exp() * (s - log_m)).sum(-1)
    return masked_mean(beta * kl_t + (1 - beta) * kl_s, mask)


# ---------------------------------------------------------------- which KL: a 1-D Gaussian mixture


@dataclass
class Mixture:
    """A 1-D Gaussian mixture: weights (sum to 1), means, stds."""

    weights: tuple[float, ...]
    means: tuple[float, ...]
    stds: tuple[float, ...]

    def __post_init__(self):
        if not (len(self.weights) == len(self.means) == len(self.stds) >= 1):
            raise ValueError("weights, means and stds must have the same, non-zero length")
        if abs(sum(self.weights) - 1) > 1e-6 or min(self.weights) <= 0 or min(self.stds) <= 0:
            raise ValueError("weights must be positive and sum to 1, stds positive")

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        w, mu, sd = (torch.tensor(v, dtype=x.dtype) for v in (self.weights, self.means, self.stds))
        comp = torch.distributions.Normal(mu, sd).log_prob(x[..., None])  # (..., K)
        return torch.logsumexp(comp + w.log(), dim=-1)

    def mean_std(self) -> tuple[float, float]:
        w, mu, sd = (torch.tensor(v, dtype=torch.float64) for v in (self.weights, self.means, self.stds))
        mean = (w * mu).sum()
        var = (w * (sd**2 + mu**2)).sum() - mean**2
        return mean.item(), var.sqrt().item()


def grid_kl(log_p: torch.Tensor, log_q: torch.Tensor, dx: float) -> torch.Tensor:
    """KL(p‖q) = ∫ p (log p − log q) dx by the rectangle rule on a uniform grid."""
    return (log_p.exp() * (log_p - log_q)).sum() * dx


def fit_gaussian(target: Mixture, direction: str, init_mean: float = 0.5, init_std: float = 1.0,
                 steps: int = 200, lr: float = 0.05, grid=(-10.0, 10.0, 1001)) -> dict:
    """Fit one Gaussian q to ``target`` by gradient descent (Adam) on the KL in ``direction``.

    "forward" minimizes KL(p‖q) (its optimum matches p's mean and variance);
    "reverse" minimizes KL(q‖p). Returns {"mean", "std", "history": [(mean, std, kl)]}."""
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' (KL(p‖q)) or 'reverse' (KL(q‖p)), got {direction!r}")
    x = torch.linspace(grid[0], grid[1], grid[2], dtype=torch.float64)
    dx = (grid[1] - grid[0]) / (grid[2] - 1)
    log_p = target.log_prob(x)
    mean = torch.tensor(float(init_mean), dtype=torch.float64, requires_grad=True)
    log_std = torch.tensor(math.log(init_std), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([mean, log_std], lr=lr)
    history = []
    for _ in range(steps):
        log_q = torch.distributions.Normal(mean, log_std.exp()).log_prob(x)
        kl = grid_kl(log_p, log_q, dx) if direction == "forward" else grid_kl(log_q, log_p, dx)
        opt.zero_grad()
        kl.backward()
        opt.step()
        history.append((mean.item(), log_std.exp().item(), kl.item()))
    return {"mean": mean.item(), "std": log_std.exp().item(), "history": history}


# ---------------------------------------------------------------- rollouts and log-probs


@dataclass
class Compute:
    """What a training run spent: tokens sampled one at a time, tokens run through each
    model in parallel (prefill/scoring), tokens trained on, and the FLOPs of all of it
    (forward 2N per token via ``ModelConfig.flops_per_token``, training 3× that)."""

    generated_tokens: int = 0
    sequential_calls: int = 0  # decode steps: each waits for the previous one
    teacher_tokens: int = 0
    student_tokens: int = 0
    trained_tokens: int = 0
    flops: float = 0.0

    def generate(self, model, batch: int, prompt_len: int, new_tokens: int, teacher: bool):
        total = prompt_len + new_tokens
        self.generated_tokens += batch * new_tokens
        self.sequential_calls += new_tokens
        self._forward(model, batch * total, total, teacher)

    def score(self, model, batch: int, seq_len: int, teacher: bool):
        self._forward(model, batch * seq_len, seq_len, teacher)

    def train(self, model, batch: int, seq_len: int):
        self.trained_tokens += batch * seq_len
        self.flops += 3 * batch * seq_len * model.cfg.flops_per_token(seq_len)

    def _forward(self, model, tokens: int, seq_len: int, teacher: bool):
        if teacher:
            self.teacher_tokens += tokens
        else:
            self.student_tokens += tokens
        self.flops += tokens * model.cfg.flops_per_token(seq_len)


def sample_rollouts(model, prompts: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    stop_token: int | None = None, generator: torch.Generator | None = None,
                    compute: Compute | None = None, teacher: bool = False) -> Rollout:
    """``llmsys.core.model.sample_rollout`` at a temperature > 0, counted in ``compute``: completions of
    each prompt (B, P) with the log-prob of every sampled token under the sampling distribution.

    After ``stop_token`` a row is padded with ``stop_token`` and masked out."""
    _check_temperature(temperature, allow_zero=False)
    rollout = sample_rollout(model, prompts, max_new_tokens, temperature, stop_token=stop_token, generator=generator)
    if compute is not None:
        B, T = rollout.tokens.shape
        compute.generate(model, B, rollout.prompt_len, T - rollout.prompt_len, teacher)
    return rollout


# ---------------------------------------------------------------- the on-policy signal and loss


def reverse_kl_advantages(student_logprobs, teacher_logprobs, mask, coef: float = 1.0) -> torch.Tensor:
    """advantage_t = −coef·(log π_S(x_t) − log π_T(x_t)) on sampled tokens, 0 off the mask.

    No discounting: each token is rewarded for itself only (tinker-cookbook's
    kl_discount_factor = 0). Detached: it is a reward, not something to differentiate."""
    _check_same_shape(student_logprobs, teacher_logprobs)
    _check_same_shape(student_logprobs, mask)
    return (-coef * (student_logprobs - teacher_logprobs) * mask).detach()


def sparse_advantages(student_logprobs, teacher_logprobs, mask) -> torch.Tensor:
    """The same information as one number per sequence, as in outcome-reward RL:
    reward = −(mean reverse KL of the sequence), minus the batch mean as a baseline,
    given to every token of the sequence."""
    per_token = (student_logprobs - teacher_logprobs) * mask
    reward = -per_token.sum(1) / mask.sum(1).clamp_min(1)  # (B,)
    return ((reward - reward.mean())[:, None] * mask).detach()


def importance_sampling_loss(new_logprobs, old_logprobs, advantages, mask) -> torch.Tensor:
    """−mean over masked tokens of (π_new/π_old)·advantage: a policy-gradient loss that
    stays correct when the sampler's log-probs (old) differ from the trainer's (new)."""
    for other in (old_logprobs, advantages, mask):
        _check_same_shape(new_logprobs, other)
    ratio = torch.exp(new_logprobs - old_logprobs.detach())
    return -masked_mean(ratio * advantages.detach(), mask)


SIGNALS = ("dense", "sparse", "full")


def on_policy_step(student, teacher, optimizer, prompts, max_new_tokens: int, coef: float = 1.0,
                   signal: str = "dense", temperature: float = 1.0, stop_token: int | None = None,
                   generator=None, compute: Compute | None = None) -> dict:
    """One on-policy distillation step: the student samples, the teacher scores the samples
    in one forward pass, one gradient step on the importance-sampling loss.

    ``signal="dense"`` uses the per-token reverse KL of the sampled tokens (all an API that
    returns sampled log-probs gives); ``"sparse"`` only its per-sequence mean; ``"full"``
    the exact reverse KL over the whole vocabulary at every sampled position (GKD with
    β = 1: no sampling noise in the per-position term, but it needs the teacher's logits)."""
    if signal not in SIGNALS:
        raise ValueError(f"signal must be one of {SIGNALS} (per sampled token, per sequence, full vocabulary), got {signal!r}")
    student.eval()
    rollout = sample_rollouts(student, prompts, max_new_tokens, temperature, stop_token, generator, compute)
    with torch.no_grad():
        teacher_lp, teacher_logits = token_logprobs(teacher, rollout.tokens, return_logits=True)
    B, T = rollout.tokens.shape
    if compute is not None:
        compute.score(teacher, B, T - 1, teacher=True)
    student.train()
    new_lp, new_logits = token_logprobs(student, rollout.tokens, return_logits=True)
    if signal == "full":
        loss = coef * masked_mean(reverse_kl(new_logits, teacher_logits), rollout.mask)
    else:
        if signal == "dense":
            adv = reverse_kl_advantages(rollout.logprobs, teacher_lp, rollout.mask, coef)
        else:
            adv = coef * sparse_advantages(rollout.logprobs, teacher_lp, rollout.mask)
        loss = importance_sampling_loss(new_lp, rollout.logprobs, adv, rollout.mask)
    _student_step(student, optimizer, loss, rollout, compute)
    sampled_kl = masked_mean(rollout.logprobs - teacher_lp, rollout.mask)
    return {"loss": loss.item(), "sampled_reverse_kl": sampled_kl.item()}


# ---------------------------------------------------------------- sequence-level KD (off-policy)


def teacher_rollouts(teacher, prompts, max_new_tokens: int, temperature: float = 1.0, stop_token=None,
                     generator=None, compute: Compute | None = None) -> Rollout:
    """The teacher writes the completions the student will imitate."""
    return sample_rollouts(teacher, prompts, max_new_tokens, temperature, stop_token, generator, compute, teacher=True)


def sequence_kd_step(student, optimizer, rollout: Rollout, compute: Compute | None = None) -> dict:
    """Cross-entropy on the completion tokens of ``rollout`` (teacher text), prompt and
    padding masked: the student learns only on prefixes the teacher wrote."""
    student.train()
    logp = token_logprobs(student, rollout.tokens)
    loss = -masked_mean(logp, rollout.mask)
    _student_step(student, optimizer, loss, rollout, compute)
    return {"loss": loss.item()}


def _student_step(student, optimizer, loss, rollout: Rollout, compute: Compute | None) -> None:
    """One gradient step on ``loss``, counted as training on the rollout's tokens; the student ends in eval mode."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    student.eval()
    if compute is not None:
        B, T = rollout.tokens.shape
        compute.train(student, B, T - 1)


# ---------------------------------------------------------------- measuring


@torch.no_grad()
def evaluate_reverse_kl(student, teacher, prompts, max_new_tokens: int, seed: int = 0) -> float:
    """Exact KL(π_S‖π_T) summed over the vocabulary, averaged over the completion positions
    of the student's own samples: the quantity on-policy distillation minimizes."""
    return _kl_on_samples(reverse_kl, student, student, teacher, prompts, max_new_tokens, seed)


@torch.no_grad()
def evaluate_forward_kl(student, teacher, prompts, max_new_tokens: int, seed: int = 0) -> float:
    """Exact KL(π_T‖π_S) averaged over the completion positions of the teacher's samples:
    what off-policy distillation minimizes."""
    return _kl_on_samples(forward_kl, teacher, student, teacher, prompts, max_new_tokens, seed)


def _kl_on_samples(kl, writer, student, teacher, prompts, max_new_tokens: int, seed: int) -> float:
    """``kl(student logits, teacher logits)`` averaged over the completion positions of ``writer``'s samples."""
    rollout = sample_rollouts(writer, prompts, max_new_tokens, generator=device.generator(seed, writer))
    inputs = rollout.tokens[:, :-1]
    return masked_mean(kl(student(inputs), teacher(inputs)), rollout.mask).item()


@torch.no_grad()
def exposure_bias(student, teacher, prompts, max_new_tokens: int, seed: int = 0) -> dict:
    """Per completion position, how the student does on teacher prefixes vs on its own.

    Both continue the same prompts. "teacher_prefix": the teacher wrote the text
    so far (how the student was trained); "own_prefix": the student wrote it (how
    it is used). At each position: the teacher's expected log-prob of the
    student's next token, Σ_v π_S(v) log π_T(v), and the reverse KL. Each (N,)."""
    out = {}
    for name, writer in (("teacher_prefix", teacher), ("own_prefix", student)):
        rollout = sample_rollouts(writer, prompts, max_new_tokens, generator=device.generator(seed, writer))
        inputs = rollout.tokens[:, :-1]
        s, t = F.log_softmax(student(inputs).float(), -1), F.log_softmax(teacher(inputs).float(), -1)
        P = rollout.prompt_len
        teacher_lp = (s.exp() * t).sum(-1)[:, P - 1:]  # (B, N)
        kl = (s.exp() * (s - t)).sum(-1)[:, P - 1:]
        out[name] = {"teacher_logprob": teacher_lp.mean(0), "reverse_kl": kl.mean(0)}
    return out


def prompt_batch(ids: torch.Tensor, batch_size: int, prompt_len: int, generator=None) -> torch.Tensor:
    """Random windows of ``ids`` to use as prompts: (batch_size, prompt_len)."""
    if len(ids) <= prompt_len:
        raise ValueError(f"need more than prompt_len={prompt_len} tokens, got {len(ids)}")
    starts = torch.randint(len(ids) - prompt_len, (batch_size,), generator=generator)
    return torch.stack([ids[s : s + prompt_len] for s in starts.tolist()])


# ---------------------------------------------------------------- the training loop


METHODS = ("on_policy", "sparse", "full_kl", "seq_kd")


def train(student, teacher, train_ids, eval_prompts, method: str = "on_policy", steps: int = 50,
          batch_size: int = 16, prompt_len: int = 8, max_new_tokens: int = 24, lr: float = 1e-3,
          coef: float = 1.0, eval_every: int = 10, seed: int = 0, prompt_pool: int | None = None,
          progress: bool = True, desc: str | None = None) -> list[dict]:
    """Distill ``teacher`` into ``student`` (trained in place) for ``steps`` steps.

    method: "on_policy" (per sampled token reverse KL), "sparse" (one reward per
    sequence, same information), "full_kl" (exact reverse KL over the vocabulary on
    the student's samples) or "seq_kd" (cross-entropy on teacher samples).
    ``prompt_pool``: draw prompts from a fixed set of this many (data reuse) instead
    of fresh ones. Returns history rows {step, flops, generated_tokens,
    teacher_tokens, reverse_kl (held-out, on the student's samples)}."""
    from tqdm.auto import tqdm

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if steps < 0 or eval_every < 1:
        raise ValueError(f"steps must be >= 0 and eval_every >= 1, got {steps} and {eval_every}")
    gen = torch.Generator().manual_seed(seed)  # prompts are drawn on the CPU
    sampler = device.generator(seed, student)  # completions are sampled where the models live
    pool = prompt_batch(train_ids, prompt_pool, prompt_len, gen) if prompt_pool else None
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    compute = Compute()
    history = []

    def log(step):
        kl = evaluate_reverse_kl(student, teacher, eval_prompts, max_new_tokens, seed=seed + 1)
        history.append({"step": step, "flops": compute.flops, "generated_tokens": compute.generated_tokens,
                        "teacher_tokens": compute.teacher_tokens, "reverse_kl": kl})

    log(0)
    for step in tqdm(range(1, steps + 1), desc=desc or method, disable=not progress, leave=False):
        if pool is not None:
            prompts = pool[torch.randint(len(pool), (batch_size,), generator=gen)]
        else:
            prompts = prompt_batch(train_ids, batch_size, prompt_len, gen)
        if method == "seq_kd":
            rollout = teacher_rollouts(teacher, prompts, max_new_tokens, generator=sampler, compute=compute)
            sequence_kd_step(student, optimizer, rollout, compute)
        else:
            signal = {"on_policy": "dense", "sparse": "sparse", "full_kl": "full"}[method]
            on_policy_step(student, teacher, optimizer, prompts, max_new_tokens, coef, signal,
                           generator=sampler, compute=compute)
        if step % eval_every == 0 or step == steps:
            log(step)
    return history


# ---------------------------------------------------------------- self-distillation


def born_again(teacher, train_ids, val_ids, steps: int = 200, temperature: float = 2.0, alpha: float = 0.5,
               batch_size: int = 8, seq_len: int = 64, lr: float = 3e-3, eval_every: int = 50, seed: int = 0,
               progress: bool = True) -> dict[str, list[tuple[int, float]]]:
    """Self-distillation (born-again networks, Furlanello et al. 2018): two fresh models of the
    teacher's own size and the same initial weights, trained on the same batches, one on the data's
    labels alone, one on (1 − alpha)·cross-entropy + alpha·word-level KD from the teacher at
    ``temperature``. Returns the held-out loss per token of each, {"labels", "labels + teacher"}:
    [(step, loss)] every ``eval_every`` steps."""
    from tqdm.auto import tqdm

    from llmsys.core.model import Transformer
    from llmsys.core.zoo import batch

    if not 0.0 <= alpha <= 1.0 or steps < 1 or eval_every < 1:
        raise ValueError(f"need 0 <= alpha <= 1, steps >= 1 and eval_every >= 1, got {alpha}, {steps}, {eval_every}")
    dev = _device_of(teacher)
    n = (len(val_ids) - 1) // seq_len  # every full held-out window
    val_x = val_ids[: n * seq_len].view(n, seq_len).to(dev)  # (n, T)
    val_y = val_ids[1: n * seq_len + 1].view(n, seq_len).to(dev)
    out = {}
    for name, kd_weight in (("labels", 0.0), ("labels + teacher", alpha)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            student = Transformer(teacher.cfg).to(dev)
        optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
        batches = torch.Generator().manual_seed(seed)
        history = []
        for step in tqdm(range(steps + 1), desc=f"born-again: {name}", disable=not progress, leave=False):
            if step % eval_every == 0 or step == steps:
                with torch.no_grad():
                    student.eval()
                    logits = student(val_x)
                    history.append((step, F.cross_entropy(logits.flatten(0, 1).float(), val_y.flatten()).item()))
            if step == steps:
                break
            student.train()
            x, y = (t.to(dev) for t in batch(train_ids, batch_size, seq_len, batches))
            logits = student(x)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            if kd_weight:
                with torch.no_grad():
                    teacher_logits = teacher(x)
                loss = (1 - kd_weight) * loss + kd_weight * word_kd_loss(logits, teacher_logits, temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        out[name] = history
    return out


# ---------------------------------------------------------------- helpers


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def _check_temperature(temperature: float, allow_zero: bool = False):
    if not temperature > 0 and not (allow_zero and temperature == 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_same_shape(a: torch.Tensor, b: torch.Tensor):
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}; pass tensors aligned position by position")
