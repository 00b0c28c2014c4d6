"""Each scratch optimizer against its torch.optim counterpart, on the same small regression."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmsys.optim.adamw import SGD, Adam, AdamW, RMSProp
from llmsys.optim.muon import Muon

SCRATCH_AND_TORCH = {  # our class -> the torch.optim class it must match
    "SGD": (SGD, torch.optim.SGD),
    "RMSProp": (RMSProp, torch.optim.RMSprop),
    "Adam": (Adam, torch.optim.Adam),
    "AdamW": (AdamW, torch.optim.AdamW),
    "Muon": (Muon, torch.optim.Muon),
}


def compare_with_torch(name: str, steps: int = 100, seed: int = 0, update=None, **hyperparameters) -> float:
    """Largest |difference| between our optimizer ``name`` (a key of SCRATCH_AND_TORCH) and
    torch.optim's after ``steps`` steps on the same small two-layer regression.
    ``update`` replaces our class's update rule (a learner's own version of it)."""
    if name not in SCRATCH_AND_TORCH:
        raise ValueError(f"name must be one of {sorted(SCRATCH_AND_TORCH)}, got {name!r}")
    ours, theirs = SCRATCH_AND_TORCH[name]
    if update is not None:
        ours = type(ours.__name__, (ours,), {"update": staticmethod(update)})
    results = []
    for cls in (ours, theirs):
        g = torch.Generator().manual_seed(seed)
        W1, W2 = nn.Parameter(torch.randn(12, 20, generator=g)), nn.Parameter(torch.randn(20, 6, generator=g))
        x, y = torch.randn(32, 12, generator=g), torch.randn(32, 6, generator=g)
        # torch's multi-tensor path sums in another order; compare against its one-tensor loop
        extra = {"foreach": False} if cls.__module__.startswith("torch") and name != "Muon" else {}
        opt = cls([W1, W2], **hyperparameters, **extra)
        for _ in range(steps):
            opt.zero_grad()
            ((torch.tanh(x @ W1) @ W2 - y) ** 2).mean().backward()
            opt.step()
        results.append(torch.cat([W1.detach().flatten(), W2.detach().flatten()]))
    return (results[0] - results[1]).abs().max().item()
