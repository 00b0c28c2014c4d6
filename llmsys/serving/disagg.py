"""Disaggregated serving: a prefill instance and a decode instance in separate processes, the finished
prompt's KV cache sent from one to the other over ``torch.distributed``.

    run = serve_disaggregated(model, trace, prefill_blocks=256, decode_blocks=256)
    run.report.summary(), run.transfers, run.prefill_waits

Rank 0 (prefill) runs an ``Engine`` on every request cut to one output token; when a prompt is done
(``Engine.on_finish``, before its blocks are freed) it sends a header, the prompt's chained prefix hashes
and its keys and values, (2·layers, prompt, n_kv, hs) = layers × 2 × KV heads × head dim × tokens elements
(``accounting.kv_cache_bytes``). Rank 1 (decode) checks the hashes against the tokens, writes the KV into
fresh blocks of its own pool (``admit_prefilled``) and decodes the rest. A long prompt computed on
rank 0 no longer shares a step with rank 1's decodes (DistServe, Zhong et al., OSDI'24, arXiv 2401.09670;
Splitwise, Patel et al., ISCA'24; Mooncake, Qin et al., FAST'25, arXiv 2407.00079).

Backpressure by credits: a request holds blocks_for(prompt + max_tokens) of the decode pool from the moment
rank 0 starts its prefill until rank 1 finishes it, so the decode side never runs out of blocks nor preempts.
Rank 1 reports the blocks not held and how many transfers it has admitted; rank 0 subtracts what it sent
since and what it is prefilling, and starts no prefill (first come, first served) that does not fit: it
waits (``prefill_waits``). Nothing is dropped; a request that could never fit is rejected at the start.

Control messages (headers, credits, heartbeats) go over a gloo group, KV over the default group (NCCL when
``accelerator`` and one GPU per rank). Every receive is bounded: a peer silent for ``peer_timeout`` seconds
(each side sends a heartbeat at least every quarter of it) or gone ends the run with ``kvlink.PeerLost``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmsys.core.accounting import kv_cache_bytes
from llmsys.core.dist import launch
from llmsys.serving.blocks import blocks_for, prefix_hashes
from llmsys.serving.engine import Engine
from llmsys.serving.kvlink import Link
from llmsys.serving.report import Report, Result
from llmsys.serving.scheduler import SchedulerConfig, Sequence

PREFILL, DECODE = 0, 1
SEQUENCE, HEARTBEAT, DONE = 1, 2, 3  # message kinds
HEADER_TAG, HASHES_TAG, KV_TAG, CREDIT_TAG = 1, 2, 3, 4  # one FIFO per kind of message
HEADER = 5  # kind, request index, first token, first token time (µs), prompt hashes sent
CREDIT = 3  # kind, blocks not held, transfers admitted
SIGNED = 2**63  # blake2b hashes are unsigned 64-bit; int64 tensors hold them shifted


def kv_transfer_bytes(cfg, tokens: int, bytes_per_elem: float) -> float:
    """Bytes of one prompt's keys and values: layers × 2 × KV heads × head dim × tokens × bytes per element."""
    return kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, tokens, bytes_per_elem)


def check_prefilled(engine: Engine, request) -> str:
    """Why ``request`` cannot be decoded by ``engine`` after a prefill elsewhere ("" when it can)."""
    if request.temperature > 0 or request.logprobs is not None or request.grammar is not None:
        return ("a prefilled request is decoded greedily, without logprobs or a grammar: "
                "its sampler state stays with the prefill instance")
    return engine.check(request)


def admit_prefilled(engine: Engine, request, kv: torch.Tensor, first_token: int, when: float) -> Sequence:
    """Decode ``request`` on ``engine`` from here on: its prompt was computed elsewhere (a prefill instance),
    which sent its keys and values ``kv`` (2·layers, prompt length, n_kv, hs; ``PagedKVCache.read_tokens``) and
    its first token, sampled at ``when``. The prompt goes into fresh blocks, indexed by the prefix cache; the
    sequence joins the running batch. Greedy requests only: a sampler's state does not travel with the KV."""
    reason = check_prefilled(engine, request)
    if reason:
        raise ValueError(reason)
    seq, n = Sequence(request), len(request.prompt)
    engine.blocks.add(seq.key)
    engine.blocks.prepare(seq.key, 0, n)  # OutOfBlocks when the pool cannot hold the prompt
    engine.cache.write_tokens(engine.blocks.table(seq.key), kv)
    seq.num_computed = n
    engine.blocks.commit(seq.key, seq.tokens, n)
    seq.tokens.append(first_token)
    seq.output.append(first_token)
    seq.token_times.append(when)
    engine.scheduler.join(seq)
    if seq.done:  # its one token came with it
        engine.scheduler.finish(seq)
    return seq


def receive_credit(link: Link):
    credit = link.receive(torch.zeros(CREDIT, dtype=torch.int64), CREDIT_TAG, "a credit")
    return None if credit[0] == DONE else credit[1:].tolist()


def receive_prefilled(model, requests, block_size: int):
    """The decode instance's receiver: (index, first token, its time, KV, seconds the KV took) per request."""
    cfg, dtype = model.cfg, model.tok_embeddings.weight.dtype

    def receive_one(link: Link):
        kind, i, first, when_us, n_hashes = link.receive(torch.zeros(HEADER, dtype=torch.int64), HEADER_TAG,
                                                         "a header").tolist()
        if kind != SEQUENCE:
            return None if kind == DONE else HEARTBEAT  # a heartbeat wakes the main loop, which answers it
        r, start = requests[i], time.perf_counter()
        hashes = link.receive(torch.zeros(n_hashes, dtype=torch.int64), HASHES_TAG, f"request {r.id!r}'s hashes")
        kv = link.receive(torch.empty(2 * cfg.n_layers, len(r.prompt), cfg.n_kv_heads, cfg.head_dim, dtype=dtype,
                                      device=link.kv_device), KV_TAG, f"request {r.id!r}'s keys and values", data=True)
        seconds = time.perf_counter() - start
        if [h + SIGNED for h in hashes.tolist()] != prefix_hashes(r.prompt, block_size):
            raise ValueError(f"the prefix hashes sent with request {r.id!r} do not match its prompt: "
                             f"its keys and values belong to other tokens (or another block size)")
        return i, first, when_us / 1e6, kv, seconds
    return receive_one


def prefill_instance(link: Link, model, requests, blocks: int, block_size: int, config, decode_blocks: int,
                     t0: float) -> dict:
    """Rank 0: prefill each request when the decode pool has room for all of it; send its KV on."""
    engine = Engine(model, blocks, block_size, config)
    need = [blocks_for(len(r.prompt) + r.max_tokens, block_size) for r in requests]
    sent, order = [], []  # need and index of each sent request, in order
    prefilling = {}  # request index -> need, while its prompt is computed here
    waits, wait_s, rejected, pending = 0, 0.0, {}, []
    for i, r in sorted(enumerate(requests), key=lambda ir: ir[1].arrival):
        why = check_prefilled(engine, r) or (f"needs {need[i]} KV blocks but the decode instance has {decode_blocks}"
                                  if need[i] > decode_blocks else "")
        if why:
            rejected[i] = why
        else:
            pending.append(i)

    def send(seq) -> None:  # Engine.on_finish: the prompt is computed, its blocks still held
        i, n = seq.request.meta["disagg"], len(seq.request.prompt)
        kv = engine.cache.read_tokens(engine.blocks.table(seq.key), n).to(link.kv_device)
        hashes = torch.tensor([h - SIGNED for h in prefix_hashes(seq.request.prompt, block_size)], dtype=torch.int64)
        link.send(torch.tensor([SEQUENCE, i, seq.output[0], round(seq.token_times[0] * 1e6), hashes.numel()]),
                  HEADER_TAG)
        link.send(hashes, HASHES_TAG)
        link.send(kv, KV_TAG, data=True)
        order.append(i)
        sent.append(prefilling.pop(i))

    engine.on_finish = send
    link.start_receiving(receive_credit)
    report = link.take(True, "the decode pool's first credit")  # [blocks not held, transfers admitted]
    waiting_since = None
    while pending or engine.has_work():
        while (credit := link.take(False)) is not None:
            report = credit
        now = time.monotonic() - t0
        free = report[0] - sum(sent[report[1]:]) - sum(prefilling.values())
        while pending and requests[pending[0]].arrival <= now and need[pending[0]] <= free:
            i = pending.pop(0)
            engine.submit(dataclasses.replace(requests[i], max_tokens=1, meta={**requests[i].meta, "disagg": i}))
            prefilling[i], free = need[i], free - need[i]
            if waiting_since is not None:
                wait_s, waiting_since = wait_s + time.monotonic() - waiting_since, None
        blocked = bool(pending) and requests[pending[0]].arrival <= now
        if blocked and waiting_since is None:
            waits, waiting_since = waits + 1, time.monotonic()
        if engine.has_work():
            engine.step(now)
        elif blocked:  # the decode pool is full: wait until it frees blocks
            report = link.take(True, "credits (the decode pool is full)")
        else:
            time.sleep(max(0.0, min(requests[pending[0]].arrival - now, link.peer_timeout / 4)))
        if link.heartbeat_due():
            link.send(torch.tensor([HEARTBEAT, 0, 0, 0, 0]), HEADER_TAG)
    link.send(torch.tensor([DONE, 0, 0, 0, 0]), HEADER_TAG)
    while link.take(True, "the decode instance to finish") != Link.END:
        pass
    link.close()
    kv_bytes = [n for tag, n in link.sent if tag == KV_TAG]  # what the transport took, message by message
    return {"rejected": rejected, "transfer_bytes": dict(zip(order, kv_bytes)),
            "control_bytes": sum(n for tag, n in link.sent if tag != KV_TAG), "waits": waits, "wait_s": wait_s,
            "computed": engine.scheduler.prefill_computed, "cached": engine.scheduler.prefill_cached,
            "blocks_in_use": engine.blocks.allocator.num_used}


def decode_instance(link: Link, model, requests, blocks: int, block_size: int, config, t0: float) -> dict:
    """Rank 1: admit each transferred prompt into the pool, decode everything, report free blocks."""
    engine = Engine(model, blocks, block_size, dataclasses.replace(config, max_batch=max(config.max_batch, blocks)))
    held, admitted, seqs, transfers, steps = {}, 0, {}, {}, []

    def tell(kind: int = HEARTBEAT) -> None:
        link.send(torch.tensor([kind, blocks - sum(held.values()), admitted]), CREDIT_TAG)

    tell()
    link.start_receiving(receive_prefilled(model, requests, block_size))
    prefill_done, last_told = False, (blocks, 0)
    while True:
        message = link.take(not engine.has_work() and not prefill_done, "the next prefilled request")
        while message is not None and message != Link.END:
            if message == HEARTBEAT:
                message = link.take(False)
                continue
            i, first, when, kv, seconds = message
            r = requests[i]
            seqs[i] = admit_prefilled(engine, r, kv, first, when)
            transfers[i] = (kv.numel() * kv.element_size(), seconds)
            held[i], admitted = blocks_for(len(r.prompt) + r.max_tokens, block_size), admitted + 1
            message = link.take(False)
        prefill_done = prefill_done or message == Link.END
        if engine.has_work():
            steps.append(engine.step(time.monotonic() - t0))
        elif prefill_done:
            break
        for i, seq in seqs.items():
            if seq.status != "running":
                held.pop(i, None)
        if (blocks - sum(held.values()), admitted) != last_told or link.heartbeat_due():
            last_told = (blocks - sum(held.values()), admitted)
            tell()
    tell(DONE)
    link.close()
    return {"results": {i: Engine.result_of(seq) for i, seq in seqs.items()}, "transfers": transfers,
            "steps": steps, "blocks_in_use": engine.blocks.allocator.num_used}


def disagg_worker(rank: int, world_size: int, model, requests, prefill_blocks: int, decode_blocks: int,
                  block_size: int, prefill_config, decode_config, peer_timeout: float, fail_after=None) -> dict:
    """A ``launch`` worker: rank 0 the prefill instance, rank 1 the decode instance."""
    if world_size != 2:
        raise ValueError(f"disaggregated serving runs one prefill and one decode rank, got world_size={world_size}")
    control = dist.new_group(backend="gloo")
    kv_device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    names = {PREFILL: "the prefill instance (rank 0)", DECODE: "the decode instance (rank 1)"}
    link = Link(1 - rank, control, dist.group.WORLD, peer_timeout, kv_device, names)
    model = model.to(kv_device) if kv_device != "cpu" else model
    t0 = torch.tensor([time.monotonic()], dtype=torch.float64)  # CLOCK_MONOTONIC: one clock for both processes
    dist.broadcast(t0, src=PREFILL, group=control)
    if rank == PREFILL:
        return prefill_instance(link, model, requests, prefill_blocks, block_size, prefill_config,
                                decode_blocks, t0.item())
    if fail_after is not None:  # tests: a decode instance that dies or hangs
        fail_after(link)
    return decode_instance(link, model, requests, decode_blocks, block_size, decode_config, t0.item())


@dataclass
class DisaggRun:
    report: Report  # results in trace order, the decode instance's steps
    transfers: list[dict]  # per transferred request: id, tokens, bytes sent, bytes received, seconds
    prefill_waits: int  # times the prefill instance stopped for want of decode blocks
    prefill_wait_s: float
    control_bytes: int  # headers, hashes, credits and heartbeats the prefill instance sent
    blocks_in_use: tuple[int, int]  # (prefill, decode) at the end: 0 and 0 when every block was freed


def serve_disaggregated(model, requests, prefill_blocks: int, decode_blocks: int, block_size: int = 16,
                        prefill_config: SchedulerConfig | None = None, decode_config: SchedulerConfig | None = None,
                        peer_timeout: float = 30.0, timeout: float = 600.0, accelerator: bool = False,
                        fail_after=None) -> DisaggRun:
    """Serve ``requests`` (arrivals in seconds of wall time) on a prefill and a decode process; see the module."""
    prefill_config = prefill_config or SchedulerConfig(prefix_caching=True)
    decode_config = decode_config or SchedulerConfig()
    if decode_config.policy != "continuous":
        raise ValueError("the decode instance admits prefilled requests into a continuous batch: "
                         "give it a SchedulerConfig with policy='continuous'")
    args = (model, list(requests), prefill_blocks, decode_blocks, block_size, prefill_config, decode_config,
            peer_timeout, fail_after)
    prefill, decode = launch(disagg_worker, 2, args=args, timeout=timeout, accelerator=accelerator)
    results = []
    for i, r in enumerate(requests):
        if i in prefill["rejected"]:
            results.append(Result(r.id, "rejected", prefill["rejected"][i], len(r.prompt), arrival=r.arrival,
                                  ttft_slo=r.ttft_slo))
        else:
            results.append(decode["results"][i])
    transfers = [{"id": requests[i].id, "tokens": len(requests[i].prompt), "bytes_sent": prefill["transfer_bytes"][i],
                  "bytes_received": got, "seconds": s} for i, (got, s) in sorted(decode["transfers"].items())]
    report = Report("disaggregated", results, decode["steps"], block_size, decode_blocks, prefill["computed"],
                    prefill["cached"])
    return DisaggRun(report, transfers, prefill["waits"], prefill["wait_s"], prefill["control_bytes"],
                     (prefill["blocks_in_use"], decode["blocks_in_use"]))
