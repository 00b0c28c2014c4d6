"""Load any OpenAI-compatible server with chat sessions at several Poisson rates.

    python -m llmsys serve --model smollm2 &                      # the course's server
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --model smollm2

It reports, per rate: requests served and failed (429s included), output tokens/s, TTFT,
TPOT and ITL at p50 and p99, the share meeting the SLO (TTFT <= 1 s, TPOT <= 100 ms by
default), goodput (such requests per second) and the server's prefix-cache hit rate (from
its /metrics; blank for servers that name it differently). The trace and the metrics are
described in ``llmsys.serving.load``.

The script speaks only the OpenAI API, so on a GPU machine point the same command at vLLM
(`vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8000`) or SGLang
(`python -m sglang.launch_server --model-path ... --port 8000`) and compare with the
course's engine on the same trace. Loopback addresses only; bounded by --requests per rate
and --max-seconds.

    python benchmarks/serve_load.py --long-prompt --json hol.json   # fair prefill, in-process

``--long-prompt`` measures head-of-line blocking in the server's engine itself (no HTTP): short
requests arrive while one ~8k-token prompt is being prefilled, with the old chunked-prefill policy
(the oldest prompt takes the whole step budget), with capped prefill (each prompt's share of a
step capped at --prefill-cap tokens while others wait, decodes first; ``SchedulerConfig.prefill_cap``),
with capped prefill and steps paused between layers for newcomers' prompts (the server's policy,
``pause_for_arrivals``), and with no long prompt at all. It prints the short requests' TTFT p50/p95
and total throughput (tokens computed per second), and their ratios, side by side in one run.

    python benchmarks/serve_load.py --long-prompt --model smollm2 --clock cpu --json hol.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from llmsys.serving.load import check_loopback, sweep, sweep_table


def head_of_line(model_name: str = "target", long_tokens: int = 8000, n_short: int = 12, short_tokens: int = 16,
                 short_output: int = 8, budget: int = 256, cap: int = 64, clock: str = "wall",
                 gap_s: float | None = None) -> dict:
    """Short requests' TTFT (p50, p95) while a ``long_tokens`` prompt is prefilled, per policy, and ratios.

    The short requests arrive ``gap_s`` apart, by default three of their own alone TTFTs (measured first),
    so that alone they do not queue behind one another: what they wait for with the long prompt in flight
    is the long prompt."""
    import torch

    from llmsys.core import zoo
    from llmsys.serving import Engine, Request, SchedulerConfig, percentile

    torch.set_num_threads(max(1, torch.get_num_threads()))
    context = long_tokens + 64
    model = zoo.load(model_name, device="cpu", max_seq_len=context)
    words = zoo.tokenizer().encode(zoo.corpus())
    text = (words * (context // len(words) + 1))[:context]

    def make_engine(config):
        return Engine(model, context // 16 + 8 * n_short, 16, config, clock=clock)

    probe = make_engine(SchedulerConfig(max_batch=32, chunked_prefill=True, token_budget=budget))
    one = [Request("probe", text[:short_tokens], 1)]
    probe.run(one)  # warm up
    gap_s = gap_s or 3 * probe.run(one).results[0].ttft

    def trace(with_long: bool) -> list[Request]:
        shorts = [Request(f"short{i}", text[100 * i:100 * i + short_tokens], short_output, arrival=0.02 + gap_s * i)
                  for i in range(n_short)]
        return ([Request("long", text[:long_tokens], 4, arrival=0.0)] if with_long else []) + shorts

    rows = {}
    for name, with_long, prefill_cap, pause in (("alone", False, cap, True), ("old", True, None, False),
                                                ("capped", True, cap, False), ("fair", True, cap, True)):
        config = SchedulerConfig(max_batch=32, chunked_prefill=True, token_budget=budget, prefill_cap=prefill_cap,
                                 pause_for_arrivals=pause)
        engine = make_engine(config)
        engine.run(trace(False)[:2])  # warm up
        report = engine.run(trace(with_long))
        short = [r.ttft for r in report.results if r.id != "long"]
        steps = report.steps
        elapsed = steps[-1].start + steps[-1].duration - steps[0].start
        rows[name] = {"ttft_p50": percentile(short, 50), "ttft_p95": percentile(short, 95),
                      "tokens_per_s": sum(n for s in steps for _, n, _ in s.chunks) / elapsed,
                      "long_ttft": next((r.ttft for r in report.results if r.id == "long"), None)}
    ratios = {"old_p95_over_alone": rows["old"]["ttft_p95"] / rows["alone"]["ttft_p95"],
              "fair_p95_over_alone": rows["fair"]["ttft_p95"] / rows["alone"]["ttft_p95"],
              "fair_p95_over_old": rows["fair"]["ttft_p95"] / rows["old"]["ttft_p95"],
              "capped_p95_over_alone": rows["capped"]["ttft_p95"] / rows["alone"]["ttft_p95"],
              "fair_throughput_over_old": rows["fair"]["tokens_per_s"] / rows["old"]["tokens_per_s"],
              "fair_long_ttft_over_old": rows["fair"]["long_ttft"] / rows["old"]["long_ttft"]}
    return {"model": model_name, "long_tokens": long_tokens, "n_short": n_short, "gap_s": gap_s, "token_budget": budget,
            "prefill_cap": cap, "rows": rows, "ratios": ratios}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--long-prompt", action="store_true", help="measure head-of-line blocking in the engine instead")
    p.add_argument("--long-tokens", type=int, default=8000, help="--long-prompt: the long prompt's tokens")
    p.add_argument("--prefill-cap", type=int, default=64, help="--long-prompt: the capped policy's cap")
    p.add_argument("--gap", type=float, default=None,
                   help="--long-prompt: seconds between short requests (default: 3 of one's TTFT alone)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="--long-prompt: the engine's clock (cpu: this process's CPU time, steadier on a shared machine)")
    p.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4], help="requests per second")
    p.add_argument("--requests", type=int, default=24, help="requests per rate")
    p.add_argument("--max-seconds", type=float, default=120, help="stop sending after this long, per rate")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.long_prompt:
        if args.long_tokens < 256 or args.prefill_cap < 1 or (args.gap is not None and not args.gap > 0):
            p.exit(2, "error: --long-tokens must be >= 256, --prefill-cap >= 1 and --gap > 0\n")
        out = head_of_line(args.model or "target", args.long_tokens, cap=args.prefill_cap, clock=args.clock,
                           gap_s=args.gap)
        print(f"{out['model']}: short requests' TTFT with a {out['long_tokens']}-token prompt in flight "
              f"(budget {out['token_budget']} tokens/step, shorts {out['gap_s']:.3f} s apart, {args.clock} clock)")
        print(f"{'policy':<8} {'TTFT p50 s':>10} {'TTFT p95 s':>10} {'tok/s':>8} {'long TTFT s':>11}")
        for name, row in out["rows"].items():
            long_ttft = f"{row['long_ttft']:>11.2f}" if row["long_ttft"] is not None else f"{'-':>11}"
            print(f"{name:<8} {row['ttft_p50']:>10.3f} {row['ttft_p95']:>10.3f} {row['tokens_per_s']:>8.0f} "
                  f"{long_ttft}")
        for name, value in out["ratios"].items():
            print(f"{name:<26} {value:.2f}")
        if args.json:
            import torch

            meta = {"command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]), "clock": args.clock,
                    "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            with open(args.json, "w") as f:
                json.dump({**meta, **out}, f, indent=1)
        return [out]
    if args.base_url is None:
        p.exit(2, "error: give --base-url (a server to load) or --long-prompt\n")
    try:
        check_loopback(args.base_url)
        if min(args.rates) <= 0 or args.requests < 1 or args.max_seconds <= 0:
            raise ValueError("--rates, --requests and --max-seconds must be positive")
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    model = args.model
    if model is None:
        import openai

        try:
            model = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0).models.list().data[0].id
        except openai.APIConnectionError:
            p.exit(1, f"error: no server answers at {args.base_url}; start one, e.g. python -m llmsys serve\n")
    rows = sweep(args.base_url, model, sorted(args.rates), args.requests, args.max_seconds, args.seed,
                 ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo)
    print(f"{model} at {args.base_url}; SLO: TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo} s")
    print(sweep_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "base_url": args.base_url, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
