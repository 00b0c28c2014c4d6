"""PPO with a learned critic (actor-critic) on the same task, sampler and batches as GRPO.

Each step: sample completions, score them, give every completion token the reward
-β·(log π_old - log π_ref) (the KL to the reference, as a penalty in the reward, as in
InstructGPT) and the last one also the task's reward; a critic V (a copy of the policy's body
with a scalar head) values the state before each token; GAE turns rewards and values into
per-token advantages; then ``inner_steps`` clipped policy steps and critic regressions on the
GAE returns. GRPO replaces V by the mean reward of a group of completions of one prompt.

References: Schulman et al. 2017 (PPO, arXiv 1707.06347) and 2015 (GAE, arXiv 1506.02438);
Ouyang et al. 2022 (InstructGPT: the KL penalty in the reward, the value model).
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmsys.core.model import Transformer, masked_mean
from llmsys.rl.loop import HISTORY_KEYS, log_step
from llmsys.rl.losses import gae, ppo_loss
from llmsys.rl.memory import ValueModel, training_state_bytes
from llmsys.rl.sampling import RolloutBatch, rollout, rollout_logprobs


@dataclass
class PPOConfig:
    steps: int = 60
    prompts_per_step: int = 16
    samples_per_prompt: int = 8  # GRPO's G: the same completions per step as GRPO samples
    max_new_tokens: int = 24
    temperature: float = 1.0
    lr: float = 5e-4
    critic_lr: float = 1e-3
    epsilon: float = 0.2
    gamma: float = 1.0  # one episode per completion: no discount
    lam: float = 0.95  # GAE's λ
    beta: float = 0.04  # KL penalty per token, in the reward
    inner_steps: int = 2
    grad_clip: float = 1.0
    warmup_steps: int = 5
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens", "inner_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for on-policy sampling, got {self.temperature}")
        if self.beta < 0 or self.lr <= 0 or self.critic_lr <= 0 or self.epsilon <= 0:
            raise ValueError(f"beta must be >= 0, lr, critic_lr and epsilon > 0; got "
                             f"{self.beta}, {self.lr}, {self.critic_lr}, {self.epsilon}")


@dataclass
class PPORun:
    history: dict[str, list[float]]  # per step: PPO_HISTORY_KEYS (GRPO's, and the critic's)
    critic: ValueModel
    critic_bytes: int  # the critic's weights, gradients and Adam state, as allocated
    policy_bytes: int  # the same for the policy
    seconds: float


PPO_HISTORY_KEYS = HISTORY_KEYS + ("value_loss", "explained_variance")


def make_critic(policy: Transformer) -> ValueModel:
    """A critic initialised from the policy's body, its scalar head at zero (V = 0 at the start)."""
    critic = ValueModel(policy)
    torch.nn.init.zeros_(critic.head.weight)
    torch.nn.init.zeros_(critic.head.bias)
    return critic


def rollout_values(critic: ValueModel, batch: RolloutBatch) -> torch.Tensor:
    """V(state before each completion token), (N, L), zero-padded like ``rollout_logprobs``."""
    width = batch.mask.size(1)
    parts = []
    for chunk in batch.chunks:
        values = critic(chunk.tokens[:, :-1])[:, chunk.prompt_len - 1:]  # position t predicts token t+1
        parts.append(F.pad(values, (0, width - values.size(1))))
    return torch.cat(parts).float()


def token_rewards(batch: RolloutBatch, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                  beta: float) -> torch.Tensor:
    """Per-token rewards (N, L): -β·(log π_old - log π_ref) on every completion token, plus the
    task's reward on the last one (the EOS, or the last token of a completion cut at the limit)."""
    mask = batch.mask.float()
    rewards = -beta * (old_logprobs - ref_logprobs) * mask
    last = (batch.lengths.long() - 1).clamp(min=0)
    rewards[torch.arange(len(rewards), device=rewards.device), last] += batch.rewards.float() * (batch.lengths > 0)
    return rewards


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) / std over the masked positions: the advantages' scale stops depending on
    the reward's scale, so one learning rate fits (what PPO implementations for LMs do)."""
    mean = masked_mean(values, mask)
    std = masked_mean((values - mean) ** 2, mask).sqrt()
    return (values - mean) / (std + 1e-8) * mask


def ppo_update(policy: Transformer, critic: ValueModel, policy_opt, critic_opt, batch: RolloutBatch,
               old_logprobs: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
               epsilon: float = 0.2, grad_clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One gradient step of the actor (the clipped surrogate) and of the critic (squared error
    to the GAE returns), each with its own optimizer. Returns (policy loss, value loss, logprobs)."""
    mask = batch.mask.float()
    logprobs = rollout_logprobs(policy, batch)
    policy_loss = ppo_loss(logprobs, old_logprobs, advantages, mask, epsilon)
    value_loss = masked_mean((rollout_values(critic, batch) - returns) ** 2, mask)
    for model, optimizer, loss in ((policy, policy_opt, policy_loss), (critic, critic_opt, value_loss)):
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return policy_loss.detach(), value_loss.detach(), logprobs.detach()


def train_ppo(policy: Transformer, tokenizer, task, config: PPOConfig | None = None,
              critic: ValueModel | None = None, reference: Transformer | None = None,
              progress: bool = True) -> PPORun:
    """Train ``policy`` in place with PPO and a learned critic (``make_critic(policy)`` unless
    given); the problems of each step are drawn exactly as ``train_grpo`` draws them for the
    same seed, so PPO and GRPO see the same prompts and sample as many completions."""
    from tqdm.auto import tqdm

    cfg = config or PPOConfig()
    device = policy.tok_embeddings.weight.device
    critic = (critic or make_critic(policy)).to(device)
    reference = (reference or copy.deepcopy(policy)).eval().requires_grad_(False)
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, betas=(0.9, 0.99), weight_decay=0.0)
    problem_rng = random.Random(cfg.seed)
    sampler = torch.Generator(device=device).manual_seed(cfg.seed)
    history = {key: [] for key in PPO_HISTORY_KEYS}
    start = time.perf_counter()
    for step in tqdm(range(cfg.steps), desc="PPO (critic)", disable=not progress):
        warm = min(1.0, (step + 1) / (cfg.warmup_steps + 1))
        for optimizer, lr in ((policy_opt, cfg.lr), (critic_opt, cfg.critic_lr)):
            for group in optimizer.param_groups:
                group["lr"] = lr * warm
        problems = task.sample(cfg.prompts_per_step, problem_rng)
        policy.eval()
        critic.eval()
        batch = rollout(policy, tokenizer, task, problems, cfg.samples_per_prompt, cfg.max_new_tokens,
                        cfg.temperature, sampler)
        with torch.no_grad():
            old_logprobs = rollout_logprobs(policy, batch, cfg.temperature)
            ref_logprobs = rollout_logprobs(reference, batch, cfg.temperature)
            values = rollout_values(critic, batch)
        mask = batch.mask.float()
        rewards = token_rewards(batch, old_logprobs, ref_logprobs, cfg.beta)
        advantages, returns = gae(rewards, values, cfg.gamma, cfg.lam, mask)
        advantages = whiten(advantages, mask)
        policy.train()
        critic.train()
        for _ in range(cfg.inner_steps):
            policy_loss, value_loss, logprobs = ppo_update(policy, critic, policy_opt, critic_opt, batch,
                                                           old_logprobs, advantages, returns, cfg.epsilon,
                                                           cfg.grad_clip)
        log_step(history, batch, logprobs, old_logprobs, ref_logprobs, advantages, policy_loss, cfg)
        _log_critic(history, values, returns, value_loss, mask)
    seconds = time.perf_counter() - start
    policy.eval()
    critic.eval()
    return PPORun(history, critic, training_state_bytes(critic, optimizer=critic_opt),
                  training_state_bytes(policy, optimizer=policy_opt), seconds)


def _log_critic(history, values, returns, value_loss, mask):
    residual = masked_mean((returns - values) ** 2, mask)
    spread = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    history["value_loss"].append(value_loss.item())
    # 1 - Var(returns - V) / Var(returns): how much of the return the critic predicted before the update
    history["explained_variance"].append((1 - residual / spread.clamp(min=1e-12)).item())
