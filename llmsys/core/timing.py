"""The course's timing helpers: the median time of a call, with GPU work waited for; a process's CPU time."""

from __future__ import annotations

import resource
import statistics
import time

import torch

from llmsys.core import device as _device


def median_seconds(fn, reps: int = 5, warmup: int = 1, device: torch.device | str | None = None,
                   clock: str = "wall") -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, after ``warmup`` uncounted calls.

    On CUDA each call is timed by CUDA events recorded around it (the GPU's own clock, so a
    kernel's time is not hidden by asynchronous launch); elsewhere by a wall clock, or with
    ``clock="cpu"`` by this process's CPU time (``time.process_time``: steady on a shared machine)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
        raise ValueError(f"reps must be a positive int, got {reps!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    dev = torch.device(device) if device is not None else _device.device()
    for _ in range(warmup):
        fn()
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        return statistics.median(times)
    now = time.perf_counter if clock == "wall" else time.process_time
    for _ in range(reps):
        start = now()
        fn()
        times.append(now() - start)
    return statistics.median(times)


def cpu_seconds() -> float:
    """CPU seconds this process has used, user and system, as the operating system counts them.

    Steadier than a wall clock on a shared machine (waiting for a core costs none), and a
    measure the grader takes of a process it runs itself."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
