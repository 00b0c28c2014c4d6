"""The engine's own thread beside a server's event loop.

The HTTP handlers live on an asyncio event loop; the model runs in one thread
that owns the ``Engine`` and nothing else touches it. Handlers hand requests and
aborts over through an inbox; after every step the thread sends each request's
new tokens back to its handler's asyncio queue (``call_soon_threadsafe``).
torch releases the GIL inside its kernels, so the event loop keeps answering
(new requests, streams, /metrics) while a step runs.

Admission control: at most ``max_num_seqs`` requests run and ``max_queue`` more
wait; a request beyond that is refused at once (the server answers 429) rather
than queued without bound, and a request once accepted is always served to its
end, aborted by its client, or failed when the server stops.

Failures stay as small as they can: a request whose sampling fails ends alone
(the engine's per-request isolation); a step that fails as a whole fails the
requests in it; and if the thread itself dies, every request in flight is ended
with an error, ``alive`` turns False (the server's /health answers 503) and
``on_death`` is called (the server then exits non-zero) rather than leaving
clients waiting for tokens that will never come. ``drain`` stops admitting new
requests (the server answers 503) while those in flight go on.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmsys.serving.engine import Engine
from llmsys.serving.trace import Request

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class QueueFull(Exception):
    """Every running slot and queue place is taken; ``retry_after`` is a guess in seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is at capacity; retry in {retry_after} s")
        self.retry_after = retry_after


class Unavailable(Exception):
    """The server is shutting down (or its engine died): no request is admitted any more."""


@dataclass
class Handle:
    """One request's (or one choice's, with n > 1) channel from the engine thread back to its handler: items
    are (choice index, new token ids, their log-probabilities or None, finish reason or None, error or None).
    The n choices of one request share one queue."""
    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0
    seq: object = None
    sent: int = 0

    def push(self, tokens: list[int], finish: str | None = None, error: str | None = None, logprobs=None) -> None:
        """From the engine thread; a handler whose event loop has closed no longer listens."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, tokens, logprobs, finish, error))
        except RuntimeError:  # the event loop is closed: the server has gone
            pass


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers can share a process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("llmsys_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("llmsys_requests_waiting", "Accepted requests not running yet", registry=r)
        self.kv_used = Gauge("llmsys_kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.kv_free = Gauge("llmsys_kv_blocks_free", "KV cache blocks free (cached prefixes included)", registry=r)
        self.prefix_hits = Counter("llmsys_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                   registry=r)
        self.prompt_tokens = Counter("llmsys_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generated = Counter("llmsys_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("llmsys_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in ("finished", "aborted", "failed", "refused"):
            self.requests.labels(outcome)  # every series exists from the start, at 0
        self.ttft = Histogram("llmsys_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("llmsys_inter_token_latency_seconds", "Gap between a request's tokens", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("llmsys_e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=LATENCY_BUCKETS)


class EngineLoop:
    def __init__(self, engine: Engine, max_num_seqs: int, max_queue: int):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine, self.max_num_seqs, self.max_queue = engine, max_num_seqs, max_queue
        self.metrics = Metrics()
        self.metrics.kv_free.set(engine.blocks.num_free)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.active: dict[int, Handle] = {}  # engine thread only
        self.in_flight = 0  # accepted and not done; changed under the lock
        self.lock = threading.Lock()
        self.mean_latency = 1.0  # seconds per request, a moving average, for Retry-After
        self.stopping = False
        self.draining = False
        self.alive = True  # False once the thread has died or stopped
        self.on_death = lambda: None  # called from the engine thread if it dies
        self.death: str | None = None
        self.hits_counted = 0  # the scheduler's prefix-cache hits already in the counter
        self.deferred: list = []  # inbox messages other than new requests, taken while a step was paused
        engine.arrivals = self._arrived  # a step computing prompt tokens pauses for newcomers' prompts
        engine.on_step = lambda record: self._deliver()  # tokens go out after every step, paused-for ones too
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, handles: list[Handle]) -> None:
        """Accept a checked request's choices (one handle each, one prompt), or raise Unavailable or QueueFull.
        Each choice takes a place: n choices run as n sequences."""
        with self.lock:
            if self.draining or self.stopping or not self.alive:
                self.metrics.requests.labels("refused").inc()
                raise Unavailable("the server is shutting down; retry on another replica or after it restarts"
                                  if self.alive else f"the engine has stopped ({self.death}); the server is exiting")
            if self.in_flight + len(handles) > self.max_num_seqs + self.max_queue:
                self.metrics.requests.labels("refused").inc()
                waiting = max(self.in_flight - self.max_num_seqs + 1, 1)
                raise QueueFull(max(1, math.ceil(self.mean_latency * waiting / self.max_num_seqs)))
            self.in_flight += len(handles)
        self.inbox.put(("add", handles))
        self.wake.set()

    def abort(self, handle: Handle, outcome: str = "aborted") -> None:
        """End a request early: its client went away ("aborted"), or its answer is complete ("finished",
        at a stop string)."""
        self.inbox.put((outcome, handle))
        self.wake.set()

    def drain(self) -> None:
        """Admit nothing new; requests in flight go on."""
        self.draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is still in flight (the server drained what it could first) and end the thread."""
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # noqa: BLE001 - a bug here must not leave clients and /health waiting
            self.death = traceback.format_exc(limit=2).strip().splitlines()[-1]
            print(f"the engine thread died:\n{traceback.format_exc()}", flush=True)
            self.alive = False
            for handle in list(self.active.values()):
                self._end(handle, "failed", finish="error", error=f"the engine stopped: {self.death}")
            self.on_death()
        self.alive = False

    def _serve(self) -> None:
        while True:
            self._take_inbox()
            if self.stopping:
                for handle in list(self.active.values()):
                    self._end(handle, "aborted", finish="error",
                              error="the server is shutting down and this request ran out of drain time; retry")
                return
            if not self.engine.has_work():
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                self.engine.step(time.perf_counter())
            except Exception as e:  # noqa: BLE001 - fail the requests of this step, keep serving the rest
                print(f"an engine step failed:\n{traceback.format_exc()}", flush=True)
                for handle in list(self.active.values()):
                    if handle.seq.status == "running":
                        self._end(handle, "failed", finish="error", error=f"the engine step failed: {type(e).__name__}")
                continue

    def _arrived(self, elapsed: float) -> bool:
        """Called between the layers of a paused step: take the new requests in, and say whether any came."""
        waiting = len(self.engine.scheduler.waiting)
        self._take_inbox(adds_only=True)
        return len(self.engine.scheduler.waiting) > waiting

    def _take_inbox(self, adds_only: bool = False) -> None:
        """Act on the inbox's messages. With ``adds_only`` (a step is paused) the others wait for the next
        call: an abort would free blocks that the paused step is still writing."""
        while True:
            if self.deferred and not adds_only:
                kind, handle = self.deferred.pop(0)
            else:
                try:
                    kind, handle = self.inbox.get_nowait()
                except queue.Empty:
                    break
            if adds_only and kind != "add":
                self.deferred.append((kind, handle))
            elif kind == "add":
                handles = handle
                self.active.update((id(h), h) for h in handles)
                reason = self.engine.check_group([h.request for h in handles])
                if reason:  # the handler checked it: only a bug gets here, and it fails this request alone
                    for h in handles:
                        self._end(h, "failed", finish="error", error=reason)
                    continue
                for h, seq in zip(handles, self.engine.submit_group([h.request for h in handles])):
                    h.seq = seq
                self.metrics.prompt_tokens.inc(len(handles[0].request.prompt))  # computed once for all choices
            elif id(handle) in self.active:
                self._end(handle, kind, finish="stop" if kind == "finished" else None)
        self._gauges()

    def _deliver(self) -> None:
        for handle in list(self.active.values()):
            seq = handle.seq
            new = seq.output[handle.sent:]
            if new:
                times = seq.token_times
                if handle.sent == 0:
                    self.metrics.ttft.observe(times[0] - handle.request.arrival)
                for i in range(max(handle.sent, 1), len(seq.output)):
                    self.metrics.itl.observe(times[i] - times[i - 1])
                self.metrics.generated.inc(len(new))
                handle.sent = len(seq.output)
            logprobs = seq.logprobs[len(seq.output) - len(new):] if seq.request.logprobs is not None else None
            if seq.status == "failed":
                self._end(handle, "failed", new, "error", seq.error, logprobs)
            elif seq.status == "finished":
                self._end(handle, "finished", new, seq.finish_reason, logprobs=logprobs)
            elif new:
                handle.push(new, logprobs=logprobs)
        self._gauges()

    def _end(self, handle: Handle, outcome: str, tokens=(), finish: str | None = None, error: str | None = None,
             logprobs=None):
        del self.active[id(handle)]
        if handle.seq is not None and handle.seq.status in ("waiting", "running"):
            self.engine.abort(handle.seq)
        handle.push(list(tokens), finish or outcome, error, logprobs)
        self.metrics.requests.labels(outcome).inc()
        if outcome == "finished" and handle.seq is not None and handle.seq.token_times:
            latency = handle.seq.token_times[-1] - handle.request.arrival
            self.metrics.e2e.observe(latency)
            self.mean_latency = 0.9 * self.mean_latency + 0.1 * latency
        with self.lock:
            self.in_flight -= 1

    def _gauges(self) -> None:
        s, m = self.engine.scheduler, self.metrics
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting))
        m.kv_used.set(self.engine.blocks.allocator.num_used)
        m.kv_free.set(self.engine.blocks.num_free)
        if s.prefill_cached > self.hits_counted:
            m.prefix_hits.inc(s.prefill_cached - self.hits_counted)
            self.hits_counted = s.prefill_cached
