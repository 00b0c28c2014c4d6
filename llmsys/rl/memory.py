"""The memory arithmetic of PPO vs GRPO: what a critic costs."""

from __future__ import annotations

import copy

import torch

from llmsys.core.model import Transformer


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
