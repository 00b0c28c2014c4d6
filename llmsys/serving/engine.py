"""A small LLM serving engine: a request trace in, every request's tokens and
timings out.

    engine = Engine(model, num_blocks=256, config=SchedulerConfig(chunked_prefill=True, token_budget=64))
    report = engine.run(make_trace(64, vocab_size=..., max_seq_len=...))
    print(report.summary())

Each step the scheduler picks (sequence, tokens) pairs, the engine runs them
as one flat batch through ``paged_forward`` and picks the next token of every
sequence that has caught up with its tokens: greedily, or with the request's
temperature and top-p from its own seeded generator, so a request's tokens
never depend on what else shares the batch. A request with a response format
(``grammar``) has every token its grammar refuses masked out first; the other
rows of the batch are untouched. A request ends at ``max_tokens`` or after one
of its stop tokens (a chat's end-of-turn token).

``submit_group`` serves one prompt's n choices (the API's ``n``): the first
sequence prefills the prompt, then the others fork its block table (shared
blocks, reference counted, copied on their first write) and draw their first
tokens from the same logits, each with its own generator.

With ``speculate=Speculation(...)`` a greedy decode also carries drafts (a suffix-decoding
tree or a prompt-lookup chain) that the same step verifies (``speculative``), still equal
to greedy decoding; a step verifies only the draft tokens that pay on the engine's measured step costs.

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

import torch

from llmsys.core.model import Transformer
from llmsys.serving.blocks import BlockManager
from llmsys.serving.paged import Chunk, PagedForward, PagedKVCache
from llmsys.serving.report import Report, Result, StepRecord
from llmsys.serving.sampling import draw, logprobs_of, needs_draw
from llmsys.serving.scheduler import Plan, Scheduler, SchedulerConfig, Sequence, is_decode
from llmsys.serving.speculative import Draft, Speculation, Speculator
from llmsys.serving.trace import Request

PAD = 0  # the token a padding row computes


def linear_cost(step_s: float = 2e-3, per_token_s: float = 5e-5):
    """A reproducible clock: each step costs a fixed overhead plus a price per token computed."""
    return lambda n_tokens, n_seqs: step_s + per_token_s * n_tokens


class Engine:
    """Serve requests with ``model`` over a paged KV cache of ``num_blocks`` blocks."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int = 16,
                 config: SchedulerConfig | None = None, attention: str = "torch", clock="wall",
                 speculate: Speculation | None = None,
                 tiers=None):
        if attention not in ("torch", "triton"):
            raise ValueError(f"attention must be 'torch' or 'triton', got {attention!r}")
        if clock not in ("wall", "cpu") and not callable(clock):
            raise ValueError("clock must be 'wall', 'cpu' or a function (n_tokens, n_seqs) -> seconds, "
                             "e.g. linear_cost()")
        if speculate is not None and not isinstance(speculate, Speculation):
            raise ValueError(f"speculate must be a serving.speculative.Speculation or None, got {speculate!r}")
        self.model, self.config = model.eval(), config or SchedulerConfig()
        self.attention, self.clock = attention, clock
        self.speculator = None if speculate is None else Speculator(speculate, model.cfg.vocab_size)
        self.drafted = self.accepted = 0  # draft tokens verified, kept
        self.blocks = BlockManager(num_blocks, block_size, self.config.prefix_caching)
        self.cache = PagedKVCache(model, num_blocks, block_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.tiers = tiers  # KV tiers (``tiers.KVTiers``) below the pool: evicted blocks reload instead of recompute
        if tiers is not None:
            if not self.config.prefix_caching:
                raise ValueError("KV tiers hold evicted prefix-cache blocks: use SchedulerConfig(prefix_caching=True)")
            tiers.attach(self.cache, self.blocks)
        self.scheduler, self.steps = Scheduler(self.config, self.blocks, self.max_seq_len), 0
        # called with each sequence that ends, before its blocks are freed: a prefill instance sends its KV here
        self.on_finish = None
        # with SchedulerConfig.pause_for_arrivals: called between the layers of a step that computes prompt
        # tokens, with the seconds since it started (steps it paused for included); submits the requests that
        # arrived meanwhile and says whether any did (``run`` and the server's loop set it)
        self.arrivals = None
        self.on_step = None  # called with the record of every step run, paused-for steps included
        self.interleaved: list[StepRecord] = []  # steps run while the last ``step`` was paused

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

    def check_group(self, requests: list[Request]) -> str:
        """Why requests cannot be served as one prompt's choices (``submit_group``); "" when they can."""
        reason = next((why for why in map(self.check, requests) if why), "")
        if reason or len(requests) == 1:
            return reason
        if self.config.policy != "continuous" or len(requests) > self.config.max_batch:
            return (f"{len(requests)} choices of one prompt run side by side: that needs continuous batching "
                    f"with max_batch >= {len(requests)} (it is {self.config.max_batch})")
        if len({tuple(r.prompt) for r in requests}) > 1:
            return "the choices of one group must share their prompt"
        shared = len(requests[0].prompt) // self.block_size  # full prompt blocks, held once for all choices
        need = sum(self.scheduler.blocks_needed(r) for r in requests) - (len(requests) - 1) * shared
        if need > self.num_blocks:
            return (f"{len(requests)} choices need {need} KV blocks of {self.block_size} tokens but the cache has "
                    f"only {self.num_blocks} in all; lower n or max_tokens")
        return ""

    def submit(self, request: Request) -> Sequence:
        """Queue a request checked by ``check``; it runs in the coming steps."""
        return self.submit_group([request])[0]

    def submit_group(self, requests: list[Request]) -> list[Sequence]:
        """Queue requests checked by ``check_group`` that share one prompt (n > 1 choices): the first prefills
        it; once it is computed the others fork its blocks (shared, copied on their first write) and draw
        their first tokens from the same logits, each with its own generator and grammar."""
        seqs = [Sequence(r) for r in requests]
        for seq in seqs:
            r = seq.request
            if r.temperature > 0:  # its own generator: its tokens do not depend on who shares the batch
                seq.generator = torch.Generator(self.cache.device)
                if r.seed is None:
                    seq.generator.seed()
                else:
                    seq.generator.manual_seed(r.seed)
            if r.grammar is not None:
                seq.matcher = r.grammar.matcher()
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0])
        return seqs

    def abort(self, seq: Sequence) -> None:
        """Stop serving ``seq`` and free its KV blocks; siblings waiting for its prompt wait for the next of them."""
        parent = next((p for p in self.scheduler.waiting + self.scheduler.running if seq in p.forks), None)
        if parent is not None:  # a choice not forked yet: it holds no blocks
            parent.forks.remove(seq)
            seq.status = "aborted"
            return
        if seq.forks:  # the first sibling left prefills the prompt for the rest (the prefix cache keeps its blocks)
            heir, heir.forks, seq.forks = seq.forks[0], seq.forks[1:], []
            self.scheduler.add(heir)
        self.scheduler.abort(seq)
        if self.speculator is not None:
            self.speculator.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, now: float) -> StepRecord:
        """Schedule and run one step that starts at ``now`` on the engine's clock."""
        plan = self.scheduler.schedule(now)
        if not plan.chunks:
            raise RuntimeError(f"the scheduler found nothing runnable with {len(self.scheduler.waiting)} waiting and "
                               f"{len(self.scheduler.running)} running requests; this is a scheduler bug")
        self.steps += 1
        self.interleaved = []
        return self._step(plan, now, self.steps - 1, pausable=True)

    def run(self, requests: list[Request], progress: bool = False, max_steps: int | None = None,
            realtime: bool = False) -> Report:
        """Serve every request (arrivals are honoured on the engine's clock); return their results.

        With ``realtime`` the clock is the wall clock since the run started: the engine waits for arrivals
        instead of jumping to them, and time spent between steps counts (as it does for engines in separate
        processes, ``disagg``). The engine's blocks (and so its prefix cache) persist from one run to the next."""
        if realtime and self.clock != "wall":
            raise ValueError("a realtime run reads the wall clock: make the engine with clock='wall'")
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
        now = 0.0 if realtime else min((r.arrival for r in pending), default=0.0)
        start = time.perf_counter()
        steps: list[StepRecord] = []
        submitted = {}

        def arrived(elapsed: float) -> bool:  # the requests that arrived while a step ran join the queue
            at = time.perf_counter() - start if realtime else now + elapsed
            newcomers = [pending.pop(0) for _ in range(sum(r.arrival <= at for r in pending))]
            for request in newcomers:
                submitted[id(request)] = self.submit(request)
            return bool(newcomers)

        self.arrivals = arrived
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(pending), desc=self.config.name, leave=False)
        while pending or self.has_work():
            if realtime:
                now = time.perf_counter() - start
            while pending and pending[0].arrival <= now:
                request = pending.pop(0)
                submitted[id(request)] = self.submit(request)
            if not self.has_work():
                if realtime:
                    time.sleep(max(0.0, pending[0].arrival - now))
                else:
                    now = pending[0].arrival  # idle: jump to the next arrival
                continue
            record = self.step(now)
            for done in sorted(self.interleaved + [record], key=lambda r: r.start):
                now += done.duration
                steps.append(done)
                if bar is not None:
                    bar.update(len(done.finished))
            if max_steps is not None and len(steps) >= max_steps:
                break
        if bar is not None:
            bar.close()
        self.arrivals = None
        for seq in self.scheduler.running + self.scheduler.padding:  # only when stopped early by max_steps
            self.blocks.free(seq.key)
        results = [e if isinstance(e, Result) else self.result_of(submitted.get(id(e)) or Sequence(e)) for e in entries]
        return Report(self.config.name, results, steps, self.block_size, self.num_blocks,
                      self.scheduler.prefill_computed, self.scheduler.prefill_cached)

    @staticmethod
    def result_of(seq: Sequence) -> Result:
        """What serving ``seq`` gave, as a run's report holds it."""
        r = seq.request
        status = seq.status if seq.status in ("finished", "failed") else "unfinished"
        reason = {"finished": "", "failed": seq.error}.get(status, "the run stopped at max_steps")
        return Result(r.id, status, reason, len(r.prompt), seq.output, r.arrival,
                      seq.token_times, seq.preemptions, seq.cached_tokens, r.ttft_slo)

    @staticmethod
    def _sample(logits: torch.Tensor, seqs) -> list[int | None]:
        """The next token of each sequence (logits (len(seqs), vocab)): the argmax, or ``draw`` (a grammar,
        penalties, the request's own generator), as decoding it alone would. A draw that fails (or gives no
        valid token) fails its own sequence only: None, and ``seq.error``. Rows of sequences that have not
        caught up yet (a prefill chunk) are not used."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if needs_draw(seq):
                try:
                    tokens[i] = draw(logits[i], seq)
                except Exception as e:  # noqa: BLE001 - whatever went wrong, it is this request's alone
                    tokens[i], seq.error = None, f"sampling failed: {type(e).__name__}: {e}"[:300]
        return tokens

    def _fork(self, parent: Sequence, row: torch.Tensor, now: float) -> list[Sequence]:
        """``parent``'s waiting siblings join the batch: its prompt blocks become theirs too (copy-on-write),
        and each draws its first token from the logits ``row`` that gave ``parent`` its own."""
        forks, parent.forks = parent.forks, []
        for seq in forks:
            self.blocks.fork(parent.key, seq.key)
            seq.num_computed = len(seq.tokens)
            self.scheduler.join(seq)
            (token,) = self._sample(row[None], [seq])
            if token is not None:
                self._emit(seq, token, row, now)
        return forks

    @staticmethod
    def _emit(seq: Sequence, token: int, row: torch.Tensor, now: float) -> None:
        """``seq``'s next token, picked at ``now`` from the logits ``row``."""
        seq.tokens.append(token)
        seq.output.append(token)
        seq.token_times.append(now)
        if seq.request.logprobs is not None:
            seq.logprobs.append(logprobs_of(row, token, seq.request.logprobs))

    def _forward(self, plan: Plan, chunks: list[Chunk], drafting: bool, now: float, pausable: bool):
        """The step's forward pass: (logits, seconds spent paused). A step that computes prompt tokens pauses
        between layers when requests have arrived (``SchedulerConfig.pause_for_arrivals``), runs a step of their
        prompts, then resumes: a newcomer's first token waits for one layer of a long prompt's chunk, not for
        the whole chunk (on a CPU, a chunk deep into an 8k-token prompt costs 15× a short prompt's step)."""
        forward = PagedForward(self.model, self.cache, chunks, self.attention, all_logits=drafting)
        pausable = pausable and self.config.pause_for_arrivals and self.arrivals is not None and any(
            not is_decode(seq, n) for seq, n in plan.chunks)
        start, paused = self._clock_reading(), 0.0
        while not forward.done:
            forward.run_layer()
            if not pausable or forward.done:
                continue
            if callable(self.clock):  # a cost model prices the whole step: its share so far
                elapsed = self.clock(sum(len(c.tokens) for c in chunks), len(plan.chunks)) * forward.layer \
                    / len(self.model.layers)
            else:
                elapsed = self._clock_reading() - start - paused
            at = now + elapsed + paused  # the engine's clock: this step's own time and the steps it paused for
            if self.arrivals(elapsed + paused):
                first = self.scheduler.schedule(at, admit_only=True)
                if first.chunks:
                    self.steps += 1
                    record = self._step(first, at, self.steps - 1, pausable=False)
                    self.interleaved.append(record)
                    paused += record.duration
        return forward.logits(), paused

    def _clock_reading(self) -> float:
        return time.process_time() if self.clock == "cpu" else time.perf_counter()

    def _step(self, plan: Plan, now: float, index: int, pausable: bool = False) -> StepRecord:
        """Run one planned step; its record holds how long it took on the engine's clock."""
        scheduler = self.scheduler
        kinds = ["decode" if is_decode(seq, n) else "prefill" for seq, n in plan.chunks]
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.cache.copy_blocks(plan.copies)
        drafts = ([Draft() for _ in plan.chunks] if self.speculator is None else
                  self.speculator.drafts(plan, self.blocks, self.cache, self.max_seq_len,
                                         (self.accepted + 1) / (self.drafted + 2)))  # one kept, one rejected first
        chunks = [Chunk(seq.tokens[seq.num_computed:seq.num_computed + n] + d.tokens, seq.num_computed,
                        self.blocks.table(seq.key), [-1] + [p + 1 for p in d.parents] if d.tokens else None)
                  for (seq, n), d in zip(plan.chunks, drafts)]
        chunks += [Chunk([PAD], position, self.blocks.table(seq.key)) for seq, position in plan.padding]
        ends = torch.tensor([len(c.tokens) for c in chunks]).cumsum(0)
        drafting = any(d.tokens for d in drafts)
        logits, paused = self._forward(plan, chunks, drafting, now, pausable)  # (N | chunks, V)
        last = logits[ends[:len(plan.chunks)] - 1] if drafting else logits[:len(plan.chunks)]  # padding's dropped
        caught_up = [i for i, (seq, n) in enumerate(plan.chunks) if seq.num_computed + n == len(seq.tokens)]
        next_tokens = [PAD] * len(plan.chunks)  # unused for a prefill not done yet; None where sampling failed
        for i, token in zip(caught_up, self._sample(last[caught_up], [plan.chunks[i][0] for i in caught_up])):
            next_tokens[i] = token
        verified = [logits[ends[i] - 1 - len(d.tokens):ends[i]].argmax(-1).tolist() if d.tokens else None
                    for i, d in enumerate(drafts)]
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize()
        if self.clock == "wall":
            duration = time.perf_counter() - t0 - paused
        elif self.clock == "cpu":
            duration = time.process_time() - cpu0 - paused
        else:
            duration = self.clock(sum(len(c.tokens) for c in chunks), len(plan.chunks))
        if self.tiers is not None:  # the block copies to and from the tiers done while planning this step
            wall, cpu = self.tiers.take_time()
            duration += {"wall": wall, "cpu": cpu}.get(self.clock, 0.0)
        end = now + duration
        finished, forked = [], []
        for (seq, n), token, d, target, row in zip(plan.chunks, next_tokens, drafts, verified, last):
            if token is None:
                continue
            bonus = [token]
            if d.tokens:
                kept, bonus = self.speculator.keep_agreed(seq, n, d, target, end, self.cache, self.blocks)
                n, self.drafted, self.accepted = n + kept, self.drafted + len(d.tokens), self.accepted + kept
            seq.num_computed += n
            self.blocks.commit(seq.key, seq.tokens, seq.num_computed)
            if seq.num_computed == len(seq.tokens) and bonus:  # caught up: this step's logits pick the next token
                self._emit(seq, bonus[0], row, end)
                if seq.forks:  # its prompt is computed: the other choices start from it
                    forked += self._fork(seq, row, end)
        filled = self.blocks.filled_slots({s.key: s.num_computed for s in scheduler.running})
        used = self.blocks.allocator.num_used
        for seq in [s for s, _ in plan.chunks] + forked:
            if seq.error is not None:
                self.abort(seq)
                seq.status = "failed"
            elif seq.done and seq.status == "running":
                if self.on_finish is not None:
                    self.on_finish(seq)
                scheduler.finish(seq)
                finished.append(seq.id)
            if self.speculator is not None and seq.status != "running":
                self.speculator.finish(seq)
        record = StepRecord(index, now, duration, [(s.id, n + len(d.tokens), k) for (s, n), d, k in zip(plan.chunks, drafts, kinds)],
                            len(plan.padding), [s.id for s in plan.admitted], [s.id for s in plan.preempted], finished,
                            used, self.blocks.allocator.num_cached, filled, len(scheduler.running),
                            len(scheduler.waiting))
        if self.on_step is not None:
            self.on_step(record)
        return record
