"""Serving benchmark: static vs continuous batching, + chunked prefill, + prefix caching.

Serves one generated trace (``serving_trace``: requests of ~310 tokens, shared
system prompts, long-tailed output lengths, everyone arriving at once: an
overloaded server) with the embedded target model at a 1024-token context,
each scheduler and the same KV memory, and prints side by side:
throughput, TTFT and TPOT (p50/p99), KV blocks used and wasted, prefix-cache
hit rate, preemptions. Every configuration must produce the same tokens for
every request (greedy decoding); the script says whether they did.

    python benchmarks/serving.py                 # the embedded target model
    python benchmarks/serving.py --requests 48   # quicker
    python benchmarks/serving.py --attention triton   # on a GPU: the Triton paged decode kernel

Timings depend on the machine and on what else runs on it. On a shared CPU the
default clock is this process's CPU time with one torch thread, which other
processes disturb much less than the wall clock; on a GPU it is the wall clock.
Static batching is a dense batch: each request reserves the whole context, and a
finished request's row is computed until the batch's longest is done (as in a
batched ``generate``). Prompts are not padded to the longest, which a dense
batch would do, so static still gets off lightly.
"""

from __future__ import annotations

import argparse
import time

import torch

from llmsys import device as _device
from llmsys.serving import (SERVING_CONTEXT, BlockManager, Chunk, Engine, PagedKVCache, SchedulerConfig, blocks_for,
                            paged_forward, serving_trace, summary_table)
from llmsys.serving import paged


def configs(max_batch: int, budget: int) -> list[SchedulerConfig]:
    return [
        SchedulerConfig(policy="static", max_batch=max_batch),
        SchedulerConfig(max_batch=max_batch),
        SchedulerConfig(max_batch=max_batch, chunked_prefill=True, token_budget=budget),
        SchedulerConfig(max_batch=max_batch, chunked_prefill=True, token_budget=budget, prefix_caching=True),
    ]


def run(model, trace, num_blocks: int, block_size: int, max_batch: int, budget: int, attention: str,
        clock: str = "wall", progress: bool = True):
    """Serve ``trace`` with every configuration; return (summaries, whether all outputs agree)."""
    summaries, outputs = [], []
    for config in configs(max_batch, budget):
        engine = Engine(model, num_blocks, block_size, config, attention=attention, clock=clock)
        engine.run(trace[:2])  # warm up kernels and allocator paths, outside the measurement
        engine = Engine(model, num_blocks, block_size, config, attention=attention, clock=clock)
        report = engine.run(trace, progress=progress)
        summaries.append(report.summary())
        outputs.append([r.output for r in report.results])
    return summaries, all(o == outputs[0] for o in outputs)


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--num-blocks", type=int, default=1536, help="KV memory, in blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--budget", type=int, default=128, help="tokens per step with chunked prefill")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--attention", default="torch", choices=("torch", "triton"))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--clock", default="cpu", choices=("cpu", "wall"),
                   help="step durations from this process's CPU time (steady on a shared machine; "
                        "meaningful with one thread) or from the wall clock (use on a quiet machine or a GPU)")
    p.add_argument("--model", default="target", help="a zoo model name")
    p.add_argument("--context", type=int, default=SERVING_CONTEXT, help="the model's context limit when served")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from llmsys import zoo

    model = zoo.load(args.model, max_seq_len=args.context)
    clock = "wall" if _device.has_cuda() else args.clock
    trace = serving_trace(args.requests, model.cfg.vocab_size, rate=args.rate, max_seq_len=args.context)
    n = len(trace)
    kv = model.cfg.kv_bytes_per_token(model.tok_embeddings.weight.element_size())
    slots = args.num_blocks * args.block_size
    print(f"model {args.model}: {model.cfg.n_params() / 1e6:.1f}M params on {_device.device()}, context {args.context}, "
          f"{torch.get_num_threads()} threads, attention={args.attention}, clock={clock}")
    arrivals = "arriving at once" if args.rate is None else f"arriving at {args.rate:g}/s"
    print(f"trace: {n} requests {arrivals}, mean prompt {sum(len(r.prompt) for r in trace) / n:.0f}, "
          f"mean output {sum(r.max_tokens for r in trace) / n:.0f} tokens")
    print(f"KV memory: {args.num_blocks} blocks × {args.block_size} = {slots} token slots "
          f"({slots * kv / 2**20:.1f} MiB); static reserves the whole context ({model.cfg.max_seq_len} tokens) per request")
    t0 = time.perf_counter()
    summaries, same = run(model, trace, args.num_blocks, args.block_size, args.max_batch, args.budget, args.attention,
                          clock)
    print(summary_table(summaries))
    static, continuous = summaries[0], summaries[1]
    print(f"continuous / static: {continuous['throughput tok/s'] / static['throughput tok/s']:.2f}× measured; "
          f"{static['steps'] / continuous['steps']:.2f}× if every step cost the same "
          f"(memory-bound decoding, as on a GPU)")
    print(f"every configuration produced identical tokens for every request: {same}")
    step = decode_step_ms(model, args.max_batch, args.block_size, args.attention, clock)
    print(f"one step of {args.max_batch} decodes, contexts of 50-800 tokens: {step['grouped']:.1f} ms with decodes "
          f"grouped by length (within {paged.GROUP_RATIO}x), {step['one group']:.1f} ms padded to the longest "
          f"({step['one group'] / step['grouped']:.1f}x)")
    print(f"benchmark wall time {time.perf_counter() - t0:.0f} s")
    return summaries


if __name__ == "__main__":
    main()
