"""A real pipeline over processes: a Transformer cut into stages, each process running its
stage's op order from the simulator with point-to-point sends and receives."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from llmsys.parallel.pipeline.schedules import Op, Slot, Timeline, schedule_orders


class PipelineStage(nn.Module):
    """A run of consecutive blocks of a ``llmsys.core.model.Transformer``; the first stage also
    embeds tokens, the last applies the final norm and the output head."""

    def __init__(self, model: nn.Module, first_layer: int, last_layer: int, is_first: bool, is_last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.is_first, self.is_last = is_first, is_last
        self.first_layer = first_layer
        self.tok_embeddings = model.tok_embeddings if is_first else None
        self.layers = nn.ModuleList(model.layers[first_layer:last_layer])
        self.norm = model.norm if is_last else None
        self.output = model.output if is_last else None

    def forward(self, x):  # token ids (B, T) on the first stage, hidden states (B, T, D) after
        from llmsys.core.model import rope_tables

        if self.is_first:
            x = self.tok_embeddings(x)  # (B, T, D)
        cos, sin = rope_tables(self.cfg.head_dim, torch.arange(x.size(1), device=x.device), self.cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype))
        return self.output(self.norm(x)) if self.is_last else x  # logits (B, T, V) on the last stage


def split_stages(model: nn.Module, n_stages: int) -> list[PipelineStage]:
    """Cut a Transformer into ``n_stages`` stages of whole, consecutive layers (as even as possible)."""
    n_layers = len(model.layers)
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive int, got {n_stages!r}")
    if n_stages > n_layers:
        raise ValueError(f"a pipeline of {n_stages} stages needs at least {n_stages} layers (each stage holds "
                         f"whole layers), but the model has n_layers={n_layers}; use at most {n_layers} stages")
    if model.cfg.tie_embeddings and n_stages > 1:
        raise ValueError("tied embeddings put one weight on the first and the last stage; use tie_embeddings=False")
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return [PipelineStage(model, bounds[i], bounds[i + 1], i == 0, i == n_stages - 1) for i in range(n_stages)]


@dataclass
class InFlight:
    """What a stage keeps for one microbatch from its forward until its last backward op."""

    input: torch.Tensor  # what the stage received: token ids on the first stage, hidden states after
    output: torch.Tensor  # the stage's output; on the last stage, its share of the loss
    grad_output: torch.Tensor | None = None  # received in B (or BW), kept for W; None on the last stage


def run_schedule(stage: PipelineStage, order, inputs, targets, rank: int, world_size: int, group=None):
    """Execute one device's op order for one batch: forward, backward (split or not), sends and receives.

    ``inputs``/``targets`` are lists of microbatches (needed on the first / last
    stage). Activations go forward, gradients backward (``batch_isend_irecv``); sends
    never block, so any order the simulator accepts runs without deadlock.
    ``rank`` and ``world_size`` are this stage's place in ``group`` (the default group if None).
    Returns (summed loss on the last stage else None, [(kind, microbatch, start, end)]).
    """
    m = len(inputs)
    # point-to-point calls name their peer by its global rank, even when given a group
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    prev_rank = to_global(rank - 1) if rank > 0 else None
    next_rank = to_global(rank + 1) if rank < world_size - 1 else None
    dtype = next(stage.parameters()).dtype
    params = list(stage.parameters())
    state: dict[int, InFlight] = {}  # microbatch -> what its backward ops need
    sends, log = [], []
    total_loss = torch.zeros(())
    t0 = time.perf_counter()
    for item in order:
        op = item[0] if isinstance(item, tuple) else item
        if isinstance(item, tuple):
            raise ValueError("overlapped F&B pairs are simulated only; run a schedule without them")
        start = time.perf_counter() - t0
        mb = op.microbatch
        batch, seq = inputs[mb].shape
        if op.kind == "F":
            if stage.is_first:
                x = inputs[mb]
            else:
                x = torch.empty(batch, seq, stage.cfg.dim, dtype=dtype)
                _recv(x, prev_rank, group)
                x.requires_grad_()
                start = time.perf_counter() - t0  # waiting for the input is idle time, not work
            out = stage(x)
            if stage.is_last:
                out = F.cross_entropy(out.flatten(0, 1), targets[mb].flatten()) / m  # mean over the batch
                total_loss += out.detach()
            else:
                sends += _send(out.detach().contiguous(), next_rank, group)
            state[mb] = InFlight(x, out)
        else:
            kept = state[mb]
            if op.kind in ("B", "BW") and not stage.is_last:
                kept.grad_output = torch.empty_like(kept.output)
                _recv(kept.grad_output, next_rank, group)
                start = time.perf_counter() - t0
            if op.kind == "BW":
                torch.autograd.backward(kept.output, kept.grad_output)
                input_grad = None if stage.is_first else kept.input.grad
                del state[mb]
            elif op.kind == "B":  # input gradient only; keep the graph (and grad_output) for W
                input_grad = None if stage.is_first else torch.autograd.grad(
                    kept.output, kept.input, kept.grad_output, retain_graph=True)[0]
            else:  # W: weight gradients only
                torch.autograd.backward(kept.output, kept.grad_output, inputs=params)
                input_grad = None
                del state[mb]
            if input_grad is not None:
                sends += _send(input_grad.contiguous(), prev_rank, group)
        log.append((op.kind, mb, start, time.perf_counter() - t0))
    for request in sends:
        request.wait()
    return (total_loss if stage.is_last else None), log


def _send(tensor, peer: int, group) -> list:
    """Start sending ``tensor`` to global rank ``peer``; the requests to wait on."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer, group)])


def _recv(tensor, peer: int, group) -> None:
    """Receive into ``tensor`` from global rank ``peer``, waiting until it has arrived."""
    for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, peer, group)]):
        request.wait()


def pipeline_train(rank: int, world_size: int, model: nn.Module, batches, schedule: str = "1f1b",
                   microbatches: int = 4, lr: float = 0.1, ranks: list[int] | None = None) -> dict | None:
    """Worker: train ``model`` on ``batches`` [(x, y), ...] as a pipeline with SGD.

    The pipeline runs on the processes ``ranks`` (default all of them), stage i on the i-th
    lowest of them; the others return None. Every rank receives the same full model and keeps
    its stage. Returns this rank's per-step losses (last stage), its stage's final parameters
    and the op log of the last step.
    """
    group = None
    if ranks is not None:
        if len(set(ranks)) != len(ranks) or not set(ranks) <= set(range(world_size)):
            raise ValueError(f"ranks must be distinct ranks in 0..{world_size - 1}, got {ranks}")
        group = dist.new_group(sorted(ranks))  # every process takes part in creating the group
        if rank not in ranks:
            return None
        rank, world_size = dist.get_rank(group), len(ranks)
    if schedule not in ("gpipe", "1f1b", "zb-h1"):
        raise ValueError(f"the real pipeline runs gpipe, 1f1b or zb-h1, not {schedule!r} "
                         "(interleaved and DualPipe hold several chunks per device: simulate them)")
    stage = split_stages(model, world_size)[rank]
    order = schedule_orders(schedule, world_size, microbatches)[rank]
    optimizer = torch.optim.SGD(stage.parameters(), lr=lr)
    losses, log = [], []
    for x, y in batches:
        if x.size(0) % microbatches:
            raise ValueError(f"batch size {x.size(0)} must be divisible by microbatches={microbatches}")
        optimizer.zero_grad(set_to_none=True)
        loss, log = run_schedule(stage, order, list(x.chunk(microbatches)), list(y.chunk(microbatches)),
                                 rank, world_size, group)
        optimizer.step()
        if loss is not None:
            losses.append(loss.item())
    params = {f"layer{stage.first_layer}+" + name: p.detach().clone() for name, p in stage.named_parameters()}
    return {"losses": losses, "params": params, "log": log}


def single_process_train(model: nn.Module, batches, lr: float = 0.1) -> list[float]:
    """The reference: the same model, batches and SGD in one process."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def log_timeline(logs: list, schedule: str, microbatches: int) -> Timeline:
    """A Timeline from the per-rank op logs of ``pipeline_train`` (wall-clock seconds)."""
    timeline = Timeline(schedule + " (measured)", len(logs), microbatches, 1)
    for device, log in enumerate(logs):
        for kind, mb, start, end in log:
            timeline.slots.append(Slot(device, start, end, (Op(kind, mb, device),)))
    return timeline
