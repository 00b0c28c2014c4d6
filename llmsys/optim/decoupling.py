"""Chapter 7: Loshchilov & Hutter's decoupling experiment, in small and with seeds.

The claim (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Fig. 2): with
Adam + L2 the best weight decay λ moves with the learning rate α; decoupled from the adaptive
step, it does not. Where the best λ sits only matters on a problem with something to
regularize, so the model here is non-convex and overfits: a 3-layer MLP classifier trained
on 200 noisy examples of a random teacher network, minibatches, a cosine schedule, and the
held-out loss read on 2,000 more.

For every learning rate of a grid the best λ is found on a grid of λ (refined by a parabola
through the best point and its neighbours in log λ), and the *slope* of log10(best λ) against
log10(α), over the learning rates that train within 10% of the best loss, says how far it
moves: 0 means it stays put, 1 means it moves with α. The slope is
measured per seed, and its mean comes with a 95% interval. The paper's form decays by η_t·λ
(η_t the schedule's multiplier); torch's AdamW decays by α_t·λ, so the same runs read in
torch's units have a slope smaller by exactly 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.optim.adamw import DECAY_CONVENTIONS, decay_optimizer

L2, PAPER = DECAY_CONVENTIONS[0], DECAY_CONVENTIONS[2]
LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
WEIGHT_DECAYS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def classification_task(seed: int, n_train: int = 200, n_val: int = 2000, dim: int = 20, classes: int = 4,
                        label_noise: float = 0.2):
    """Labels from a random tanh network, a fifth of them replaced at random: few, noisy examples
    that an MLP memorises without regularization."""
    g = torch.Generator().manual_seed(seed)
    W1, W2 = torch.randn(dim, 64, generator=g), torch.randn(64, classes, generator=g)
    X = torch.randn(n_train + n_val, dim, generator=g)
    y = (torch.tanh(X @ W1 / dim**0.5) @ W2).argmax(-1)
    noisy = torch.rand(len(y), generator=g) < label_noise
    y = torch.where(noisy, torch.randint(classes, y.shape, generator=g), y)
    return (X[:n_train], y[:n_train]), (X[n_train:], y[n_train:])


def mlp_run(convention: str, lr: float, weight_decay: float, steps: int = 400, seed: int = 0,
            batch_size: int = 32, width: int = 256) -> float:
    """Held-out cross-entropy after training a 3-layer MLP on ``classification_task(seed)`` with a
    cosine schedule under one weight-decay ``convention``."""
    (X, y), (X_val, y_val) = classification_task(seed)
    classes = int(y.max()) + 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(X.shape[1], width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                              nn.Linear(width, classes))
    opt = decay_optimizer(convention, model.parameters(), lr, weight_decay)
    batches = torch.Generator().manual_seed(seed + 1)
    for t in range(steps):
        for group in opt.param_groups:  # cosine schedule: η_t = (1 + cos(πt/T)) / 2
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * t / steps))
        idx = torch.randint(len(X), (batch_size,), generator=batches)
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        return F.cross_entropy(model(X_val), y_val).item()


def best_decay(losses, weight_decays) -> float:
    """The λ of the lowest loss in one row, refined by a parabola through it and its two
    neighbours in log λ (the grid's own point at either end)."""
    losses = [float(v) for v in losses]
    logs = [math.log10(wd) for wd in weight_decays]
    i = min(range(len(losses)), key=losses.__getitem__)
    if i in (0, len(losses) - 1):
        return weight_decays[i]
    (x0, x1, x2), (y0, y1, y2) = logs[i - 1:i + 2], losses[i - 1:i + 2]
    curvature = (y0 - 2 * y1 + y2) / ((x2 - x1) * (x1 - x0))
    if curvature <= 0:
        return weight_decays[i]
    x = x1 - (y2 - y0) / (x2 - x0) / curvature  # vertex of the parabola (equal spacing in log λ)
    return 10 ** min(max(x, x0), x2)


def argmin_slope(grid: torch.Tensor, lrs, weight_decays, within: float = 0.1) -> float:
    """Least-squares slope of log10(best λ) against log10(α) over the rows of a (lrs, λs) loss grid
    whose best loss is within ``within`` (relative) of the grid's best: at a learning rate too
    small or too large to train in the budget the best λ says nothing about decoupling."""
    grid = torch.as_tensor(grid, dtype=torch.float64)
    good = [i for i, row in enumerate(grid) if row.min() <= (1 + within) * grid.min()]
    if len(good) < 2:
        raise ValueError(f"need two learning rates that train within {within:.0%} of the best loss, got {len(good)}")
    xs = [math.log10(lrs[i]) for i in good]
    ys = [math.log10(best_decay(grid[i], weight_decays)) for i in good]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def decoupling_grid(convention: str, lrs=LEARNING_RATES, weight_decays=WEIGHT_DECAYS, steps: int = 400,
                    seed: int = 0, progress=None) -> torch.Tensor:
    """Held-out loss over the α × λ grid, (len(lrs), len(weight_decays)), one seed."""
    cells = [(lr, wd) for lr in lrs for wd in weight_decays]
    cells = progress(cells) if progress else cells
    losses = [mlp_run(convention, lr, wd, steps, seed) for lr, wd in cells]
    return torch.tensor(losses).view(len(lrs), len(weight_decays))
