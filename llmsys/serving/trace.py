"""Request traces: who arrives when, with which prompt, wanting how many tokens.

A generated trace mixes the features that make serving hard: Poisson
arrivals, prompt and output lengths that vary a lot (a long tail of long
answers is what leaves static batches idle), and a few shared system prompts
that many requests start with (what prefix caching reuses). Optional TTFT/TPOT
targets per request let an SLO-aware scheduler put urgent requests first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    id: object
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the trace starts
    ttft_slo: float | None = None  # seconds the first token may take, if the request has a target
    tpot_slo: float | None = None  # seconds per later token
    meta: dict = field(default_factory=dict)  # e.g. which system prompt, which session turn
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's penalties on tokens already generated (0: none)
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives
    seed: int | None = None  # of the request's own random generator (None: a fresh random seed)
    stop_ids: tuple[int, ...] = ()  # generation ends after any of these (e.g. the chat's end-of-turn token)
    grammar: object = None  # a response format (``grammar.Grammar``) the output must follow, or None

    @property
    def deadline(self) -> float:
        """When the first token is due (SLO ordering serves the earliest first)."""
        return self.arrival + (self.ttft_slo if self.ttft_slo is not None else float("inf"))


def _lengths(gen, n, mean, low, high, tail: bool):
    """n integer lengths in low..high: exponential (a long tail) around ``mean``, or uniform."""
    if tail:
        x = torch.empty(n, dtype=torch.float64).exponential_(1.0 / max(mean - low, 1e-9), generator=gen) + low
    else:
        x = torch.rand(n, generator=gen, dtype=torch.float64) * (high - low + 1) + low
    return x.floor().clamp(low, high).long().tolist()


def make_trace(n_requests: int = 64, *, vocab_size: int, max_seq_len: int, seed: int = 0,
               rate: float | None = None, prompt_len: tuple[int, int] = (8, 64), mean_output: int = 32,
               output_len: tuple[int, int] = (1, 128), n_system_prompts: int = 2, system_len: int = 32,
               shared_fraction: float = 0.5, ttft_slos: tuple[float, ...] = (), corpus_ids=None) -> list[Request]:
    """A reproducible trace of ``n_requests`` requests.

    - arrivals: Poisson with ``rate`` requests/s (None: everyone at t = 0, an offline batch);
    - user prompt lengths uniform in ``prompt_len``; a ``shared_fraction`` of requests start with
      one of ``n_system_prompts`` system prompts of ``system_len`` tokens;
    - output lengths exponential with mean ``mean_output``, clipped to ``output_len`` and to the context;
    - tokens random ids, or slices of ``corpus_ids`` (real text) when given;
    - ``ttft_slos``: each request draws one of these TTFT targets (none when empty).
    """
    if n_requests <= 0:
        raise ValueError(f"n_requests must be positive, got {n_requests}")
    if not 0 <= shared_fraction <= 1:
        raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    if not 1 <= prompt_len[0] <= prompt_len[1] or not 1 <= output_len[0] <= output_len[1]:
        raise ValueError(f"length ranges must be 1 <= low <= high, "
                         f"got prompt_len={prompt_len}, output_len={output_len}")
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        if corpus_ids is None:
            return torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        start = int(torch.randint(0, len(corpus_ids) - n, (1,), generator=gen))
        return [int(t) for t in corpus_ids[start:start + n]]

    systems = [tokens(system_len) for _ in range(n_system_prompts)]
    users = _lengths(gen, n_requests, None, *prompt_len, tail=False)
    outputs = _lengths(gen, n_requests, mean_output, *output_len, tail=True)
    gaps = (torch.empty(n_requests, dtype=torch.float64).exponential_(rate, generator=gen).tolist()
            if rate else [0.0] * n_requests)
    shared = (torch.rand(n_requests, generator=gen) < shared_fraction).tolist()
    which = torch.randint(0, max(n_system_prompts, 1), (n_requests,), generator=gen).tolist()
    slo_pick = torch.randint(0, max(len(ttft_slos), 1), (n_requests,), generator=gen).tolist()
    trace, now = [], 0.0
    for i in range(n_requests):
        now += gaps[i]
        system = systems[which[i]] if shared[i] and systems else []
        prompt = (system + tokens(users[i]))[:max_seq_len - 1]
        max_tokens = max(1, min(outputs[i], max_seq_len - len(prompt)))
        meta = {"system": which[i] if system else None}
        trace.append(Request(id=i, prompt=prompt, max_tokens=max_tokens, arrival=now,
                             ttft_slo=ttft_slos[slo_pick[i]] if ttft_slos else None, meta=meta))
    return trace


SERVING_CONTEXT = 1024  # long enough for requests of hundreds of tokens, as served in practice


def serving_trace(n_requests: int, vocab_size: int, seed: int = 0, rate: float | None = None,
                  max_seq_len: int = SERVING_CONTEXT) -> list[Request]:
    """The trace of the chapter's benchmark: user prompts of 16-192 tokens, three quarters of
    them after one of three 64-token system prompts, outputs exponential with mean 160 (8-512):
    about 310 tokens per request, so a 16-token block's empty tail is a few percent of it."""
    return make_trace(n_requests, vocab_size=vocab_size, max_seq_len=max_seq_len, seed=seed, rate=rate,
                      prompt_len=(16, 192), mean_output=160, output_len=(8, 512), n_system_prompts=3,
                      system_len=64, shared_fraction=0.75)


def predicted_steps(trace: list[Request], max_batch: int, static_batch: int) -> dict:
    """Model steps each policy needs for ``trace`` (everyone waiting at t = 0), from its lengths alone.

    A request needs one step per output token (its prompt runs in the step that yields the first).
    Static batching runs ``static_batch`` requests at a time (what whole-context reservations fit)
    until the longest of them is done: Σ over batches of max(max_tokens). Continuous batching puts
    the next request in a slot as soon as one frees (at most ``max_batch``): list scheduling,
    ignoring KV memory limits and prompt chunking, so a lower bound of the engine's steps."""
    outs = [r.max_tokens for r in trace]
    static = sum(max(outs[i:i + static_batch]) for i in range(0, len(outs), static_batch))
    free_at = [0] * min(max_batch, len(outs))  # the step at which each slot frees
    for n in outs:
        slot = free_at.index(min(free_at))
        free_at[slot] += n
    return {"static": static, "continuous": max(free_at), "ratio": static / max(free_at)}


def next_turn(request: Request, output: list[int], user_tokens: list[int], *, id=None, arrival: float = 0.0,
              max_tokens: int | None = None) -> Request:
    """The follow-up request of a multi-turn session: the whole conversation so far plus a new user message.

    Its prompt starts with the previous prompt and answer, which the prefix cache may still hold."""
    return Request(id=id if id is not None else (request.id, "next"), prompt=request.prompt + output + user_tokens,
                   max_tokens=max_tokens if max_tokens is not None else request.max_tokens, arrival=arrival,
                   ttft_slo=request.ttft_slo, tpot_slo=request.tpot_slo,
                   meta={**request.meta, "turn": request.meta.get("turn", 0) + 1})
