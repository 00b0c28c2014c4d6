"""KV tiers benchmark: reload evicted blocks from CPU RAM or disk instead of recomputing them.

1. Long multi-turn sessions (every turn's prompt holds the earlier turns plus a new tool result),
   served interleaved through a block pool that holds about one session: the prompt tokens served
   by the pool, by RAM, by disk and computed, with and without tiers, and whether the answers agree.
2. TTFT per context length T: a prompt of T + 1 tokens computed whole (recompute), and with its first
   T tokens reloaded from RAM or from disk (page cache warm), two prompts taking turns in a pool that
   holds one, so each reload pushes the other one down; medians of a few repeats.
3. Reload bandwidth measured here (RAM, disk with warm and dropped page cache), the prefill FLOP
   rate R measured from (2), and the crossover context length where reloading beats recomputing,
   measured beside its formula (``llmsys.serving.tier_costs``):
       T* = 2·(R·b / BW − F) / a − 1        (T* < 1: from the first block).
   The same formula for a GPU (NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, taken at peak) over
   PCIe 5.0 x16 and from an NVMe SSD, for this model and a Llama-3-70B-shaped one, in bf16.

    python benchmarks/kv_tiers.py --json kv_tiers.json                 # SmolLM2-135M, fp32, ~3 min
    python benchmarks/kv_tiers.py --model target --contexts 32 64 128 192 # the course's small model, seconds

All times are wall times side by side in one run; on a shared machine they include what else runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch

from llmsys.core import ledger
from llmsys.core.accounting import GPUS
from llmsys.serving import Engine, Request
from llmsys.serving.tier_costs import (
    BLOCK_SIZE as BS,
    LLAMA3_70B,
    NVME_READ,
    PCIE5_X16,
    crossover,
    prompt_of,
    reload_bandwidth,
    serve_sessions,
    session_prompts,
    ttft_by_context,
)
from llmsys.serving.tiers import KVTiers

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a zoo model name (smollm2: the real model)")
    p.add_argument("--dtype", default="fp32", choices=("bf16", "fp32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tool-words", type=int, default=40, help="words of each turn's new tool result")
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 128, 512, 1024], help="reused prefix lengths")
    p.add_argument("--repeats", type=int, default=3, help="reloads per prompt and tier (TTFTs are medians)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from llmsys.serving.served import load_served

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    served = load_served(args.model, args.dtype, max(args.contexts) + 2 if args.model == "smollm2" else None)
    cfg, elem = served.model.cfg, served.model.tok_embeddings.weight.element_size()
    if any(T % BS for T in args.contexts):
        p.error(f"--contexts must be multiples of the block size {BS}: whole blocks are reloaded")
    if max(args.contexts) + 2 > cfg.max_seq_len:
        p.error(f"--contexts up to {max(args.contexts)} do not fit {args.model}'s context of {cfg.max_seq_len}")
    b = cfg.kv_bytes_per_token(elem)
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s), KV {b / 1024:.1f} KiB/token, blocks of {BS}")
    folder = tempfile.mkdtemp(prefix="kv-tiers-bench-")

    try:
        sessions, longest = session_prompts(served, args.sessions, args.turns, args.tool_words, answer_tokens=8)
    except ValueError as e:
        p.error(str(e))
    plain = serve_sessions(served.model, sessions, longest, None)
    ram_blocks, disk_blocks = longest // 4, 4 * longest * args.sessions  # RAM: a quarter session, disk: all
    tiered = serve_sessions(served.model, sessions, longest, KVTiers(ram_blocks, disk_blocks, folder))
    same = tiered["answers"] == plain["answers"]
    print(f"\n{args.sessions} sessions x {args.turns} turns, interleaved; pool {longest} blocks (one session), "
          f"RAM {ram_blocks} blocks, disk {disk_blocks}")
    print(f"{'':12} {'pool':>6} {'RAM':>6} {'disk':>6} {'computed':>9} {'TTFT mean':>10}")
    for name, r in (("no tiers", plain), ("RAM + disk", tiered)):
        s = r["share"]
        print(f"{name:12} {s['pool']:6.1%} {s['ram']:6.1%} {s['disk']:6.1%} {s['computed']:9.1%} {r['ttft_mean_s']:9.3f}s")
    print(f"answers equal with and without tiers: {same}; tiers: {tiered['tiers']}")

    Engine(served.model, 4, BS).run([Request("warm-up", prompt_of(served, 8, 0), 1)])  # first-call costs
    rows = ttft_by_context(served, args.contexts, folder, args.repeats)
    flop_rate = rows[-1]["flops"] / rows[-1]["recompute_s"]
    bandwidth = reload_bandwidth(served.model, folder)
    print("\nTTFT by context T: a prompt of T + 1 tokens computed whole, or its first T reloaded (one answer token)")
    print(f"{'T':>6} {'recompute':>10} {'RAM':>8} {'disk':>8} {'recompute/RAM':>14} {'recompute/disk':>15}")
    for r in rows:
        print(f"{r['context']:>6} {r['recompute_s']:9.3f}s {r['ram_s']:7.3f}s {r['disk_s']:7.3f}s "
              f"{r['recompute_s'] / r['ram_s']:14.1f} {r['recompute_s'] / r['disk_s']:15.1f}")
    measured = {tier: next((r["context"] for r in rows if r[f"{tier}_s"] < r["recompute_s"]), None) for tier in ("ram", "disk")}
    print(f"\nmeasured here: R = {flop_rate / 1e9:.1f} GFLOP/s (median prefill of {rows[-1]['context'] + 1} tokens); reload "
          + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in bandwidth.items()))
    print("crossover T* = 2·(R·b/BW − F)/a − 1 (reload wins past it; 1 = from the first block)")
    formula = {}
    for name, bw in bandwidth.items():
        formula[f"here, {name}"] = crossover(b, bw, cfg, flop_rate)
    for model_name, model_cfg in ((args.model, cfg), ("Llama-3-70B shape", LLAMA3_70B)):
        for link, bw in (("PCIe 5.0 x16", PCIE5_X16), ("NVMe", NVME_READ)):
            formula[f"H100 bf16 {model_name}, {link}"] = crossover(model_cfg.kv_bytes_per_token(2), bw, model_cfg,
                                                                     GPUS["H100 SXM"]["bf16_flops"])
    for name, value in formula.items():
        print(f"  {name:42} T* = {value:10.0f} tokens")
    print(f"  measured here (smallest context tried where reload's TTFT < recompute's): "
          f"RAM {measured['ram']}, disk {measured['disk']}")
    print(f"benchmark wall time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        result = {"model": args.model, "dtype": args.dtype, "kv_bytes_per_token": b,
                  "sessions": {k: {x: r[x] for x in ("tokens", "share", "ttft_mean_s", "tiers")}
                               for k, r in (("no tiers", plain), ("ram+disk", tiered))},
                  "answers_equal": same, "ttft_by_context": rows, "flop_rate": flop_rate,
                  "reload_bandwidth": bandwidth, "crossover_formula": formula, "crossover_measured": measured}
        stamp = {"command": "python benchmarks/kv_tiers.py " + " ".join(sys.argv[1:] if argv is None else argv),
                 "when": datetime.datetime.now().isoformat(timespec="seconds"), **ledger.origin(),
                 "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0]}
        with open(args.json, "w") as f:
            json.dump(stamp | result, f, indent=1, default=float)
    return formula


if __name__ == "__main__":
    main()
