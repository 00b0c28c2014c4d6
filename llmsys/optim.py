"""Optimizers from scratch: SGD to AdamW (chapter 7), Muon and QK-clip (chapter 8).

Every update rule is a small function ``*_update(p, grad, state, **hyperparameters)``
that changes ``p`` in place and keeps its running statistics in ``state``; the
optimizer classes only loop over parameters and call it. Each one is checked
against its torch.optim counterpart in tests/test_optim.py.

Chapter 7, the one idea: Adam with L2 adds λθ to the gradient, so the decay is
divided by √v̂ like everything else and parameters with a large gradient history
are barely decayed; AdamW multiplies θ by (1 − lr·λ) outside the adaptive step,
so every weight decays at the same rate.

Chapter 8: Muon keeps one momentum matrix per hidden weight matrix and applies
its *orthogonalised* version, computed by a Newton–Schulz iteration; embeddings,
the head and norm gains stay with AdamW. QK-clip rescales W_q and W_k of any
attention head whose largest logit went past τ.

One module for both chapters, on purpose: Muon is one more update rule on the same
``ScratchOptimizer`` base, trained by the same harness and compared with AdamW in the
same runs; split it along those sections if it grows further.

References:
1) Loshchilov & Hutter, Decoupled Weight Decay Regularization (ICLR 2019)
2) Keller Jordan, Muon (kellerjordan.github.io/posts/muon; github.com/KellerJordan/Muon)
3) Moonshot AI, Muon is Scalable for LLM Training (Moonlight, arXiv 2502.16982)
4) Kimi K2 (arXiv 2507.20534): QK-Clip and MuonClip
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.model import Transformer

# ---------------------------------------------------------------------------
# Chapter 7: update rules, SGD to AdamW


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


SCRATCH_AND_TORCH = {  # our class -> the torch.optim class it must match
    "SGD": (SGD, torch.optim.SGD),
    "RMSProp": (RMSProp, torch.optim.RMSprop),
    "Adam": (Adam, torch.optim.Adam),
    "AdamW": (AdamW, torch.optim.AdamW),
}  # + "Muon", registered below


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
    if convention == "Adam + L2":
        opt = Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    else:  # torch's AdamW decays by lr_t·wd; wd = λ/lr makes that η_t·λ
        wd = weight_decay if convention.startswith("AdamW, torch") else weight_decay / lr
        opt = AdamW(model.parameters(), lr=lr, weight_decay=wd)
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


# ---------------------------------------------------------------------------
# Chapter 8: Newton–Schulz and Muon

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately orthogonalise G: U S Vᵀ -> U S' Vᵀ with S' near 1 (roughly 0.5..1.5), in ``dtype``.

    The quintic X ← aX + b(XXᵀ)X + c(XXᵀ)²X maps every singular value σ through
    p(σ) = aσ + bσ³ + cσ⁵, leaving the singular vectors alone. Its coefficients
    make p steep at 0 (small σ grow fast) at the price of not converging exactly to 1.
    """
    if G.ndim != 2:
        raise ValueError(f"Newton–Schulz needs a matrix, got shape {tuple(G.shape)}; "
                         f"reshape it to 2-D first (e.g. flatten a conv kernel to (out, in·k·k))")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:  # iterate on the wide side: X Xᵀ is then the smaller Gram matrix
        X = X.mT
    X = X / X.norm().clamp(min=eps)  # ‖X‖_F ≥ σ_max, so every σ starts in (0, 1]
    for _ in range(steps):
        A = X @ X.mT  # (m, m) Gram matrix
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b·A + c·A², one rounding (as torch.optim.Muon)
        X = torch.addmm(X, B, X, beta=a)  # a·X + B·X
    return X.mT if tall else X


ADJUST_LR_FNS = ("original", "match_rms_adamw")


def adjust_lr(lr: float, shape, adjust_lr_fn: str | None = None) -> float:
    """Shape-based learning rate for an (A, B) matrix.

    "original" (Keller Jordan, the default): lr·√max(1, A/B), so tall matrices,
    whose orthogonalised update has smaller entries, are not under-trained.
    "match_rms_adamw" (Moonlight): lr·0.2·√max(A, B), which gives the update the
    RMS (≈0.2) of a typical AdamW update, so AdamW's lr and weight decay carry over.
    """
    if len(shape) != 2:
        raise ValueError(f"shape-based lr scaling is for matrices, got shape {tuple(shape)}")
    A, B = shape
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def muon_update(p, grad, state, *, lr, weight_decay=0.1, momentum=0.95, nesterov=True,
                ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None):
    """One Muon step for a matrix: momentum, Nesterov look-ahead, orthogonalise, decoupled decay."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - momentum)  # M ← μM + (1 − μ)G
    update = grad.lerp(buf, momentum) if nesterov else buf  # (1 − μ)G + μM: a look-ahead
    ortho = newton_schulz(update, ns_steps, ns_coefficients, eps)
    p.mul_(1 - lr * weight_decay)  # decay uses the base lr, not the shape-adjusted one
    p.add_(ortho.to(p.dtype), alpha=-adjust_lr(lr, p.shape, adjust_lr_fn))


class Muon(ScratchOptimizer):
    """Muon for 2-D hidden weights, with torch.optim.Muon's arguments and defaults."""

    update = staticmethod(muon_update)

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None):
        if adjust_lr_fn not in (None, *ADJUST_LR_FNS):
            raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes only matrices, got a parameter of shape {tuple(p.shape)}; "
                                     f"give embeddings, norms and biases to AdamW (see split_muon_adamw)")


SCRATCH_AND_TORCH["Muon"] = (Muon, torch.optim.Muon)


def adam_update_rms(state: dict, betas=(0.9, 0.999), eps: float = 1e-8) -> float:
    """RMS of the Adam direction m̂/(√v̂ + ε) held in one parameter's state (typically 0.2-0.4 in LLM
    training, Moonlight's observation behind 0.2·√max(A, B))."""
    t = state["step"]
    t = t.item() if torch.is_tensor(t) else t
    m_hat = state["exp_avg"] / (1 - betas[0] ** t)
    v_hat = state["exp_avg_sq"] / (1 - betas[1] ** t)
    return (m_hat / (v_hat.sqrt() + eps)).pow(2).mean().sqrt().item()


def split_muon_adamw(model: nn.Module, head_names=("output",)) -> tuple[list, list]:
    """(Muon parameters, AdamW parameters): 2-D hidden weights vs embeddings, the head and norm gains.

    Embeddings and the head are lookups/classifiers over the vocabulary, not
    maps between hidden spaces, and 1-D gains have no matrix to orthogonalise."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(model.get_submodule(name).weight) for name in head_names}
    muon, adamw = [], []
    for _, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and id(p) not in embeddings and id(p) not in heads
        (muon if hidden_matrix else adamw).append(p)
    return muon, adamw


class Chain:
    """Several optimizers stepped as one (Muon for matrices + AdamW for the rest)."""

    def __init__(self, *optimizers):
        self.optimizers = [o for o in optimizers if o is not None]

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict:
        merged = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged


def build_optimizer(model: nn.Module, kind: str, lr: float = 3e-3, weight_decay: float = 0.1,
                    muon_lr: float | None = None, adjust_lr_fn: str | None = "match_rms_adamw",
                    betas=(0.9, 0.95)):
    """"adamw": AdamW everywhere. "muon": Muon on hidden matrices, AdamW (lr) on the rest.

    With Moonlight's "match_rms_adamw" scaling Muon reuses AdamW's lr and weight
    decay (muon_lr defaults to lr), so the two runs differ only in the optimizer."""
    if kind == "adamw":
        return AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "muon":
        muon_params, adamw_params = split_muon_adamw(model)
        return Chain(Muon(muon_params, lr=lr if muon_lr is None else muon_lr, weight_decay=weight_decay,
                          adjust_lr_fn=adjust_lr_fn),
                     AdamW(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay))
    raise ValueError(f"kind must be 'adamw' or 'muon', got {kind!r}")


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of ``steps`` iterations on a (rows, cols) matrix, m = min, n = max side:
    XXᵀ 2m²n, A² 2m³, B·X 2m²n per iteration."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def stable_rank(M: torch.Tensor) -> float:
    """‖M‖_F² / ‖M‖₂²: how many directions carry the energy (≤ rank)."""
    s = torch.linalg.svdvals(M.float())
    return (s.pow(2).sum() / s[0].pow(2)).item() if s[0] > 0 else 0.0


def effective_rank(M: torch.Tensor) -> float:
    """exp(entropy of σ/Σσ) (Roy & Vetterli): min(rows, cols) for a flat spectrum, 1 for rank one."""
    s = torch.linalg.svdvals(M.float())
    p = s / s.sum()
    p = p[p > 0]
    return math.exp(-(p * p.log()).sum().item())


# ---------------------------------------------------------------------------
# Chapter 8: training at equal tokens


def random_batch(ids: torch.Tensor, batch_size: int, seq_len: int, generator=None):
    """batch_size random windows of ids: inputs x and next-token targets y, each (B, T)."""
    if ids.numel() <= seq_len:
        raise ValueError(f"need more than seq_len={seq_len} tokens, got {ids.numel()}")
    starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model, ids, batch_size, seq_len, batches=4, seed=1234) -> float:
    """Mean next-token loss on fixed windows of ids (the same windows every call)."""
    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(batches):
        x, y = random_batch(ids, batch_size, seq_len, g)
        logits = model(x)
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def train_lm(model, optimizer, train_ids, val_ids, *, steps, batch_size, seq_len, eval_every=25,
             seed=0, after_step=None, progress=None) -> dict:
    """Train for ``steps`` steps; return history: tokens seen, train loss per step, val loss every eval_every.

    ``after_step(step, model, optimizer)`` runs after each optimizer step (QK-clip, spectra, ...)."""
    g = torch.Generator().manual_seed(seed)
    history = {"step": [], "tokens": [], "train_loss": [], "val_tokens": [], "val_loss": []}
    model.train()
    steps_iter = progress(range(1, steps + 1)) if progress else range(1, steps + 1)
    for step in steps_iter:
        x, y = random_batch(train_ids, batch_size, seq_len, g)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(step, model, optimizer)
        tokens = step * batch_size * seq_len
        history["step"].append(step)
        history["tokens"].append(tokens)
        history["train_loss"].append(loss.item())
        if step % eval_every == 0 or step == steps:
            history["val_tokens"].append(tokens)
            history["val_loss"].append(evaluate(model, val_ids, batch_size, seq_len))
    return history


def probe_run(cfg, kind: str, train_ids, val_ids, *, steps: int, batch_size: int, seq_len: int,
              lr: float = 3e-3, weight_decay: float = 0.1, tau: float | None = None, snapshot_steps=(),
              eval_every: int = 25, seed: int = 0, progress=None, build=None) -> dict:
    """Train a fresh Transformer(cfg) with build_optimizer(kind) (or ``build``, a function with its
    signature (model, kind, lr=, weight_decay=)) and watch it:

    - ``max_logit``: the largest attention logit of every step's forward;
    - ``momenta``: {step: {name: momentum matrix}} of the hidden matrices at ``snapshot_steps``
      (AdamW's m, Muon's momentum buffer);
    - with ``tau``, QK-clip after every step (Muon + QK-clip = MuonClip).
    Returns those plus ``model``, ``optimizer`` and the ``history`` of train_lm."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    opt = (build or build_optimizer)(model, kind, lr=lr, weight_decay=weight_decay)
    hidden = {name: p for name, p in model.named_parameters() if any(p is q for q in split_muon_adamw(model)[0])}
    key = "exp_avg" if kind == "adamw" else "momentum_buffer"
    tracker = MaxLogitTracker(model)
    out = {"max_logit": [], "momenta": {}}

    def after_step(step, model, optimizer):
        S = tracker.max_logits.clone()  # from this step's forward, before the update
        tracker.reset()
        out["max_logit"].append(S.max().item())
        if tau is not None:
            qk_clip_(model, S, tau)
        if step in snapshot_steps:
            out["momenta"][step] = {name: optimizer.state[p][key].clone() for name, p in hidden.items()}

    with tracker:
        out["history"] = train_lm(model, opt, train_ids, val_ids, steps=steps, batch_size=batch_size,
                                  seq_len=seq_len, eval_every=eval_every, seed=seed, after_step=after_step,
                                  progress=progress)
    out.update(model=model, optimizer=opt)
    return out


def tokens_to_reach(tokens, losses, target: float) -> float:
    """Tokens at which a loss curve first reaches ``target`` (linear between evaluations); inf if never."""
    prev_t, prev_l = 0, math.inf
    for t, l in zip(tokens, losses):
        if l <= target:
            if math.isinf(prev_l):
                return float(t)
            return prev_t + (t - prev_t) * (prev_l - target) / (prev_l - l)
        prev_t, prev_l = t, l
    return math.inf


# ---------------------------------------------------------------------------
# Chapter 8: QK-clip


def attention_logits(attention, x, cos, sin) -> torch.Tensor:
    """The causal attention logits q·k/√d of every head, (B, n_heads, T, T), -inf above the diagonal.

    x is the attention block's input (after its norm), (B, T, dim); cos/sin the rotary tables for its positions."""
    T = x.size(1)
    nh, nkv, hs = attention.n_heads, attention.n_kv_heads, attention.head_dim
    q, k, _ = attention.project_qkv(x, cos, sin)  # (B, nh, T, hs), (B, nkv, T, hs)
    k = k.repeat_interleave(nh // nkv, dim=1)  # query head h reads KV head h // group (as SDPA's GQA)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def head_max_logits(attention, x, cos, sin) -> torch.Tensor:
    """Per query head, the largest attention logit over batch and (causal) positions: (n_heads,)."""
    return attention_logits(attention, x, cos, sin).amax(dim=(0, 2, 3))


class MaxLogitTracker:
    """While active, every forward of a ``llmsys.model.Transformer`` (without a KV cache) records
    each layer's per-head max attention logit; ``max_logits`` is (n_layers, n_heads),
    the running max since the last ``reset()``. Costs one extra QKᵀ per layer."""

    def __init__(self, model):
        self.model = model
        self.n_layers, self.n_heads = model.cfg.n_layers, model.cfg.n_heads
        self.handles = []
        self.reset()

    def reset(self):
        self.max_logits = torch.full((self.n_layers, self.n_heads), float("-inf"))

    def _hook(self, layer_idx):
        def hook(attention, args):
            x, cos, sin = args[:3]
            if len(args) > 3 and args[3] is not None:
                raise ValueError("MaxLogitTracker tracks training forwards; call the model without a KV cache")
            with torch.no_grad():
                m = head_max_logits(attention, x, cos, sin).float().cpu()
            self.max_logits[layer_idx] = torch.maximum(self.max_logits[layer_idx], m)
        return hook

    def __enter__(self):
        for i, layer in enumerate(self.model.layers):
            self.handles.append(layer.attention.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


@torch.no_grad()
def attention_inputs(model, idx) -> list[tuple]:
    """Each layer's attention input (x, cos, sin) on token ids idx, to recompute logits on the same inputs
    (after clipping layer 0, layer 1 sees a different residual stream in a fresh forward)."""
    inputs = []
    handles = [layer.attention.register_forward_pre_hook(lambda m, args: inputs.append(args[:3]))
               for layer in model.layers]
    try:
        model(idx)
    finally:
        for h in handles:
            h.remove()
    return inputs


@torch.no_grad()
def max_logits_from_inputs(model, inputs) -> torch.Tensor:
    """(n_layers, n_heads) max logits of the model's current W_q, W_k on stored attention inputs."""
    return torch.stack([head_max_logits(layer.attention, *args).float().cpu()
                        for layer, args in zip(model.layers, inputs)])


@torch.no_grad()
def attention_max_logits(model, idx) -> torch.Tensor:
    """(n_layers, n_heads) max attention logit of ``model`` on token ids ``idx`` (B, T)."""
    with MaxLogitTracker(model) as tracker:
        model(idx)
    return tracker.max_logits


@torch.no_grad()
def qk_clip_(model, max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Scale the query/key weights of every head whose max logit S exceeded τ so that S becomes τ.

    γ_h = min(1, τ/S_h). With one key head per query head (MHA) the head's rows of
    W_q and W_k are both multiplied by √γ_h, as in Kimi K2. With grouped-query
    attention a key head is shared by several query heads, and scaling it would also
    shrink heads that never exceeded τ, so W_q^h alone is multiplied by γ_h and W_k
    is left alone: the same choice K2 makes for MLA's shared rotary key. Either way
    every logit of head h scales by exactly γ_h and other heads are untouched.
    Returns γ, (n_layers, n_heads)."""
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    cfg = model.cfg
    if tuple(max_logits.shape) != (cfg.n_layers, cfg.n_heads):
        raise ValueError(f"max_logits must be (n_layers, n_heads) = {(cfg.n_layers, cfg.n_heads)}, "
                         f"got {tuple(max_logits.shape)}; get it from attention_max_logits or MaxLogitTracker")
    gamma = (tau / max_logits.double()).clamp(max=1.0)  # S ≤ τ (or -inf) -> 1
    hs, shared_keys = cfg.head_dim, cfg.n_kv_heads < cfg.n_heads
    for layer, g_layer in zip(model.layers, gamma):
        attn = layer.attention
        for h in (g_layer < 1).nonzero().flatten().tolist():
            rows = slice(h * hs, (h + 1) * hs)  # head h's output rows of W_q (and of W_k in MHA)
            g = g_layer[h].item()
            if shared_keys:
                attn.wq.weight[rows] *= g
            else:
                attn.wq.weight[rows] *= math.sqrt(g)
                attn.wk.weight[rows] *= math.sqrt(g)
    return gamma.float()


def mla_clip_factors(gamma: float) -> dict[str, float]:
    """K2's QK-clip for multi-head latent attention: per-head parts share √γ, the rotary query
    part takes all of γ, and the rotary key, shared by every head, is left alone."""
    root = math.sqrt(gamma)
    return {"q_nope": root, "k_nope": root, "q_rope": gamma, "k_rope": 1.0}
