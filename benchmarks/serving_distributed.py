"""The KV cache as a distributed store: disaggregated prefill/decode vs one colocated engine, then KV tiers
and prefix-aware routing at a small size, in one JSON (``python benchmarks/serving.py --distributed``).

1. Colocated vs disaggregated on two traces, served in real time (arrivals wait for their wall-clock
   time): chat (``trace.make_trace``: Poisson arrivals, prompts after shared system prompts, a long tail
   of answers) and agentic (``specdec.agentic`` coding and SQL sessions played once by the model, every
   turn resending the whole session: long prompts, short answers, sessions starting ``--agent-gap`` s
   apart and their turns ``--turn-gap`` s apart, an open loop). Colocated: one engine with 2 torch
   threads (equal total threads) and with 1 (each instance's share), whole prompts per step and, as a
   tuned baseline, chunked prefill (Sarathi-Serve). Disaggregated (``serving.disagg``): a prefill process
   and a decode process of 1 thread each.
   TTFT and TPOT p50/p95, goodput (requests per second with TTFT <= its target and TPOT <= its target;
   targets are multiples of one median request served alone), and whether every token matches.
   DistServe's argument (Zhong et al., OSDI'24): a prefill burst stalls every decode that shares its step,
   so TPOT p95 should drop when prefills run elsewhere; on 2 shared cores the two processes also compete
   for the cores, which a GPU per instance would not.
2. Per transferred prompt: bytes sent (what the transport took) = layers × 2 × KV heads × head dim ×
   tokens × bytes (``accounting.kv_cache_bytes``), the measured transfer time beside the α–β prediction
   of chapter 2 (α, β fitted here from a gloo ping-pong, ``alpha_beta.time_send_recv``).
3. KV tiers (``benchmarks/kv_tiers.py`` at a small size: hit rates per tier, reload vs recompute TTFT,
   the crossover context) and prefix-aware vs round-robin routing (``benchmarks/serve_router.py`` at a
   small size: hit rates, TTFT, goodput), run as they are and stored under "tiers" and "routing".

    python benchmarks/serving.py --distributed --json benchmarks/results/serving_distributed.json
    python benchmarks/serving.py --distributed --quick          # the tiny model, no tiers or routing (CI)

All times are wall times on this machine; on a shared machine they include what else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmsys.core.dist import launch
from llmsys.parallel import alpha_beta
from llmsys.serving import Engine, Request, SchedulerConfig, make_trace, percentile
from llmsys.serving.disagg import kv_transfer_bytes, serve_disaggregated

sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmarks reused here
import serving  # goodput, write_json

BS = 16


def chat_trace(served, n: int, rate: float, seed: int = 0) -> list[Request]:
    from llmsys.core import zoo

    ids = served.encode(zoo.corpus()[:200_000])
    return make_trace(n, vocab_size=served.model.cfg.vocab_size, max_seq_len=served.model.cfg.max_seq_len, seed=seed,
                      rate=rate, prompt_len=(16, 160), mean_output=32, output_len=(4, 96), n_system_prompts=3,
                      system_len=48, shared_fraction=0.75, corpus_ids=ids)


def agentic_trace(served, sessions: int, answer_tokens: int, gap: float, turn_gap: float) -> list[Request]:
    """Every turn of the agent sessions, played once by the model (greedy), as requests."""
    from llmsys.specdec import agentic

    engine, trace = Engine(served.model, 4096 // BS * 4, BS, SchedulerConfig(prefix_caching=True)), []
    for s, session in enumerate(agentic.sessions(sessions)):
        def answer(messages, s=s):
            prompt = served.encode_chat(messages)[-(served.model.cfg.max_seq_len - answer_tokens):]
            trace.append(Request((s, len(trace)), prompt, answer_tokens, arrival=s * gap + len(
                [r for r in trace if r.id[0] == s]) * turn_gap))
            return served.decode(engine.run([dataclasses.replace(trace[-1], arrival=0.0)]).results[0].output)
        agentic.run(session, answer)
    return sorted(trace, key=lambda r: r.arrival)


def ping_pong(max_bytes: int, repeats: int) -> alpha_beta.Fit:
    sizes = tuple(2**k for k in range(10, max(11, max_bytes.bit_length() + 1), 2))
    rows = launch(alpha_beta.time_send_recv, 2, args=(sizes, repeats), timeout=120)[0]
    return alpha_beta.fit_line([b for b, _ in rows], [t for _, t in rows], "send")


def latency(report, ttft_slo: float, tpot_slo: float) -> dict:
    done = [r for r in report.results if r.status == "finished"]
    for r in done:
        r.ttft_slo = ttft_slo
    return {"finished": len(done), "requests": len(report.results),
            "ttft_p50": percentile([r.ttft for r in done], 50), "ttft_p95": percentile([r.ttft for r in done], 95),
            "tpot_p50": percentile([r.tpot for r in done], 50), "tpot_p95": percentile([r.tpot for r in done], 95),
            "goodput_rps": serving.goodput(report, tpot_slo),
            "slo_met": sum(r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo) for r in done) / len(done)}


def alone(model, trace) -> tuple[float, float]:
    """TTFT and TPOT of the trace's median request served alone (1 thread, after a warm-up)."""
    median = sorted(trace, key=lambda r: len(r.prompt) + r.max_tokens)[len(trace) // 2]
    request = dataclasses.replace(median, id="alone", arrival=0.0, max_tokens=max(median.max_tokens, 8))
    engine = Engine(model, 512, BS)
    engine.run([request])
    r = engine.run([request]).results[0]
    return r.ttft, r.tpot


def compare(model, trace, args, fit) -> dict:
    torch.set_num_threads(1)
    ttft_alone, tpot_alone = alone(model, trace)
    ttft_slo, tpot_slo = args.ttft_slo * ttft_alone, args.tpot_slo * tpot_alone
    rows, reports = {}, {}
    for threads in (2, 1):  # 2: the cores the two instances use together; 1: what each of them has
        torch.set_num_threads(threads)
        for name, config in (("colocated", SchedulerConfig(prefix_caching=True)),
                             ("colocated + chunked", SchedulerConfig(prefix_caching=True, chunked_prefill=True,
                                                                     token_budget=args.budget))):
            reports[f"{name}, {threads} thr"] = Engine(model, args.blocks, BS, config).run(trace, realtime=True)
    run = serve_disaggregated(model, trace, args.blocks, args.blocks, BS, timeout=args.timeout)  # 1 thread each
    reports["disaggregated"] = run.report
    for name, report in reports.items():
        rows[name] = latency(report, ttft_slo, tpot_slo)
    elem = model.tok_embeddings.weight.element_size()
    formula = [kv_transfer_bytes(model.cfg, t["tokens"], elem) for t in run.transfers]
    seconds = [t["seconds"] for t in run.transfers]
    predicted = [fit.predict(b, 2) for b in formula]
    transfer = {"transfers": len(run.transfers), "bytes_sent": sum(t["bytes_sent"] for t in run.transfers),
                "bytes_formula": sum(formula),
                "bytes_equal_formula": all(t["bytes_sent"] == t["bytes_received"] == f for t, f in zip(run.transfers, formula)),
                "control_bytes": run.control_bytes, "seconds_p50": percentile(seconds, 50),
                "seconds_p95": percentile(seconds, 95), "alpha_beta_p50": percentile(predicted, 50),
                "measured_over_predicted_p50": percentile([s / p for s, p in zip(seconds, predicted)], 50),
                "tokens_p50": percentile([t["tokens"] for t in run.transfers], 50)}
    colocated = reports["colocated, 2 thr"].results
    disagg_p95 = rows["disaggregated"]["tpot_p95"]
    return {"slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo, "ttft_alone_s": ttft_alone, "tpot_alone_s": tpot_alone},
            "latency": rows, "transfer": transfer, "prefill_waits": run.prefill_waits,
            "blocks_in_use_after": list(run.blocks_in_use),
            "tokens_equal": [r.output for r in run.report.results] == [r.output for r in colocated],
            "tpot_p95_disagg_over": {name: disagg_p95 / r["tpot_p95"] for name, r in rows.items() if name != "disaggregated"}}


def table(name: str, result: dict) -> str:
    lines = [f"{name}: SLO TTFT <= {result['slo']['ttft_s'] * 1e3:.0f} ms, TPOT <= {result['slo']['tpot_s'] * 1e3:.1f} ms",
             f"  {'':26} {'done':>5} {'TTFT50':>8} {'TTFT95':>8} {'TPOT50':>8} {'TPOT95':>8} {'SLO met':>8} {'goodput':>8}"]
    for config, r in result["latency"].items():
        lines.append(f"  {config:26} {r['finished']:>2}/{r['requests']:<2} {r['ttft_p50'] * 1e3:7.1f}m "
                     f"{r['ttft_p95'] * 1e3:7.1f}m {r['tpot_p50'] * 1e3:7.2f}m {r['tpot_p95'] * 1e3:7.2f}m "
                     f"{r['slo_met']:8.0%} {r['goodput_rps']:8.2f}")
    t = result["transfer"]
    lines.append(f"  KV sent: {t['transfers']} prompts, {t['bytes_sent'] / 2**20:.2f} MiB = formula "
                 f"{t['bytes_formula'] / 2**20:.2f} MiB ({'equal' if t['bytes_equal_formula'] else 'NOT EQUAL'}); "
                 f"median prompt {t['tokens_p50']:.0f} tokens: measured {t['seconds_p50'] * 1e3:.2f} ms, α–β "
                 f"{t['alpha_beta_p50'] * 1e3:.2f} ms (measured/predicted {t['measured_over_predicted_p50']:.1f}x)")
    lines.append(f"  tokens equal to colocated: {result['tokens_equal']}; prefill waited for decode blocks "
                 f"{result['prefill_waits']} times")
    lines.append("  TPOT p95 disaggregated / " + ", ".join(f"{name} {ratio:.2f}"
                                                          for name, ratio in result["tpot_p95_disagg_over"].items()))
    return "\n".join(lines)


def reused(module, argv) -> dict:
    """Run a sibling benchmark's main with ``argv`` plus a JSON path; return its JSON."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "out.json")
        module.main([*argv, "--json", path])
        return json.loads(Path(path).read_text())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="serving.py --distributed")
    p.add_argument("--model", default="target", help="a zoo model (target, tiny, ...) or smollm2")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--context", type=int, default=2048, help="the served context (agent sessions are long)")
    p.add_argument("--chat-requests", type=int, default=32)
    p.add_argument("--chat-rate", type=float, default=8.0, help="chat arrivals per second")
    p.add_argument("--agent-sessions", type=int, default=6, help="agent sessions (3 turns each, up to 9)")
    p.add_argument("--agent-tokens", type=int, default=32, help="answer tokens per agent turn")
    p.add_argument("--agent-gap", type=float, default=0.3, help="seconds between agent sessions' starts")
    p.add_argument("--turn-gap", type=float, default=0.6, help="seconds between a session's turns")
    p.add_argument("--blocks", type=int, default=512, help="KV blocks of 16 per engine")
    p.add_argument("--budget", type=int, default=128, help="tokens per step of the chunked colocated engine")
    p.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT target, x the median request alone")
    p.add_argument("--tpot-slo", type=float, default=3.0, help="TPOT target, x the median request alone")
    p.add_argument("--repeats", type=int, default=10, help="ping-pong round trips per size")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="the tiny model, short traces, no tiers or routing")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.context, args.chat_requests, args.agent_sessions, args.agent_tokens = "tiny", 1024, 8, 1, 8
    from llmsys.serving.served import load_served

    t0 = time.perf_counter()
    served = load_served(args.model, args.dtype, args.context, device="cpu")
    model = served.model
    traces = {"chat": chat_trace(served, args.chat_requests, args.chat_rate),
              "agentic": agentic_trace(served, args.agent_sessions, args.agent_tokens, args.agent_gap, args.turn_gap)}
    longest = max(len(r.prompt) for trace in traces.values() for r in trace)
    fit = ping_pong(kv_transfer_bytes(model.cfg, longest, model.tok_embeddings.weight.element_size()), args.repeats)
    print(f"{args.model} {args.dtype}, KV {model.cfg.kv_bytes_per_token(model.tok_embeddings.weight.element_size())} "
          f"B/token; gloo ping-pong: α = {fit.alpha_s * 1e6:.0f} µs, 1/β = {fit.bandwidth / 1e9:.2f} GB/s (R² {fit.r2:.2f})")
    out = {"model": args.model, "dtype": args.dtype, "threads": "colocated: one engine with 2 threads (the cores "
           "both instances use together) and with 1; disaggregated: prefill 1 thread + decode 1 thread", "alpha_beta": dataclasses.asdict(fit), "traces": {}}
    for name, trace in traces.items():
        print(f"\n{name}: {len(trace)} requests, prompts {statistics.median(len(r.prompt) for r in trace):.0f} tokens "
              f"(median, max {max(len(r.prompt) for r in trace)}), answers {statistics.median(r.max_tokens for r in trace):.0f}")
        out["traces"][name] = compare(model, trace, args, fit)
        print(table(name, out["traces"][name]))
    if not args.quick:
        import kv_tiers
        import serve_router

        contexts = ["32", "128", "512", "1024"] if args.model == "smollm2" else ["32", "64", "128", "192"]
        out["tiers"] = reused(kv_tiers, ["--model", args.model, "--threads", "1", "--contexts", *contexts,
                                         "--sessions", "2", "--turns", "3", "--tool-words", "12"])
        out["routing"] = reused(serve_router, ["--model", args.model, "--chat-requests", "16", "--agent-sessions", "3",
                                               "--agent-tokens", "24", "--kv-blocks", "128"])
    out["wall_s"] = time.perf_counter() - t0
    cores, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
    if load > cores:
        out["note"] = (f"a loaded machine: load average {load:.1f} on {cores} cores at the end of the run; "
                       "wall times include other processes' work")
    print(f"\nbenchmark wall time {out['wall_s']:.0f} s (load average {os.getloadavg()[0]:.1f})")
    if args.json:
        serving.write_json(args.json, out, ["--distributed", *(sys.argv[2:] if argv is None else argv)])
    return out
