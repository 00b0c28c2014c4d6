"""A load generator for any OpenAI-compatible server: chat sessions arriving as a Poisson process.

The trace (``ChatTrace``): every request starts with one shared system prompt; user messages
are slices of English text with a length uniform in ``user_words``; answers are capped at
``max_tokens`` drawn from an exponential distribution (mean ``mean_output``, clipped to
``output_len``). Half the arrivals (``follow_up``) continue an earlier session whose last
answer has come back: they resend the whole conversation, system prompt, every earlier
turn and the server's actual answers, plus a new user message, as chat clients do. A
server with prefix caching computes only the new part.

Each request streams (``stream=True``, ``include_usage``) through the official async
``openai`` client; from the chunks' arrival times come TTFT (first content), ITL (gaps
between content chunks) and TPOT ((last − first) / (tokens − 1)). Goodput counts the
requests per second that met both SLOs (TTFT ≤ ``ttft_slo``, TPOT ≤ ``tpot_slo``), the
figure serving papers optimise (DistServe, Zhong et al. 2024, arXiv 2401.09670).

Load goes to loopback addresses only; every run is bounded in requests and seconds.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from llmsys.serving.report import percentile

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_loopback(base_url: str) -> None:
    host = urllib.parse.urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"{base_url} is not a loopback address; this load generator only loads servers on "
                         f"this machine (use http://127.0.0.1:PORT/v1)")


@dataclass
class ChatTrace:
    """Where the requests' words and lengths come from (see the module docstring)."""
    seed: int = 0
    system_words: int = 60
    user_words: tuple[int, int] = (8, 40)
    mean_output: int = 48
    output_len: tuple[int, int] = (8, 128)
    follow_up: float = 0.5  # share of arrivals that continue a finished session
    max_turns: int = 4
    rng: random.Random = field(init=False)

    def __post_init__(self):
        from llmsys.core import zoo

        self.rng = random.Random(self.seed)
        self.words = zoo.corpus().split()
        self.system = "You are a concise assistant. Answer from this reference text: " + self.text(self.system_words)

    def text(self, n: int) -> str:
        start = self.rng.randrange(len(self.words) - n)
        return " ".join(self.words[start:start + n])

    def user_message(self) -> str:
        return self.text(self.rng.randint(*self.user_words))

    def max_tokens(self) -> int:
        low, high = self.output_len
        return int(min(high, max(low, low + self.rng.expovariate(1 / max(self.mean_output - low, 1)))))


@dataclass
class Outcome:
    ttft: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


async def one_request(client, model: str, messages: list[dict], max_tokens: int) -> tuple[Outcome, str]:
    """Stream one chat completion; return its timings and the answer's text."""
    out, pieces, times = Outcome(), [], []
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
    except Exception as e:  # a refused (429) or failed request counts against goodput, and the run goes on
        out.error = f"{type(e).__name__}: {e}"[:200]
        return out, ""
    if times:
        out.ttft = times[0] - start
        out.itl = [b - a for a, b in zip(times, times[1:])]
        if out.tokens > 1:
            out.tpot = (times[-1] - times[0]) / (out.tokens - 1)
    return out, "".join(pieces)


async def run_rate(base_url: str, model: str, rate: float, n_requests: int, trace: ChatTrace,
                   max_seconds: float = 120.0, ttft_slo: float = 1.0, tpot_slo: float = 0.1) -> dict:
    """``n_requests`` arriving at ``rate`` per second (Poisson); stops sending after ``max_seconds``
    and cancels what is still running at twice that."""
    import openai

    check_loopback(base_url)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=max_seconds)
    finished_sessions: list[list[dict]] = []
    outcomes: list[Outcome] = []

    async def session_turn(messages):
        max_tokens = trace.max_tokens()
        out, answer = await one_request(client, model, messages, max_tokens)
        outcomes.append(out)
        if answer and len(messages) // 2 < trace.max_turns:
            finished_sessions.append(messages + [{"role": "assistant", "content": answer}])

    before = scrape(base_url)
    start, tasks = time.perf_counter(), []
    for _ in range(n_requests):
        await asyncio.sleep(trace.rng.expovariate(rate))
        if time.perf_counter() - start > max_seconds:
            break
        if finished_sessions and trace.rng.random() < trace.follow_up:
            history = finished_sessions.pop(trace.rng.randrange(len(finished_sessions)))
        else:
            history = [{"role": "system", "content": trace.system}]
        tasks.append(asyncio.create_task(session_turn(history + [{"role": "user", "content": trace.user_message()}])))
    done, late = await asyncio.wait(tasks, timeout=max(1.0, 2 * max_seconds - (time.perf_counter() - start)))
    for task in late:
        task.cancel()
    elapsed = time.perf_counter() - start
    after = scrape(base_url)
    hits = after.get("llmsys_prefix_cache_hit_tokens_total", 0) - before.get("llmsys_prefix_cache_hit_tokens_total", 0)
    prompt = after.get("llmsys_prompt_tokens_total", 0) - before.get("llmsys_prompt_tokens_total", 0)
    return {"rate": rate, **summarize(outcomes, len(tasks), len(late), elapsed, ttft_slo, tpot_slo),
            "prefix_hit_rate": hits / prompt if prompt else float("nan")}


def summarize(outcomes: list[Outcome], sent: int, late: int, elapsed: float, ttft_slo: float, tpot_slo: float) -> dict:
    """Latency percentiles, throughput and goodput of ``sent`` requests (``late`` of them cancelled unfinished)."""
    ok = [o for o in outcomes if not o.error]
    good = [o for o in ok if o.ttft is not None and o.ttft <= ttft_slo and (o.tpot is None or o.tpot <= tpot_slo)]
    return {
        "sent": sent, "ok": len(ok), "failed": len(outcomes) - len(ok) + late,
        "elapsed_s": elapsed, "tok_s": sum(o.tokens for o in ok) / elapsed,
        "ttft_p50": percentile([o.ttft for o in ok], 50), "ttft_p95": percentile([o.ttft for o in ok], 95),
        "ttft_p99": percentile([o.ttft for o in ok], 99),
        "tpot_p50": percentile([o.tpot for o in ok], 50), "tpot_p99": percentile([o.tpot for o in ok], 99),
        "itl_p50": percentile([g for o in ok for g in o.itl], 50),
        "itl_p99": percentile([g for o in ok for g in o.itl], 99),
        "slo_met": len(good) / max(sent, 1), "goodput_rps": len(good) / elapsed,
    }


def scrape(base_url: str) -> dict:
    """The server's Prometheus counters without labels (empty if it has no /metrics, as some servers do)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(root + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {name: float(value) for name, value in re.findall(r"^([A-Za-z_:]+) ([0-9.e+-]+)$", text, re.M)}


def sweep(base_url: str, model: str, rates, n_requests: int, max_seconds: float = 120.0, seed: int = 0,
          progress: bool = True, trace: dict | None = None, **slo) -> list[dict]:
    """``run_rate`` at each rate, lowest first, each with a ``ChatTrace(seed, **trace)``."""
    from tqdm.auto import tqdm

    rows = []
    for rate in tqdm(list(rates), desc="load sweep", disable=not progress):
        coroutine = run_rate(base_url, model, rate, n_requests, ChatTrace(seed=seed, **(trace or {})), max_seconds,
                             **slo)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: a script
            rows.append(asyncio.run(coroutine))
            continue
        with ThreadPoolExecutor(1) as pool:  # a notebook runs its own loop: run ours in a thread beside it
            rows.append(pool.submit(asyncio.run, coroutine).result())
    return rows


def sweep_table(rows: list[dict]) -> str:
    head = (f"{'rate/s':>7} {'ok':>4} {'fail':>4} {'tok/s':>7} {'TTFT50':>7} {'TTFT99':>7} {'TPOT50':>7} "
            f"{'TPOT99':>7} {'ITL99':>7} {'SLO met':>7} {'goodput':>7} {'hit':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['rate']:>7.2f} {r['ok']:>4d} {r['failed']:>4d} {r['tok_s']:>7.1f} {r['ttft_p50']:>7.3f} "
                     f"{r['ttft_p99']:>7.3f} {r['tpot_p50']:>7.4f} {r['tpot_p99']:>7.4f} {r['itl_p99']:>7.4f} "
                     f"{r['slo_met']:>7.0%} {r['goodput_rps']:>7.2f} {r['prefix_hit_rate']:>6.1%}")
    return "\n".join(lines)
