"""Chapter 8: Newton–Schulz orthogonalisation and Muon.

Muon keeps one momentum matrix per hidden weight matrix and applies its
*orthogonalised* version, computed by a Newton–Schulz iteration; embeddings, the head
and norm gains stay with AdamW. Muon is one more update rule on the same
``ScratchOptimizer`` base as chapter 7's AdamW.

References: Keller Jordan, Muon (kellerjordan.github.io/posts/muon); Moonshot AI,
Muon is Scalable for LLM Training (Moonlight, arXiv 2502.16982).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from llmsys.optim.adamw import AdamW, ScratchOptimizer

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


