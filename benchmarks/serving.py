"""Serving benchmark: static vs continuous batching, + chunked prefill, + prefix caching, SLO ordering.

Serves one generated trace (24 chat-shaped requests: user prompts of 16-128 tokens, three quarters
after one of three shared system prompts, outputs with a long tail, exponential with mean 64 from
4 to 256; everyone arriving at once: an overloaded server) with a zoo model, each scheduler and the
same KV memory, timed by the wall clock (or ``--clock cpu``), at each torch thread count given;
prints side by side: throughput, TTFT and TPOT (p50/p99), KV blocks used and wasted, prefix-cache
hit rate, preemptions, and the step counts each policy needs by the trace's lengths alone
(``predicted_steps``) beside the ones the engine ran. Then:

- a second turn of every request (its history + a new user message, ``next_turn``) served
  with and without prefix caching: the prefill tokens saved against the share the trace
  predicts (every full block of the first turn's prompt + answer, which the cache holds);
- at the first thread count, Poisson arrivals at rising rates (shorter requests, to bound the
  sweep), interactive and batch TTFT targets and one TPOT target, all stated as multiples of one
  request's TTFT and TPOT measured alone: goodput of FCFS vs SLO (earliest deadline first)
  ordering at each rate, up to the knee, the first rate where FCFS meets fewer than 90%.
  Every step runs the model and is timed; arrivals follow the engine's clock (idle gaps skipped).
  Then both orderings again at the knee on several traces, each step priced by a line (seconds
  per step + seconds per token) fitted to the sweep's timed steps: the policies compared without
  the machine's noise, which at one knee can be larger than their difference.

    python benchmarks/serving.py --model smollm2 --json serving.json     # the real model, bf16
    python benchmarks/serving.py --model target --dtype fp32             # the course's small model
    python benchmarks/serving.py --attention triton                      # on a GPU: the Triton decode kernel
    python benchmarks/serving.py --model smollm2 --spec --threads 1      # speculative decoding at batch 1, 4, 16
    python benchmarks/serving.py --model smollm2 --long-session --threads 1 --context 2048 \\
        --json benchmarks/results/long_session.json                      # a long session (the chapter shows it)
    python benchmarks/serving.py --distributed --json benchmarks/results/serving_distributed.json
                                                                         # prefill and decode in two processes

Goals (checked and printed): continuous >= 3x static in tokens/s; KV waste <= 4% of the
allocated KV memory; the measured prefill cut equals the predicted share; SLO ordering's
goodput above FCFS's at the knee. Static batching is a dense batch: each request reserves the
whole context, and a finished request's row is computed until the batch's longest is done (as in
a batched ``generate``). Wall times on a shared machine include what else runs on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from llmsys.core import device as _device
from llmsys.core import ledger
from llmsys.parallel import alpha_beta
from llmsys.serving import (BlockManager, Chunk, Engine, PagedKVCache, Request, SchedulerConfig, blocks_for,
                            Speculation, linear_cost, make_trace, next_turn, paged_forward, percentile,
                            predicted_steps, prefix_hashes, summary_table)
from llmsys.serving import paged
from llmsys.serving.sessions import long_session, long_session_table

GOALS = {"continuous / static": 3.0, "KV waste": 0.04}


def bench_trace(n: int, vocab_size: int, context: int, seed: int = 0, rate: float | None = None, ttft_slos=(),
                mean_output: int = 64, output_len=(4, 256), prompt_len=(16, 128)):
    """Chat-shaped requests: user prompts uniform in 16-128 tokens, three quarters of them after one of
    three shared 64-token system prompts; outputs exponential with mean 64 from 4 up to 256, a long
    tail as in chat traces (most answers short, a few long ones; static batching waits for the
    longest of its batch). A request stores ~160 tokens on average over its life (a 136-token prompt,
    half of a 51-token answer, both after clipping); the empty part of its last block averages
    (block_size - 1) / 2 slots: about 2% with blocks of 8, 4.7% with 16."""
    return make_trace(n, vocab_size=vocab_size, max_seq_len=context, seed=seed, rate=rate, prompt_len=prompt_len,
                      mean_output=mean_output, output_len=output_len, n_system_prompts=3, system_len=64,
                      shared_fraction=0.75, ttft_slos=ttft_slos)


def configs(max_batch: int, budget: int) -> list[SchedulerConfig]:
    return [
        SchedulerConfig(policy="static", max_batch=max_batch),
        SchedulerConfig(max_batch=max_batch),
        SchedulerConfig(max_batch=max_batch, chunked_prefill=True, token_budget=budget),
        SchedulerConfig(max_batch=max_batch, chunked_prefill=True, token_budget=budget, prefix_caching=True),
    ]


def run(model, trace, num_blocks: int, block_size: int, max_batch: int, budget: int, attention: str,
        clock: str = "wall", progress: bool = True):
    """Serve ``trace`` with every configuration; return (reports, share of requests whose tokens
    agree across all of them: all of them in fp32, most in bf16, whose rounding depends on the batch)."""
    reports = []
    for config in configs(max_batch, budget):
        Engine(model, num_blocks, block_size, config, attention=attention, clock=clock).run(trace[:2])  # warm-up
        reports.append(Engine(model, num_blocks, block_size, config, attention=attention, clock=clock)
                       .run(trace, progress=progress))
    outputs = [[r.output for r in rep.results] for rep in reports]
    agree = sum(all(o[i] == outputs[0][i] for o in outputs) for i in range(len(trace))) / len(trace)
    return reports, agree


def predicted_hits(first_turn, outputs, second_turn, block_size: int) -> int:
    """Prompt tokens of the second turn a prefix cache holding every first-turn block serves: the full
    blocks of each second-turn prompt (less its last token, always computed) found among the first
    turn's full blocks of prompt + answer (the answer's last token never had its KV computed)."""
    stored = {h for r, out in zip(first_turn, outputs) for h in prefix_hashes(r.prompt + out[:-1], block_size)}
    hits = 0
    for r in second_turn:
        for h in prefix_hashes(r.prompt[:-1], block_size):
            if h not in stored:
                break
            hits += block_size
    return hits


def multi_turn(model, trace, args, clock: str, seed: int = 1) -> dict:
    """Each request's second turn (its history + 24 new tokens), served with and without prefix caching.
    The first turn is served on the prefix-caching engine with memory for the whole conversation, so the
    cache holds every block the prediction counts (the benchmark's KV memory is too small to keep a whole
    trace's history cached: there the cut is lower, by what LRU evicted)."""
    gen = torch.Generator().manual_seed(seed)
    messages = [torch.randint(0, model.cfg.vocab_size, (24,), generator=gen).tolist() for _ in trace]
    blocks = sum(2 * blocks_for(len(r.prompt) + r.max_tokens + 32, args.block_size) for r in trace)
    engines = {caching: Engine(model, blocks, args.block_size, SchedulerConfig(
        max_batch=args.max_batch, chunked_prefill=True, token_budget=args.budget, prefix_caching=caching),
        attention=args.attention, clock=clock) for caching in (True, False)}
    outputs = [r.output for r in engines[True].run(trace).results]
    second = [next_turn(r, o, m, id=(r.id, 2), max_tokens=8) for r, o, m in zip(trace, outputs, messages)]
    computed = {}
    for caching, engine in engines.items():
        engine.run(second)
        computed[caching] = engine.scheduler.prefill_computed
    prompt_tokens = sum(len(r.prompt) for r in second)
    return {"prefill_cut": 1 - computed[True] / computed[False],
            "predicted_cut": predicted_hits(trace, outputs, second, args.block_size) / prompt_tokens,
            "second_turn_prompt_tokens": prompt_tokens, "computed_without": computed[False],
            "computed_with": computed[True]}


def goodput(report, tpot_slo: float) -> float:
    """Requests that met their TTFT target and the TPOT target, per second of the run."""
    done = [r for r in report.results if r.status == "finished"]
    elapsed = max(r.finish_time for r in done) - min(r.arrival for r in done)
    return sum(r.ttft <= r.ttft_slo and (r.tpot is None or r.tpot <= tpot_slo) for r in done) / elapsed


SLO_TRACE = {"mean_output": 16, "output_len": (4, 64), "prompt_len": (16, 128)}  # shorter requests: a bounded sweep


def alone_latency(model, args, clock: str) -> dict:
    """TTFT and TPOT of one sweep-sized request served alone (mean prompt and output of the sweep's trace)."""
    trace = bench_trace(args.slo_requests, model.cfg.vocab_size, args.context, seed=2, **SLO_TRACE)
    prompt = trace[0].prompt[:sum(len(r.prompt) for r in trace) // len(trace)]
    request = Request("alone", prompt, SLO_TRACE["mean_output"])
    engine = Engine(model, args.num_blocks, args.block_size, SchedulerConfig(), attention=args.attention, clock=clock)
    engine.run([request])  # warm-up
    r = Engine(model, args.num_blocks, args.block_size, SchedulerConfig(), attention=args.attention,
               clock=clock).run([request]).results[0]
    return {"ttft": r.ttft, "tpot": r.tpot, "prompt": len(prompt)}


def slo_sweep(model, capacity_rps: float, args, clock: str) -> dict:
    """FCFS vs earliest-deadline-first at rising Poisson rates, every step run and timed (arrivals on the
    engine's clock, idle gaps skipped). Targets relative to one request served alone: interactive requests
    want their first token within 5x its TTFT, batch requests within 50x; every request wants TPOT within
    5x (a step of a full batch with a prompt chunk costs a few single decodes on this CPU). Goodput counts
    requests meeting both. Stops after the first rate (the knee) where FCFS meets fewer than 90%."""
    alone = alone_latency(model, args, clock)
    tight, loose, tpot_slo = 5 * alone["ttft"], 50 * alone["ttft"], 5 * alone["tpot"]
    print(f"SLO sweep: one request alone ({alone['prompt']}-token prompt): TTFT {alone['ttft']:.2f} s, TPOT "
          f"{alone['tpot']:.3f} s -> targets TTFT <= {tight:.2f} s (interactive) or {loose:.1f} s (batch), "
          f"TPOT <= {tpot_slo:.3f} s")
    rows, steps = [], []
    for factor in (0.5, 1.0, 1.5, 2.5, 4.0):
        rate = factor * capacity_rps
        trace = bench_trace(args.slo_requests, model.cfg.vocab_size, args.context, seed=2, rate=rate,
                            ttft_slos=(tight, loose), **SLO_TRACE)
        row = {"rate": rate}
        for ordering in ("fcfs", "slo"):
            config = SchedulerConfig(max_batch=args.max_batch, chunked_prefill=True, token_budget=args.budget,
                                     prefix_caching=True, ordering=ordering)
            report = Engine(model, args.num_blocks, args.block_size, config, attention=args.attention,
                            clock=clock).run(trace, progress=True)
            s, steps = report.summary(), steps + report.steps
            met = [r.ttft <= r.ttft_slo and (r.tpot is None or r.tpot <= tpot_slo) for r in report.results]
            row[ordering] = {"goodput": goodput(report, tpot_slo), "slo_met": sum(met) / len(met),
                             "ttft_p50": s["TTFT p50 s"], "ttft_p99": s["TTFT p99 s"], "tpot_p50": s["TPOT p50 s"],
                             "tpot_p99": s["TPOT p99 s"],
                             "tight_ttft_p99": percentile([r.ttft for r in report.results if r.ttft_slo == tight], 99)}
        rows.append(row)
        if row["fcfs"]["slo_met"] < 0.9:
            break
    cost = step_cost_line(steps)
    repeats = [{"seed": seed, **{ordering: goodput(report, tpot_slo) for ordering, report in
                                 knee_runs(model, args, rows[-1]["rate"], (tight, loose), seed, cost).items()}}
               for seed in SLO_SEEDS]
    return {"alone": alone, "tight_s": tight, "loose_s": loose, "tpot_s": tpot_slo, "rows": rows, "at": rows[-1],
            "step_cost": cost, "repeats": repeats}


SLO_SEEDS = (3, 4, 5, 6, 7)  # the traces both orderings serve again at the knee (the sweep's is seed 2)


def step_cost_line(steps) -> dict:
    """Seconds per step and per token computed: a least-squares line through timed steps (the same
    fit as the α–β model of collectives, with tokens in place of bytes)."""
    fit = alpha_beta.fit_line([sum(n for _, n, _ in s.chunks) for s in steps], [s.duration for s in steps])
    return {"step_s": fit.alpha_s, "per_token_s": fit.beta_s_per_byte, "r2": fit.r2}


def knee_runs(model, args, rate: float, ttft_slos, seed: int, cost: dict) -> dict:
    """Both orderings on one sweep-shaped trace, each step priced by ``cost`` instead of timed."""
    trace = bench_trace(args.slo_requests, model.cfg.vocab_size, args.context, seed=seed, rate=rate,
                        ttft_slos=ttft_slos, **SLO_TRACE)
    clock = linear_cost(cost["step_s"], cost["per_token_s"])
    return {ordering: Engine(model, args.num_blocks, args.block_size, SchedulerConfig(
                max_batch=args.max_batch, chunked_prefill=True, token_budget=args.budget, prefix_caching=True,
                ordering=ordering), attention=args.attention, clock=clock).run(trace)
            for ordering in ("fcfs", "slo")}


def slo_table(slo: dict) -> str:
    lines = [f"{'rate/s':>6} {'policy':>6} {'goodput/s':>9} {'met':>5} {'TTFT p50':>8} {'TTFT p99':>8} "
             f"{'TPOT p50':>8} {'TPOT p99':>8} {'interactive TTFT p99':>20}"]
    for row in slo["rows"]:
        for p in ("fcfs", "slo"):
            r = row[p]
            lines.append(f"{row['rate']:>6.2f} {p:>6} {r['goodput']:>9.3f} {r['slo_met']:>5.0%} {r['ttft_p50']:>7.2f}s "
                         f"{r['ttft_p99']:>7.2f}s {r['tpot_p50']:>7.3f}s {r['tpot_p99']:>7.3f}s "
                         f"{r['tight_ttft_p99']:>19.2f}s")
    c = slo["step_cost"]
    lines.append(f"\nat {slo['at']['rate']:.2f}/s on {len(slo['repeats'])} more traces, steps priced at {c['step_s'] * 1e3:.1f} ms "
                 f"+ {c['per_token_s'] * 1e3:.2f} ms per token (fitted to the sweep's steps, r2 {c['r2']:.2f}): goodput/s")
    lines += [f"  trace {r['seed']}: fcfs {r['fcfs']:.3f}  slo {r['slo']:.3f}  ({r['slo'] / r['fcfs'] - 1:+.0%})"
              for r in slo["repeats"]]
    return "\n".join(lines)


def decode_step_ms(model, n_seqs: int, block_size: int, attention: str, clock: str, repeats: int = 10) -> dict:
    """One step of ``n_seqs`` decodes with contexts of 50-800 tokens: milliseconds with decodes
    attending in length groups (the engine's way) and as one group padded to the longest."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, min(800, model.cfg.max_seq_len - 1), (n_seqs,), generator=gen).tolist()
    blocks = BlockManager(sum(blocks_for(n + 1, block_size) for n in lengths), block_size)
    cache = PagedKVCache(model, blocks.allocator.num_blocks, block_size)
    chunks = []
    for i, n in enumerate(lengths):
        blocks.add(i)
        blocks.prepare(i, 0, n + 1)
        chunks.append(Chunk([1], n, blocks.table(i)))
    timer = time.perf_counter if clock == "wall" else time.process_time
    # GPU work is queued: the timer stops only once the device has finished it
    sync = torch.cuda.synchronize if model.tok_embeddings.weight.is_cuda else (lambda: None)
    out, grouped = {}, paged.GROUP_RATIO
    for name, ratio in (("grouped", grouped), ("one group", float("inf"))):
        paged.GROUP_RATIO = ratio
        try:
            paged_forward(model, cache, chunks, attention)  # warm-up
            sync()
            start = timer()
            for _ in range(repeats):
                paged_forward(model, cache, chunks, attention)
            sync()
            out[name] = (timer() - start) / repeats * 1e3
        finally:
            paged.GROUP_RATIO = grouped
    return out


def copy_requests(served, n: int, max_tokens: int, seed: int = 0):
    """Chat requests that ask the model to repeat a passage of English: answers that copy their prompt,
    where prompt lookup drafts well (as in quoting, editing or summarising)."""
    from llmsys.core import zoo

    words, gen = zoo.corpus().split(), torch.Generator().manual_seed(seed)
    requests = []
    for i in range(n):
        start = int(torch.randint(0, len(words) - 60, (1,), generator=gen))
        text = " ".join(words[start:start + 40])
        prompt = served.encode_chat([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}])
        requests.append(Request(i, prompt, max_tokens, stop_ids=served.stop_ids))
    return requests


def step_cost_ms(model, batch: int, tokens_per_seq: int, context: int, repeats: int = 5) -> float:
    """Wall milliseconds of one engine step of ``batch`` sequences at ``context`` computing ``tokens_per_seq``
    tokens each: the cost curve speculation moves along."""
    bs = 16
    blocks = BlockManager(batch * blocks_for(context + tokens_per_seq, bs), bs)
    cache = PagedKVCache(model, blocks.allocator.num_blocks, bs)
    chunks = []
    for i in range(batch):
        blocks.add(i)
        blocks.prepare(i, 0, context + tokens_per_seq)
        chunks.append(Chunk([1] * tokens_per_seq, context, blocks.table(i)))
    paged_forward(model, cache, chunks, all_logits=True)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        paged_forward(model, cache, chunks, all_logits=True)
    return (time.perf_counter() - start) / repeats * 1e3


def spec_vs_batch(served, batches, gamma: int, max_tokens: int) -> list[dict]:
    """Greedy decoding with and without γ prompt-lookup drafts per step, B requests at once, for each B;
    the estimate combines the measured acceptance with the measured step cost at 1 and 1 + γ̄ tokens."""
    rows = []
    for batch in batches:
        trace = copy_requests(served, batch, max_tokens)
        config = SchedulerConfig(max_batch=batch, chunked_prefill=True, token_budget=512)
        blocks = batch * blocks_for(max(len(r.prompt) for r in trace) + max_tokens + gamma, 16)
        Engine(served.model, blocks, 16, config).run(trace[:1])  # warm-up
        plain = Engine(served.model, blocks, 16, config).run(trace, progress=True)
        engine = Engine(served.model, blocks, 16, config, speculate=Speculation("prompt lookup", gamma=gamma))
        spec = engine.run(trace, progress=True)
        decode_steps = sum(1 for s in spec.steps for _, _, kind in s.chunks if kind == "decode")
        out_tokens = sum(len(r.output) for r in spec.results)
        per_step = (out_tokens - batch) / max(decode_steps, 1)  # tokens a sequence gains per decode step
        drafts = engine.drafted / max(decode_steps, 1)  # drafts a decode carried on average
        context = sum(len(r.prompt) for r in trace) // batch + max_tokens // 2
        cost_1 = step_cost_ms(served.model, batch, 1, context)
        cost_k = step_cost_ms(served.model, batch, 1 + round(drafts), context)
        measured = spec.summary()["throughput tok/s"] / plain.summary()["throughput tok/s"]
        same = all(a.output == b.output for a, b in zip(plain.results, spec.results))
        rows.append({"batch": batch, "gamma": gamma, "acceptance": engine.accepted / max(engine.drafted, 1),
                     "tokens_per_step": per_step, "drafts_per_step": drafts, "step_ms_1": cost_1,
                     "step_ms_1+drafts": cost_k, "estimated_speedup": per_step * cost_1 / cost_k,
                     "measured_speedup": measured, "plain_tok_s": plain.summary()["throughput tok/s"],
                     "spec_tok_s": spec.summary()["throughput tok/s"], "same_tokens": same})
    return rows


def spec_table(rows: list[dict]) -> str:
    lines = [f"{'batch':>5} {'accept':>7} {'tok/step':>8} {'drafts':>6} {'step 1':>8} {'step 1+d':>9} "
             f"{'estimate':>8} {'measured':>8} {'plain tok/s':>11} {'spec tok/s':>10} same"]
    for r in rows:
        lines.append(f"{r['batch']:>5} {r['acceptance']:>7.0%} {r['tokens_per_step']:>8.2f} {r['drafts_per_step']:>6.2f} "
                     f"{r['step_ms_1']:>6.0f}ms {r['step_ms_1+drafts']:>7.0f}ms {r['estimated_speedup']:>7.2f}x "
                     f"{r['measured_speedup']:>7.2f}x {r['plain_tok_s']:>11.1f} {r['spec_tok_s']:>10.1f} {r['same_tokens']}")
    return "\n".join(lines)


def bench_threads(model, trace, args, clock: str, sweep: bool = True) -> dict:
    """Everything at the current torch thread count (the SLO sweep only if ``sweep``); returns the JSON row."""
    reports, agree = run(model, trace, args.num_blocks, args.block_size, args.max_batch, args.budget,
                         args.attention, clock)
    summaries = [r.summary() for r in reports]
    print(summary_table(summaries))
    static, continuous, _, prefix = summaries
    speedup = continuous["throughput tok/s"] / static["throughput tok/s"]
    waste = continuous["KV waste"]
    predicted = predicted_steps(trace, args.max_batch, args.num_blocks * args.block_size // args.context)
    print(f"continuous / static: {speedup:.2f}x by {clock} time (goal >= {GOALS['continuous / static']:.0f}x: "
          f"{'met' if speedup >= GOALS['continuous / static'] else 'NOT met'}); steps {static['steps']} / "
          f"{continuous['steps']} = {static['steps'] / continuous['steps']:.2f}x run, {predicted['static']} / "
          f"{predicted['continuous']} = {predicted['ratio']:.2f}x predicted from the trace's lengths")
    print(f"KV waste (continuous): {waste:.1%} of allocated KV memory (goal <= {GOALS['KV waste']:.0%}: "
          f"{'met' if waste <= GOALS['KV waste'] else 'NOT met'}); static: {static['KV waste']:.1%}")
    print(f"requests with identical tokens under every configuration: {agree:.0%}"
          + (" (identical tokens for every request: True)" if agree == 1 else ""))
    turns = multi_turn(model, trace, args, clock) if sweep else None  # token counts: the same at any thread count
    if turns:
        print(f"second turns: prefill tokens {turns['computed_without']} without prefix caching, "
              f"{turns['computed_with']} with: cut {turns['prefill_cut']:.1%}, the trace predicts "
              f"{turns['predicted_cut']:.1%} ({'equal' if abs(turns['prefill_cut'] - turns['predicted_cut']) < 0.005 else 'DIFFERENT'})")
    capacity = prefix["throughput tok/s"] / SLO_TRACE["mean_output"]  # requests/s of the sweep's length
    slo = slo_sweep(model, capacity, args, clock) if args.slo_requests and sweep else None
    if slo:
        print(slo_table(slo))
        at = slo["at"]
        if at["fcfs"]["slo_met"] >= 0.9:
            print("FCFS met 90% of the targets at every rate tried: no rate to compare at")
        else:
            wins = sum(r["slo"] > r["fcfs"] for r in slo["repeats"])
            gain = sum(r["slo"] for r in slo["repeats"]) / sum(r["fcfs"] for r in slo["repeats"]) - 1
            print(f"SLO ordering raises goodput over FCFS at {at['rate']:.2f}/s, where FCFS starts missing: "
                  f"timed {at['slo']['goodput'] / at['fcfs']['goodput'] - 1:+.0%}; priced, on {wins} of "
                  f"{len(slo['repeats'])} traces, {gain:+.0%} in all: "
                  f"{'met' if wins == len(slo['repeats']) else 'NOT met'}")
    return {"threads": torch.get_num_threads(), "configs": summaries,
            "static_tok_s": static["throughput tok/s"], "continuous_tok_s": continuous["throughput tok/s"],
            "continuous_over_static": speedup, "kv_waste": waste, "prefix_hit_rate": prefix["prefix hit rate"],
            "steps_predicted": predicted, "multi_turn": turns, "agree": agree,
            "goodput": {p: slo["at"][p]["goodput"] for p in ("fcfs", "slo")} if slo else None, "slo": slo}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--distributed" in argv:  # prefill and decode in separate processes, KV tiers, routing: their own module
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import serving_distributed

        return serving_distributed.main([a for a in argv if a != "--distributed"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--distributed", action="store_true",
                   help="disaggregated prefill/decode vs colocated, KV tiers, routing (benchmarks/serving_distributed.py)")
    p.add_argument("--model", default="target", help="a zoo model name (smollm2: the real model)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: bf16 for smollm2, else fp32")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--slo-requests", type=int, default=20,
                   help="requests per rate of the SLO sweep, run at the first thread count (0: skip it)")
    p.add_argument("--num-blocks", type=int, default=384,
                   help="KV memory, in blocks (384 x 8 = 3 whole contexts of 1024: what static batching runs at once)")
    p.add_argument("--block-size", type=int, default=8,
                   help="token slots per KV block: a sequence wastes (block_size - 1) / 2 of them on average")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--budget", type=int, default=128, help="tokens per step with chunked prefill")
    p.add_argument("--attention", default="torch", choices=("torch", "triton"))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch CPU thread counts to measure")
    p.add_argument("--context", type=int, default=1024, help="the model's context limit when served")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="step durations by the wall clock, or by this process's CPU time (steadier on a machine "
                        "shared with other work; meaningful with one thread)")
    p.add_argument("--spec", action="store_true",
                   help="only the speculative-decoding table: prompt-lookup drafts at batch 1, 4, 16 (first thread count)")
    p.add_argument("--gamma", type=int, default=4, help="drafts per decode step with --spec")
    p.add_argument("--long-session", action="store_true",
                   help="only the long-session table: a session outgrowing the KV budget, three eviction policies")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from llmsys.serving.served import load_served

    dtype = args.dtype or ("bf16" if args.model == "smollm2" else "fp32")
    served = load_served(args.model, dtype, args.context)
    model = served.model
    clock = "wall" if _device.has_cuda() else args.clock
    if args.long_session:
        torch.set_num_threads(args.threads[0])
        try:
            result = long_session(served, turns=10, user_words=30, answer_tokens=24, budget_blocks=40, progress=True)
        except ValueError as e:
            p.error(str(e))
        print(f"{args.model} {dtype}: a 10-turn session, KV budget {result['budget_blocks']} blocks of 16 "
              f"({result['budget_blocks'] * 16} tokens) vs {result['full_blocks']} for everything")
        print(long_session_table(result))
        if args.json:
            write_json(args.json, {"model": args.model, "dtype": dtype, "long_session": result}, argv)
        return result
    if args.spec:
        torch.set_num_threads(args.threads[0])
        rows = spec_vs_batch(served, (1, 4, 16), args.gamma, max_tokens=48)
        print(f"{args.model} {dtype}, {torch.get_num_threads()} thread(s), greedy, gamma = {args.gamma} prompt-lookup drafts")
        print(spec_table(rows))
        if args.json:
            write_json(args.json, {"model": args.model, "dtype": dtype, "spec": rows}, argv)
        return rows
    trace = bench_trace(args.requests, model.cfg.vocab_size, args.context)
    n, slots = len(trace), args.num_blocks * args.block_size
    kv = model.cfg.kv_bytes_per_token(model.tok_embeddings.weight.element_size())
    print(f"model {args.model}: {model.cfg.n_params() / 1e6:.1f}M params, {dtype} on {_device.device()}, "
          f"context {args.context}, attention={args.attention}, clock={clock}")
    print(f"trace: {n} requests arriving at once, mean prompt {sum(len(r.prompt) for r in trace) / n:.0f}, "
          f"mean output {sum(r.max_tokens for r in trace) / n:.0f} tokens")
    print(f"KV memory: {args.num_blocks} blocks x {args.block_size} = {slots} token slots ({slots * kv / 2**20:.1f} MiB); "
          f"static reserves the whole context ({args.context} tokens): {slots // args.context} requests at once")
    t0 = time.perf_counter()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n--- {torch.get_num_threads()} torch thread(s) ---")
        rows.append(bench_threads(model, trace, args, clock, sweep=not rows))
    step = decode_step_ms(model, args.max_batch, args.block_size, args.attention, clock)
    print(f"\none step of {args.max_batch} decodes, contexts of 50-800 tokens: {step['grouped']:.1f} ms with decodes "
          f"grouped by length (within {paged.GROUP_RATIO}x), {step['one group']:.1f} ms padded to the longest "
          f"({step['one group'] / step['grouped']:.1f}x)")
    print(f"benchmark wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        first = rows[0]
        result = {k: first[k] for k in ("static_tok_s", "continuous_tok_s", "kv_waste", "prefix_hit_rate", "goodput")}
        write_json(args.json, result | {"model": args.model, "dtype": dtype, "by_threads": rows, "decode_step_ms": step},
                   argv)
    return [s for row in rows for s in row["configs"]]


def write_json(path: str, result: dict, argv) -> None:
    """``result`` with how it was measured: the command, when, where, threads, load."""
    stamp = {"command": "python benchmarks/serving.py " + " ".join(sys.argv[1:] if argv is None else argv),
             "when": datetime.datetime.now().isoformat(timespec="seconds"), **ledger.origin(),
             "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0]}
    with open(path, "w") as f:
        json.dump(stamp | result, f, indent=1, default=float)


if __name__ == "__main__":
    main()
