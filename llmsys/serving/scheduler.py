"""Which sequences run in the next model step, and how many tokens each.

Every sequence is a list of tokens (prompt, then generated ones) of which the
first ``num_computed`` have keys and values in the cache. A step computes
some of the rest: a whole prompt, a chunk of it, or the one token sampled last
step (a decode). When a sequence has computed all its tokens, the step's
logits choose its next token. Prefill, chunked prefill, decoding and
recomputation after preemption are all this one rule.

Policies:

- ``static``: take a batch of waiting requests, reserve each one's KV memory
  for the longest it could get (the model's context), and run the batch until
  its last request finishes; newcomers wait for the next batch. The batch is
  one dense tensor, so a request that has finished keeps its row and is
  computed as padding until the batch ends. What serving systems did before
  iteration-level scheduling (FasterTransformer, a batched ``generate``).
- ``continuous``: decide again every step (Orca's iteration-level
  scheduling): finished requests leave at once and waiting ones join, with KV
  blocks allocated as sequences grow (vLLM).
- ``chunked_prefill`` with a ``token_budget``: each step runs every decode
  first, then fills what is left of the budget with prompt chunks, so a long
  prompt never stalls the decodes behind it (Sarathi-Serve).
- ``prefill_cap``: with chunked prefill, the most prompt tokens one sequence
  computes per step while others wait for the budget: decodes go first, then
  every prefill gets its capped share in priority order, then, unless the step
  carries a whole (short) prompt, what is left of the budget tops the chunks up
  (nothing is wasted when long prompts run alone).
  Without it, the first prompt in priority order takes the whole budget, so a
  long prompt keeps short ones behind it waiting for its first token until its
  prefill ends (head-of-line blocking; Sarathi-Serve, Agrawal et al. 2024, and
  vLLM's ``long_prefill_token_threshold`` cap each prefill the same way).
- ``pause_for_arrivals``: a step is not atomic: a step computing prompt tokens
  pauses between layers when requests arrive, a step of their prompts alone
  runs (``schedule(admit_only=True)``), then the paused one resumes. A short
  request then waits for one layer of a long prompt's chunk instead of the
  whole chunk, and the long prompt loses nothing (its chunk is not cut).
- ``prefix_caching``: a new request starts from the cached blocks of the
  longest prefix already computed (its system prompt, an earlier turn).
- when a step needs a block and none is free, the lowest-priority running
  sequence is preempted: its blocks are freed and it goes back to waiting, to
  be recomputed later (recomputation, not swapping). No request is dropped.
- ``ordering``: ``fcfs`` (arrival order) or ``slo`` (earliest TTFT deadline first,
  requests whose first token is already late last).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from llmsys.serving.blocks import BlockManager, blocks_for
from llmsys.serving.trace import Request

POLICIES = ("static", "continuous")
ORDERINGS = ("fcfs", "slo")


@dataclass
class SchedulerConfig:
    policy: str = "continuous"
    max_batch: int = 32  # sequences running at once
    token_budget: int | None = None  # tokens computed per step; None = no limit
    chunked_prefill: bool = False
    prefill_cap: int | None = None  # prompt tokens per sequence per step when others want the budget
    pause_for_arrivals: bool = False  # a step computing prompt tokens pauses between layers for newcomers' prompts
    prefix_caching: bool = False
    ordering: str = "fcfs"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}")
        if not isinstance(self.max_batch, int) or self.max_batch <= 0:
            raise ValueError(f"max_batch must be a positive integer, got {self.max_batch!r}")
        if self.token_budget is not None and (not isinstance(self.token_budget, int) or self.token_budget <= 0):
            raise ValueError(f"token_budget must be a positive integer or None, got {self.token_budget!r}")
        if self.prefill_cap is not None and (not isinstance(self.prefill_cap, int) or self.prefill_cap <= 0
                                             or not self.chunked_prefill):
            raise ValueError(f"prefill_cap must be a positive integer with chunked_prefill=True (or None), "
                             f"got {self.prefill_cap!r}")
        if self.pause_for_arrivals is not False and (self.pause_for_arrivals is not True or self.policy != "continuous"):
            raise ValueError(f"pause_for_arrivals must be True or False, and True needs policy='continuous', "
                             f"got {self.pause_for_arrivals!r} with policy={self.policy!r}")
        if self.chunked_prefill and self.token_budget is None:
            raise ValueError("chunked_prefill needs a token_budget (tokens per step), e.g. token_budget=64")
        if self.policy == "static" and (self.chunked_prefill or self.prefix_caching):
            raise ValueError("static batching runs whole prompts with reserved memory; "
                             "chunked_prefill and prefix_caching need policy='continuous'")

    @property
    def name(self) -> str:
        if self.policy == "static":
            return "static"
        chunked = ["chunked" + (f" (cap {self.prefill_cap})" if self.prefill_cap else "")] * self.chunked_prefill
        parts = ["continuous"] + chunked + ["prefix"] * self.prefix_caching
        return " + ".join(parts) + (" (slo)" if self.ordering == "slo" else "")


_serial = itertools.count()


class Sequence:
    """A request being served: its tokens, how many are in the KV cache, and its timings."""

    def __init__(self, request: Request):
        self.request, self.id = request, request.id
        self.key = next(_serial)  # block tables are keyed by this, never by a user-given id
        self.tokens = list(request.prompt)
        self.output: list[int] = []
        self.num_computed = 0
        self.status = "waiting"
        self.token_times: list[float] = []  # when each output token was produced
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, over all admissions
        self.padding_position = 0  # static batching: where its row computes next once it has finished
        self.generator = None  # the request's own random generator, made by the engine when it samples
        self.error: str | None = None  # why serving it failed (its status is then "failed")
        self.logprobs: list = []  # per output token (log p, [(id, log p) of the top alternatives]) when asked
        self.matcher = None  # its place in the response format's grammar (``grammar.Matcher``), if it has one
        self.forks: list[Sequence] = []  # siblings (n > 1) waiting for this prompt's blocks, forked once it is computed

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next one can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def finish_reason(self) -> str | None:
        """"stop" after a stop token, "length" at max_tokens, None while it goes on."""
        if self.output and self.output[-1] in self.request.stop_ids:
            return "stop"
        return "length" if len(self.output) >= self.request.max_tokens else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self):
        return f"Sequence({self.id!r}, {self.num_computed}/{len(self.tokens)} computed, {self.status})"


def is_decode(seq: Sequence, n: int) -> bool:
    """A decode computes just the token sampled last step; anything else is (re)filling the prompt."""
    return n == 1 and bool(seq.output) and seq.num_computed == len(seq.tokens) - 1


@dataclass
class Plan:
    """One step: (sequence, tokens to compute) pairs, block copies to do first, and who was preempted/admitted."""
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    padding: list[tuple[Sequence, int]] = field(default_factory=list)  # (finished row, position): static only
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Tokens the step computes, padding rows included."""
        return sum(n for _, n in self.chunks) + len(self.padding)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_seq_len: int):
        self.config, self.blocks, self.max_seq_len = config, blocks, max_seq_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.padding: list[Sequence] = []  # finished rows of the static batch, computed until it ends
        self.prefill_computed = 0  # prompt (and recomputed) tokens actually run
        self.prefill_cached = 0  # prompt tokens taken from the prefix cache instead
        self.preemptions = 0
        self.now = 0.0  # the engine's clock at the step being planned

    # ------------------------------------------------------------------ bookkeeping
    def priority(self, seq: Sequence):
        r = seq.request
        if self.config.ordering == "fcfs":
            return (r.arrival, seq.key)
        # a request still waiting for its first token past its deadline can no longer meet it: served
        # ahead of requests that still can, one miss becomes many (earliest-deadline-first's domino
        # effect under overload), so it waits until nothing urgent does
        late = not seq.output and self.now > r.deadline
        return (late, r.deadline, r.arrival, seq.key)

    def reserved_tokens(self, request: Request) -> int:
        """KV slots a request holds: static reserves the whole context, paging only what it fills."""
        if self.config.policy == "static":
            return self.max_seq_len
        return len(request.prompt) + request.max_tokens

    def blocks_needed(self, request: Request) -> int:
        return blocks_for(self.reserved_tokens(request), self.blocks.block_size)

    def add(self, seq: Sequence) -> None:
        seq.status = "waiting"
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        seq.status = "finished"
        self.running.remove(seq)
        if self.config.policy == "static" and self.running:  # its row stays in the batch
            seq.padding_position = len(seq.tokens) - 1  # its last token, never fed, is the first pad
            self.padding.append(seq)
            return
        for done in self.padding + [seq]:
            self.blocks.free(done.key)
        self.padding.clear()

    def join(self, seq: Sequence) -> None:
        """A sequence whose blocks are already in place (a forked choice of n > 1) runs from the next step."""
        seq.status = "running"
        self.running.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a waiting or running sequence (its client went away) and free its blocks at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.key)
        seq.status = "aborted"

    def _preempt(self, seq: Sequence) -> None:
        """Free all of seq's blocks; it waits to be recomputed (prompt + what it generated so far)."""
        self.running.remove(seq)
        self.blocks.free(seq.key)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)

    def _start(self, seq: Sequence, plan: Plan) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = "running"
        plan.admitted.append(seq)

    def _run(self, seq: Sequence, n: int, plan: Plan) -> None:
        plan.copies += self.blocks.prepare(seq.key, seq.num_computed, n)
        plan.chunks.append((seq, n))
        if not is_decode(seq, n):
            self.prefill_computed += n

    def _blocks_still_needed(self, seqs=None) -> int:
        """New blocks ``seqs`` (default: the running ones) need to hold all their known tokens plus the next one."""
        bs = self.blocks.block_size
        return sum(max(0, blocks_for(len(s.tokens) + 1, bs) - len(self.blocks.table(s.key)))
                   for s in (self.running if seqs is None else seqs))

    # ------------------------------------------------------------------ policies
    def schedule(self, now: float = 0.0, admit_only: bool = False) -> Plan:
        """Plan the step that starts at ``now`` on the engine's clock. With ``admit_only``, a step of waiting
        prompts alone, run while another step is paused (the running sequences are in that one)."""
        plan, self.now = Plan(), now
        self.waiting.sort(key=self.priority)
        self.running.sort(key=self.priority)
        if self.config.policy == "static":
            self._schedule_static(plan)
        else:
            self._schedule_continuous(plan, admit_only)
        return plan

    def _schedule_static(self, plan: Plan) -> None:
        if not self.running:  # a new batch only when the whole previous one is done
            for seq in list(self.waiting):
                if len(self.running) >= self.config.max_batch:
                    break
                need = blocks_for(self.reserved_tokens(seq.request), self.blocks.block_size)
                if need > self.blocks.num_free:
                    break
                self.blocks.add(seq.key)
                self.blocks.prepare(seq.key, 0, self.reserved_tokens(seq.request))  # reserve it all now
                self._start(seq, plan)
        for seq in self.running:
            self._run(seq, seq.remaining, plan)
        for seq in self.padding:  # rows of finished requests, inside their reserved context
            if seq.padding_position < self.max_seq_len:
                plan.padding.append((seq, seq.padding_position))
                seq.padding_position += 1

    def _schedule_continuous(self, plan: Plan, admit_only: bool = False) -> None:
        cfg = self.config
        budget = cfg.token_budget if cfg.token_budget is not None else float("inf")
        cap = cfg.prefill_cap or float("inf")

        def chunk(seq: Sequence) -> int:
            return min(seq.remaining, budget, cap) if cfg.chunked_prefill else seq.remaining

        # 1. running sequences, highest priority first (decodes before any prefill when prefills are capped):
        # decodes and unfinished prompt chunks
        running = sorted(self.running, key=lambda s: s.remaining > 1) if cfg.prefill_cap else list(self.running)
        running = [] if admit_only else running
        for seq in running:
            if seq not in self.running or budget <= 0:  # preempted as a victim, or the step is full
                continue
            n = chunk(seq)
            if n > budget:
                continue
            while not self.blocks.can_prepare(seq.key, seq.num_computed, n):
                victim = self.running[-1]  # the lowest priority gives its blocks back
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                break  # it preempted itself: everyone behind it is gone too
            self._run(seq, n, plan)
            budget -= n
        if plan.preempted:  # memory is short: admit nobody this step
            return
        # 2. waiting requests, in priority order, while slots, budget and blocks allow
        for seq in list(self.waiting):
            # a prompt with n choices takes n places: its siblings join once it is computed
            if len(self.running) + sum(len(s.forks) for s in self.running) + 1 + len(seq.forks) > cfg.max_batch \
                    or budget <= 0:
                break
            cached = self.blocks.add(seq.key, seq.tokens)
            seq.num_computed = cached
            n = chunk(seq)
            # admit only if its whole prompt and everyone's next token fit: admitting more just to preempt
            # them again would waste the prefill
            spare = self.blocks.num_free - self._blocks_still_needed()
            if n > budget or spare < self._blocks_still_needed([seq]):
                self.blocks.free(seq.key)  # give the cached blocks back; try again next step
                seq.num_computed = 0
                break
            seq.cached_tokens += cached
            self.prefill_cached += cached
            self._start(seq, plan)
            self._run(seq, n, plan)
            budget -= n
        # 3. what is left of the budget tops capped prefills up, in priority order, unless the step carries a
        # whole prompt: that step stays short, so its first token comes soon
        if cfg.prefill_cap and not admit_only and not any(1 < n == seq.remaining for seq, n in plan.chunks):
            for i, (seq, n) in enumerate(plan.chunks):
                more = min(seq.remaining - n, budget)
                if more > 0 and self.blocks.can_prepare(seq.key, seq.num_computed, n + more):
                    plan.copies += self.blocks.prepare(seq.key, seq.num_computed, n + more)
                    plan.chunks[i] = (seq, n + more)
                    self.prefill_computed += more
                    budget -= more


def scheduler_in_state(config: SchedulerConfig, running, waiting, free_blocks: int = 4096, block_size: int = 16,
                       max_seq_len: int = 4096) -> Scheduler:
    """A scheduler caught mid-run, for exercises and checks that ask "what does the next step do?".

    ``running``: (id, tokens, computed) per running sequence, holding the blocks of its computed
    tokens; ``waiting``: (id, prompt length) per queued request, in arrival order after them;
    ``free_blocks`` are left over once the running sequences hold theirs."""
    held = sum(blocks_for(computed, block_size) for _, _, computed in running)
    scheduler = Scheduler(config, BlockManager(held + free_blocks, block_size), max_seq_len=max_seq_len)
    for order, (rid, n_tokens, computed) in enumerate(running):
        seq = Sequence(Request(rid, [1] * n_tokens, max_tokens=8, arrival=order))
        scheduler.blocks.add(seq.key)
        scheduler.blocks.prepare(seq.key, 0, computed)
        seq.num_computed, seq.status = computed, "running"
        scheduler.running.append(seq)
    for order, (rid, prompt_len) in enumerate(waiting, start=len(running)):
        scheduler.add(Sequence(Request(rid, [1] * prompt_len, max_tokens=8, arrival=order)))
    return scheduler
