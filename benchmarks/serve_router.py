"""Prefix-aware routing vs round-robin in front of engine replicas, on multi-turn chat and agent sessions.

    python benchmarks/serve_router.py --json router.json                      # 2 replicas of the target model
    python benchmarks/serve_router.py --model tiny --chat-requests 16 --agent-sessions 3   # a quick look

For each policy, fresh replicas (``python -m llmsys serve`` processes on loopback, empty caches) behind
the router (``llmsys.serving.router``, in this process) serve two workloads in turn:

- chat: ``load.ChatTrace`` sessions arriving as a Poisson process, ``--follow-up`` of the arrivals
  continuing a finished session with its whole history (``load.run_rate``), all after one system prompt;
- agent: the coding and SQL agent sessions of ``llmsys.specdec.agentic`` played concurrently (staggered
  starts), every turn resending the whole session with the tool's new message.

Per policy and workload: the prefix-cache hit rate the replicas count themselves (hit tokens over prompt
tokens, summed from their /metrics) beside the one the router expects from its record; TTFT p50/p95,
TPOT p50; goodput (requests per second meeting TTFT <= --ttft-slo and TPOT <= --tpot-slo); and the
busiest replica's share of the prompt tokens (routing by prefix can pile sessions onto one replica; the
load rule is what spreads them). Then prefix / round-robin ratios. Every process shares this machine's
cores, the load generator and router included: on a busy 2-core machine the numbers are indicative.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from llmsys.core import ledger
from llmsys.serving.api import BackgroundServer
from llmsys.serving.load import ChatTrace, Outcome, one_request, run_rate, scrape, summarize
from llmsys.serving.router import RouterThread
from llmsys.serving.routing import POLICIES

HIT, PROMPT = "llmsys_prefix_cache_hit_tokens_total", "llmsys_prompt_tokens_total"


def start_replicas(args) -> list[BackgroundServer]:
    flags = ("--model", args.model, "--dtype", "fp32", "--context", str(args.context), "--kv-blocks",
             str(args.kv_blocks), "--block-size", str(args.block_size))
    with ThreadPoolExecutor(args.replicas) as pool:
        return list(pool.map(lambda _: BackgroundServer(*flags), range(args.replicas)))


def chat_workload(url: str, args) -> dict:
    trace = ChatTrace(seed=args.seed, mean_output=args.chat_tokens, output_len=(8, 2 * args.chat_tokens),
                      follow_up=args.follow_up, max_turns=6)
    return asyncio.run(run_rate(url + "/v1", args.model, args.chat_rate, args.chat_requests, trace,
                                args.max_seconds, args.ttft_slo, args.tpot_slo))


def agent_workload(url: str, args) -> dict:
    """Every agent session in its own thread, started ``agent_gap`` seconds apart, turns in order."""
    import openai

    from llmsys.specdec import agentic

    outcomes: list[Outcome] = []

    def answer(messages: list[dict]) -> str:
        async def turn():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                          timeout=args.max_seconds) as client:
                return await one_request(client, args.model, messages, args.agent_tokens)
        out, text = asyncio.run(turn())
        outcomes.append(out)
        return text

    def play(i_session):
        i, session = i_session
        time.sleep(i * args.agent_gap)
        agentic.run(session, answer)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.agent_sessions) as pool:
        list(pool.map(play, enumerate(agentic.sessions(args.agent_sessions))))
    return summarize(outcomes, len(outcomes), 0, time.perf_counter() - start, args.ttft_slo, args.tpot_slo)


def measure(policy: str, args) -> dict:
    """Both workloads through a router with ``policy`` over fresh replicas."""
    servers = start_replicas(args)
    rows = {}
    try:
        with RouterThread([s.url for s in servers], policy, block_size=args.block_size,
                          replica_blocks=args.kv_blocks, balance_abs=args.balance_abs) as router:
            for name, workload in (("chat", chat_workload), ("agent", agent_workload)):
                before, router_before = [scrape(s.url) for s in servers], scrape(router.url)
                row = workload(router.url, args)
                after, router_after = [scrape(s.url) for s in servers], scrape(router.url)
                prompt = [a.get(PROMPT, 0) - b.get(PROMPT, 0) for b, a in zip(before, after)]
                hits = sum(a.get(HIT, 0) - b.get(HIT, 0) for b, a in zip(before, after))
                routed = {k: router_after.get(k, 0) - router_before.get(k, 0)
                          for k in ("llmsys_router_prompt_tokens_total", "llmsys_router_matched_tokens_total")}
                row.pop("prefix_hit_rate", None)  # the router has no such counter: the replicas' is below
                rows[name] = row | {
                    "hit_rate": hits / sum(prompt) if sum(prompt) else float("nan"),
                    "router_expected_hit_rate": routed["llmsys_router_matched_tokens_total"]
                    / max(routed["llmsys_router_prompt_tokens_total"], 1),
                    "busiest_share": max(prompt) / sum(prompt) if sum(prompt) else float("nan"),
                    "prompt_tokens_per_replica": prompt}
    finally:
        for s in servers:
            s.stop()
    return rows


def table(results: dict) -> str:
    head = (f"{'policy':<12} {'workload':<6} {'ok':>4} {'fail':>4} {'hit':>6} {'router':>6} {'TTFT50':>7} "
            f"{'TTFT95':>7} {'TPOT50':>7} {'SLO met':>7} {'goodput':>7} {'busiest':>7}")
    lines = [head]
    for policy, rows in results.items():
        for name, r in rows.items():
            lines.append(f"{policy:<12} {name:<6} {r['ok']:>4d} {r['failed']:>4d} {r['hit_rate']:>6.1%} "
                         f"{r['router_expected_hit_rate']:>6.1%} {r['ttft_p50']:>7.3f} {r['ttft_p95']:>7.3f} "
                         f"{r['tpot_p50']:>7.4f} {r['slo_met']:>7.0%} {r['goodput_rps']:>7.2f} "
                         f"{r['busiest_share']:>7.0%}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="target", help="a zoo model: target (default), tiny, draft or smollm2")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--context", type=int, default=2048, help="the replicas' context limit in tokens")
    p.add_argument("--kv-blocks", type=int, default=256, help="each replica's KV cache, in blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--balance-abs", type=int, default=8, help="the router's load-imbalance threshold (requests)")
    p.add_argument("--chat-rate", type=float, default=2.0, help="chat arrivals per second")
    p.add_argument("--chat-requests", type=int, default=40)
    p.add_argument("--chat-tokens", type=int, default=32, help="mean answer length of the chat trace")
    p.add_argument("--follow-up", type=float, default=0.75,
                   help="share of chat arrivals that continue a finished session (up to 6 turns)")
    p.add_argument("--agent-sessions", type=int, default=6, help="agent sessions (up to 9)")
    p.add_argument("--agent-tokens", type=int, default=48, help="answer length of each agent turn")
    p.add_argument("--agent-gap", type=float, default=0.5, help="seconds between agent sessions' starts")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--max-seconds", type=float, default=120, help="bound on each workload's sending time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.replicas < 2 or not 1 <= args.agent_sessions <= 9 or min(args.chat_rate, args.chat_requests) <= 0:
        p.exit(2, "error: --replicas must be >= 2, --agent-sessions 1..9, --chat-rate and --chat-requests positive\n")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replicas share the cores: one thread each
    t0 = time.perf_counter()
    results = {policy: measure(policy, args) for policy in POLICIES}
    print(f"{args.replicas} replicas of {args.model}, {args.kv_blocks} KV blocks of {args.block_size} each; "
          f"SLO: TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo} s; hit: the replicas' prefix-cache hit rate, "
          f"router: the one its record expected; busiest: that replica's share of prompt tokens")
    print(table(results))
    prefix, rr = results["prefix"], results["round-robin"]
    ratios = {name: {"hit_rate": prefix[name]["hit_rate"] / max(rr[name]["hit_rate"], 1e-9),
                     "ttft_p50": prefix[name]["ttft_p50"] / rr[name]["ttft_p50"],
                     "ttft_p95": prefix[name]["ttft_p95"] / rr[name]["ttft_p95"],
                     "goodput": prefix[name]["goodput_rps"] / max(rr[name]["goodput_rps"], 1e-9)} for name in prefix}
    for name, r in ratios.items():
        print(f"prefix / round-robin, {name}: hit rate {r['hit_rate']:.2f}x, TTFT p50 {r['ttft_p50']:.2f}x, "
              f"p95 {r['ttft_p95']:.2f}x, goodput {r['goodput']:.2f}x")
    print(f"benchmark wall time {time.perf_counter() - t0:.0f} s (load average {os.getloadavg()[0]:.1f})")
    out = {"command": "python benchmarks/serve_router.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "when": datetime.datetime.now().isoformat(timespec="seconds"), **ledger.origin(),
           "load_average": os.getloadavg()[0], "args": vars(args), "results": results, "ratios": ratios}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=float)
    return out


if __name__ == "__main__":
    main()
