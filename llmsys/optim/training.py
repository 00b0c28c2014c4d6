"""Chapter 8: training the same model with AdamW or Muon at equal tokens, and reading
off how many tokens each needs to reach a loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmsys.core.model import Transformer
from llmsys.optim.muon import build_optimizer, split_muon_adamw
from llmsys.optim.qk_clip import MaxLogitTracker, qk_clip_


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


