"""KV tiers benchmark: reload evicted blocks from CPU RAM or disk instead of recomputing them.

1. Long multi-turn sessions (every turn's prompt holds the earlier turns plus a new tool result),
   served interleaved through a block pool that holds about one session: the prompt tokens served
   by the pool, by RAM, by disk and computed, with and without tiers, and whether the answers agree.
2. TTFT per context length T: a prompt of T + 1 tokens computed whole (recompute), and with its first
   T tokens reloaded from RAM or from disk (page cache warm), two prompts taking turns in a pool that
   holds one, so each reload pushes the other one down; medians of a few repeats.
3. Reload bandwidth measured here (RAM, disk with warm and dropped page cache), the prefill FLOP
   rate R measured from (2), and the crossover context length where reloading beats recomputing,
   measured beside its formula: per token of a T-token prefix, reload costs b / BW (b = KV bytes per
   token) and recompute (F + a·(T + 1) / 2) / R on average (F = 2 × layer weights, a = attention FLOPs
   per token of context: the token at position t costs F + a·t), so reload wins for contexts past
       T* = 2·(R·b / BW − F) / a − 1        (T* < 1: from the first block).
   The same formula for a GPU (NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, taken at peak) over
   PCIe 5.0 x16 (PCI-SIG: 64 GB/s per direction) and from an NVMe SSD (Samsung 990 PRO datasheet:
   7,450 MB/s sequential read), for this model and a Llama-3-70B-shaped one (Llama 3 paper,
   arXiv 2407.21783: 80 layers, 8 KV heads of 128, dim 8192, FFN 28672), in bf16.

    python benchmarks/kv_tiers.py --json kv_tiers.json                 # SmolLM2-135M, fp32, ~3 min
    python benchmarks/kv_tiers.py --model target --contexts 32 64 128 192 # the course's small model, seconds

All times are wall times side by side in one run; on a shared machine they include what else runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from llmsys.core import ledger
from llmsys.core.model import ModelConfig
from llmsys.serving import (
    BlockManager,
    Engine,
    PagedKVCache,
    Request,
    SchedulerConfig,
    blocks_for,
    next_turn,
)
from llmsys.serving.tiers import KVTiers

BS = 16
GPU_FLOPS = 989e12  # H100 SXM, dense bf16 (NVIDIA datasheet)
PCIE5_X16 = 64e9  # bytes/s per direction (PCI-SIG)
NVME_READ = 7.45e9  # bytes/s sequential read (Samsung 990 PRO datasheet)
LLAMA3_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672)


def flops_terms(cfg: ModelConfig) -> tuple[float, float]:
    """(F, a): prefill FLOPs of the token at position t are F + a·t (the LM head runs only on the last token)."""
    head = 2 * cfg.vocab_size * cfg.dim
    return cfg.flops_per_token(0) - head, cfg.flops_per_token(1) - cfg.flops_per_token(0)


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    per_token, per_context = flops_terms(cfg)
    return tokens * per_token + per_context * tokens * (tokens + 1) / 2


def crossover(bytes_per_token: float, bandwidth: float, cfg: ModelConfig, flop_rate: float) -> float:
    """T* = 2·(R·b/BW − F)/a − 1: past this context, reloading a token costs less than recomputing it."""
    per_token, per_context = flops_terms(cfg)
    return max(1.0, 2 * (flop_rate * bytes_per_token / bandwidth - per_token) / per_context - 1)


def session_prompts(served, sessions: int, turns: int, tool_words: int, answer_tokens: int):
    """Per session, every turn's request (the history, a new tool result), with answers fixed by a run
    with memory to spare, so every engine sees the same prompts."""
    from llmsys.core import zoo

    words = zoo.corpus().split()
    longest = blocks_for(40 + turns * (3 * tool_words + answer_tokens), BS) + 4
    keep = Engine(served.model, sessions * longest, BS, SchedulerConfig(prefix_caching=True))
    out = []
    for s in range(sessions):
        system = served.encode_chat([{"role": "system", "content": f"You are agent {s}. Summarise each tool result."}])
        rows, request, answer = [], None, []
        for t in range(turns):
            start = (s * turns + t) * tool_words
            tool = served.encode(f"<tool>{' '.join(words[start:start + tool_words])}</tool>")
            request = (Request((s, t), system + tool, answer_tokens) if request is None else
                       next_turn(request, answer, tool, id=(s, t), max_tokens=answer_tokens))
            result = keep.run([request]).results[0]
            if result.status != "finished":
                raise ValueError(f"turn {t} cannot be served: {result.reason}; ask for fewer --turns or --tool-words")
            answer = result.output
            rows.append(request)
        out.append(rows)
    return out, longest


def serve_sessions(model, sessions, num_blocks: int, tiers: KVTiers | None) -> dict:
    """Turn t of every session, then turn t + 1 of every session, ...: TTFT, tokens by source, answers."""
    engine = Engine(model, num_blocks, BS, SchedulerConfig(prefix_caching=True), tiers=tiers)
    source = {"pool": 0, "ram": 0, "disk": 0, "computed": 0}
    ttft, answers = [], {}
    for t in range(len(sessions[0])):
        for rows in sessions:
            before = tiers.stats() if tiers else {}
            report = engine.run([rows[t]])
            after = tiers.stats() if tiers else {}
            reloaded = {name: (after[name]["hits"] - before[name]["hits"]) * BS for name in ("ram", "disk") if name in after}
            source["pool"] += report.prefill_cached - sum(reloaded.values())
            for name, n in reloaded.items():
                source[name] += n
            source["computed"] += report.prefill_computed
            ttft.append(report.results[0].ttft)
            answers[rows[t].id] = report.results[0].output
    total = sum(source.values())
    return {"tokens": source, "share": {k: v / total for k, v in source.items()},
            "ttft_mean_s": statistics.mean(ttft), "answers": answers, "tiers": tiers.stats() if tiers else None}


def prompt_of(served, length: int, offset: int) -> list[int]:
    from llmsys.core import zoo

    ids = served.encode(zoo.corpus()[offset * 40000:offset * 40000 + 40 * length])
    if len(ids) < length:
        raise ValueError(f"the corpus passage is shorter than {length} tokens; ask for shorter --contexts")
    return ids[:length]


def ttft_by_context(served, lengths, folder, repeats: int = 3) -> list[dict]:
    """Per context length T (a multiple of the block size): median TTFT of a prompt of T + 1 tokens computed
    whole, and with its first T reloaded from RAM, from disk (the last token is always computed: its logits
    answer). Two prompts take turns in a pool that holds one: each reload pushes the other prompt down."""
    rows = []
    for T in lengths:
        n = blocks_for(T + 2, BS)  # the pool holds one request: the next one evicts all of it
        row = {"context": T, "flops": prefill_flops(served.model.cfg, T + 1), "recompute": []}
        for tier, (ram, disk) in (("ram", (n, 0)), ("disk", (0, n))):
            tiers = KVTiers(ram, disk, folder)
            engine = Engine(served.model, n, BS, SchedulerConfig(prefix_caching=True), tiers=tiers)
            prompts = [prompt_of(served, T + 1, i) for i in range(2)]
            for prompt in prompts:
                row["recompute"].append(engine.run([Request("cold", prompt, 1)]).results[0].ttft)
            row[tier] = []
            for i in range(2 * repeats):
                hits = tiers.stats()[tier]["hits"]
                row[tier].append(engine.run([Request(i, prompts[i % 2], 1)]).results[0].ttft)
                if tiers.stats()[tier]["hits"] - hits != T // BS:
                    raise RuntimeError(f"the {tier} tier did not serve the {T}-token prefix; the setup is wrong")
            tiers.close()
        rows.append(row | {f"{k}_s": statistics.median(row[k]) for k in ("recompute", "ram", "disk")})
    return rows


def reload_bandwidth(model, folder, n_blocks: int = 48) -> dict:
    """Bytes per second the tiers reload into the pool, per-block overheads included: RAM, disk with the
    page cache warm (just written), disk with the files' pages dropped (read from the device)."""
    out = {}
    for name, cold in (("ram", False), ("disk (page cache)", False), ("disk (device)", True)):
        ram, disk = (n_blocks, 0) if name == "ram" else (0, n_blocks)
        tiers, cache = KVTiers(ram, disk, folder), PagedKVCache(model, n_blocks, BS)
        tiers.attach(cache, BlockManager(n_blocks, BS, prefix_caching=True))
        for h in range(1, n_blocks + 1):
            tiers.offload(h - 1, h, (h,) * BS)
        if cold:
            for path in tiers.tiers[1].folder.iterdir():
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)  # written back first: dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        t0 = time.perf_counter()
        for h in range(1, n_blocks + 1):
            tiers.reload(h, (h,) * BS, lambda block=h - 1: block)
        out[name] = n_blocks * cache.bytes_per_block / (time.perf_counter() - t0)
        tiers.close()
    return out


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
            formula[f"H100 bf16 {model_name}, {link}"] = crossover(model_cfg.kv_bytes_per_token(2), bw, model_cfg, GPU_FLOPS)
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
