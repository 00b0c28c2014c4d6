"""A long agent session whose history outgrows the KV budget: what each way of coping costs.

Every turn resends the whole conversation plus a new tool result, as chat and agent clients do.
Three policies, each measured per turn: prompt tokens computed, peak KV blocks, TTFT (wall) and
whether the greedy answer equals the one with memory to spare.
"""

from __future__ import annotations

from llmsys.serving.blocks import blocks_for
from llmsys.serving.engine import Engine
from llmsys.serving.scheduler import SchedulerConfig
from llmsys.serving.trace import Request, next_turn


def long_session(served, turns: int, user_words: int, answer_tokens: int, budget_blocks: int,
                 progress: bool = False) -> dict:
    """An agent-style session whose history outgrows a KV budget. Every turn resends the whole history (the
    transcript is fixed by a first run with memory to spare, so each policy sees the same prompts) plus a tool
    result of ``user_words`` words and asks for ``answer_tokens`` tokens. Per turn and policy: prompt tokens
    recomputed, peak KV blocks, TTFT (wall), whether the greedy answer equals the full-history one and how
    much of it does (the share of its tokens before the first that differs), and the answer's text.

    - ``keep all``: KV memory for the whole session, prefix caching: each turn computes only its new tokens;
    - ``LRU, budget``: ``budget_blocks`` of KV memory, prefix caching: freed blocks stay cached until
      reallocated, oldest first, so while the history fits each turn still computes only its new tokens;
      once it needs more than the whole budget no eviction or preemption can help and it is refused;
    - ``window``: the same budget, the prompt cut to its system prompt (the attention sinks of StreamingLLM,
      Xiao et al. 2023, arXiv 2309.17453, at message granularity) plus the most recent tokens that fit:
      memory stays bounded, but the cut moves every turn, so the cache no longer matches past the system
      prompt and the whole window is recomputed, and answers may change."""
    from tqdm.auto import tqdm

    from llmsys.core import zoo

    words, bs = zoo.corpus().split(), 16
    system = served.encode_chat([{"role": "system", "content": "You are an agent. Summarise each tool result."}])
    prompts, answers, request = [], [], None
    full_blocks = blocks_for(len(system) + turns * (2 * user_words + answer_tokens + 16), bs) + 8
    keep = Engine(served.model, full_blocks, bs, SchedulerConfig(prefix_caching=True))
    for t in tqdm(range(turns), desc="transcript", disable=not progress, leave=False):  # the transcript, from the run that keeps everything
        tool = served.encode(f"<tool>{' '.join(words[t * user_words:(t + 1) * user_words])}</tool>")
        request = (Request(("turn", t), system + tool, answer_tokens) if request is None else
                   next_turn(request, answers[-1], tool, id=("turn", t), max_tokens=answer_tokens))
        prompts.append(request.prompt)
        result = keep.run([request]).results[0]
        if result.status != "finished":
            raise ValueError(f"turn {t} does not fit the model's context: {result.reason}; serve a longer --context")
        answers.append(result.output)
    policies = {"keep all": (full_blocks, False), "LRU, budget": (budget_blocks, False),
                "window": (budget_blocks, True)}
    rows = {name: [] for name in policies}
    engines = {name: Engine(served.model, blocks, bs, SchedulerConfig(prefix_caching=True))
               for name, (blocks, _) in policies.items()}
    # turn by turn, every policy in turn: each turn's wall times are taken under the same load
    for t, full_prompt in enumerate(tqdm(prompts, desc="policies", disable=not progress, leave=False)):
        for name, (blocks, window) in policies.items():
            fit, sink, prompt = blocks * bs - answer_tokens, len(system), full_prompt
            if window and len(prompt) > fit:
                prompt = prompt[:sink] + prompt[len(prompt) - (fit - sink):]
            report = engines[name].run([Request(("turn", t), prompt, answer_tokens)])
            r = report.results[0]
            rows[name].append({"turn": t, "prompt": len(prompt), "computed": report.prefill_computed,
                               "peak_blocks": report.summary()["KV used blocks (peak)"], "ttft": r.ttft,
                               "served": r.status == "finished",
                               "same_answer": r.status == "finished" and r.output == answers[t],
                               "same_share": common_prefix(r.output, answers[t]) / len(answers[t]),
                               "text": served.decode(r.output) if r.status == "finished" else None})
    return {"budget_blocks": budget_blocks, "full_blocks": full_blocks, "rows": rows,
            "last_answer": served.decode(answers[-1])}


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share before the first that differs."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def long_session_table(result: dict) -> str:
    """Per turn, for each policy: prompt tokens computed, peak KV blocks, TTFT, and the answer: equal to the
    full-history one ("yes"), the share of it before the first token that differs, or "refused"."""
    names = list(result["rows"])
    head = f"{'turn':>4} {'prompt':>6} " + " ".join(f"{n + ': computed/peak blk/TTFT/same':>40}" for n in names)
    lines = [head]
    for t in range(len(result["rows"][names[0]])):
        cells = []
        for n in names:
            r = result["rows"][n][t]
            same = "yes" if r["same_answer"] else f"{r['same_share']:.0%}" if r["served"] else "refused"
            cells.append(f"{r['computed']:>8} {r['peak_blocks']:>4} {r['ttft'] or float('nan'):>7.2f}s {same:>7}".rjust(40))
        lines.append(f"{t:>4} {result['rows'][names[0]][t]['prompt']:>6} " + " ".join(cells))
    return "\n".join(lines)
