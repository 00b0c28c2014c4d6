"""What serving a trace produced: each request's result and timings (``Result``), each step's record
(``StepRecord``), and the run's summary (``Report``: throughput, TTFT / TPOT / ITL percentiles, KV use,
prefix hits), printed side by side with ``summary_table``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Result:
    id: object
    status: str  # "finished", "rejected", "failed" (sampling it failed) or "unfinished" (stopped at max_steps)
    reason: str = ""
    prompt_len: int = 0
    output: list[int] = field(default_factory=list)
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each output token was produced
    preemptions: int = 0
    cached_tokens: int = 0
    ttft_slo: float | None = None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def finish_time(self) -> float | None:
        return self.token_times[-1] if self.status == "finished" else None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival → first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first one, averaged over the request (None with one token)."""
        if self.finish_time is None or len(self.output) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.output) - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gap before each token after the first (a stalled step shows up here)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class StepRecord:
    """What one engine step did: for the timeline widget and the memory metrics."""
    index: int
    start: float
    duration: float
    chunks: list[tuple[object, int, str]]  # (request id, tokens, "prefill" | "decode")
    padding: int  # rows computed for requests that had already finished (static batching)
    admitted: list
    preempted: list
    finished: list
    blocks_used: int
    blocks_cached: int  # blocks indexed by the prefix cache (in use or free)
    slots_filled: int  # distinct token slots holding keys and values
    running: int
    waiting: int


def percentile(values, q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; nan for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return math.nan
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


@dataclass
class Report:
    name: str
    results: list[Result]  # one per request, in trace order
    steps: list[StepRecord]
    block_size: int
    num_blocks: int
    prefill_computed: int
    prefill_cached: int

    @property
    def by_id(self) -> dict:
        """Results by request id (for a repeated id, the first request's, which was served)."""
        out = {}
        for r in self.results:
            out.setdefault(r.id, r)
        return out

    def summary(self) -> dict:
        done = [r for r in self.results if r.status == "finished"]
        out_tokens = sum(len(r.output) for r in done)
        start = min((r.arrival for r in done), default=0.0)
        elapsed = max((r.finish_time for r in done), default=0.0) - start
        allocated = sum(s.blocks_used for s in self.steps) * self.block_size
        filled = sum(s.slots_filled for s in self.steps)
        with_slo = [r for r in done if r.ttft_slo is not None]
        prompt_total = self.prefill_computed + self.prefill_cached
        return {
            "config": self.name,
            "requests": len(self.results),
            "finished": len(done),
            "rejected": sum(r.status == "rejected" for r in self.results),
            "output tokens": out_tokens,
            "steps": len(self.steps),
            "elapsed s": elapsed,
            "throughput tok/s": out_tokens / elapsed if elapsed > 0 else math.nan,
            "TTFT p50 s": percentile([r.ttft for r in done], 50),
            "TTFT p99 s": percentile([r.ttft for r in done], 99),
            "TPOT p50 s": percentile([r.tpot for r in done], 50),
            "TPOT p99 s": percentile([r.tpot for r in done], 99),
            "ITL p99 s": percentile([gap for r in done for gap in r.itl], 99),
            "KV used blocks (mean)": allocated / self.block_size / max(len(self.steps), 1),
            "KV used blocks (peak)": max((s.blocks_used for s in self.steps), default=0),
            "KV waste": 1 - filled / allocated if allocated else 0.0,
            "prefix hit rate": self.prefill_cached / prompt_total if prompt_total else 0.0,
            "prefill tokens computed": self.prefill_computed,
            "preemptions": sum(r.preemptions for r in done),
            "TTFT SLO met": (sum(r.ttft <= r.ttft_slo for r in with_slo) / len(with_slo)) if with_slo else math.nan,
        }


_TABLE = [  # summary key, header, width, format
    ("config", "config", 29, "s"), ("throughput tok/s", "tok/s", 7, ".0f"), ("x first", "×first", 6, ".2f"),
    ("TTFT p50 s", "TTFT50", 7, ".2f"), ("TTFT p99 s", "TTFT99", 7, ".2f"), ("TPOT p50 s", "TPOT50", 7, ".4f"),
    ("TPOT p99 s", "TPOT99", 7, ".4f"), ("ITL p99 s", "ITL99", 7, ".4f"), ("KV used blocks (mean)", "KVblk", 6, ".1f"),
    ("KV waste", "waste", 6, ".1%"), ("prefix hit rate", "hit", 6, ".1%"), ("preemptions", "pre", 4, "d"),
    ("steps", "steps", 6, "d"),
]


def summary_table(summaries: list[dict]) -> str:
    """Reports' summaries side by side, one line each; ×first is throughput relative to the first line."""
    base = summaries[0]["throughput tok/s"]
    lines = [" ".join(h.ljust(w) if fmt == "s" else h.rjust(w) for _, h, w, fmt in _TABLE)]
    for s in summaries:
        row = {**s, "x first": s["throughput tok/s"] / base}
        lines.append(" ".join(format(row[key], (("<" if fmt == "s" else ">") + str(w) + fmt))
                              for key, _, w, fmt in _TABLE))
    return "\n".join(lines)
