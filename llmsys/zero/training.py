"""Runs: the same data and model on 1 or N processes, so that a sharded run can be compared with one process.

``TrainConfig`` names a run; ``global_batch`` is the same on every rank and
``local_batch`` is this rank's equal part of it; ``train_single_process`` is the
reference and ``train_zero`` the same run under ``ZeroEngine`` at any stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmsys.core.comm import CommCounter
from llmsys.core.model import ModelConfig, Transformer
from llmsys.zero.engine import ZeroEngine
from llmsys.zero.estimates import STAGE_NAMES


def tiny_model_config(**overrides) -> ModelConfig:
    """A model small enough to train on several CPU processes in a second (≈ 28k parameters),
    with tied embeddings like the zoo's models."""
    base = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, tie_embeddings=True)
    return ModelConfig(**{**base, **overrides})


@dataclass
class TrainConfig:
    """One training run; ``batch_size`` is the global batch, split evenly over the ranks."""

    model: ModelConfig = field(default_factory=tiny_model_config)
    steps: int = 3
    batch_size: int = 4
    seq_len: int = 16
    lr: float = 1e-2
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}")


def build_model(config: TrainConfig, device=None) -> Transformer:
    """The same initial weights on every rank and in the single-process reference."""
    torch.manual_seed(config.seed)
    return Transformer(config.model).to(device or "cpu")


def global_batch(config: TrainConfig, step: int, tokens: torch.Tensor | None = None):
    """The full batch of ``step`` (x, y), each (batch_size, seq_len): the same on every rank.

    Windows of ``tokens`` when given (e.g. ``zoo.dataset()[0]``), else random token ids.
    """
    gen = torch.Generator().manual_seed(config.seed * 100_003 + step)
    B, T = config.batch_size, config.seq_len
    if tokens is None:
        ids = torch.randint(config.model.vocab_size, (B, T + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]
    if len(tokens) <= T + 1:
        raise ValueError(f"need more than seq_len + 1 = {T + 1} tokens, got {len(tokens)}")
    starts = torch.randint(len(tokens) - T - 1, (B,), generator=gen).tolist()
    windows = torch.stack([tokens[s : s + T + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def local_batch(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal part of a global batch (rows rank·B/N .. (rank+1)·B/N)."""
    if x.size(0) % world_size:
        raise ValueError(
            f"the global batch of {x.size(0)} sequences does not split evenly over {world_size} ranks; "
            f"choose batch_size as a multiple of the world size (e.g. {world_size * max(1, x.size(0) // world_size)})"
        )
    per_rank = x.size(0) // world_size
    return x[rank * per_rank : (rank + 1) * per_rank]


def rank_device() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_over_ranks(value: torch.Tensor, group=None) -> float:
    """The global mean of a per-rank mean (equal batch shares): what a single process would print."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def adamw(params, config: TrainConfig) -> torch.optim.AdamW:
    """The optimizer every run uses, with the run's hyper-parameters (one tensor at a time, as the
    sharded runs do, so that both sides round alike)."""
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, foreach=False)


def train_step(model, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step of next-token cross-entropy on (x, y); returns the (local) loss."""
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_single_process(config: TrainConfig, tokens: torch.Tensor | None = None) -> dict:
    """The reference: plain AdamW on the full batch in one process. Returns losses and parameters."""
    model = build_model(config)
    optimizer = adamw(model.parameters(), config)
    losses = [train_step(model, optimizer, *global_batch(config, step, tokens)).item() for step in range(config.steps)]
    params = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "params": params, "grads": grads}  # grads: of the last step


def train_zero(rank: int, world_size: int, stage: int, config: TrainConfig, tokens: torch.Tensor | None = None,
               verbose: bool = False) -> dict:
    """Train with ``ZeroEngine`` at ``stage`` on this rank; meant for ``launch`` or torchrun.

    Returns the global losses, the final full parameters, the bytes this rank
    holds, and the collectives of the last step (counted by ``CommCounter``).
    """
    device = rank_device()
    model = build_model(config, device)
    n_params = sum(p.numel() for p in model.parameters())
    engine = ZeroEngine(model, stage, lr=config.lr, betas=config.betas, eps=config.eps,
                        weight_decay=config.weight_decay)
    losses = []
    for step in range(config.steps):
        x, y = (local_batch(t, rank, world_size).to(device) for t in global_batch(config, step, tokens))
        counting = CommCounter() if step == config.steps - 1 else contextlib.nullcontext()
        with counting as comm:
            loss = engine.train_step(x, y)
        losses.append(mean_over_ranks(loss))
        if verbose and rank == 0:
            print(f"{STAGE_NAMES[stage]} step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return {
        "losses": losses,
        "params": {k: v.cpu() for k, v in engine.full_parameters().items()},
        "grads": {k: v.cpu() for k, v in engine.full_gradients().items()},  # of the last step
        "state_bytes": engine.state_bytes(),
        "peak_in_flight_bytes": engine.peak_in_flight_bytes,
        "n_params": n_params,
        "padded_params": engine.padded_params(),
        "calls": dict(comm.calls),
        "comm_bytes": dict(comm.bytes),
        "ring_bytes": dict(comm.ring_bytes),
    }

