"""Chapter 7: update rules from SGD to AdamW, written from scratch.

Every update rule is a small function ``*_update(p, grad, state, **hyperparameters)``
that changes ``p`` in place and keeps its running statistics in ``state``; the
optimizer classes only loop over parameters and call it. Each one is checked
against its torch.optim counterpart in tests/test_optim.py.

The one idea: Adam with L2 adds λθ to the gradient, so the decay is divided by √v̂
like everything else and parameters with a large gradient history are barely
decayed; AdamW multiplies θ by (1 − lr·λ) outside the adaptive step, so every
weight decays at the same rate (Loshchilov & Hutter, Decoupled Weight Decay
Regularization, ICLR 2019).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def sgd_update(p, grad, state, *, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
    """θ ← θ − lr·d, where d is the gradient (+ L2 term), optionally through a momentum buffer."""
    d = grad.add(p, alpha=weight_decay) if weight_decay else grad
    if momentum:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = d.clone()  # torch starts the buffer at the first gradient, not at 0
        else:
            state["momentum_buffer"].mul_(momentum).add_(d)
        buf = state["momentum_buffer"]
        d = d.add(buf, alpha=momentum) if nesterov else buf
    p.add_(d, alpha=-lr)


def rmsprop_update(p, grad, state, *, lr, alpha=0.99, eps=1e-8, weight_decay=0.0):
    """Divide by a running RMS of the gradient: every coordinate moves about lr per step."""
    d = grad.add(p, alpha=weight_decay) if weight_decay else grad
    if "square_avg" not in state:
        state["square_avg"] = torch.zeros_like(p)
    sq = state["square_avg"]
    sq.mul_(alpha).addcmul_(d, d, value=1 - alpha)
    p.addcdiv_(d, sq.sqrt().add_(eps), value=-lr)


def _adam_moments(p, grad, state, betas):
    """Update the two moment estimates; return (m̂ step size factor, denominator √v̂ without eps)."""
    beta1, beta2 = betas
    if "step" not in state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p)  # m: running mean of gradients
        state["exp_avg_sq"] = torch.zeros_like(p)  # v: running mean of squared gradients
    state["step"] += 1
    t = state["step"]
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # bias correction: m and v start at 0, so early averages are too small by (1 - β^t)
    bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
    return bias1, state["exp_avg_sq"].sqrt() / math.sqrt(bias2)


def adam_update(p, grad, state, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    """Adam; weight_decay is an L2 term λθ added to the gradient, so it is normalised by √v̂ too."""
    if weight_decay:
        grad = grad.add(p, alpha=weight_decay)  # the L2 term joins the gradient
    bias1, denom = _adam_moments(p, grad, state, betas)
    p.addcdiv_(state["exp_avg"], denom.add_(eps), value=-lr / bias1)


def adamw_update(p, grad, state, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """AdamW: shrink θ by (1 − lr·λ) outside the adaptive step (decoupled decay), then step like Adam."""
    p.mul_(1 - lr * weight_decay)
    bias1, denom = _adam_moments(p, grad, state, betas)
    p.addcdiv_(state["exp_avg"], denom.add_(eps), value=-lr / bias1)


class ScratchOptimizer(torch.optim.Optimizer):
    """Calls the class's ``update`` rule on every parameter that has a gradient."""

    update = None  # an update rule (p, grad, state, **hyperparameters); set by subclasses

    def __init__(self, params, defaults: dict):
        for name in ("lr", "weight_decay", "eps"):
            if name in defaults and defaults[name] < 0:
                raise ValueError(f"{name} must be >= 0, got {defaults[name]}")
        for beta in defaults.get("betas", ()):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas must lie in [0, 1), got {defaults['betas']}")
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rule = type(self).update
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is not None:
                    rule(p, p.grad, self.state[p], **hyper)
        return loss


class SGD(ScratchOptimizer):
    update = staticmethod(sgd_update)

    def __init__(self, params, lr=1e-3, momentum=0.0, weight_decay=0.0, nesterov=False):
        if nesterov and not momentum:
            raise ValueError("nesterov=True needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))


class RMSProp(ScratchOptimizer):
    update = staticmethod(rmsprop_update)

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must lie in [0, 1), got {alpha}")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay))


class Adam(ScratchOptimizer):
    """Adam with L2 weight decay, like torch.optim.Adam."""

    update = staticmethod(adam_update)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))


class AdamW(ScratchOptimizer):
    """Adam with decoupled weight decay, like torch.optim.AdamW."""

    update = staticmethod(adamw_update)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))


def zero_gradient_decay(optimizer_cls, steps=3, theta0=1.0, lr=0.1, weight_decay=0.5, **kwargs) -> list[float]:
    """θ after each of ``steps`` steps with a zero loss gradient: only weight decay moves θ.

    AdamW gives (1 − lr·λ)^k; Adam's L2 term is divided by its own √v̂, so θ
    falls by about lr per step whatever λ is."""
    p = nn.Parameter(torch.tensor([theta0], dtype=torch.float64))
    opt = optimizer_cls([p], lr=lr, weight_decay=weight_decay, **kwargs)
    values = []
    for _ in range(steps):
        p.grad = torch.zeros_like(p)
        opt.step()
        values.append(p.item())
    return values


def effective_decay(optimizer_cls, grad_scale: float, steps: int = 50, lr: float = 1e-2,
                    weight_decay: float = 0.1, n: int = 1000, seed: int = 0) -> float:
    """How fast weight decay shrinks θ under random gradients of scale ``grad_scale``, per step,
    in units of lr·λ·θ₀ (θ₀ = 1; a copy without decay sees the same gradient noise).

    AdamW: about 1 whatever the gradient scale. Adam + L2: large where gradients
    are small, vanishing where they are large."""
    g = torch.Generator().manual_seed(seed)
    noise = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(steps)]
    final = []
    for wd in (weight_decay, 0.0):
        p = nn.Parameter(torch.ones(n, dtype=torch.float64))
        opt = optimizer_cls([p], lr=lr, weight_decay=wd)
        for z in noise:
            p.grad = grad_scale * z
            opt.step()
        final.append(p.detach())
    return ((final[1] - final[0]).mean() / (steps * lr * weight_decay)).item()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in the optimizer's state tensors (moments, buffers, step counters)."""
    total = 0
    for state in optimizer.state.values():
        total += sum(v.nbytes for v in state.values() if torch.is_tensor(v))
    return total


def decay_trajectories(lr: float, weight_decay: float, grad_scale: float, steps: int = 100,
                       seed: int = 0) -> dict[str, list[float]]:
    """One weight θ₀ = 1 driven by zero-mean gradient noise of scale ``grad_scale``: θ after each
    step under AdamW, Adam + L2 and Adam without decay (the same noise for all three)."""
    noise = torch.randn(steps, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    runs = {"AdamW": (AdamW, weight_decay), "Adam + L2": (Adam, weight_decay), "no decay": (Adam, 0.0)}
    out = {}
    for name, (cls, wd) in runs.items():
        p = nn.Parameter(torch.ones(1, dtype=torch.float64))
        opt = cls([p], lr=lr, weight_decay=wd)
        values = []
        for z in noise:
            p.grad = (grad_scale * z).reshape(1)
            opt.step()
            values.append(p.item())
        out[name] = values
    return out


# The three ways "weight decay λ" is written (Loshchilov & Hutter 2019, "Decoupled Weight Decay
# Regularization"): Adam + L2 adds λθ to the gradient; torch's AdamW multiplies θ by (1 - lr·λ), so the
# decay per step still scales with the learning rate; the paper's own form multiplies by (1 - η_t·λ),
# η_t the schedule's multiplier, so λ alone sets the decay. Their finding, that the best λ no longer
# depends on the learning rate, holds for the last form; with torch's, the best lr·λ is what stays put.
DECAY_CONVENTIONS = ("Adam + L2", "AdamW, torch: θ(1 - lr·λ)", "AdamW, paper: θ(1 - η_t·λ)")


def decay_optimizer(convention: str, params, lr: float, weight_decay: float) -> ScratchOptimizer:
    """Adam or AdamW with weight decay λ = ``weight_decay`` written as ``convention`` says."""
    if convention not in DECAY_CONVENTIONS:
        raise ValueError(f"convention must be one of {DECAY_CONVENTIONS}, got {convention!r}")
    if convention == "Adam + L2":
        return Adam(params, lr=lr, weight_decay=weight_decay)
    # torch's AdamW decays by lr_t·wd; wd = λ/lr makes that η_t·λ
    return AdamW(params, lr=lr, weight_decay=weight_decay if convention.startswith("AdamW, torch") else weight_decay / lr)


def regression_task(seed: int, n_train: int = 64, n_val: int = 512, dim: int = 128):
    """More features than samples and noisy targets: without decay a linear model fits the noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, 1, generator=g) / dim**0.5
    X = torch.randn(n_train + n_val, dim, generator=g)
    y = X @ w + 0.5 * torch.randn(n_train + n_val, 1, generator=g)
    return (X[:n_train], y[:n_train]), (X[n_train:], y[n_train:])


def decay_run(convention: str, lr: float, weight_decay: float, steps: int = 300, seed: int = 0) -> float:
    """Validation loss after training a linear model full-batch with a cosine schedule under one
    weight-decay ``convention`` of ``DECAY_CONVENTIONS``."""
    if convention not in DECAY_CONVENTIONS:
        raise ValueError(f"convention must be one of {DECAY_CONVENTIONS}, got {convention!r}")
    (X, y), (X_val, y_val) = regression_task(seed)
    torch.manual_seed(seed)
    model = nn.Linear(X.shape[1], 1)
    opt = decay_optimizer(convention, model.parameters(), lr, weight_decay)
    for t in range(steps):
        for group in opt.param_groups:  # cosine schedule: η_t = (1 + cos(πt/T)) / 2
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * t / steps))
        opt.zero_grad()
        F.mse_loss(model(X), y).backward()
        opt.step()
    with torch.no_grad():
        return F.mse_loss(model(X_val), y_val).item()


def lr_wd_grid(convention: str, lrs, weight_decays, steps: int = 300, seed: int = 0, run=decay_run) -> torch.Tensor:
    """Validation loss over a learning-rate × weight-decay grid, (len(lrs), len(weight_decays)); ``run`` is
    the training run (``decay_run`` or a function with its signature)."""
    return torch.tensor([[run(convention, lr, wd, steps, seed) for wd in weight_decays] for lr in lrs])

