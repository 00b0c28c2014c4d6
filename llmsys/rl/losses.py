"""The ladder from REINFORCE to GRPO, one small function per rung, each tested against its definition.

References: Williams 1992 (REINFORCE); Schulman et al. 2015 (GAE, arXiv 1506.02438) and 2017
(PPO, arXiv 1707.06347); DeepSeekMath (GRPO, arXiv 2402.03300); Liu et al. 2025 (Dr. GRPO,
arXiv 2503.20783); TRL 1.16's GRPOTrainer for the loss variants.
"""

from __future__ import annotations

import torch

from llmsys.core.model import masked_mean


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
