"""Disaggregated prefill and decode (two processes, gloo): the same tokens as one colocated engine, the
KV bytes the formula gives, backpressure when the decode pool is full, and a clear error in bounded time
when the decode instance dies or hangs."""

import functools
import os
import threading
import time

import pytest
import torch

from llmsys.core import zoo
from llmsys.core.dist import WorkerError
from llmsys.core.model import ModelConfig, Transformer
from llmsys.serving import Engine, PagedKVCache, Request, SchedulerConfig, blocks_for, make_trace
from llmsys.serving import disagg
from llmsys.serving.disagg import kv_transfer_bytes, serve_disaggregated
from llmsys.serving.kvlink import Link, PeerLost

BS = 8


@pytest.fixture(scope="module")
def model():
    return zoo.load("target", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def sensitive():
    """A small fp32 decoder with well-separated logits whose next token depends on the whole context (the zoo's
    briefly trained models lean on the last few tokens, so keys and values in the wrong order may go unseen)."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=96)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 3.0 / p.size(1) ** 0.5)
    return m


def chat(model, n=10, rate=40.0, seed=0):
    """Chat-shaped requests, prompts of several blocks, some after a shared system prompt, one of one token."""
    trace = make_trace(n, vocab_size=model.cfg.vocab_size, max_seq_len=model.cfg.max_seq_len, seed=seed, rate=rate,
                       prompt_len=(8, 48), mean_output=10, output_len=(2, 24), system_len=16)
    trace[1].max_tokens = 1  # its only token comes from the prefill instance
    return trace


def colocated(model, trace):
    return Engine(model, 256, BS, SchedulerConfig(prefix_caching=True)).run(trace)


def test_wrong_keys_and_values_change_the_tokens(sensitive):
    """The equality check below can fail: the prompt's KV with layers swapped, or read from its blocks in the
    wrong order (the partial last block's empty slots land inside the context), decodes other tokens. (A pure
    permutation of the positions would not: attention sums over keys that carry their rotary positions.)"""
    prompt = list(range(1, 30))  # 3 full blocks of 8 and 5 tokens
    reference = Engine(sensitive, 16, BS).run([Request(0, prompt, 8)]).results[0].output
    prefill = Engine(sensitive, 16, BS)
    prefill.on_finish = lambda seq: kept.append(prefill.cache.read_tokens(prefill.blocks.table(seq.key), len(prompt)))
    kept = []
    first = prefill.run([Request(0, prompt, 1)]).results[0].output[0]

    def decode(kv):
        engine = Engine(sensitive, 16, BS)
        seq = disagg.admit_prefilled(engine, Request(0, prompt, 8), kv, first, 0.0)
        while engine.has_work():
            engine.step(0.0)
        return seq.output
    assert decode(kept[0]) == reference
    layers = sensitive.cfg.n_layers
    assert decode(kept[0][[1, 0, *range(2, 2 * layers)]]) != reference  # keys of layers 0 and 1 swapped
    table = list(range(blocks_for(len(prompt), BS)))
    cache = PagedKVCache(sensitive, len(table), BS)
    cache.write_tokens(table, kept[0])
    assert decode(cache.read_tokens(table[::-1], len(prompt))) != reference  # blocks in reverse order


@pytest.mark.parametrize("which", ["target", "sensitive"])
def test_outputs_equal_colocated_and_bytes_equal_formula(which, request):
    model = request.getfixturevalue("model" if which == "target" else which)
    trace = chat(model)
    run = serve_disaggregated(model, trace, 128, 128, BS, peer_timeout=10, timeout=60)
    reference = colocated(model, trace)
    assert [r.status for r in run.report.results] == ["finished"] * len(trace)
    assert [r.output for r in run.report.results] == [r.output for r in reference.results]
    assert [t["id"] for t in run.transfers] == [r.id for r in trace]
    elem = model.tok_embeddings.weight.element_size()
    for t, r in zip(run.transfers, trace):
        assert t["tokens"] == len(r.prompt)
        assert t["bytes_sent"] == t["bytes_received"] == kv_transfer_bytes(model.cfg, len(r.prompt), elem)
    assert run.blocks_in_use == (0, 0)
    assert all(r.preemptions == 0 for r in run.report.results)
    assert {kind for s in run.report.steps for _, n, kind in s.chunks} == {"decode"}  # no prompt token recomputed


def test_backpressure_when_the_decode_pool_is_full(sensitive):
    """A decode pool that holds two or three requests: the prefill instance must wait for blocks, every
    request still finishes with the colocated tokens, the decode side never preempts, every block comes back."""
    trace = chat(sensitive, n=12, rate=None, seed=1)  # everyone at once: prefill runs far ahead of decode
    largest = max(blocks_for(len(r.prompt) + r.max_tokens, BS) for r in trace)
    chunked = SchedulerConfig(prefix_caching=True, chunked_prefill=True, token_budget=16)  # prompts span steps
    run = serve_disaggregated(sensitive, trace, 128, largest + 2, BS, chunked, peer_timeout=10, timeout=60)
    assert [r.status for r in run.report.results] == ["finished"] * len(trace)
    assert [r.output for r in run.report.results] == [r.output for r in colocated(sensitive, trace).results]
    assert run.prefill_waits > 0 and run.prefill_wait_s > 0
    assert max(s.blocks_used for s in run.report.steps) <= largest + 2
    assert all(r.preemptions == 0 for r in run.report.results)
    assert run.blocks_in_use == (0, 0)


def test_quiet_gaps_longer_than_the_peer_timeout_are_not_failures(model):
    """Arrivals 2.5 s apart with a 1 s peer timeout: heartbeats keep both instances sure of each other."""
    trace = chat(model, n=2)
    trace[1].arrival = trace[0].arrival + 2.5
    run = serve_disaggregated(model, trace, 64, 64, BS, peer_timeout=1, timeout=60)
    assert [r.status for r in run.report.results] == ["finished"] * 2


def test_a_request_larger_than_the_decode_pool_is_rejected(model):
    trace = chat(model, n=3)
    big = Request("big", list(range(1, 41)), 20)  # 60 tokens: 8 blocks of 8
    sampled = Request("sampled", list(range(1, 9)), 4, temperature=0.8)
    run = serve_disaggregated(model, trace + [big, sampled], 64, 6, BS, peer_timeout=10, timeout=60)
    assert run.report.results[-2].status == "rejected" and "decode instance has 6" in run.report.results[-2].reason
    assert run.report.results[-1].status == "rejected" and "greedily" in run.report.results[-1].reason
    assert [r.status for r in run.report.results[:-2]] == ["finished"] * 3


def on_third_admission(failure: str, link):
    """A decode instance that dies (exits 3) or hangs (two minutes) when the third prefilled request arrives."""
    def admit(*args, _calls=[]):  # noqa: B006 - counts calls in this (decode) process only
        _calls.append(1)
        if len(_calls) == 3:
            os._exit(3) if failure == "die" else time.sleep(120)
        return real(*args)
    real, disagg.admit_prefilled = disagg.admit_prefilled, admit


die_on_third_admission = functools.partial(on_third_admission, "die")
hang_on_third_admission = functools.partial(on_third_admission, "hang")


def test_decode_instance_dying_mid_run_ends_the_run_with_an_error(model):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 died with exit code 3"):
        serve_disaggregated(model, chat(model, n=8, rate=None), 64, 64, BS, peer_timeout=5, timeout=60,
                            fail_after=die_on_third_admission)
    assert time.monotonic() - start < 30


def test_prefill_instance_reports_a_hung_decode_instance(model):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 0 raised PeerLost: the decode instance \(rank 1\)") as caught:
        serve_disaggregated(model, chat(model, n=8, rate=None), 64, 64, BS, peer_timeout=2, timeout=60,
                            fail_after=hang_on_third_admission)
    assert caught.value.rank == 0
    assert time.monotonic() - start < 30


def test_a_silent_receiver_ends_in_peer_lost():
    """The main thread never waits on the peer for longer than the timeout, whatever its receiver thread does."""
    link = Link(1, None, None, peer_timeout=0.3, kv_device="cpu", names={1: "the decode instance"})
    stuck = threading.Event()
    link.start_receiving(lambda link: stuck.wait())
    outcome = []

    def take():
        try:
            link.take(True, "credits")
        except PeerLost as e:
            outcome.append(str(e))
    waiter = threading.Thread(target=take, daemon=True)  # a take that hangs fails this test instead of hanging it
    waiter.start()
    waiter.join(5)
    stuck.set()
    assert outcome == ["the decode instance sent nothing for 0.3 s while this one waited for credits"]


def test_kv_read_and_write_by_token_round_trip(model):
    cache = PagedKVCache(model, 8, 4)
    for layer in cache.k + cache.v:
        layer.normal_()
    table = [5, 2, 7]
    kv = cache.read_tokens(table, 10)  # (2·layers, tokens, n_kv, hs)
    cfg = model.cfg
    assert kv.shape == (2 * cfg.n_layers, 10, cfg.n_kv_heads, cfg.head_dim)
    assert torch.equal(kv[cfg.n_layers + 1, 5], cache.v[1][2, 1])  # values of layer 1, position 5: block 2, slot 1
    other = PagedKVCache(model, 8, 4)
    other.write_tokens([0, 3, 1], kv)
    assert torch.equal(other.read_tokens([0, 3, 1], 10), kv)
    with pytest.raises(ValueError, match="2·layers, tokens, n_kv, hs"):
        other.write_tokens([0, 3, 1], kv[1:])


def test_realtime_run_waits_for_arrivals(model):
    """The colocated baseline's clock: arrivals wait for their wall-clock time; the tokens do not change."""
    trace = chat(model, n=3)
    trace[2].arrival = 0.3
    report = Engine(model, 64, BS).run(trace, realtime=True)
    assert report.results[2].first_token_time >= 0.3
    assert [r.output for r in report.results] == [r.output for r in Engine(model, 64, BS).run(trace).results]
    with pytest.raises(ValueError, match="clock='wall'"):
        Engine(model, 64, BS, clock="cpu").run(trace, realtime=True)


def test_admit_prefilled_refuses_sampled_requests(model):
    engine = Engine(model, 16, BS)
    kv = torch.zeros(2 * model.cfg.n_layers, 4, model.cfg.n_kv_heads, model.cfg.head_dim)
    with pytest.raises(ValueError, match="decoded greedily"):
        disagg.admit_prefilled(engine, Request("r", [1, 2, 3, 4], 4, temperature=0.7), kv, 5, 0.0)


def test_benchmark_distributed_mode_quick(tmp_path):
    """``benchmarks/serving.py --distributed --quick`` end to end: every configuration finishes every request,
    the KV bytes sent equal the formula, the tokens equal the colocated engine's, every block comes back."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch_threads = torch.get_num_threads()
    try:
        bench.main(["--distributed", "--quick", "--repeats", "2", "--json", str(tmp_path / "out.json")])
    finally:
        torch.set_num_threads(torch_threads)
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["command"].startswith("python benchmarks/serving.py --distributed")
    assert set(result["traces"]) == {"chat", "agentic"}
    assert {"alpha_s", "beta_s_per_byte"} <= set(result["alpha_beta"])
    for trace in result["traces"].values():
        assert {"colocated, 2 thr", "colocated, 1 thr", "disaggregated"} <= set(trace["latency"])
        for row in trace["latency"].values():
            assert row["finished"] == row["requests"] > 0
            assert {"ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "goodput_rps"} <= set(row)
        transfer = trace["transfer"]
        assert transfer["bytes_equal_formula"] and transfer["bytes_sent"] == transfer["bytes_formula"] > 0
        assert transfer["transfers"] == trace["latency"]["disaggregated"]["requests"]
        assert trace["tokens_equal"] and trace["blocks_in_use_after"] == [0, 0]
