"""The simulator: run each device's order against the ops' dependencies with given durations;
and the closed-form bubble of each schedule to check it against."""

from __future__ import annotations

from llmsys.parallel.pipeline.schedules import SCHEDULES, Slot, Timeline, schedule_orders


def _layout(schedule: str, p: int, v: int):
    """(number of stages per pipeline, stage -> device) for a schedule."""
    if schedule == "interleaved":
        return p * v, lambda stage, pipe: stage % p
    if schedule == "dualpipev":
        return 2 * p, lambda stage, pipe: stage if stage < p else 2 * p - 1 - stage
    if schedule == "dualpipe":
        return p, lambda stage, pipe: stage if pipe == 0 else p - 1 - stage
    return p, lambda stage, pipe: stage


def simulate(schedule: str, devices: int, microbatches: int, chunks: int = 2, f_time: float = 1.0,
             b_time: float = 1.0, w_time: float = 1.0, fb_time: float | None = None, orders=None) -> Timeline:
    """Run a schedule's orders against their dependencies and return the timeline.

    Durations, for one microbatch through one stage: ``f_time`` forward (F), ``b_time``
    input-gradient backward (B), ``w_time`` weight-gradient backward (W; a full backward
    BW takes B + W), ``fb_time`` an overlapped forward + full backward pair (DualPipe;
    default F + B + W, no overlap gain). Interleaved 1F1B cuts each device's layers into ``chunks``
    (v) chunks, so there one op takes 1/v of these. ``orders`` replaces the
    schedule's own orders (one list per device, laid out as ``schedule``'s), to
    run an order written by hand; one that deadlocks raises RuntimeError.
    """
    if min(f_time, b_time, w_time) < 0 or (fb_time is not None and fb_time < 0):
        raise ValueError("durations must be >= 0")
    if orders is None:
        orders = schedule_orders(schedule, devices, microbatches, chunks)
    elif len(orders) != devices:
        raise ValueError(f"orders must hold one list per device: {devices} lists, got {len(orders)}")
    n_stages, device_of = _layout(schedule, devices, chunks)
    fb_time = f_time + b_time + w_time if fb_time is None else fb_time
    scale = 1 / chunks if schedule == "interleaved" else 1
    duration = {"F": f_time * scale, "B": b_time * scale, "W": w_time * scale, "BW": (b_time + w_time) * scale}
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
                end = start + (fb_time if len(ops) > 1 else duration[ops[0].kind])
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


def bubble_formula(schedule: str, p: int, f_time: float = 1.0, b_time: float = 1.0, w_time: float = 1.0,
                   fb_time: float | None = None, chunks: int = 2) -> float:
    """Idle time per device of a schedule (Zero Bubble Table 2; DeepSeek-V3 Table 2).

    With F, B, W, F&B the durations ``f_time``, ``b_time``, ``w_time``, ``fb_time``: B is the
    input-gradient backward; DeepSeek's tables write B for the full backward, so their
    (F&B + B - 3W) is F&B + B - 2W here. For DualPipe p is the
    device count; for DualPipeV, devices = PP/2 run the same as DualPipe on PP.
    """
    f, b, w = f_time, b_time, w_time
    fb = f + b + w if fb_time is None else fb_time
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * (f + b + w)
    if schedule == "interleaved":
        return (p - 1) * (f + b + w) / chunks
    if schedule == "zb-h1":
        return (p - 1) * (f + b - w)
    if schedule == "dualpipe":
        return (p / 2 - 1) * (fb + b - 2 * w)
    if schedule == "dualpipev":
        return (p - 1) * (fb + b - 2 * w)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
