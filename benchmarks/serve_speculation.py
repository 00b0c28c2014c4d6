"""Speculative decoding inside the serving engine, on the agentic workload, at batch 1, 4 and 16.

The agentic sessions (``llmsys.specdec.agentic``: coding and SQL agents that re-read and re-emit
what they saw) are played once by the model's own greedy decoding; every turn's prompt becomes
a request of the trace, all arriving at once in session order. The continuous-batching engine
(chunked prefill, prefix caching) serves the trace with at most B requests running, for B in
1, 4, 16, side by side in one run:

- plain: one token per request per step;
- suffix: every greedy request keeps a suffix-decoding drafter (its own trie, one workload
  trie shared by all) whose draft tree the same batched step verifies, keeping only the draft
  tokens whose chance of acceptance pays for them on the engine's own step costs measured here
  first (``serving.step_costs``, ``StepCosts.worth_keeping``);
- suffix, no off rule: the same verifying every draft token, to show what the rule saves when
  the batch makes a step compute-bound;
- plain in the other dtype: each row's speedup is given over plain decoding in the serving dtype
  and over the faster plain decoding of the two (fp32 verifies exactly, bf16 may step faster).

Per row: throughput on the engine's clock (CPU time of this process on a CPU, steadier on a
shared machine; wall time on a GPU), its ratio to plain at the same B, drafts verified and kept,
tokens a request gains per decode step, decodes left without drafts by the rule, and whether
the outputs equal plain's (token for token in fp32; in bf16 near-ties may break differently).
The dtype is the one the cost curves favour (``specdec.plan``, as ``benchmarks/specdec.py``).

    python benchmarks/serve_speculation.py --json benchmarks/results/serve_speculation.json
    python benchmarks/serve_speculation.py --sessions 6 --new-tokens 48 --dtype float32
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time

import torch

from llmsys import specdec
from llmsys.core import device, zoo
from llmsys.serving import Engine, Request, SchedulerConfig, Speculation, blocks_for, step_costs
from llmsys.specdec import agentic

BLOCK = 16
CURVE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_SIZES = (1, 2, 4, 8, 16, 32)  # decodes per engine step, each after STEP_CONTEXT tokens
STEP_CONTEXT = 256


def agentic_trace(model, tok, sessions: int, new_tokens: int) -> list[Request]:
    prompts = agentic.played_prompts(model, tok, sessions, new_tokens)
    return [Request(f"turn {i}", p[0].tolist(), new_tokens, stop_ids=(tok.eos_token_id,)) for i, p in enumerate(prompts)]


def serve(model, trace, batch: int, clock: str, speculate=None):
    """One engine run of the trace with at most ``batch`` requests running; (report, engine)."""
    config = SchedulerConfig(max_batch=batch, chunked_prefill=True, token_budget=512, prefix_caching=True)
    extra = speculate.nodes + 1 if speculate else 0
    need = sorted((blocks_for(len(r.prompt) + r.max_tokens + extra, BLOCK) for r in trace), reverse=True)
    engine = Engine(model, sum(need[:batch]) + batch, BLOCK, config, clock=clock, speculate=speculate)
    return engine.run(trace), engine


def row(name, batch, report, engine, plain) -> dict:
    out = report.summary()
    decodes = sum(1 for s in report.steps for *_, kind in s.chunks if kind == "decode")
    tokens = sum(len(r.output) for r in report.results)
    same = sum(a.output == b.output for a, b in zip(report.results, plain.results)) if plain else len(report.results)
    return {"method": name, "batch": batch, "tok_s": out["throughput tok/s"], "steps": out["steps"],
            "drafted": engine.drafted, "accepted": engine.accepted,
            "tokens_per_decode": (tokens - len(report.results)) / max(decodes, 1),
            "switched_off": engine.speculator.switched_off if engine.speculator else 0,
            "same_outputs": f"{same}/{len(report.results)}"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=6, help="agentic sessions, 3 turns (requests) each")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--nodes", type=int, default=16, help="most draft tokens per request per step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--json", help="write the rows and the cost curves here")
    args = p.parse_args()
    if min(args.sessions, args.new_tokens, args.nodes, args.threads, *args.batches) < 1:
        sys.exit("--sessions, --new-tokens, --nodes, --threads and --batches must be positive")
    torch.set_num_threads(args.threads)
    dev = device.device()
    clock = "wall" if dev.type == "cuda" else "cpu"
    models = {"float32": zoo.load(zoo.PRETRAINED, device=dev)}
    models["bfloat16"] = copy.deepcopy(models["float32"]).to(torch.bfloat16)
    curves = specdec.cost_curves(models, 512, CURVE_TOKENS, repeats=5)
    dtype = args.dtype if args.dtype != "auto" else specdec.plan(curves, {"nominal": (0.8, 0.0)}).dtype
    model = models[dtype]
    for d, c in curves.items():
        print(f"cost curve {d} (k tokens after 512 / one token): "
              + ", ".join(f"{k}: {s / c[1]:.2f}" for k, s in c.items()) + f"; ridge point {specdec.ridge_point(c):.0f}")
    costs = step_costs(model, STEP_CONTEXT, STEP_SIZES)
    print(f"engine steps in {dtype} (B decodes after {STEP_CONTEXT} tokens / one): "
          + ", ".join(f"{b}: {s / costs.plain[1]:.2f}" for b, s in costs.plain.items()))
    kept = {b: costs.worth_keeping(b, [0.8] * args.nodes) for b in STEP_SIZES}
    print(f"serving in {dtype}, {args.threads} thread(s), {clock} clock; of {args.nodes} draft tokens each accepted "
          f"with chance 0.8, a sequence keeps at batch B: " + ", ".join(f"{b}: {k}" for b, k in kept.items()))
    tok = zoo.tokenizer(zoo.PRETRAINED)
    trace = agentic_trace(model, tok, args.sessions, args.new_tokens)
    print(f"agentic trace: {len(trace)} requests, prompts of {min(len(r.prompt) for r in trace)}-"
          f"{max(len(r.prompt) for r in trace)} tokens, up to {args.new_tokens} new tokens each")
    serve(model, trace[:1], 1, clock)  # warm-up
    rows = []
    for batch in args.batches:
        plain, engine = serve(model, trace, batch, clock)
        batch_rows = [row("plain", batch, plain, engine, None)]
        for other in (d for d in models if d != dtype):  # the baseline is the faster plain decoding of the two
            report, engine = serve(models[other], trace, batch, clock)
            batch_rows.append(row(f"plain, {other}", batch, report, engine, plain))
        for name, spec in (("suffix", Speculation("suffix", nodes=args.nodes, costs=costs)),
                           ("suffix, no off rule", Speculation("suffix", nodes=args.nodes))):
            report, engine = serve(model, trace, batch, clock, spec)
            batch_rows.append(row(name, batch, report, engine, plain))
        fastest_plain = max(r["tok_s"] for r in batch_rows if r["method"].startswith("plain"))
        for r in batch_rows:
            r["speedup"] = r["tok_s"] / batch_rows[0]["tok_s"]  # over plain decoding in the serving dtype
            r["speedup_vs_fastest_plain"] = r["tok_s"] / fastest_plain
            print(f"B={batch:>2} {r['method']:<20} {r['tok_s']:7.1f} tok/s {r['speedup']:5.2f}x "
                  f"({r['speedup_vs_fastest_plain']:.2f}x the fastest plain)  steps {r['steps']:>5}  "
                  f"drafts {r['accepted']}/{r['drafted']} kept  {r['tokens_per_decode']:.2f} tok/decode  "
                  f"off {r['switched_off']:>5}  same outputs {r['same_outputs']}", flush=True)
        rows += batch_rows
    if args.json:
        meta = {"command": "python benchmarks/serve_speculation.py " + " ".join(sys.argv[1:]),
                "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dtype": dtype, "threads": args.threads,
                "clock": clock, "requests": len(trace), "new_tokens": args.new_tokens}
        with open(args.json, "w") as f:
            json.dump({**meta, "cost_curves": curves, "step_costs": dataclasses.asdict(costs),
                       "kept_at_chance_0.8": kept, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
