"""Speculative decoding benchmark: tokens per second of target-only decoding against every
drafting method, measured side by side in one run, with acceptance, tokens per target call and
a lossless check (greedy outputs must equal the target's own greedy decoding, token for token).

    python benchmarks/specdec.py --model smollm2 --json out.json   # the real chat model, 1 and 2 threads
    python benchmarks/specdec.py --model smollm2 --workload agentic --threads 1 --json benchmarks/results/specdec_agentic.json
    python benchmarks/specdec.py --model smollm2 --workload agentic --threads 1 --dtype float32 --json out.json
    python benchmarks/specdec.py --model smollm2 --quick           # 4 prompts, 48 new tokens, 2 sessions
    python benchmarks/specdec.py                                   # the embedded zoo models
    python benchmarks/specdec.py --bf16                            # zoo models in bf16

With ``--model smollm2`` the target is SmolLM2-135M-Instruct. The run first measures the cost
curve of both dtypes (scoring k tokens in one call, relative to the fastest one-token step) and
verifies in the dtype the curves favour (``--dtype auto``: bf16 where it is memory-bound, fp32
where bf16 is emulated). The drafters: the zoo's EAGLE head (one decoder layer on the target's
features, an 8k-row head; ``llmsys.specdec.chat``) as a chain, a static tree and an EAGLE-2
dynamic tree; prompt lookup; suffix decoding (``llmsys.specdec.suffix``, its workload trie
shared across the task's prompts, each tree cut to the nodes worth their place in the call on the
measured cost curve); and the hybrid (``llmsys.specdec.hybrid``: the suffix tree where the tries
expect at least one accepted token, the EAGLE dynamic tree elsewhere). Workloads: 18 held-out
chat prompts (questions and explanations); an editing task where copying is the point; and agentic sessions
(``llmsys.specdec.agentic``: a coding agent and a SQL agent, three turns each, every turn's
context holding the earlier ones). Plain KV-cached decoding runs in fp32 and in bf16; the
baseline is the faster of the two in the same run. Per method: acceptance α, tokens per target
call, draft cost ratio c (wall time per drafted token / per baseline token), speedup by wall
and CPU time, and the analytic speedup E(α, γ) / (γc + 1) (Leviathan et al., Thm 3.8) beside it.

Methods run round-robin (prompt 1 with every method, then prompt 2, ...), so a machine shared
with other work slows them all alike. Two clocks: wall time, and the CPU time of this process
(robust when other processes compete for the cores; on a GPU only wall time means anything).

Greedy rows are lossless when they reproduce target-only greedy decoding token for token. In
bf16 a token's logits can depend on how many tokens share its forward call (other kernels,
other rounding); the check reports any prompt where that broke a near-tie.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time

import torch

from llmsys.core import device, pretrained, zoo
from llmsys import specdec
from llmsys.specdec import agentic, chat

SMOLLM2_GAMMA, SMOLLM2_WIDTHS, LOOKUP_NGRAM = 5, (3, 1, 1, 1), 3
SMOLLM2_DYNAMIC = (6, 4, 12)  # EAGLE-2 tree: depth, nodes expanded per level, nodes verified


def prompts_from(val_ids: torch.Tensor, n: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(val_ids) - length, (n,), generator=gen).tolist()
    return [val_ids[s:s + length].long()[None] for s in starts]


def method_rows(rows: list[dict], temperature: float, threads: int, new_tokens: int, gammas: dict,
                dtype: str) -> list[dict]:
    """Rows of measure_methods with the speedups over the baseline (the faster target-only row),
    c and the analytic speedup: what the JSON lists. Greedy drafting verified in ``dtype`` is lossless
    when every output equals plain greedy decoding's, in fp32 only: in bf16 a near-tie can break either
    way with the number of tokens in a call, so those rows give their match rate and are never lossless."""
    base = min((r for r in rows if r["method"].startswith("target only")), key=lambda r: r["wall"])
    base_step = base["wall"] / (new_tokens * base["n_prompts"])  # wall seconds per target-only token
    out = []
    for r in rows:
        gamma = gammas.get(r["method"])
        c = r["draft_seconds"] / r["drafted"] / base_step if r["drafted"] else 0.0
        alpha = r["acceptance"]
        analytic = (specdec.expected_speedup(alpha, gamma, c) if gamma and alpha == alpha else None)
        out.append({"name": r["method"], "temperature": temperature, "threads": threads,
                    "speedup": base["wall"] / r["wall"], "speedup_cpu": base["cpu"] / r["cpu"],
                    # plain decoding is the target itself; greedy drafting must reproduce it token for token
                    "lossless": (r["exact"] and dtype == "float32"
                                 if temperature == 0 and not r["method"].startswith("target only") else True),
                    "lossless_check": ("tokens identical to target-only greedy decoding" if temperature == 0
                                       else "distribution preserved (tests/test_specdec.py)"),
                    "match_rate": r["matches"] / r["n_prompts"] if temperature == 0 else None,
                    "acceptance": None if alpha != alpha else alpha, "tokens_per_call": r["tokens_per_call"],
                    "c": c, "gamma": gamma, "analytic_speedup": analytic,
                    "tok_s_wall": r["tok_s_wall"], "tok_s_cpu": r["tok_s_cpu"]})
    return out


def format_rows(rows: list[dict], title: str) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [title, f"{'method':<34} {'α':>5} {'tok/call':>8} {'c':>6} {'speedup wall':>12} {'cpu':>6} "
                    f"{'analytic':>8} {'lossless':>8} {'same':>5}"]
    for r in rows:
        lines.append(f"{r['name']:<34} {f(r['acceptance'], '.2f'):>5} {r['tokens_per_call']:>8.2f} "
                     f"{f(r['c'], '.3f'):>6} "
                     f"{r['speedup']:>11.2f}x {r['speedup_cpu']:>5.2f}x {f(r['analytic_speedup'], '.2f'):>8} "
                     f"{'yes' if r['lossless'] else 'NO':>8} {f(r['match_rate'], '.0%'):>5}")
    return "\n".join(lines)


def run_smollm2(args, threads: int) -> tuple[list[dict], dict]:
    dev = device.device()
    tok = zoo.tokenizer(zoo.PRETRAINED)
    models = {"float32": zoo.load(zoo.PRETRAINED, device=dev)}
    models["bfloat16"] = copy.deepcopy(models["float32"]).to(torch.bfloat16)
    head = chat.load_eagle(models["float32"], sequences=args.eagle_answers)  # stays fp32: a few MB, in cache either way
    context = 256
    curves = specdec.cost_curves(models, context, ks=(1, 2, 4, 8, 16, 32), repeats=10)  # suffix trees reach 24 nodes
    # the dtype to verify in: the one a drafter that agrees 80% of the time would gain most from here
    dtype = args.dtype if args.dtype != "auto" else specdec.plan(curves, {"nominal": (0.8, 0.0)}).dtype
    target = models[dtype]
    clock = "wall" if dev.type == "cuda" else "cpu"
    fastest = min(curve[1] for curve in curves.values())
    print(f"\n== {threads} thread(s), device {dev}: one token at a {context}-token context costs "
          + ", ".join(f"{d} {c[1] * 1e3:.1f} ms" for d, c in curves.items())
          + f" ({clock} time); the baseline is the faster plain decoding, measured below in both dtypes; "
            f"the drafting methods verify with the target in {dtype} (--dtype {args.dtype})")
    for d, curve in curves.items():
        print(f"cost curve {d}, k tokens in one call / the fastest one-token step: "
              + ", ".join(f"{k}: {seconds / fastest:.2f}" for k, seconds in curve.items()))
    drafting = specdec.standard_methods(target, heads={"eagle": head}, gamma=args.gamma, widths=args.widths,
                                        lookup_ngram=LOOKUP_NGRAM, dynamic=SMOLLM2_DYNAMIC)
    # one workload trie across the task's prompts; each tree cut to the nodes that pay on this dtype's curve
    suffix = specdec.SuffixDrafter(target.cfg.vocab_size, cost_curve=curves[dtype])
    drafting["suffix decoding"] = lambda p, n, t, g: specdec.suffix_decode(target, suffix, p, n, t, generator=g)
    hybrid = specdec.HybridDrafter(target.cfg.vocab_size, specdec.make_drafter(head, target), SMOLLM2_DYNAMIC,
                                   cost_curve=curves[dtype])
    drafting["hybrid: suffix, else EAGLE"] = lambda p, n, t, g: specdec.suffix_decode(target, hybrid, p, n, t,
                                                                                        generator=g)
    methods = {f"target only, {d}": (lambda p, n, t, g, m=m: specdec.autoregressive_decode(m, p, n, t, generator=g))
               for d, m in models.items()}
    # the lossless check compares with the plain decoding of the dtype the drafting methods verify in
    methods = {f"target only, {dtype}": methods.pop(f"target only, {dtype}"), **methods,
               **{k: v for k, v in drafting.items() if k != "target only"}}
    gammas = {name: args.gamma for name in methods if "chain" in name}
    tasks = {}
    if "chat" in args.workload:
        tasks["chat"] = ([p.to(dev) for p in chat.eval_prompts(tok)][:args.prompts], methods)
    if "editing" in args.workload:
        tasks["editing"] = ([pretrained.chat_ids(tok, chat.EDIT_PROMPT).to(dev)],
                            {k: v for k, v in methods.items() if "tree" not in k})
    if "agentic" in args.workload:
        tasks["agentic"] = (agentic.played_prompts(target, tok, args.sessions, args.new_tokens), methods)
    results = []
    record = {"threads": threads, "context": context, "verify_dtype": dtype, "clock": clock,
              "seconds_one_token": {d: c[1] for d, c in curves.items()},
              "cost_curves": {d: {k: s / fastest for k, s in c.items()} for d, c in curves.items()}, "ceiling_t1": {}}
    for task, (task_prompts, task_methods) in tasks.items():
        ceiling = record["ceiling_t1"][task] = specdec.sampled_ceiling(target, task_prompts, args.new_tokens)
        print(f"\n{task}, temperature 1: along the target's own sampled answers its likeliest token has p = "
              f"{ceiling['p_max']:.2f} on average and its top {ceiling['top']} p = {ceiling['p_top']:.2f}: the "
              f"chance a fixed draft token (or a level of {ceiling['top']}) is accepted, at best; an oracle chain "
              f"of its likeliest tokens would give {ceiling['chain_tokens']:.2f} tokens per call")
        reference = [specdec.autoregressive_decode(target, p, args.new_tokens)[0] for p in task_prompts]
        for temperature in (0.0, 1.0):
            rows = specdec.measure_methods(task_methods, task_prompts, args.new_tokens, temperature,
                                           reference if temperature == 0 else None, progress=True)
            for r in rows:
                r["n_prompts"] = len(task_prompts)
            rows = method_rows(rows, temperature, threads, args.new_tokens, gammas, dtype)
            for r in rows:
                r["task"], r["dtype"] = task, dtype
            print("\n" + format_rows(rows, f"{task}: {len(task_prompts)} prompt(s) x {args.new_tokens} new tokens, "
                                            f"temperature {temperature:g}, {threads} thread(s)"))
            results += rows
    return results, record


def run_zoo(args, threads: int) -> list[dict]:
    dev = device.device()
    target, draft = zoo.load("target", device=dev), zoo.load("draft", device=dev)
    train_ids, val_ids = zoo.dataset()
    heads = {kind: specdec.load_head(spec, target, train_ids) for kind, spec in specdec.HEAD_SPECS.items()}
    if args.bf16:
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
        heads = {k: h.to(torch.bfloat16) for k, h in heads.items()}
    prompts = [p.to(dev) for p in prompts_from(val_ids, args.prompts, args.prompt_len)]
    clock = "wall" if dev.type == "cuda" else "cpu"
    print(f"device {dev}, {torch.get_num_threads()} thread(s); target {target.cfg.n_params():,} params, "
          f"draft {draft.cfg.n_params():,}; {args.prompts} prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens each")
    one = specdec.call_seconds(target, args.prompt_len, 1)
    costs = ", ".join(f"{k}: {specdec.call_seconds(target, args.prompt_len, k) / one:.2f}x" for k in (2, 5, 8, 16, 32))
    print(f"target call, 1 token: {one * 1e3:.2f} ms ({clock} time); k tokens in one call cost {costs}")
    c = specdec.call_seconds(draft, args.prompt_len, 1) / one
    print(f"draft model call, 1 token: c = {c:.2f} of a target call")

    methods = specdec.standard_methods(target, draft, heads, gamma=args.gamma, widths=args.widths)
    reference = [specdec.autoregressive_decode(target, p, args.new_tokens)[0] for p in prompts]
    results = {}
    for mode, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        rows = specdec.measure_methods(methods, prompts, args.new_tokens, temperature,
                                       reference if temperature == 0 else None, progress=True)
        note = ("lossless = the same tokens as target-only greedy decoding" if temperature == 0
                else "lossless in distribution (tests/test_specdec.py)")
        print("\n" + specdec.format_table(rows, f"{mode} (temperature {temperature:g}); {note}"))
        results[mode] = rows
    key = f"tok_s_{clock}"
    best_mode, best = max(((m, r) for m, rows in results.items() for r in rows[1:]),
                          key=lambda mr: mr[1][key] / results[mr[0]][0][key])
    print(f"\nbest: {best['method']} ({best_mode}), {best[key] / results[best_mode][0][key]:.2f}x "
          f"target-only by {clock} time")
    # what no drafter could beat here: a round yields E(α, γ) tokens and costs at least its verify call
    for mode, rows in results.items():
        chain = max((r for r in rows if "chain" in r["method"]), key=lambda r: r["acceptance"])
        gamma = int(chain["method"].rsplit("γ=", 1)[1])
        verify = specdec.call_seconds(target, args.prompt_len, gamma + 1) / one
        tokens = specdec.expected_tokens(chain["acceptance"], gamma)
        print(f"ceiling ({mode}): α = {chain['acceptance']:.2f} ({chain['method']}) gives E = {tokens:.2f} tokens per "
              f"round; verifying {gamma + 1} tokens costs {verify:.2f} steps, so even free drafting gives at most "
              f"{tokens / verify:.2f}x")
    exact = all(r["exact"] for r in results["greedy"])
    if not exact and not args.bf16:
        raise SystemExit("a greedy method changed the output: speculative decoding must be lossless")
    if not exact:
        _explain_bf16(target, reference, args.prompt_len)
    return [{"name": r["method"], "temperature": 0.0 if mode == "greedy" else 1.0, "threads": threads,
             "speedup": r[key] / rows[0][key], "lossless": r["exact"] if mode == "greedy" else True}
            for mode, rows in results.items() for r in rows]


def _explain_bf16(target, reference, prompt_len: int) -> None:
    # In bf16 the target's logits for a token depend on how many tokens share its forward call
    # (other kernels, other rounding), so near-ties can break differently. The target alone shows it:
    with torch.no_grad():
        full_pass = [target(ref[:, :-1]).argmax(-1)[0, prompt_len - 1:] for ref in reference]
    disagree = sum(not torch.equal(f, ref[0, prompt_len:]) for f, ref in zip(full_pass, reference))
    print(f"\nbf16: greedy outputs differ from target-only decoding. The target alone disagrees with itself "
          f"(one token per call vs one call over the whole sequence) on {disagree} of {len(reference)} prompts: "
          f"rounding, not the algorithm. Run without --bf16 for the exact check.")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("zoo", "smollm2"), default="zoo")
    parser.add_argument("--prompts", type=int, default=None, help="chat prompts (smollm2: up to 18; zoo: 6)")
    parser.add_argument("--prompt-len", type=int, default=32, help="zoo: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=None, help="draft tokens per round (chains)")
    parser.add_argument("--widths", default=None, help="children per node at each depth (trees), e.g. 3,2,1")
    parser.add_argument("--threads", default=None, help="intra-op threads, a comma list (smollm2: 1,2; zoo: 1)")
    parser.add_argument("--bf16", action="store_true", help="zoo: models and heads in bf16")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="smollm2: the target's dtype in the drafting methods; auto: the one whose measured "
                             "cost curve favours drafting here (the baseline is the faster plain decoding of the "
                             "two, measured in the same run)")
    parser.add_argument("--workload", nargs="+", choices=("chat", "editing", "agentic"),
                        default=["chat", "editing", "agentic"], help="smollm2: the tasks to run")
    parser.add_argument("--sessions", type=int, default=6, help="smollm2: agentic sessions (3 turns each)")
    parser.add_argument("--eagle-answers", type=int, default=chat.DEFAULT_SEQUENCES,
                        help="smollm2: answers the EAGLE head trains on (a size other than the zoo's default is "
                             "built once, minutes per hundred answers; benchmarks/eagle_data.py measures what it buys)")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    parser.add_argument("--json", help="write every method's row to this file")
    args = parser.parse_args()
    smol = args.model == "smollm2"
    try:
        threads = [int(t) for t in (args.threads or ("1,2" if smol else "1")).split(",")]
        default_widths = SMOLLM2_WIDTHS if smol else (3, 2, 1)
        args.widths = tuple(int(w) for w in args.widths.split(",")) if args.widths else default_widths
    except ValueError:
        sys.exit("--threads and --widths take comma-separated integers, e.g. --threads 1,2 --widths 3,2,1")
    args.gamma = args.gamma or (SMOLLM2_GAMMA if smol else 3)
    args.prompts = args.prompts or (len(chat.EVAL_PROMPTS) if smol else 6)
    if args.quick:
        args.prompts, args.new_tokens, args.sessions = (4, 48, 2) if smol else (3, 64, 2)
    if min(threads + list(args.widths) + [args.gamma, args.prompts, args.new_tokens, args.sessions,
                                          args.eagle_answers]) < 1:
        sys.exit("--threads, --gamma, --widths, --prompts, --sessions, --eagle-answers and --new-tokens must be "
                 "positive")
    rows, records = [], []  # records: per thread count, the cost curves and ceilings the run measured
    for n in threads:
        torch.set_num_threads(n)
        if smol:
            more, record = run_smollm2(args, n)
            rows, records = rows + more, records + [record]
        else:
            rows += run_zoo(args, n)
    if args.json:
        meta = {"command": "python benchmarks/specdec.py " + " ".join(sys.argv[1:]), "model": args.model,
                "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "new_tokens": args.new_tokens, "prompts": args.prompts,
                "eagle_answers": args.eagle_answers}
        with open(args.json, "w") as f:
            json.dump({**meta, "measured": records, "methods": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
