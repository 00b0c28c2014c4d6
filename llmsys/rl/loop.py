"""The GRPO loop: sample, score, group advantages, clipped policy-gradient steps."""

from __future__ import annotations

import copy
import random
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from llmsys.core.model import Transformer, masked_mean
from llmsys.rl.losses import LOSS_TYPES, SCALE_REWARDS, grpo_loss, group_advantages, kl_k3
from llmsys.rl.sampling import RolloutBatch, rollout, rollout_logprobs


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


def grpo_step(policy: Transformer, reference: Transformer, optimizer: torch.optim.Optimizer, tokenizer, task,
              problems, cfg: GRPOConfig, generator: torch.Generator | None = None, advantage_fn=None, loss_fn=None,
              prompt_fn=None, autocast_dtype: torch.dtype | None = None) -> dict:
    """One GRPO step on ``problems``, in place on ``policy`` and ``optimizer``: sample G completions
    each (KV cache), score them, turn rewards into group advantages, then take ``cfg.inner_steps``
    clipped policy-gradient steps against the policy that sampled them, with β·KL to ``reference``.
    Returns what the step computed: ``batch``, ``advantages``, ``old_logprobs``, ``ref_logprobs``,
    and the last inner step's ``logprobs`` and ``loss`` (detached)."""
    device = policy.tok_embeddings.weight.device
    if advantage_fn is None:
        advantage_fn = lambda rewards, G: group_advantages(rewards, G, scale=cfg.scale_rewards)  # noqa: E731
    if loss_fn is None:
        def loss_fn(logprobs, old_logprobs, advantages, mask, ref_logprobs):
            return grpo_loss(logprobs, old_logprobs, advantages, mask, ref_logprobs, beta=cfg.beta,
                             epsilon=cfg.epsilon, loss_type=cfg.loss_type, max_completion_length=cfg.max_new_tokens)
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext())
    policy.eval()
    with autocast:
        batch = rollout(policy, tokenizer, task, problems, cfg.group_size, cfg.max_new_tokens,
                        cfg.temperature, generator, prompt_fn)
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
    policy.eval()
    return dict(batch=batch, advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                logprobs=logprobs.detach(), loss=loss.detach())


def make_grpo_optimizer(policy: Transformer, cfg: GRPOConfig) -> torch.optim.Optimizer:
    """The loop's optimizer: AdamW without weight decay (the KL to the reference regularises instead)."""
    return torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)


def train_grpo(policy: Transformer, tokenizer, task, config: GRPOConfig | None = None,
               reference: Transformer | None = None, progress: bool = True, advantage_fn=None, loss_fn=None,
               prompt_fn=None, autocast_dtype: torch.dtype | None = None, callback=None,
               step_fn=None) -> dict[str, list[float]]:
    """Train ``policy`` in place with GRPO; returns the per-step history (``HISTORY_KEYS``).

    Each step is ``grpo_step`` on ``prompts_per_step`` training problems, against ``reference``
    (a frozen copy of the starting policy unless given), after a linear learning-rate warmup.
    ``advantage_fn(rewards, G)`` and ``loss_fn(logprobs, old_logprobs, advantages, mask,
    ref_logprobs)`` replace the library's (the lab plugs its own in); ``step_fn``, a function with
    ``grpo_step``'s first eight arguments and its return value, replaces the whole step.
    ``autocast_dtype`` (e.g. torch.bfloat16 on a GPU) runs the forward passes in that precision
    while the weights and optimizer stay fp32. ``callback(step, policy)`` runs after every step; a
    dict it returns is added to the history under its keys."""
    from tqdm.auto import tqdm

    cfg = config or GRPOConfig()
    device = policy.tok_embeddings.weight.device
    if reference is None:
        reference = copy.deepcopy(policy)
    reference.eval().requires_grad_(False)
    if step_fn is None:
        def step_fn(*args):
            return grpo_step(*args, advantage_fn=advantage_fn, loss_fn=loss_fn, prompt_fn=prompt_fn,
                             autocast_dtype=autocast_dtype)
    optimizer = make_grpo_optimizer(policy, cfg)
    problem_rng = random.Random(cfg.seed)
    sampler = torch.Generator(device=device).manual_seed(cfg.seed)
    history = {key: [] for key in HISTORY_KEYS}
    for step in tqdm(range(cfg.steps), desc=f"GRPO ({cfg.loss_type})", disable=not progress):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / (cfg.warmup_steps + 1))
        problems = task.sample(cfg.prompts_per_step, problem_rng)
        out = step_fn(policy, reference, optimizer, tokenizer, task, problems, cfg, sampler)
        log_step(history, out["batch"], out["logprobs"], out["old_logprobs"], out["ref_logprobs"], out["advantages"],
                  out["loss"], cfg)
        if callback is not None:
            policy.eval()
            for key, value in (callback(step, policy) or {}).items():
                history.setdefault(key, []).append(value)
    policy.eval()
    return history


def log_step(history, batch: RolloutBatch, logprobs, old_logprobs, ref_logprobs, advantages, loss, cfg):
    mask, lengths, correct = batch.mask, batch.lengths, batch.correct
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages.reshape(len(advantages), -1)  # (B, 1) one per completion, or (B, T) one per token (PPO)
    clipped = ((ratio > 1 + cfg.epsilon) & (advantages > 0)) | ((ratio < 1 - cfg.epsilon) & (advantages < 0))
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
