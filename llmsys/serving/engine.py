"""A small LLM serving engine: a request trace in, every request's tokens and
timings out.

    engine = Engine(model, num_blocks=256, config=SchedulerConfig(chunked_prefill=True, token_budget=64))
    report = engine.run(make_trace(64, vocab_size=..., max_seq_len=...))
    print(report.summary())

Each step the scheduler picks (sequence, tokens) pairs, the engine runs them
as one flat batch through ``paged_forward`` and picks the next token of every
sequence that has caught up with its tokens: greedily, or with the request's
temperature and top-p from its own seeded generator, so a request's tokens
never depend on what else shares the batch. A request ends at ``max_tokens``
or after one of its stop tokens (a chat's end-of-turn token).

With ``spec_tokens`` = γ > 0, a greedy decode also carries up to γ prompt-lookup
drafts that the same step verifies (``speculative``), still equal to greedy decoding.

``run`` serves a whole trace on a simulated timeline; a server drives the same
engine step by step (``submit``, ``step``, ``abort``). The engine's clock advances by
each step's duration: wall time (``clock="wall"``), this process's CPU time
(``"cpu"``: steadier on a shared machine, meaningful with one torch thread),
or a cost model ``clock(n_tokens, n_seqs) -> seconds`` (reproducible schedules
for tests and teaching). When nothing is runnable the clock jumps to the next
arrival instead of sleeping.

Bad requests (an empty prompt, a prompt and output longer than the context or
than the whole KV memory, max_tokens < 1, a repeated id) are rejected with a
reason; every other request is served. If sampling one request fails, that
request alone ends (status "failed", its blocks freed, ``error`` saying why) and
the rest of the batch goes on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from llmsys.core.model import Transformer, sample
from llmsys.serving.blocks import BlockManager
from llmsys.serving.paged import Chunk, PagedKVCache, paged_forward
from llmsys.serving.scheduler import Plan, Scheduler, SchedulerConfig, Sequence, is_decode
from llmsys.serving.speculative import accept_greedy, prompt_lookup
from llmsys.serving.trace import Request

PAD = 0  # the token a padding row computes


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


def penalise(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: each token's logit minus ``frequency`` × its count in the
    output so far, minus ``presence`` if it appears at all (OpenAI's API reference, "Parameter details")."""
    if not (presence or frequency) or not output:
        return logits
    counts = torch.bincount(torch.tensor(output), minlength=logits.shape[-1]).to(logits.device, logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the model and the ``top`` likeliest tokens' (logits (V,)): the model's
    own distribution, before temperature, top-p and penalties, as vLLM reports by default."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(top)
    return float(logp[token]), list(zip(ids.tolist(), values.tolist()))


def linear_cost(step_s: float = 2e-3, per_token_s: float = 5e-5):
    """A reproducible clock: each step costs a fixed overhead plus a price per token computed."""
    return lambda n_tokens, n_seqs: step_s + per_token_s * n_tokens


class Engine:
    """Serve requests with ``model`` over a paged KV cache of ``num_blocks`` blocks."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int = 16,
                 config: SchedulerConfig | None = None, attention: str = "torch", clock="wall", spec_tokens: int = 0,
                 tiers=None):
        if attention not in ("torch", "triton"):
            raise ValueError(f"attention must be 'torch' or 'triton', got {attention!r}")
        if clock not in ("wall", "cpu") and not callable(clock):
            raise ValueError("clock must be 'wall', 'cpu' or a function (n_tokens, n_seqs) -> seconds, "
                             "e.g. linear_cost()")
        if not isinstance(spec_tokens, int) or spec_tokens < 0:
            raise ValueError(f"spec_tokens (drafts per greedy decode) must be an integer >= 0, got {spec_tokens!r}")
        self.model, self.config = model.eval(), config or SchedulerConfig()
        self.attention, self.clock = attention, clock
        self.spec_tokens, self.drafted, self.accepted = spec_tokens, 0, 0
        self.blocks = BlockManager(num_blocks, block_size, self.config.prefix_caching)
        self.cache = PagedKVCache(model, num_blocks, block_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.tiers = tiers  # KV tiers (``tiers.KVTiers``) below the pool: evicted blocks reload instead of recompute
        if tiers is not None:
            if not self.config.prefix_caching:
                raise ValueError("KV tiers hold evicted prefix-cache blocks: use SchedulerConfig(prefix_caching=True)")
            tiers.attach(self.cache, self.blocks)
        self.scheduler, self.steps = Scheduler(self.config, self.blocks, self.max_seq_len), 0

    @property
    def max_seq_len(self) -> int:
        return self.model.cfg.max_seq_len

    def check(self, request: Request) -> str:
        """Why a request cannot be served ("" when it can)."""
        vocab = self.model.cfg.vocab_size
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            return f"max_tokens must be a positive integer, got {request.max_tokens!r}"
        if len(request.prompt) == 0:
            return "the prompt is empty; send at least one token"
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in request.prompt):
            return f"the prompt holds token ids outside 0..{vocab - 1}"
        if not 0 <= request.temperature < math.inf:
            return f"temperature must be finite and >= 0 (0 = greedy), got {request.temperature!r}"
        if request.seed is not None and not (isinstance(request.seed, int) and -2**63 <= request.seed < 2**64):
            return f"seed must be an integer in -2**63 .. 2**64-1 (torch's manual_seed range), got {request.seed!r}"
        if not 0 < request.top_p <= 1:
            return f"top_p must be in (0, 1], got {request.top_p!r}"
        if not (-2 <= request.presence_penalty <= 2 and -2 <= request.frequency_penalty <= 2):
            return (f"presence_penalty and frequency_penalty must be in [-2, 2], got {request.presence_penalty!r} "
                    f"and {request.frequency_penalty!r}")
        need = len(request.prompt) + request.max_tokens
        if need > self.max_seq_len:
            return (f"prompt ({len(request.prompt)}) + max_tokens ({request.max_tokens}) = {need} tokens is longer "
                    f"than the model's context ({self.max_seq_len}); shorten the prompt or lower max_tokens")
        blocks = self.scheduler.blocks_needed(request)
        if blocks > self.num_blocks:
            return (f"needs {blocks} KV blocks of {self.block_size} tokens but the cache has only {self.num_blocks} "
                    f"in all; lower max_tokens or give the engine more KV memory")
        budget = self.config.token_budget
        if budget is not None and not self.config.chunked_prefill and len(request.prompt) + request.max_tokens > budget:
            return (f"without chunked prefill one step must hold the whole prompt, up to {need} tokens when it is "
                    f"recomputed after a preemption, but token_budget={budget}; "
                    f"enable chunked_prefill or raise token_budget")
        return ""

    def submit(self, request: Request) -> Sequence:
        """Queue a request checked by ``check``; it runs in the coming steps."""
        seq = Sequence(request)
        if request.temperature > 0:  # its own generator: its tokens do not depend on who shares the batch
            seq.generator = torch.Generator(self.cache.device)
            if request.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(request.seed)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop serving ``seq`` and free its KV blocks."""
        self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, now: float) -> StepRecord:
        """Schedule and run one step that starts at ``now`` on the engine's clock."""
        plan = self.scheduler.schedule(now)
        if not plan.chunks:
            raise RuntimeError(f"the scheduler found nothing runnable with {len(self.scheduler.waiting)} waiting and "
                               f"{len(self.scheduler.running)} running requests; this is a scheduler bug")
        self.steps += 1
        return self._step(plan, now, self.steps - 1)

    def run(self, requests: list[Request], progress: bool = False, max_steps: int | None = None) -> Report:
        """Serve every request (arrivals are honoured on the engine's clock); return their results.

        The engine's blocks (and so its prefix cache) persist from one run to the next."""
        self.scheduler, self.steps = Scheduler(self.config, self.blocks, self.max_seq_len), 0
        entries, pending, seen = [], [], set()
        for r in requests:
            reason = self.check(r)
            if r.id in seen:
                reason = (f"duplicate request id {r.id!r}: ids in a trace must be unique; "
                          f"the first request with this id is served, this one is not")
            seen.add(r.id)
            if reason:
                entries.append(Result(r.id, "rejected", reason, len(r.prompt), arrival=r.arrival, ttft_slo=r.ttft_slo))
            else:
                entries.append(r)
                pending.append(r)
        pending.sort(key=lambda r: r.arrival)
        now = min((r.arrival for r in pending), default=0.0)
        steps: list[StepRecord] = []
        submitted = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(pending), desc=self.config.name, leave=False)
        while pending or self.has_work():
            while pending and pending[0].arrival <= now:
                request = pending.pop(0)
                submitted[id(request)] = self.submit(request)
            if not self.has_work():
                now = pending[0].arrival  # idle: jump to the next arrival
                continue
            record = self.step(now)
            now += record.duration
            steps.append(record)
            if bar is not None:
                bar.update(len(record.finished))
            if max_steps is not None and len(steps) >= max_steps:
                break
        if bar is not None:
            bar.close()
        for seq in self.scheduler.running + self.scheduler.padding:  # only when stopped early by max_steps
            self.blocks.free(seq.key)
        results = [e if isinstance(e, Result) else self._result(submitted.get(id(e)) or Sequence(e)) for e in entries]
        return Report(self.config.name, results, steps, self.block_size, self.num_blocks,
                      self.scheduler.prefill_computed, self.scheduler.prefill_cached)

    @staticmethod
    def _result(seq: Sequence) -> Result:
        r = seq.request
        status = seq.status if seq.status in ("finished", "failed") else "unfinished"
        reason = {"finished": "", "failed": seq.error}.get(status, "the run stopped at max_steps")
        return Result(r.id, status, reason, len(r.prompt), seq.output, r.arrival,
                      seq.token_times, seq.preemptions, seq.cached_tokens, r.ttft_slo)

    @staticmethod
    def _sample(logits: torch.Tensor, chunks) -> list[int | None]:
        """The next token of each chunk's sequence (logits (len(chunks), vocab)): argmax, or a draw from
        the request's own generator, taken only once the sequence has caught up, as decoding it alone would.
        A draw that fails (or gives no valid token) fails its own sequence only: None, and ``seq.error``."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, (seq, n) in enumerate(chunks):
            r = seq.request
            penalised = bool(r.presence_penalty or r.frequency_penalty)
            if (r.temperature > 0 or penalised) and seq.num_computed + n == len(seq.tokens):
                try:
                    row = penalise(logits[i:i + 1], seq.output, r.presence_penalty, r.frequency_penalty)
                    tokens[i] = (int(sample(row, r.temperature, generator=seq.generator, top_p=r.top_p))
                                 if r.temperature > 0 else int(row.argmax()))
                    if not 0 <= tokens[i] < logits.shape[-1]:
                        raise ValueError(f"sampled token id {tokens[i]} is outside the vocabulary")
                except Exception as e:  # noqa: BLE001 - whatever went wrong, it is this request's alone
                    tokens[i], seq.error = None, f"sampling failed: {type(e).__name__}: {e}"[:300]
        return tokens

    def _drafts(self, seq: Sequence, n: int) -> list[int]:
        """Prompt-lookup drafts for a greedy decode, as many as its output, the context and free blocks allow;
        their blocks are made ready here (the scheduler planned the one decoded token)."""
        r = seq.request
        plain_greedy = r.temperature == 0 and not (r.presence_penalty or r.frequency_penalty) and r.logprobs is None
        if not self.spec_tokens or not plain_greedy or not is_decode(seq, n):
            return []
        k = min(self.spec_tokens, seq.request.max_tokens - len(seq.output) - 1, self.max_seq_len - len(seq.tokens))
        drafts = prompt_lookup(seq.tokens, k) if k > 0 else []
        if not drafts or not self.blocks.can_prepare(seq.key, seq.num_computed, 1 + len(drafts)):
            return []
        self.cache.copy_blocks(self.blocks.prepare(seq.key, seq.num_computed, 1 + len(drafts)))
        return drafts

    def _step(self, plan: Plan, now: float, index: int) -> StepRecord:
        """Run one planned step; its record holds how long it took on the engine's clock."""
        scheduler = self.scheduler
        kinds = ["decode" if is_decode(seq, n) else "prefill" for seq, n in plan.chunks]
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.cache.copy_blocks(plan.copies)
        drafts = [self._drafts(seq, n) for seq, n in plan.chunks]
        chunks = [Chunk(seq.tokens[seq.num_computed:seq.num_computed + n] + d, seq.num_computed,
                        self.blocks.table(seq.key)) for (seq, n), d in zip(plan.chunks, drafts)]
        chunks += [Chunk([PAD], position, self.blocks.table(seq.key)) for seq, position in plan.padding]
        ends = torch.tensor([len(c.tokens) for c in chunks]).cumsum(0)
        logits = paged_forward(self.model, self.cache, chunks, self.attention, all_logits=any(drafts))  # (N | chunks, V)
        last = logits[ends[:len(plan.chunks)] - 1] if any(drafts) else logits[:len(plan.chunks)]  # padding's dropped
        next_tokens = self._sample(last, plan.chunks)  # None where sampling that request failed
        verified = [logits[ends[i] - 1 - len(d):ends[i]].argmax(-1).tolist() if d else None
                    for i, d in enumerate(drafts)]
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize()
        if self.clock == "wall":
            duration = time.perf_counter() - t0
        elif self.clock == "cpu":
            duration = time.process_time() - cpu0
        else:
            duration = self.clock(sum(len(c.tokens) for c in chunks), len(plan.chunks))
        if self.tiers is not None:  # the block copies to and from the tiers done while planning this step
            wall, cpu = self.tiers.take_time()
            duration += {"wall": wall, "cpu": cpu}.get(self.clock, 0.0)
        end = now + duration
        finished = []
        for (seq, n), token, d, target, row in zip(plan.chunks, next_tokens, drafts, verified, last):
            if token is None:
                continue
            bonus = [token]
            if d:  # keep the drafts the target agrees with: their keys and values are valid
                kept, new = accept_greedy(d, target, seq.request.stop_ids)
                seq.tokens += new[:kept]
                seq.output += new[:kept]
                seq.token_times += [end] * kept
                n, bonus = n + kept, new[kept:]
                self.drafted, self.accepted = self.drafted + len(d), self.accepted + kept
            seq.num_computed += n
            self.blocks.commit(seq.key, seq.tokens, seq.num_computed)
            if seq.num_computed == len(seq.tokens) and bonus:  # caught up: this step's logits pick the next token
                seq.tokens.append(bonus[0])
                seq.output.append(bonus[0])
                seq.token_times.append(end)
                if seq.request.logprobs is not None:
                    seq.logprobs.append(logprobs_of(row, bonus[0], seq.request.logprobs))
        filled = self.blocks.filled_slots({s.key: s.num_computed for s in scheduler.running})
        used = self.blocks.allocator.num_used
        for seq, _ in plan.chunks:
            if seq.error is not None:
                scheduler.abort(seq)
                seq.status = "failed"
            elif seq.done and seq.status == "running":
                scheduler.finish(seq)
                finished.append(seq.id)
        record = StepRecord(index, now, duration, [(s.id, n + len(d), k) for (s, n), d, k in zip(plan.chunks, drafts, kinds)],
                            len(plan.padding), [s.id for s in plan.admitted], [s.id for s in plan.preempted], finished,
                            used, self.blocks.allocator.num_cached, filled, len(scheduler.running),
                            len(scheduler.waiting))
        return record
