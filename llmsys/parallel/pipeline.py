"""Pipeline parallelism: a schedule simulator, and a real pipeline across processes.

A model cut into stages, one per device, processes a batch as m microbatches.
A schedule is each device's order of work:

- F: forward of one microbatch through one stage
- B: backward for the stage's *input* gradient (what the previous stage waits for)
- W: backward for the stage's *weight* gradient (nobody waits for it)
- BW: a full backward (B then W at once), as GPipe and 1F1B do

``simulate`` runs the orders against their dependencies (F after the previous
stage's F; B after the next stage's B; W after its own B) with given durations
and returns a ``Timeline``: every op's start and end on every device, the idle
("bubble") time and the activations held in flight. The schedules:

| schedule | order on device i | bubble (time) |
|---|---|---|
| GPipe | all F, then all BW | (p-1)(F+B+W) |
| 1F1B | p-1-i warm-up F, then F,BW pairs | (p-1)(F+B+W), ≤ p microbatches in flight |
| interleaved 1F1B | v chunks per device (Megatron) | (p-1)(F+B+W)/v |
| ZB-H1 | 1F1B with W split off and delayed p-1 steps | (p-1)(F+B-W) |
| DualPipe | two pipelines in opposite directions, F&B overlapped | DeepSeek-V3 Table 2 |
| DualPipeV | DualPipe folded onto p/2 devices (V shape) | same, on half the devices |

``split_stages`` and ``pipeline_train`` run a real pipeline of a
``llmsys.model.Transformer`` over processes with send/recv, executing the very
op orders the simulator produces; its losses equal one-process training.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipe", "dualpipev")


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" (input gradient), "W" (weight gradient) or "BW" (full backward)
    microbatch: int
    stage: int  # position along its pipeline, 0 .. n_stages-1
    pipe: int = 0  # DualPipe feeds two pipelines in opposite directions



@dataclass(frozen=True)
class Slot:
    """One unit of work on one device: an op, or a forward and a backward run overlapped (F&B)."""

    device: int
    start: float
    end: float
    ops: tuple

    @property
    def kind(self) -> str:
        return "F&B" if len(self.ops) > 1 else self.ops[0].kind


@dataclass
class Timeline:
    schedule: str
    devices: int
    microbatches: int
    chunks: int
    slots: list = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(s.end for s in self.slots)

    def busy(self, device: int) -> float:
        return sum(s.end - s.start for s in self.slots if s.device == device)

    def bubble(self, device: int) -> float:
        """Idle time of ``device`` between the start and the end of the whole step."""
        return self.makespan - self.busy(device)

    def idle_fraction(self, device: int | None = None) -> float:
        """Share of the step a device (default: all devices together) is idle."""
        devices = range(self.devices) if device is None else [device]
        return sum(self.bubble(d) for d in devices) / (len(devices) * self.makespan)

    def peak_in_flight(self, device: int) -> int:
        """Most (microbatch, stage) activations held at once: from the F's start to the end of
        the backward that frees them (BW, or W when the backward is split)."""
        events = []
        for slot in self.slots:
            if slot.device != device:
                continue
            for op in slot.ops:
                if op.kind == "F":
                    events.append((slot.start, 1))
                elif op.kind in ("BW", "W"):
                    events.append((slot.end, -1))
        held = peak = 0
        for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # frees before allocations at a tie
            held += change
            peak = max(peak, held)
        return peak

    def chunk_of(self, op: Op) -> int:
        """Which of a device's model chunks an op belongs to (0 unless a device holds several)."""
        if self.schedule.startswith(("interleaved", "dualpipev")):
            return op.stage // self.devices
        return op.pipe

    def label(self, slot: Slot) -> str:
        """F3, BW0, ... with the chunk as a suffix where a device holds several (F3.1)."""
        several = self.schedule.startswith(("interleaved", "dualpipe"))
        return "&".join(f"{op.kind}{op.microbatch}" + (f".{self.chunk_of(op)}" if several else "")
                        for op in slot.ops)

    def orders(self) -> list[list[tuple]]:
        """Each device's ops in execution order (an overlapped pair is one entry)."""
        per_device = [[] for _ in range(self.devices)]
        for slot in sorted(self.slots, key=lambda s: s.start):
            per_device[slot.device].append(slot.ops)
        return per_device

    def text(self, unit: float | None = None) -> str:
        """One line per device, one cell per time unit (default: the shortest op)."""
        unit = unit or min(s.end - s.start for s in self.slots)
        width = math.ceil(self.makespan / unit - 1e-9)
        lines = []
        for d in range(self.devices):
            cells = ["."] * width
            for s in self.slots:
                if s.device == d:
                    first, last = round(s.start / unit), round(s.end / unit)
                    for t in range(first, last):
                        cells[t] = self.label(s) if t == first else "~"
            lines.append(f"device {d}: " + " ".join(f"{c:>5}" for c in cells))
        return "\n".join(lines)


# -----------------------------------------------------------------------------
# each schedule's per-device order


def _offset_orders(p: int, m: int, b_lag, w_lag, split: bool):
    """Device i, step x: F_x, then the backward of microbatch x - b_lag(i), then W of x - w_lag.

    1F1B is b_lag(i) = p-1-i with a fused backward (p-1-i warm-up forwards, then
    one forward and one backward in turn); ZB-H1 splits W off and runs it p-1
    steps behind, so the last stages fill their cool-down with weight gradients.
    """
    orders = []
    for i in range(p):
        order = []
        for x in range(m + w_lag + b_lag(i) + 1):
            if x < m:
                order.append(Op("F", x, i))
            if 0 <= x - b_lag(i) < m:
                order.append(Op("B" if split else "BW", x - b_lag(i), i))
            if split and 0 <= x - w_lag < m:
                order.append(Op("W", x - w_lag, i))
        orders.append(order)
    return orders


def gpipe_orders(p: int, m: int):
    return [[Op("F", x, i) for x in range(m)] + [Op("BW", x, i) for x in range(m)] for i in range(p)]


def one_f_one_b_orders(p: int, m: int):
    return _offset_orders(p, m, lambda i: p - 1 - i, 0, split=False)


def zb_h1_orders(p: int, m: int):
    return _offset_orders(p, m, lambda i: p - 1 - i, p - 1, split=True)


def interleaved_orders(p: int, m: int, v: int):
    """Megatron's interleaved 1F1B: device d holds chunks c = 0..v-1, i.e. virtual stages c·p + d.

    Microbatches go through the chunks in groups of p; device d warms up with
    (p-d-1)·2 + (v-1)·p forwards, then alternates forward and backward.
    """
    if m % p:
        raise ValueError(f"interleaved 1F1B sends microbatches in groups of p: microbatches={m} "
                         f"must be a multiple of the pipeline size p={p}")

    def unit(k, backward):
        chunk = (k // p) % v
        chunk = v - 1 - chunk if backward else chunk
        return (k // (p * v)) * p + k % p, chunk

    orders = []
    total = m * v
    for d in range(p):
        warmup = min((p - d - 1) * 2 + (v - 1) * p, total)
        forwards = [Op("F", mb, c * p + d) for mb, c in (unit(k, False) for k in range(total))]
        backwards = [Op("BW", mb, c * p + d) for mb, c in (unit(k, True) for k in range(total))]
        order = forwards[:warmup]
        for k in range(total - warmup):
            order += [forwards[warmup + k], backwards[k]]
        orders.append(order + backwards[total - warmup:])
    return orders


def _dualpipe_steps(n: int, r: int, chunks: int):
    """DualPipe's eight steps for rank r of n (deepseek-ai/DualPipe), in terms of two phases.

    Phase 0 and 1 are the two model chunks a rank holds. Items: ("F", ph),
    ("B", ph) input gradient only, ("BW", ph) full backward, ("W",) the oldest
    pending weight gradient, ("FB", ph_f, ph_b) a forward overlapped with a full backward.
    """
    steps = [("F", 0)] * ((n - r - 1) * 2)  # 1: warm up the first chunk
    steps += [("F", 0), ("F", 1)] * (r + 1)  # 2: both chunks
    steps += [("B", 1), ("W",), ("F", 1)] * (n - r - 1)  # 3: zero-bubble backward of chunk 1
    for i in range(chunks - 2 * n + r + 1):  # 4: the main loop, forward and backward overlapped
        if i == 0 and r == n - 1:  # the middle rank: kept apart to shrink the bubble
            steps += [("F", 0), ("BW", 1)]
        else:
            steps.append(("FB", 0, 1))
        steps.append(("FB", 1, 0))
    steps += [("BW", 1), ("FB", 1, 0)] * (n - r - 1)  # 5
    zero_bubble = False
    for i in range(r + 1):  # 6: drain; the second half splits off W
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        steps.append(("B" if zero_bubble else "BW", 1))
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        steps.append(("B" if zero_bubble else "BW", 0))
    steps += [("W",), ("B" if zero_bubble else "BW", 0)] * (n - r - 1)  # 7
    steps += [("W",)] * (r + 1)  # 8: the last weight gradients
    return steps


def _phase_ops(steps, where):
    """Turn phase steps into Ops; ``where[phase]`` = (pipe, stage). Microbatches count up per phase."""
    count = defaultdict(int)
    pending_w = []
    order = []

    def make(kind, phase):
        pipe, stage = where[phase]
        key = (phase, "F" if kind == "F" else "B")
        op = Op(kind, count[key], stage, pipe)
        count[key] += 1
        if kind == "B":
            pending_w.append(Op("W", op.microbatch, stage, pipe))
        return op

    for step in steps:
        if step[0] == "W":
            if pending_w:
                order.append(pending_w.pop(0))
        elif step[0] == "FB":
            order.append((make("F", step[1]), make("BW", step[2])))
        else:
            order.append(make(step[0], step[1]))
    return order


def dualpipev_orders(d: int, m: int):
    """DualPipeV on d devices: one pipeline of 2d stages folded into a V; device r holds stages r and 2d-1-r."""
    if m < 2 * d:
        raise ValueError(f"DualPipeV needs at least as many microbatches as stages: microbatches={m} < 2·devices={2 * d}")
    return [_phase_ops(_dualpipe_steps(d, r, m), {0: (0, r), 1: (0, 2 * d - 1 - r)}) for r in range(d)]


def dualpipe_orders(p: int, m: int):
    """DualPipe on p devices: pipeline 0 runs stages 0..p-1 on devices 0..p-1, pipeline 1 the reverse;
    each gets m/2 microbatches. Device r holds stage r of pipeline 0 and stage p-1-r of pipeline 1."""
    if p % 2 or m % 2 or m < 2 * p:
        raise ValueError(f"DualPipe needs an even number of devices and an even number of microbatches "
                         f"at least twice the devices; got devices={p}, microbatches={m}")
    half = p // 2
    orders = []
    for r in range(p):
        h = min(r, p - 1 - r)
        mine, other = (0, 1) if r < half else (1, 0)  # a rank's phase 0 is the pipeline entering at its end
        where = {0: (mine, r if mine == 0 else p - 1 - r), 1: (other, r if other == 0 else p - 1 - r)}
        orders.append(_phase_ops(_dualpipe_steps(half, h, m // 2), where))
    return orders


# -----------------------------------------------------------------------------
# the simulator


def _layout(schedule: str, p: int, v: int):
    """(number of stages per pipeline, stage -> device) for a schedule."""
    if schedule == "interleaved":
        return p * v, lambda stage, pipe: stage % p
    if schedule == "dualpipev":
        return 2 * p, lambda stage, pipe: stage if stage < p else 2 * p - 1 - stage
    if schedule == "dualpipe":
        return p, lambda stage, pipe: stage if pipe == 0 else p - 1 - stage
    return p, lambda stage, pipe: stage


def schedule_orders(schedule: str, devices: int, microbatches: int, chunks: int = 2):
    """Each device's order of ops (lists of Op, or (F, BW) tuples for overlapped pairs)."""
    p, m = devices, microbatches
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ValueError(f"devices and microbatches must be positive ints, got {p!r} and {m!r}")
    if schedule == "gpipe":
        return gpipe_orders(p, m)
    if schedule == "1f1b":
        return one_f_one_b_orders(p, m)
    if schedule == "zb-h1":
        return zb_h1_orders(p, m)
    if schedule == "interleaved":
        if chunks < 1:
            raise ValueError(f"chunks per device must be >= 1, got {chunks}")
        return interleaved_orders(p, m, chunks)
    if schedule == "dualpipev":
        return dualpipev_orders(p, m)
    return dualpipe_orders(p, m)


def simulate(schedule: str, devices: int, microbatches: int, chunks: int = 2, F: float = 1.0, B: float = 1.0,
             W: float = 1.0, FB: float | None = None, orders=None) -> Timeline:
    """Run a schedule's orders against their dependencies and return the timeline.

    Durations, for one microbatch through one stage: F forward, B input-gradient
    backward, W weight-gradient backward (a full backward BW takes B + W), FB an
    overlapped forward + full backward pair (DualPipe; default F + B + W, no
    overlap gain). Interleaved 1F1B cuts each device's layers into ``chunks``
    (v) chunks, so there one op takes 1/v of these. ``orders`` replaces the
    schedule's own orders (one list per device, laid out as ``schedule``'s), to
    run an order written by hand; one that deadlocks raises RuntimeError.
    """
    if min(F, B, W) < 0 or (FB is not None and FB < 0):
        raise ValueError("durations must be >= 0")
    if orders is None:
        orders = schedule_orders(schedule, devices, microbatches, chunks)
    elif len(orders) != devices:
        raise ValueError(f"orders must hold one list per device: {devices} lists, got {len(orders)}")
    n_stages, device_of = _layout(schedule, devices, chunks)
    FB = F + B + W if FB is None else FB
    scale = 1 / chunks if schedule == "interleaved" else 1
    duration = {"F": F * scale, "B": B * scale, "W": W * scale, "BW": (B + W) * scale}
    done = {}  # (kind, microbatch, stage, pipe) -> end time; "G" marks an input gradient ready

    def ready_at(op):
        """When op's inputs exist, or None if their producer has not run yet."""
        if op.kind == "F":
            deps = [("F", op.microbatch, op.stage - 1, op.pipe)] if op.stage > 0 else []
        elif op.kind in ("B", "BW"):
            last = op.stage == n_stages - 1
            deps = [("F", op.microbatch, op.stage, op.pipe)]
            deps += [] if last else [("G", op.microbatch, op.stage + 1, op.pipe)]
        else:
            deps = [("G", op.microbatch, op.stage, op.pipe)]
        if any(dep not in done for dep in deps):
            return None
        return max((done[dep] for dep in deps), default=0.0)

    timeline = Timeline(schedule, devices, microbatches, chunks if schedule == "interleaved" else 1)
    position, clock = [0] * devices, [0.0] * devices
    remaining = sum(len(o) for o in orders)
    while remaining:
        progress = False
        for d in range(devices):
            while position[d] < len(orders[d]):
                item = orders[d][position[d]]
                ops = item if isinstance(item, tuple) else (item,)
                times = [ready_at(op) for op in ops]
                if any(t is None for t in times):
                    break
                for op in ops:
                    if device_of(op.stage, op.pipe) != d:
                        raise RuntimeError(f"{schedule}: {op} is in device {d}'s order but its stage lives elsewhere")
                start = max([clock[d]] + times)
                end = start + (FB if len(ops) > 1 else duration[ops[0].kind])
                for op in ops:
                    done[(op.kind, op.microbatch, op.stage, op.pipe)] = end
                    if op.kind in ("B", "BW"):
                        done[("G", op.microbatch, op.stage, op.pipe)] = end
                timeline.slots.append(Slot(d, start, end, ops))
                clock[d] = end
                position[d] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {d: str(orders[d][position[d]]) for d in range(devices) if position[d] < len(orders[d])}
            raise RuntimeError(f"{schedule} deadlocks: each device waits on an op no one can run: {stuck}")
    return timeline


# -----------------------------------------------------------------------------
# the formulas


def bubble_formula(schedule: str, p: int, F: float = 1.0, B: float = 1.0, W: float = 1.0, FB: float | None = None,
                   chunks: int = 2) -> float:
    """Idle time per device of a schedule (Zero Bubble Table 2; DeepSeek-V3 Table 2).

    B is the input-gradient backward; DeepSeek's tables write B for the full
    backward, so their (F&B + B - 3W) is F&B + B - 2W here. For DualPipe p is the
    device count; for DualPipeV, devices = PP/2 run the same as DualPipe on PP.
    """
    FB = F + B + W if FB is None else FB
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * (F + B + W)
    if schedule == "interleaved":
        return (p - 1) * (F + B + W) / chunks
    if schedule == "zb-h1":
        return (p - 1) * (F + B - W)
    if schedule == "dualpipe":
        return (p / 2 - 1) * (FB + B - 2 * W)
    if schedule == "dualpipev":
        return (p - 1) * (FB + B - 2 * W)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")


# -----------------------------------------------------------------------------
# the picture


COLOURS = {"F": "#4c72b0", "B": "#64b5cd", "BW": "#55a868", "W": "#dd8452", "F&B": "#8172b2"}


def plot_timeline(timeline: Timeline, ax=None, title: str | None = None, show_labels: bool = True):
    """Draw a timeline: one row per device, one box per op (F blue, B teal, BW green, W orange, F&B purple)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        per_device = max(sum(s.device == d for s in timeline.slots) for d in range(timeline.devices))
        _, ax = plt.subplots(figsize=(min(14, 3 + 0.3 * per_device), 0.45 * timeline.devices + 1))
    shortest = min(s.end - s.start for s in timeline.slots)
    for s in timeline.slots:
        second_chunk = len(s.ops) == 1 and timeline.chunk_of(s.ops[0]) % 2 == 1  # lighter: a device's other chunk
        ax.broken_barh([(s.start, s.end - s.start)], (s.device - 0.4, 0.8), facecolors=COLOURS[s.kind],
                       edgecolors="white", alpha=0.55 if second_chunk else 1.0)
        if show_labels and s.end - s.start >= shortest:
            label = "&".join(str(op.microbatch) for op in s.ops)
            ax.text((s.start + s.end) / 2, s.device, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(timeline.devices), [f"device {d}" for d in range(timeline.devices)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time")
    kinds = sorted({s.kind for s in timeline.slots}, key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7)
    ax.set_title(title or f"{timeline.schedule}: p={timeline.devices}, m={timeline.microbatches}, "
                          f"idle {timeline.idle_fraction():.1%}")
    return ax


# -----------------------------------------------------------------------------
# a real pipeline over processes


class PipelineStage(nn.Module):
    """A run of consecutive blocks of a ``llmsys.model.Transformer``; the first stage also
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
        from llmsys.model import rope_tables

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


def run_schedule(stage: PipelineStage, order, inputs, targets, rank: int, world_size: int, group=None):
    """Execute one device's op order for one batch: forward, backward (split or not), sends and receives.

    ``inputs``/``targets`` are lists of microbatches (needed on the first / last
    stage). Activations go forward with isend/recv, gradients backward; sends
    never block, so any order the simulator accepts runs without deadlock.
    Returns (summed loss on the last stage else None, [(kind, microbatch, start, end)]).
    """
    m = len(inputs)
    prev_rank, next_rank = rank - 1, rank + 1
    dtype = next(stage.parameters()).dtype
    params = list(stage.parameters())
    state, sends, log = {}, [], []
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
                dist.recv(x, prev_rank, group=group)
                x.requires_grad_()
                start = time.perf_counter() - t0  # waiting for the input is idle time, not work
            out = stage(x)
            if stage.is_last:
                out = F.cross_entropy(out.flatten(0, 1), targets[mb].flatten()) / m  # mean over the batch
                total_loss += out.detach()
            else:
                sends.append(dist.isend(out.detach().contiguous(), next_rank, group=group))
            state[mb] = (x, out)
        else:
            x, out = state[mb][:2]
            grad_out = None
            if op.kind in ("B", "BW") and not stage.is_last:
                grad_out = torch.empty_like(out)
                dist.recv(grad_out, next_rank, group=group)
                start = time.perf_counter() - t0
                state[mb] = (x, out, grad_out)
            elif op.kind == "W" and not stage.is_last:
                grad_out = state[mb][2]
            if op.kind == "BW":
                torch.autograd.backward(out, grad_out)
                input_grad = None if stage.is_first else x.grad
                del state[mb]
            elif op.kind == "B":  # input gradient only; keep the graph for W
                input_grad = None if stage.is_first else torch.autograd.grad(out, x, grad_out, retain_graph=True)[0]
                if stage.is_last:
                    state[mb] = (x, out, None)
            else:  # W: weight gradients only
                torch.autograd.backward(out, grad_out, inputs=params)
                input_grad = None
                del state[mb]
            if input_grad is not None:
                sends.append(dist.isend(input_grad.contiguous(), prev_rank, group=group))
        log.append((op.kind, mb, start, time.perf_counter() - t0))
    for request in sends:
        request.wait()
    return (total_loss if stage.is_last else None), log


def pipeline_train(rank: int, world_size: int, model: nn.Module, batches, schedule: str = "1f1b",
                   microbatches: int = 4, lr: float = 0.1) -> dict:
    """Worker: train ``model`` on ``batches`` [(x, y), ...] as a world_size-stage pipeline with SGD.

    Every rank receives the same full model and keeps its stage. Returns this
    rank's per-step losses (last rank), its stage's final parameters and the
    op log of the last step.
    """
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
                                 rank, world_size)
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
