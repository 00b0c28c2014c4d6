"""What reloading KV blocks from a tier costs beside recomputing them, measured on this machine, and the
context length past which reloading wins (``benchmarks/kv_tiers.py`` and chapter 9 part 2 use these).

Per token of a T-token prefix, reloading costs b / BW (b = KV bytes per token, BW the tier's reload
bandwidth) and recomputing costs (F + a·(T + 1) / 2) / R on average (R the prefill FLOP rate, F = 2 ×
layer weights, a = attention FLOPs per token of context: the token at position t costs F + a·t), so
reloading wins for contexts past

    T* = 2·(R·b / BW − F) / a − 1        (T* < 1: from the first block).

Bandwidths from datasheets for the same formula on a GPU: PCIe 5.0 x16 (PCI-SIG: 64 GB/s per direction),
an NVMe SSD (Samsung 990 PRO datasheet: 7,450 MB/s sequential read), NVLink 4 (NVIDIA H100 datasheet:
900 GB/s in both directions together, 450 GB/s each way); a Llama-3-70B-shaped model (Llama 3 paper,
arXiv 2407.21783: 80 layers, 8 KV heads of 128, dim 8192, FFN 28672).
"""

from __future__ import annotations

import os
import statistics
import time

from llmsys.core.model import ModelConfig
from llmsys.serving.blocks import BlockManager, blocks_for
from llmsys.serving.engine import Engine
from llmsys.serving.paged import PagedKVCache
from llmsys.serving.scheduler import SchedulerConfig
from llmsys.serving.tiers import KVTiers
from llmsys.serving.trace import Request, next_turn

BLOCK_SIZE = 16
PCIE5_X16 = 64e9  # bytes/s per direction (PCI-SIG)
NVME_READ = 7.45e9  # bytes/s sequential read (Samsung 990 PRO datasheet)
NVLINK4 = 450e9  # bytes/s per direction (H100 SXM datasheet: 900 GB/s both ways)
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
    longest = blocks_for(40 + turns * (3 * tool_words + answer_tokens), BLOCK_SIZE) + 4
    keep = Engine(served.model, sessions * longest, BLOCK_SIZE, SchedulerConfig(prefix_caching=True))
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
    engine = Engine(model, num_blocks, BLOCK_SIZE, SchedulerConfig(prefix_caching=True), tiers=tiers)
    source = {"pool": 0, "ram": 0, "disk": 0, "computed": 0}
    ttft, answers = [], {}
    for t in range(len(sessions[0])):
        for rows in sessions:
            before = tiers.stats() if tiers else {}
            report = engine.run([rows[t]])
            after = tiers.stats() if tiers else {}
            reloaded = {name: (after[name]["hits"] - before[name]["hits"]) * BLOCK_SIZE for name in ("ram", "disk") if name in after}
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
        n = blocks_for(T + 2, BLOCK_SIZE)  # the pool holds one request: the next one evicts all of it
        row = {"context": T, "flops": prefill_flops(served.model.cfg, T + 1), "recompute": []}
        for tier, (ram, disk) in (("ram", (n, 0)), ("disk", (0, n))):
            tiers = KVTiers(ram, disk, folder)
            engine = Engine(served.model, n, BLOCK_SIZE, SchedulerConfig(prefix_caching=True), tiers=tiers)
            prompts = [prompt_of(served, T + 1, i) for i in range(2)]
            for prompt in prompts:
                row["recompute"].append(engine.run([Request("cold", prompt, 1)]).results[0].ttft)
            row[tier] = []
            for i in range(2 * repeats):
                hits = tiers.stats()[tier]["hits"]
                row[tier].append(engine.run([Request(i, prompts[i % 2], 1)]).results[0].ttft)
                if tiers.stats()[tier]["hits"] - hits != T // BLOCK_SIZE:
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
        tiers, cache = KVTiers(ram, disk, folder), PagedKVCache(model, n_blocks, BLOCK_SIZE)
        tiers.attach(cache, BlockManager(n_blocks, BLOCK_SIZE, prefix_caching=True))
        for h in range(1, n_blocks + 1):
            tiers.offload(h - 1, h, (h,) * BLOCK_SIZE)
        if cold:
            for path in tiers.tiers[1].folder.iterdir():
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)  # written back first: dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        t0 = time.perf_counter()
        for h in range(1, n_blocks + 1):
            tiers.reload(h, (h,) * BLOCK_SIZE, lambda block=h - 1: block)
        out[name] = n_blocks * cache.bytes_per_block / (time.perf_counter() - t0)
        tiers.close()
    return out


