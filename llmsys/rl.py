"""Reinforcement learning for LLMs: from REINFORCE to GRPO and Dr. GRPO.

The ladder, one small function per rung, each tested against its definition:

- ``discounted_returns`` and ``reinforce_loss``: the score-function gradient, with an
  optional baseline (same expectation, less variance);
- ``gae``: generalized advantage estimation from a value function (the recurrence, tested
  against the direct discounted sum of TD errors), and ``actor_critic_loss`` on top of it;
- ``ppo_clip_objective`` / ``ppo_loss``: PPO's clipped surrogate, a first-order stand-in
  for TRPO's trust region;
- ``group_advantages``: GRPO's critic-free baseline, the reward minus its group's mean,
  divided by the group's std (GRPO) or not (Dr. GRPO);
- ``kl_k3``: the k3 estimator of KL(π_θ ‖ π_ref) on sampled tokens;
- ``grpo_loss``: the clipped per-token loss with the KL term and masking, normalized per
  sequence (GRPO), by a constant (Dr. GRPO) or by the batch's tokens (DAPO, TRL's default).

Then a verifiable task, Countdown (make a target from given numbers with + - * /, each
number exactly once; TinyZero's reward rules), a character tokenizer, a small policy
briefly supervised on the task and cached (``load_policy``), the GRPO loop (``train_grpo``)
with KV-cached sampling of G completions per prompt, and the memory arithmetic of PPO vs
GRPO (``rl_state_bytes``, ``training_state_bytes``, ``ValueModel``).

    from llmsys import rl
    policy, tok, task = rl.load_policy()            # SFT'd and cached on first use (seconds)
    before = rl.evaluate(policy, tok, task, task.test, samples_per_problem=8)
    history = rl.train_grpo(policy, tok, task, rl.GRPOConfig(steps=60))   # or rl.dr_grpo_config(...)
    after = rl.evaluate(policy, tok, task, task.test, samples_per_problem=8)

References: Williams 1992 (REINFORCE); Schulman et al. 2015 (GAE, arXiv 1506.02438) and 2017
(PPO, arXiv 1707.06347); DeepSeekMath (GRPO, arXiv 2402.03300); Liu et al. 2025 (Dr. GRPO,
arXiv 2503.20783); TinyZero's countdown reward; TRL 1.16's GRPOTrainer for the loss variants.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import io
import itertools
import json
import math
import random
import re
import warnings
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from llmsys.cache import atomic_write_bytes, cache_dir
from llmsys.model import ModelConfig, Transformer, sample

# ---------------------------------------------------------------------------- helpers


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (all positions without a mask); 0 if none."""
    if mask is None:
        return x.mean()
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _check_same_shape(**tensors):
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"these tensors must have the same shape: {shapes}")


# ---------------------------------------------------------------------------- the ladder


def discounted_returns(rewards: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go G_t = r_t + γ·G_{t+1} along the last dimension (an episode ends there)."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(rewards.size(-1))):
        running = rewards[..., t] + gamma * running
        returns[..., t] = running
    return returns


def reinforce_loss(logprobs: torch.Tensor, returns: torch.Tensor, baseline: torch.Tensor | float | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """-mean[(G_t - b)·log π(a_t|s_t)]: its gradient is the REINFORCE estimate of -∇J.

    A baseline b that does not depend on the action leaves the expected gradient unchanged
    (E[∇log π] = 0) and, chosen near E[G], shrinks its variance."""
    _check_same_shape(logprobs=logprobs, returns=returns, mask=mask)
    weight = returns if baseline is None else returns - baseline
    return -masked_mean(logprobs * weight.detach(), mask)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95,
        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the last dimension: (advantages, returns).

    δ_t = r_t + γ·V(s_{t+1}) - V(s_t) and A_t = δ_t + γλ·A_{t+1}, i.e. A_t = Σ_l (γλ)^l δ_{t+l}.
    The episode ends after the last step (or the last step where mask is 1): V after it is 0.
    λ = 0 gives the one-step TD error, λ = 1 the Monte-Carlo return minus V (REINFORCE with a
    baseline). ``returns = advantages + values`` are the critic's regression targets."""
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam (GAE's λ) must be in [0, 1], got {lam}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if mask is not None:  # past the end there is no reward and no value
        rewards, values = rewards * mask, values * mask
    values = values.detach()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(values[..., 0])
    next_advantage = torch.zeros_like(values[..., 0])
    for t in reversed(range(rewards.size(-1))):
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[..., t] = next_advantage
        next_value = values[..., t]
    return advantages, advantages + values


def actor_critic_loss(logprobs: torch.Tensor, values: torch.Tensor, rewards: torch.Tensor, gamma: float = 1.0,
                      lam: float = 0.95, value_coef: float = 0.5, mask: torch.Tensor | None = None):
    """Advantage actor-critic: the policy follows GAE advantages from the critic's values,
    the critic regresses on the GAE returns. Returns (total, policy_loss, value_loss)."""
    advantages, returns = gae(rewards, values, gamma, lam, mask)
    policy_loss = -masked_mean(logprobs * advantages.detach(), mask)
    value_loss = masked_mean((values - returns.detach()) ** 2, mask)
    return policy_loss + value_coef * value_loss, policy_loss, value_loss


def ppo_clip_objective(ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float = 0.2) -> torch.Tensor:
    """min(ρ·A, clip(ρ, 1-ε, 1+ε)·A) per element, to be maximised (PPO, eq. 7).

    The min makes it a pessimistic bound: once ρ has moved past 1+ε on a good action (A > 0)
    or below 1-ε on a bad one (A < 0) the objective is flat and its gradient is zero, so one
    batch cannot push the policy far from the one that sampled it (TRPO's trust region,
    without the constrained solve)."""
    if epsilon <= 0:
        raise ValueError(f"epsilon (the clip range) must be > 0, got {epsilon}")
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon)
    return torch.minimum(ratio * advantages, clipped * advantages)


def ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor | None = None, epsilon: float = 0.2) -> torch.Tensor:
    """-mean of the clipped objective with ρ = π_θ/π_old = exp(logp - old_logp) per token."""
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    return -masked_mean(ppo_clip_objective(ratio, advantages.detach(), epsilon), mask)


# ---------------------------------------------------------------------------- GRPO

SCALE_REWARDS = ("group", "batch", "none")
STD_KINDS = ("bessel", "population")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", std: str = "bessel",
                     eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantage: each reward minus the mean of its group, divided by the std.

    ``rewards`` is flat (n_prompts·G,), each prompt's G completions next to each other (the
    order of ``repeat_interleave``). ``scale``: "group" divides by the group's std (GRPO),
    "batch" by the whole batch's std, "none" by nothing (Dr. GRPO). ``std``: "bessel" is
    TRL's (n-1 in the denominator) and "population" the paper's formula; ``eps`` is added to
    the std (TRL: 1e-4), so a group whose rewards are all equal gets advantages 0, not NaN."""
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size={group_size!r}: a group of one completion has no baseline (its advantage "
                         f"is always 0 and its std undefined); sample G >= 2 completions per prompt")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be flat with a multiple of group_size={group_size} entries "
                         f"(n_prompts·G), got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; score every completion with a finite reward")
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {SCALE_REWARDS}, got {scale!r}")
    if std not in STD_KINDS:
        raise ValueError(f"std must be one of {STD_KINDS}, got {std!r}")
    grouped = rewards.float().view(-1, group_size)  # (n_prompts, G)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    # a group of equal rewards carries no signal: exactly 0 (a float mean of 0.1s is not exactly 0.1)
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    advantages = torch.where(all_equal, torch.zeros_like(advantages), advantages)
    unbiased = std == "bessel"
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True, unbiased=unbiased) + eps)
    elif scale == "batch":
        advantages = advantages / (rewards.float().std(unbiased=unbiased) + eps)
    return advantages.view(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref) on tokens sampled from π_θ:
    r - log r - 1 with r = π_ref/π_θ. Never negative, and unbiased: E_π[k3] = KL(π ‖ π_ref)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              ref_logprobs: torch.Tensor | None = None, beta: float = 0.0, epsilon: float = 0.2,
              loss_type: str = "grpo", max_completion_length: int | None = None) -> torch.Tensor:
    """The clipped GRPO loss over a batch of completions (to minimise).

    Per token: -min(ρ·Â, clip(ρ, 1±ε)·Â) + β·k3, with ρ = π_θ/π_old and Â the completion's
    advantage (one number per completion, shared by all its tokens). Then, over the tokens
    where ``mask`` is 1:

    - "grpo":    mean over each completion's own tokens (1/|o_i|), then mean over completions;
    - "dr_grpo": sum over all tokens / (B · max_completion_length), a constant, so a token
      weighs the same in a short completion as in a long one (Dr. GRPO);
    - "dapo":    sum over all tokens / the number of tokens in the batch (TRL's default).

    logprobs, old_logprobs, ref_logprobs, mask: (B, T); advantages: (B,). A completion with no
    tokens (mask all 0) adds nothing; every normalizer is at least 1, so there is no NaN."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T) per-token log-probabilities, got shape {tuple(logprobs.shape)}")
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask, ref_logprobs=ref_logprobs)
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have one value per completion, shape ({logprobs.size(0)},), "
                         f"got {tuple(advantages.shape)}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} needs ref_logprobs (the reference policy's log-probabilities); pass them or set beta=0")
    ratio = torch.exp(logprobs - old_logprobs.detach())
    per_token = -ppo_clip_objective(ratio, advantages.detach()[:, None], epsilon)  # (B, T)
    if beta != 0.0:
        per_token = per_token + beta * kl_k3(logprobs, ref_logprobs.detach())
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        length = logprobs.size(1) if max_completion_length is None else max_completion_length
        if length < logprobs.size(1):
            raise ValueError(f"max_completion_length={length} is shorter than the completions ({logprobs.size(1)} tokens)")
        return (per_token * mask).sum() / (logprobs.size(0) * length)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


# ---------------------------------------------------------------------------- the task


class CharTokenizer:
    """One token per character, plus a few whole-word special tokens. Enough for a task whose
    text is digits and operators; a policy this small learns much faster over 24 symbols than
    over a 1024-token BPE vocabulary."""

    SPECIALS = ("<eos>", "<answer>", "</answer>")

    def __init__(self, chars: str = "0123456789+-*/() ,.:"):
        if len(set(chars)) != len(chars):
            raise ValueError(f"chars has duplicates: {chars!r}")
        self.tokens = list(self.SPECIALS) + list(chars)
        self.ids = {tok: i for i, tok in enumerate(self.tokens)}
        self.eos_id = self.ids["<eos>"]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in self.SPECIALS if text.startswith(s, i)), None)
            piece = special or text[i]
            if piece not in self.ids:
                raise ValueError(f"character {piece!r} at position {i} of {text!r} is not in the vocabulary "
                                 f"{''.join(self.tokens[len(self.SPECIALS):])!r}")
            ids.append(self.ids[piece])
            i += len(piece)
        return ids

    def decode(self, ids) -> str:
        return "".join(self.tokens[int(i)] for i in ids)


class HFTokenizer:
    """The same interface over a transformers tokenizer, for a real checkpoint from a local folder."""

    def __init__(self, hf_tokenizer):
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; GRPO needs one to know where a completion ends")
        self.hf = hf_tokenizer
        self.eos_id = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    target: int
    solutions: tuple[str, ...]  # every expression of the generator that reaches the target


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_WHITELIST = re.compile(r"^[\d+\-*/().\s]+$")
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate_expression(expr: str) -> float:
    """The value of an arithmetic expression of numbers, + - * /, unary minus and parentheses;
    anything else (names, calls, powers) raises ValueError. Parsed, never passed to eval."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"not allowed in an answer: {ast.dump(node)[:60]}")

    return walk(ast.parse(expr.strip(), mode="eval"))


def countdown_reward(completion: str, numbers, target: float, format_score: float = 0.1, score: float = 1.0) -> float:
    """TinyZero's countdown rules: no ``<answer>...</answer>`` → 0; the last answer must use
    exactly the given numbers, each once, and only digits, + - * / ( ) . and spaces, else the
    format score; its value within 1e-5 of the target → ``score``, otherwise the format score."""
    answers = _ANSWER.findall(completion)
    if not answers:
        return 0.0
    expr = answers[-1].strip()
    if not _WHITELIST.match(expr) or sorted(int(n) for n in re.findall(r"\d+", expr)) != sorted(numbers):
        return format_score
    try:
        value = evaluate_expression(expr)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
        return format_score
    return score if abs(value - target) < 1e-5 else format_score


def _expressions(numbers: tuple[int, ...]):
    """Every expression using the numbers once each in the given order, with + - * and, for
    three numbers, both ways to bracket them (brackets written only where precedence needs them)."""
    if len(numbers) == 2:
        a, b = numbers
        yield from (f"{a}{op}{b}" for op in "+-*")
        return
    a, b, c = numbers
    for op1, op2 in itertools.product("+-*", repeat=2):
        yield f"{a}{op1}{b}{op2}{c}"  # precedence decides the grouping
        if op1 in "+-" and op2 == "*":
            yield f"({a}{op1}{b})*{c}"
        if op1 == "-" and op2 in "+-":
            yield f"{a}-({b}{op2}{c})"
        if op1 == "*" and op2 in "+-":
            yield f"{a}*({b}{op2}{c})"


@functools.lru_cache(maxsize=None)
def _all_problems(size: int, max_number: int, max_target: int) -> tuple[Problem, ...]:
    """Every (numbers, target) with its solutions, in a fixed order."""
    problems = []
    for numbers in itertools.product(range(1, max_number + 1), repeat=size):
        by_target = defaultdict(list)
        for perm in sorted(set(itertools.permutations(numbers))):
            for expr in _expressions(perm):
                by_target[evaluate_expression(expr)].append(expr)
        for target, exprs in sorted(by_target.items()):
            if 0 <= target <= max_target:
                problems.append(Problem(numbers, int(target), tuple(exprs)))
    return tuple(problems)


class Countdown:
    """Countdown: make ``target`` from ``numbers`` with + - * /, using each number exactly once.

    Problems are every (numbers, target) the generator reaches with two (and, if ``sizes``
    says so, three) numbers in 1..max_number and targets in 0..max_target. Two numbers suit
    the course's small policy; three are much harder for it. A fixed, seeded share of each
    size is held out (``test``). ``sample`` draws a size uniformly, then a problem.

    ``prompt(p)`` is the short form a character-level policy reads ("3,7,4:25", " 3,7:21"),
    ``chat_prompt(p)`` an instruction for a real instruction-following checkpoint."""

    def __init__(self, sizes: tuple[int, ...] = (2,), max_number: int = 9, max_target: int = 99,
                 test_fraction: float = 0.2, seed: int = 0):
        if not sizes or not set(sizes) <= {2, 3}:
            raise ValueError(f"sizes lists how many numbers a problem has, each 2 or 3; got {sizes!r}")
        if not 2 <= max_number <= 9:
            raise ValueError(f"max_number must be in 2..9 (numbers are single digits), got {max_number}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.sizes, self.max_number, self.max_target = tuple(sorted(set(sizes))), max_number, max_target
        rng = random.Random(seed)
        self.train_by_size, self.test_by_size = {}, {}
        for size in self.sizes:
            problems = list(_all_problems(size, max_number, max_target))
            rng.shuffle(problems)
            n_test = max(1, int(round(test_fraction * len(problems))))
            self.test_by_size[size], self.train_by_size[size] = problems[:n_test], problems[n_test:]
        self.train = [p for size in self.sizes for p in self.train_by_size[size]]
        self.test = [p for size in self.sizes for p in self.test_by_size[size]]

    def sample(self, n: int, generator: random.Random, split: str = "train") -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pools = self.train_by_size if split == "train" else self.test_by_size
        drawn = []
        for _ in range(n):
            pool = pools[generator.choice(self.sizes)]
            drawn.append(pool[generator.randrange(len(pool))])
        return drawn

    @property
    def prompt_width(self) -> int:
        return 2 * max(self.sizes) - 1 + 1 + len(str(self.max_target))

    def prompt(self, problem: Problem) -> str:
        """Numbers, a colon, the target, left-padded with spaces to one width, so that every
        prompt has the same length and a whole batch is sampled at once."""
        return (",".join(map(str, problem.numbers)) + f":{problem.target}").rjust(self.prompt_width)

    def chat_prompt(self, problem: Problem) -> str:
        nums = ", ".join(map(str, problem.numbers))
        return (f"Use the numbers {nums} once each, with + - * / and brackets, to make {problem.target}. "
                f"Think first, then give only the expression between <answer> and </answer>, "
                f"as in <answer>(2 + 3) * 4</answer>.\n")

    def reward(self, problem: Problem, completion: str) -> float:
        return countdown_reward(completion, problem.numbers, problem.target)

    def demonstration(self, problem: Problem, generator: random.Random, ramble_rate: float = 0.0,
                      max_ramble: int = 12) -> str:
        """A supervised completion: a correct answer in tags or, with probability ``ramble_rate``,
        an answerless ramble of 1..max_ramble dots (reward 0). Rambles give the policy a way to be
        wrong at any length, which is what the length normalization of GRPO acts on."""
        if generator.random() < ramble_rate:
            return "." * generator.randint(1, max_ramble)
        return f"<answer>{generator.choice(problem.solutions)}</answer>"


# ---------------------------------------------------------------------------- sampling and scoring


@torch.no_grad()
def sample_completions(model: Transformer, prompt_ids: torch.Tensor, max_new_tokens: int, eos_id: int,
                       temperature: float = 1.0, top_k: int | None = None,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample a completion for every row of prompt_ids (B, P) with a KV cache, stopping at EOS.

    Returns (completion_ids (B, L), mask (B, L)); the mask covers each completion's tokens up
    to and including its EOS, and L ≤ max_new_tokens (decoding stops once every row ended)."""
    B, P = prompt_ids.shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if P + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds the policy's "
                         f"max_seq_len={model.cfg.max_seq_len}; shorten one or build a longer model")
    kind = prompt_ids.device.type
    cache_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None  # K/V as computed
    cache = model.new_cache(B, max_len=P + max_new_tokens, dtype=cache_dtype)
    logits = model(prompt_ids, cache)[:, -1]  # (B, V)
    done = torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)
    tokens, masks = [], []
    for step in range(max_new_tokens):
        token = sample(logits, temperature, top_k, generator)[:, 0]  # (B,)
        token = torch.where(done, torch.full_like(token, eos_id), token)  # finished rows pad with EOS
        masks.append(~done)
        tokens.append(token)
        done = done | (token == eos_id)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(token[:, None], cache)[:, -1]
    return torch.stack(tokens, dim=1), torch.stack(masks, dim=1).float()


def completion_logprobs(model: Transformer, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """log π(o_t | prompt, o_<t) for every completion token, (B, L), in one forward pass."""
    P = prompt_ids.size(1)
    logits = model(torch.cat([prompt_ids, completion_ids], dim=1))[:, P - 1:-1]  # (B, L, V)
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, completion_ids[..., None]).squeeze(-1)


@dataclass
class Rollout:
    """G completions for each of a batch of problems, grouped by prompt length (a model without
    an attention mask cannot pad prompts), then right-padded into one (N, L) batch."""

    chunks: list[tuple[torch.Tensor, torch.Tensor]]  # (prompt_ids (n, P), completion_ids (n, L_chunk))
    mask: torch.Tensor  # (N, L): 1 on completion tokens (EOS included)
    rewards: torch.Tensor  # (N,), each problem's G completions next to each other
    texts: list[str]
    group_size: int

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)

    @property
    def correct(self) -> torch.Tensor:
        return self.rewards >= 1.0


def rollout(policy: Transformer, tokenizer, task, problems, group_size: int, max_new_tokens: int,
            temperature: float = 1.0, generator: torch.Generator | None = None, prompt_fn=None) -> Rollout:
    """Sample ``group_size`` completions per problem and score them with ``task.reward``."""
    if not problems:
        raise ValueError("no problems to sample completions for")
    prompt_fn = prompt_fn or task.prompt
    device = policy.tok_embeddings.weight.device
    by_length = defaultdict(list)
    for i, problem in enumerate(problems):
        by_length[len(tokenizer.encode(prompt_fn(problem)))].append(i)
    order, chunks, completions, masks = [], [], [], []
    for _, indices in sorted(by_length.items()):
        prompts = torch.tensor([tokenizer.encode(prompt_fn(problems[i])) for i in indices], device=device)
        prompts = prompts.repeat_interleave(group_size, dim=0)  # (n·G, P)
        ids, mask = sample_completions(policy, prompts, max_new_tokens, tokenizer.eos_id, temperature,
                                       generator=generator)
        order += indices
        chunks.append((prompts, ids))
        completions += [row[: int(m.sum())] for row, m in zip(ids.tolist(), mask)]
        masks.append(mask)
    width = max(m.size(1) for m in masks)
    mask = torch.cat([F.pad(m, (0, width - m.size(1))) for m in masks])
    texts = [tokenizer.decode([t for t in c if t != tokenizer.eos_id]) for c in completions]
    problems_in_order = [problems[i] for i in order for _ in range(group_size)]
    rewards = torch.tensor([task.reward(p, t) for p, t in zip(problems_in_order, texts)], device=device)
    return Rollout(chunks, mask, rewards, texts, group_size)


def rollout_logprobs(model: Transformer, batch: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of a rollout's completions under ``model``, (N, L), zero-padded."""
    width = batch.mask.size(1)
    parts = [completion_logprobs(model, prompts, ids, temperature) for prompts, ids in batch.chunks]
    return torch.cat([F.pad(p, (0, width - p.size(1))) for p in parts])


@torch.no_grad()
def evaluate(policy: Transformer, tokenizer, task, problems, samples_per_problem: int = 4, temperature: float = 1.0,
             max_new_tokens: int = 24, seed: int = 0, prompt_fn=None, batch_problems: int = 256) -> dict:
    """Pass rate (reward 1), format rate (an answer in tags), mean reward and lengths of sampled
    completions (temperature 0: greedy, one sample each)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    generator = torch.Generator(device=policy.tok_embeddings.weight.device).manual_seed(seed)
    samples = 1 if temperature == 0 else samples_per_problem
    was_training = policy.training
    policy.eval()
    rewards, lengths = [], []
    for start in range(0, len(problems), batch_problems):
        group = problems[start:start + batch_problems]
        batch = rollout(policy, tokenizer, task, group, samples, max_new_tokens, temperature, generator, prompt_fn)
        rewards.append(batch.rewards.cpu())
        lengths.append(batch.lengths.cpu())
    policy.train(was_training)
    rewards, lengths = torch.cat(rewards), torch.cat(lengths)
    correct = rewards >= 1.0
    return {
        "pass_rate": correct.float().mean().item(),
        "format_rate": (rewards > 0).float().mean().item(),
        "reward": rewards.mean().item(),
        "length": lengths.mean().item(),
        "wrong_length": lengths[~correct].mean().item() if (~correct).any() else float("nan"),
        "correct_length": lengths[correct].mean().item() if correct.any() else float("nan"),
    }


@torch.no_grad()
def ramble_stats(policy: Transformer, tokenizer, task, problems, max_len: int = 24, filler: str = ".") -> dict:
    """How likely the policy starts an answerless ramble, and how long it expects one to be,
    computed exactly from its probabilities rather than sampled.

    One forward pass over prompt + ``filler``·max_len per problem: P(start) = π(filler | prompt)
    and, once started, E[length] = Σ_k P(reach k fillers) for k = 1..max_len, with
    P(reach k) = Π_{j<k} π(filler | prompt, j fillers). Rambles are rare after RL, so sampling
    them would need many draws to see their length; this needs none."""
    device = policy.tok_embeddings.weight.device
    (filler_id,) = tokenizer.encode(filler)
    prompts = torch.tensor([tokenizer.encode(task.prompt(p)) for p in problems], device=device)
    rambles = torch.full((len(problems), max_len), filler_id, device=device)
    P = prompts.size(1)
    logits = policy(torch.cat([prompts, rambles], dim=1))[:, P - 1:P + max_len - 1]  # (N, max_len, V)
    p_filler = F.softmax(logits.float(), dim=-1)[..., filler_id]  # π(filler | prompt, j fillers), j = 0..max_len-1
    reach = torch.cumprod(p_filler[:, 1:], dim=1)  # P(reach k + 1 | started), k = 1..max_len-1
    expected_length = 1.0 + reach.sum(dim=1)
    return {"start": p_filler[:, 0].mean().item(), "length": expected_length.mean().item()}


# ---------------------------------------------------------------------------- the GRPO loop


@dataclass
class GRPOConfig:
    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8  # G
    max_new_tokens: int = 24
    temperature: float = 1.0
    lr: float = 5e-4
    epsilon: float = 0.2
    beta: float = 0.04  # weight of the KL to the reference policy
    loss_type: str = "grpo"  # "dr_grpo": constant normalizer; "dapo": tokens in the batch
    scale_rewards: str = "group"  # "none" for Dr. GRPO
    inner_steps: int = 2  # μ: gradient steps on each batch of samples (ρ ≠ 1 after the first)
    grad_clip: float = 1.0
    warmup_steps: int = 5  # Adam's first updates are ±lr on every weight: ramp the lr up
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size={self.group_size!r}: GRPO's baseline is the group mean, which needs "
                             f"G >= 2 completions per prompt (with G = 1 every advantage is 0)")
        for name in ("steps", "prompts_per_step", "max_new_tokens", "inner_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for on-policy sampling, got {self.temperature}")
        if self.beta < 0 or self.lr <= 0 or self.epsilon <= 0:
            raise ValueError(f"beta must be >= 0, lr and epsilon > 0; got {self.beta}, {self.lr}, {self.epsilon}")


def dr_grpo_config(**overrides) -> GRPOConfig:
    """Dr. GRPO: the same loop with a constant loss normalizer and no division by the std."""
    return GRPOConfig(**{"loss_type": "dr_grpo", "scale_rewards": "none", **overrides})


HISTORY_KEYS = ("reward", "pass_rate", "kl", "length", "wrong_length", "correct_length", "clip_fraction",
                "zero_std_fraction", "loss")


def train_grpo(policy: Transformer, tokenizer, task, config: GRPOConfig | None = None,
               reference: Transformer | None = None, progress: bool = True, advantage_fn=None, loss_fn=None,
               prompt_fn=None, autocast_dtype: torch.dtype | None = None, callback=None) -> dict[str, list[float]]:
    """Train ``policy`` in place with GRPO; returns the per-step history (``HISTORY_KEYS``).

    Each step: draw ``prompts_per_step`` training problems, sample G completions each (KV
    cache), score them, turn rewards into group advantages, then take ``inner_steps`` clipped
    policy-gradient steps against the policy that sampled them, with β·KL to ``reference``
    (a frozen copy of the starting policy unless given). ``advantage_fn(rewards, G)`` and
    ``loss_fn(logprobs, old_logprobs, advantages, mask, ref_logprobs)`` replace the library's
    (the lab plugs its own in). ``autocast_dtype`` (e.g. torch.bfloat16 on a GPU) runs the
    forward passes in that precision while the weights and optimizer stay fp32. ``callback(step,
    policy)`` runs after every step; a dict it returns is added to the history under its keys."""
    from tqdm.auto import tqdm

    cfg = config or GRPOConfig()
    device = policy.tok_embeddings.weight.device
    if reference is None:
        reference = copy.deepcopy(policy)
    reference.eval().requires_grad_(False)
    if advantage_fn is None:
        advantage_fn = lambda rewards, G: group_advantages(rewards, G, scale=cfg.scale_rewards)  # noqa: E731
    if loss_fn is None:
        def loss_fn(logprobs, old_logprobs, advantages, mask, ref_logprobs):
            return grpo_loss(logprobs, old_logprobs, advantages, mask, ref_logprobs, beta=cfg.beta,
                             epsilon=cfg.epsilon, loss_type=cfg.loss_type, max_completion_length=cfg.max_new_tokens)
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    problem_rng = random.Random(cfg.seed)
    sampler = torch.Generator(device=device).manual_seed(cfg.seed)
    history = {key: [] for key in HISTORY_KEYS}
    for step in tqdm(range(cfg.steps), desc=f"GRPO ({cfg.loss_type})", disable=not progress):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / (cfg.warmup_steps + 1))
        problems = task.sample(cfg.prompts_per_step, problem_rng)
        policy.eval()
        with autocast:
            batch = rollout(policy, tokenizer, task, problems, cfg.group_size, cfg.max_new_tokens,
                            cfg.temperature, sampler, prompt_fn)
            with torch.no_grad():
                old_logprobs = rollout_logprobs(policy, batch, cfg.temperature)
                ref_logprobs = rollout_logprobs(reference, batch, cfg.temperature)
        advantages = advantage_fn(batch.rewards, cfg.group_size)
        if not torch.isfinite(advantages).all():
            raise ValueError("the advantage function returned NaN or inf (a zero std without an epsilon?)")
        policy.train()
        for _ in range(cfg.inner_steps):
            with autocast:
                logprobs = rollout_logprobs(policy, batch, cfg.temperature)
            loss = loss_fn(logprobs, old_logprobs, advantages, batch.mask, ref_logprobs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
            optimizer.step()
        _log_step(history, batch, logprobs.detach(), old_logprobs, ref_logprobs, advantages, loss, cfg)
        if callback is not None:
            policy.eval()
            for key, value in (callback(step, policy) or {}).items():
                history.setdefault(key, []).append(value)
    policy.eval()
    return history


def _log_step(history, batch: Rollout, logprobs, old_logprobs, ref_logprobs, advantages, loss, cfg):
    mask, lengths, correct = batch.mask, batch.lengths, batch.correct
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ((ratio > 1 + cfg.epsilon) & (advantages[:, None] > 0)) | ((ratio < 1 - cfg.epsilon) & (advantages[:, None] < 0))
    grouped = batch.rewards.view(-1, batch.group_size)
    history["reward"].append(batch.rewards.mean().item())
    history["pass_rate"].append(correct.float().mean().item())
    history["kl"].append(masked_mean(kl_k3(logprobs, ref_logprobs), mask).item())
    history["length"].append(lengths.mean().item())
    history["wrong_length"].append(lengths[~correct].mean().item() if (~correct).any() else float("nan"))
    history["correct_length"].append(lengths[correct].mean().item() if correct.any() else float("nan"))
    history["clip_fraction"].append(masked_mean(clipped.float(), mask).item())
    history["zero_std_fraction"].append((grouped.std(dim=1) == 0).float().mean().item())
    history["loss"].append(loss.item())


# ---------------------------------------------------------------------------- the policy


@dataclass
class PolicySpec:
    """A small policy for Countdown and how it is briefly supervised (SFT) before RL: long
    enough to learn the answer format and some arithmetic, short enough that it solves only
    some held-out problems (about a quarter of the samples), which leaves RL room to act."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_seq_len: int = 32  # prompt + max_new_tokens
    sizes: tuple[int, ...] = (2,)  # the task: two-number problems; (2, 3) adds three-number ones
    sft_steps: int = 150
    batch_size: int = 64
    lr: float = 3e-3
    ramble_rate: float = 0.1  # share of answerless demonstrations
    max_ramble: int = 12
    seed: int = 0

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, max_seq_len=self.max_seq_len, tie_embeddings=True)


FORMAT_VERSION = 1  # bump when the way a cached policy is built changes


def sft(policy: Transformer, tokenizer, task: Countdown, steps: int, batch_size: int = 64, lr: float = 3e-3,
        ramble_rate: float = 0.0, max_ramble: int = 12, seed: int = 0, progress: bool = True) -> list[float]:
    """Supervised fine-tuning on demonstrations: cross-entropy on the completion tokens only
    (prompt tokens are given, not learned). Returns the loss per step."""
    from tqdm.auto import tqdm

    device = policy.tok_embeddings.weight.device
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    policy.train()
    losses = []
    for step in tqdm(range(steps), desc="SFT", disable=not progress):
        for group in optimizer.param_groups:  # linear warm-up over 10% of the steps, cosine decay to 10%
            warm = min(1.0, (step + 1) / max(1, steps // 10))
            group["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        rows, masks = [], []
        for problem in task.sample(batch_size, rng):
            prompt = tokenizer.encode(task.prompt(problem))
            completion = tokenizer.encode(task.demonstration(problem, rng, ramble_rate, max_ramble)) + [tokenizer.eos_id]
            rows.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.eos_id] * (width - len(r)) for r in rows], device=device)
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], device=device, dtype=torch.float)
        logits = policy(ids[:, :-1])
        token_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1), reduction="none")
        loss = masked_mean(token_loss, mask[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    policy.eval()
    return losses


def _spec_hash(spec: PolicySpec, tokenizer: CharTokenizer) -> str:
    blob = json.dumps({"spec": asdict(spec), "tokens": tokenizer.tokens, "version": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def policy_path(spec: PolicySpec | None = None):
    spec = spec or PolicySpec()
    return cache_dir() / "rl" / f"countdown-{_spec_hash(spec, CharTokenizer())}.pt"


def load_policy(spec: PolicySpec | None = None, device=None, progress: bool = True, force: bool = False):
    """(policy, tokenizer, task): the Countdown policy after its brief SFT, trained on first
    use (seconds on a CPU; on ``device`` if given) and cached in ``cache_dir()/rl``. An
    unreadable cached file is rebuilt with a warning. The policy comes back in eval mode."""
    spec = spec or PolicySpec()
    tokenizer, task = CharTokenizer(), Countdown(sizes=spec.sizes)
    path = policy_path(spec)
    policy = Transformer(spec.model_config(tokenizer.vocab_size))
    if path.exists() and not force:
        try:
            policy.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return policy.to(device or "cpu").eval(), tokenizer, task
        except Exception as err:  # a torn or stale file: rebuild rather than half-load
            warnings.warn(f"cached policy {path} is unreadable ({err}); rebuilding it")
    torch.manual_seed(spec.seed)
    policy = Transformer(spec.model_config(tokenizer.vocab_size)).to(device or "cpu")
    sft(policy, tokenizer, task, spec.sft_steps, spec.batch_size, spec.lr, spec.ramble_rate, spec.max_ramble,
        spec.seed, progress)
    buffer = io.BytesIO()
    torch.save({k: v.cpu() for k, v in policy.state_dict().items()}, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    return policy.eval(), tokenizer, task


# ---------------------------------------------------------------------------- memory: PPO vs GRPO

ALGORITHMS = ("ppo", "grpo")


def rl_state_bytes(n_params: int, algorithm: str, trained_bytes: int = 16, frozen_bytes: int = 2,
                   reward_model: bool = False, reference: bool = True) -> int:
    """Model-state bytes of an RL fine-tune (activations and samples come on top).

    Trained models cost ``trained_bytes`` per parameter (16 in mixed-precision Adam: bf16
    weight and gradient, fp32 master, m and v), frozen ones ``frozen_bytes`` (2 in bf16).
    PPO trains the policy and a critic of the same size; GRPO trains only the policy (the group
    mean is its baseline). Both keep a frozen reference for the KL term (``reference``) and, for
    learned rewards, a frozen reward model (``reward_model``; a verifiable reward needs none)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    trained = 2 if algorithm == "ppo" else 1
    frozen = int(reference) + int(reward_model)
    return n_params * (trained * trained_bytes + frozen * frozen_bytes)



def training_state_bytes(*modules: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of every parameter, gradient and optimizer state tensor actually allocated."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen and t.numel():
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for module in modules:
        for p in module.parameters():
            add(p)
            add(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:  # skip Adam's scalar step counters
                    add(t)
    return total


class ValueModel(torch.nn.Module):
    """PPO's critic: a copy of the policy's body with a scalar head instead of the LM head."""

    def __init__(self, policy: Transformer):
        super().__init__()
        self.body = copy.deepcopy(policy)
        self.body.output = torch.nn.Identity()  # the body returns the final hidden states
        self.head = torch.nn.Linear(policy.cfg.dim, 1)

    def forward(self, idx):
        return self.head(self.body(idx)).squeeze(-1)  # (B, T)
