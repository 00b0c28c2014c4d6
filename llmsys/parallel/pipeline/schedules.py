"""Pipeline schedules as data: the ops, each device's order of them, and the timeline a run of
those orders produces (see the package docstring for the schedules)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

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
