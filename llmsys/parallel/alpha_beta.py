"""Communication measured: time real collectives and fit the α–β model.

The ring model of ``llmsys.core.accounting.collective_bytes`` says how many bytes a rank
sends; how long that takes depends on the transport. The classic α–β (Hockney)
model prices one collective as

    t(n) = α + β · bytes_sent(n)

with α the fixed latency of a call and 1/β the bandwidth a rank achieves. Here the
real collectives of ``torch.distributed`` run on this machine's backend (gloo on a
CPU) over a range of message sizes, and a least-squares line gives α and β per
collective. The fit is *measured* evidence; the ring formula alone is *modelled*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmsys.core.accounting import collective_bytes
from llmsys.parallel.collectives import run_collective

FIT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DEFAULT_SIZES = tuple(2**k for k in range(10, 23, 2))  # 1 KiB .. 4 MiB of fp32 values, in bytes


@dataclass(frozen=True)
class Fit:
    op: str
    alpha_s: float  # latency per call, seconds
    beta_s_per_byte: float  # seconds per byte a rank sends
    r2: float  # share of the variance the line explains

    @property
    def bandwidth(self) -> float:
        """Bytes per second a rank sends, 1/β."""
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    def predict(self, size_bytes: float, world_size: int) -> float:
        """Seconds for one call over a full tensor of ``size_bytes``, by the fitted line."""
        return self.alpha_s + self.beta_s_per_byte * collective_bytes(self.op, size_bytes, world_size)


def fit_line(sent_bytes, seconds, op: str = "") -> Fit:
    """Least-squares α, β of t = α + β·bytes (both clamped at zero, as negative costs mean noise)."""
    x = torch.as_tensor(sent_bytes, dtype=torch.float64)
    y = torch.as_tensor(seconds, dtype=torch.float64)
    if x.numel() < 2 or x.numel() != y.numel() or torch.unique(x).numel() < 2:
        raise ValueError("need at least two different message sizes, one time each")
    A = torch.stack([torch.ones_like(x), x], dim=1)
    alpha, beta = torch.linalg.lstsq(A, y[:, None]).solution.flatten().tolist()
    residual = y - (alpha + beta * x)
    r2 = 1.0 - (residual.pow(2).sum() / (y - y.mean()).pow(2).sum().clamp_min(1e-30)).item()
    return Fit(op, max(alpha, 0.0), max(beta, 0.0), r2)


def time_collectives(rank: int, world_size: int, ops=FIT_OPS, sizes=DEFAULT_SIZES, repeats: int = 5) -> dict:
    """A ``launch`` worker: {op: [(size_bytes, seconds)]} for every op and full size.

    Every rank times the same calls after a warm-up and a barrier; rank 0's fastest
    repeat is returned (a collective ends on every rank at about the same time, and
    the minimum filters out moments when other processes held the cores)."""
    results = {}
    for op in ops:
        rows = []
        for size in sizes:
            numel = max(size // 4 // world_size, 1) * world_size  # divisible, as the collectives need
            run_collective(op, numel)  # warm-up: buffers and connections
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                run_collective(op, numel)
                times.append(time.perf_counter() - start)
            rows.append((numel * 4, min(times)))
        results[op] = rows
    return results


def fit_all(timings: dict, world_size: int) -> dict[str, Fit]:
    """α–β fits from ``time_collectives`` output, against the bytes a ring sends per rank."""
    return {op: fit_line([collective_bytes(op, size, world_size) for size, _ in rows], [t for _, t in rows], op)
            for op, rows in timings.items()}


def time_send_recv(rank: int, world_size: int, sizes=DEFAULT_SIZES, repeats: int = 5) -> list[tuple[int, float]]:
    """A ``launch`` worker for two ranks: (bytes, seconds) of one point-to-point send per size, half the fastest
    ping-pong round trip (rank 0 sends, rank 1 sends the same bytes back), on rank 0; rank 1 returns []. Fit it
    with ``fit_line(bytes, seconds, "send")``."""
    if world_size != 2:
        raise ValueError(f"a ping-pong runs on two ranks, got world_size={world_size}")
    rows = []
    for size in sizes:
        x = torch.zeros(max(size // 4, 1))
        times = []
        for i in range(repeats + 1):  # the first round trip warms buffers and connections up
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            if i:
                times.append((time.perf_counter() - start) / 2)
        rows.append((x.numel() * 4, min(times)))
    return rows if rank == 0 else []
