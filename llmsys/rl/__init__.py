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
briefly supervised on the task and cached by the zoo (``load_policy``), the GRPO loop
(``train_grpo``) with the library's KV-cached sampling (``llmsys.core.model.sample_rollout``) of
G completions per prompt, and the memory arithmetic of PPO vs GRPO (``rl_state_bytes``,
``training_state_bytes``, ``ValueModel``).

    from llmsys import rl
    policy, tok, task = rl.load_policy()            # SFT'd and cached on first use (seconds)
    before = rl.evaluate(policy, tok, task, task.test, samples_per_problem=8)
    history = rl.train_grpo(policy, tok, task, rl.GRPOConfig(steps=60))   # or rl.dr_grpo_config(...)
    after = rl.evaluate(policy, tok, task, task.test, samples_per_problem=8)

References: Williams 1992 (REINFORCE); Schulman et al. 2015 (GAE, arXiv 1506.02438) and 2017
(PPO, arXiv 1707.06347); DeepSeekMath (GRPO, arXiv 2402.03300); Liu et al. 2025 (Dr. GRPO,
arXiv 2503.20783); TinyZero's countdown reward; TRL 1.16's GRPOTrainer for the loss variants.

The package, one file per part: ``losses`` (the ladder and GRPO's loss), ``tokenizers``,
``task`` (Countdown), ``sampling`` (rollouts and their log-probabilities), ``loop`` (GRPO),
``policy`` (the cached SFT policy), ``memory`` (PPO vs GRPO state bytes), ``ppo`` (PPO with a learned
critic, trained on the same task and batches as GRPO).
"""


from llmsys.core.model import masked_mean
from llmsys.rl.loop import HISTORY_KEYS, GRPOConfig, dr_grpo_config, grpo_step, make_grpo_optimizer, train_grpo
from llmsys.rl.losses import (LOSS_TYPES, SCALE_REWARDS, STD_KINDS, actor_critic_loss, discounted_returns, gae,
                              group_advantages, grpo_loss, kl_k3, ppo_clip_objective, ppo_loss, reinforce_loss)
from llmsys.rl.memory import ALGORITHMS, ValueModel, rl_state_bytes, training_state_bytes
from llmsys.rl.policy import FORMAT_VERSION, PolicySpec, load_policy, policy_path, sft
from llmsys.rl.sampling import RolloutBatch, completion_logprobs, evaluate, ramble_stats, rollout, rollout_logprobs
from llmsys.rl.task import Countdown, Problem, countdown_reward, evaluate_expression
from llmsys.rl.tokenizers import CharTokenizer, HFTokenizer

__all__ = [
    "masked_mean", "HISTORY_KEYS", "GRPOConfig", "dr_grpo_config", "grpo_step",
    "make_grpo_optimizer", "train_grpo", "LOSS_TYPES", "SCALE_REWARDS",
    "STD_KINDS", "actor_critic_loss", "discounted_returns", "gae", "group_advantages", "grpo_loss", "kl_k3",
    "ppo_clip_objective", "ppo_loss", "reinforce_loss", "ALGORITHMS", "ValueModel", "rl_state_bytes",
    "training_state_bytes", "FORMAT_VERSION", "PolicySpec", "load_policy", "policy_path", "sft", "RolloutBatch",
    "completion_logprobs", "evaluate", "ramble_stats", "rollout", "rollout_logprobs", "Countdown", "Problem",
    "countdown_reward", "evaluate_expression", "CharTokenizer", "HFTokenizer",
]
