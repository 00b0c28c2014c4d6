"""Chapter 9: the paged KV cache's invariants, paged attention against
contiguous attention, and the engine's outputs against decoding each request
alone, under every scheduler setting."""

import math

import pytest
import torch

from llmsys.core.accounting import kv_cache_bytes
from llmsys.core.model import KVCache, ModelConfig, Transformer, attend
from llmsys.serving import (
    BlockAllocator,
    BlockManager,
    Chunk,
    Engine,
    OutOfBlocks,
    PagedKVCache,
    QuantizedKVCache,
    Request,
    SchedulerConfig,
    Speculation,
    block_hash,
    blocks_for,
    dequantize_keys,
    dequantize_values,
    kv_bytes_per_token_int8,
    linear_cost,
    make_trace,
    next_turn,
    paged_attention,
    paged_forward,
    perplexity,
    predicted_steps,
    prefix_hashes,
    quantize_keys,
    quantize_values,
)

BS = 4  # small blocks, so short test sequences span several



@pytest.fixture(scope="module")
def model():
    """A tiny decoder with well-separated logits, so greedy choices do not hinge on float rounding."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 3.0 / p.size(1) ** 0.5)
    return m


def reference(model, requests):
    """Each request decoded alone, greedily, with the model's own generate."""
    return {r.id: model.generate(torch.tensor([r.prompt]), r.max_tokens)[0, len(r.prompt):].tolist() for r in requests}


def small_trace(seed=1, n=14, **kw):
    args = dict(vocab_size=64, max_seq_len=64, seed=seed, prompt_len=(3, 20), mean_output=8, output_len=(1, 24),
                n_system_prompts=2, system_len=9, shared_fraction=0.6)
    return make_trace(n, **{**args, **kw})


# ---------------------------------------------------------------- block allocator


def test_hash_chain_separates_equal_blocks_after_different_prefixes():
    a, b = [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 9, 9, 9, 9]
    ha, hb = prefix_hashes(a, BS), prefix_hashes(b, BS)
    assert ha[1] != hb[1]  # the same tokens, a different history
    assert prefix_hashes(a + [1, 2], BS) == ha  # a trailing partial block has no hash
    assert ha[1] == block_hash(ha[0], [9, 9, 9, 9])


@pytest.mark.parametrize("length", [1, 3, 4, 5, 17, 64])
def test_sequence_holds_ceil_len_over_block_size_blocks(length):
    bm = BlockManager(32, BS)
    bm.add("s")
    for start in range(length):  # grow one token at a time, as decoding does
        bm.prepare("s", start, 1)
    assert len(bm.table("s")) == blocks_for(length, BS) == math.ceil(length / BS)
    assert len(bm.table("s")) * BS - length < BS  # waste under one block
    assert bm.filled_slots({"s": length}) == length


def test_shared_prefix_uses_exactly_k_physical_blocks():
    k = 3
    prefix = list(range(k * BS))
    a, b = prefix + [40, 41, 42, 43, 44], prefix + [50, 51]
    bm = BlockManager(32, BS, prefix_caching=True)
    bm.add("a", a)
    bm.prepare("a", 0, len(a))
    bm.commit("a", a, len(a))
    cached = bm.add("b", b)
    assert cached == k * BS
    bm.prepare("b", cached, len(b) - cached)
    shared = set(bm.table("a")) & set(bm.table("b"))
    assert shared == set(bm.table("a")[:k])
    assert bm.allocator.num_used == blocks_for(len(a), BS) + blocks_for(len(b), BS) - k
    assert all(bm.allocator.ref_counts[blk] == 2 for blk in shared)


def test_prompt_fully_cached_still_computes_its_last_token():
    bm = BlockManager(16, BS, prefix_caching=True)
    p = list(range(2 * BS))
    bm.add("a", p)
    bm.prepare("a", 0, len(p))
    bm.commit("a", p, len(p))
    assert bm.add("b", p) == BS  # the last block holds the last token, whose logits are needed


def test_freeing_everything_empties_the_pool():
    gen = torch.Generator().manual_seed(0)
    bm = BlockManager(64, BS, prefix_caching=True)
    system = torch.randint(0, 9, (2 * BS,), generator=gen).tolist()
    lengths = {}
    for i in range(8):
        toks = system + torch.randint(0, 9, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        cached = bm.add(i, toks)
        bm.prepare(i, cached, len(toks) - cached)
        bm.commit(i, toks, len(toks))
        lengths[i] = len(toks)
        if i % 3 == 0:
            bm.fork(i, (i, "child"))
            bm.prepare((i, "child"), len(toks), 2)  # the child writes: copy-on-write of its last block
            lengths[(i, "child")] = len(toks) + 2
    assert bm.allocator.num_used > 0 and bm.allocator.num_cached > 0
    for seq in list(lengths):
        bm.free(seq)
    assert bm.num_free == 64 and all(c == 0 for c in bm.allocator.ref_counts)
    assert not bm.tables


def test_copy_on_write_after_fork():
    bm = BlockManager(16, BS)
    bm.add("p")
    bm.prepare("p", 0, 6)  # blocks [x, y], y half full
    bm.fork("p", "c")
    assert bm.table("p") == bm.table("c")
    assert [bm.allocator.ref_counts[b] for b in bm.table("p")] == [2, 2]
    copies = bm.prepare("c", 6, 1)  # the child appends into the shared half-full block
    assert len(copies) == 1 and copies[0][0] == bm.table("p")[1] and copies[0][1] == bm.table("c")[1]
    assert bm.table("p")[0] == bm.table("c")[0] and bm.table("p")[1] != bm.table("c")[1]
    assert [bm.allocator.ref_counts[b] for b in bm.table("p")] == [2, 1]
    assert bm.prepare("p", 6, 1) == []  # the parent's block is its own again: no copy


def test_decodes_of_very_different_lengths_equal_model_forward(model):
    """Decodes whose contexts fill 1 to 15 blocks share a step (attention groups them by length)."""
    cache, bm = PagedKVCache(model, 64, BS), BlockManager(64, BS)
    gen = torch.Generator().manual_seed(3)
    seqs = {n: torch.randint(0, 64, (n,), generator=gen).tolist() for n in (2, 7, 12, 30, 57)}
    for n, toks in seqs.items():
        bm.add(n)
        bm.prepare(n, 0, n)
        paged_forward(model, cache, [Chunk(toks[:-1], 0, bm.table(n))])
    logits = paged_forward(model, cache, [Chunk(toks[-1:], n - 1, bm.table(n)) for n, toks in seqs.items()])
    for row, toks in zip(logits, seqs.values()):
        torch.testing.assert_close(row, model(torch.tensor([toks]))[0, -1], atol=1e-5, rtol=1e-5)


def test_forked_sequences_decode_as_if_alone(model):
    """Parallel sampling: one prompt, two continuations, KV shared until they diverge."""
    cache, bm = PagedKVCache(model, 16, BS), BlockManager(16, BS)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    bm.add("p")
    bm.prepare("p", 0, len(prompt))
    paged_forward(model, cache, [Chunk(prompt, 0, bm.table("p"))])
    bm.fork("p", "c")
    seqs = {"p": prompt + [10], "c": prompt + [20]}
    for n in range(3):
        chunks = []
        for name, toks in seqs.items():
            cache.copy_blocks(bm.prepare(name, len(toks) - 1, 1))
            chunks.append(Chunk(toks[-1:], len(toks) - 1, bm.table(name)))
        logits = paged_forward(model, cache, chunks)
        for row, (name, toks) in zip(logits, seqs.items()):
            torch.testing.assert_close(row, model(torch.tensor([toks]))[0, -1], atol=1e-5, rtol=1e-5)
            toks.append(int(row.argmax()) if n % 2 else 30 + n)


def test_cached_blocks_survive_free_until_evicted():
    alloc = BlockAllocator(2, BS, prefix_caching=True)
    b = alloc.allocate()
    alloc.register(b, 123, [1, 2, 3, 4])
    alloc.release(b)
    assert alloc.lookup(123, [1, 2, 3, 4]) == b and alloc.lookup(123, [1, 2, 3, 5]) is None
    alloc.retain(b)  # a hit revives the free block
    assert alloc.num_free == 1
    alloc.release(b)
    alloc.allocate()
    alloc.allocate()  # the pool is exhausted: the cached block is evicted and reused
    assert alloc.lookup(123, [1, 2, 3, 4]) is None and alloc.evictions == 1
    with pytest.raises(OutOfBlocks):
        alloc.allocate()


def test_allocator_bad_input():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="already free"):
        alloc.release(0)
    bm = BlockManager(2, BS)
    bm.add("s")
    with pytest.raises(OutOfBlocks, match="needs 3 free blocks"):
        bm.prepare("s", 0, 3 * BS)
    with pytest.raises(ValueError, match="already has a block table"):
        bm.add("s")


# ---------------------------------------------------------------- paged attention


def _random_paged(gen, batch, n_heads=4, n_kv=2, hs=16, num_blocks=24, max_blocks=5):
    k_cache = torch.randn(num_blocks, BS, n_kv, hs, generator=gen)
    v_cache = torch.randn(num_blocks, BS, n_kv, hs, generator=gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(batch)]).int()
    lens = torch.randint(1, max_blocks * BS + 1, (batch,), generator=gen).int()
    q = torch.randn(batch, n_heads, hs, generator=gen)
    return q, k_cache, v_cache, tables, lens


def _contiguous_attention(q, k_cache, v_cache, tables, lens):
    out = []
    for b in range(q.size(0)):
        L = int(lens[b])
        k = k_cache[tables[b].long()].flatten(0, 1)[:L].transpose(0, 1)  # (n_kv, L, hs)
        v = v_cache[tables[b].long()].flatten(0, 1)[:L].transpose(0, 1)
        out.append(attend(q[b][None, :, None], k[None], v[None])[0, :, 0])  # the model's own attention
    return torch.stack(out)


def test_paged_attention_equals_contiguous_attention():
    q, k, v, tables, lens = _random_paged(torch.Generator().manual_seed(0), batch=6)
    torch.testing.assert_close(paged_attention(q, k, v, tables, lens), _contiguous_attention(q, k, v, tables, lens))


def test_triton_paged_kernel_equals_contiguous_attention():
    from llmsys.kernels import interpreter_ok
    from llmsys.kernels.paged_attention import paged_attention_decode

    assert interpreter_ok(), "Triton's copy canary failed: this numpy/triton pair computes wrong results"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, tables, lens = (t.to(dev) for t in _random_paged(torch.Generator().manual_seed(1), batch=3))
    torch.testing.assert_close(paged_attention_decode(q, k, v, tables, lens),
                               _contiguous_attention(q, k, v, tables, lens), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_decode(q, k, v, tables.long(), lens)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode(q, k, v, tables, lens * 0)


def test_paged_forward_equals_model_forward(model):
    """Mixed steps (a prompt in two chunks, another whole, then decodes) give the model's own logits."""
    cache, bm = PagedKVCache(model, 32, BS), BlockManager(32, BS)
    gen = torch.Generator().manual_seed(2)
    seqs = {s: torch.randint(0, 64, (n,), generator=gen).tolist() for s, n in (("a", 23), ("b", 9), ("c", 1))}
    done = dict.fromkeys(seqs, 0)
    for s in seqs:
        bm.add(s)

    def step(plan):
        chunks = []
        for s, n in plan:
            bm.prepare(s, done[s], n)
            chunks.append(Chunk(seqs[s][done[s]:done[s] + n], done[s], bm.table(s)))
            done[s] += n
        return paged_forward(model, cache, chunks, all_logits=True)

    full = {s: model(torch.tensor([t]))[0] for s, t in seqs.items()}
    out = step([("a", 10), ("b", 9), ("c", 1)])
    torch.testing.assert_close(out, torch.cat([full["a"][:10], full["b"], full["c"]]), atol=1e-5, rtol=1e-5)
    out = step([("a", 13)])
    torch.testing.assert_close(out, full["a"][10:], atol=1e-5, rtol=1e-5)
    for s in seqs:
        seqs[s].append(7)
    out = step([(s, 1) for s in seqs])  # three decodes of different lengths, one batched attention
    for row, (s, toks) in zip(out, seqs.items()):
        torch.testing.assert_close(row, model(torch.tensor([toks]))[0, -1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the engine

SETTINGS = {
    "static": (SchedulerConfig(policy="static", max_batch=6), 96),
    "continuous": (SchedulerConfig(max_batch=6), 96),
    "chunked": (SchedulerConfig(chunked_prefill=True, token_budget=8), 96),
    "chunked+prefix": (SchedulerConfig(chunked_prefill=True, token_budget=12, prefix_caching=True), 96),
    "slo order": (SchedulerConfig(chunked_prefill=True, token_budget=12, ordering="slo"), 96),
    "overload": (SchedulerConfig(max_batch=16), 16),
    "overload chunked+prefix": (SchedulerConfig(chunked_prefill=True, token_budget=10, prefix_caching=True), 16),
}


@pytest.fixture(scope="module")
def trace_and_reference(model):
    trace = small_trace(ttft_slos=(0.01, 1.0), rate=200.0)
    return trace, reference(model, trace)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_output_equals_decoding_alone(model, trace_and_reference, setting):
    trace, expected = trace_and_reference
    config, num_blocks = SETTINGS[setting]
    engine = Engine(model, num_blocks, BS, config, clock=linear_cost())
    report = engine.run(trace)
    assert [r.status for r in report.results] == ["finished"] * len(trace)  # no request lost
    for r in report.results:
        assert r.output == expected[r.id], f"request {r.id} differs under {setting}"
    assert engine.blocks.num_free == num_blocks and not engine.blocks.tables  # nothing leaked
    if setting.startswith("overload"):
        assert report.summary()["preemptions"] > 0  # memory was short, sequences were recomputed
    if config.chunked_prefill:
        assert max(sum(n for _, n, _ in s.chunks) for s in report.steps) <= config.token_budget
    if config.prefix_caching:
        assert report.summary()["prefix hit rate"] > 0


def alone(model, r):
    """One request decoded alone by the model's own generate, with its sampling parameters, cut after a stop token."""
    gen = torch.Generator(model.tok_embeddings.weight.device).manual_seed(r.seed) if r.temperature else None
    out = model.generate(torch.tensor([r.prompt]), r.max_tokens, r.temperature, generator=gen,
                         top_p=r.top_p)[0, len(r.prompt):].tolist()
    stops = [i for i, t in enumerate(out) if t in r.stop_ids]
    return out[:stops[0] + 1] if stops else out


def sampled_trace(model):
    """Every kind of request at once: greedy, hot, nucleus, with stop tokens, under one seed each."""
    trace = small_trace(seed=4, rate=200.0)
    greedy = reference(model, trace)
    for r in trace:
        kind = r.id % 4
        r.temperature, r.top_p, r.seed = (0.0, 1.0, None) if kind == 0 else (1.0 + 0.5 * (kind == 1), 0.9 - 0.3 * (kind == 2), 100 + r.id)
        if r.id % 3 == 0 and len(greedy[r.id]) > 2:  # a stop token greedy decoding meets: the request ends early
            r.stop_ids = (greedy[r.id][len(greedy[r.id]) // 2],)
    return trace


@pytest.mark.parametrize("setting", ["static", "chunked+prefix", "overload chunked+prefix"])
def test_sampled_requests_with_stop_tokens_equal_decoding_alone(model, setting):
    """Each request draws from its own seeded generator only when it has caught up, so batching, chunking
    and recomputation after preemption never change its tokens."""
    trace = sampled_trace(model)
    config, num_blocks = SETTINGS[setting]
    report = Engine(model, num_blocks, BS, config, clock=linear_cost()).run(trace)
    ended_early = 0
    for r, res in zip(trace, report.results):
        assert res.output == alone(model, r), f"request {r.id} differs under {setting}"
        ended_early += len(res.output) < r.max_tokens
    assert ended_early > 0 and any(r.temperature > 0 for r in trace)
    if setting.startswith("overload"):
        assert report.summary()["preemptions"] > 0


def test_sampling_follows_the_seed(model):
    r = Request("a", [5, 6, 7], 12, temperature=1.0, seed=7)
    outputs = [Engine(model, 32, BS, clock=linear_cost()).run([Request(**{**r.__dict__, "seed": s})]).results[0].output
               for s in (7, 7, 8)]
    assert outputs[0] == outputs[1] != outputs[2]
    bad = Engine(model, 32, BS).run([Request("t", [1], 2, temperature=-1.0), Request("p", [1], 2, top_p=0.0)]).results
    assert "temperature" in bad[0].reason and "top_p" in bad[1].reason


def test_top_p_keeps_the_smallest_nucleus():
    from llmsys.core.model import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, generator=gen, top_p=0.75)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3: the two likeliest
    assert {int(sample(logits, 1.0, generator=gen, top_p=0.5)) for _ in range(50)} == {0}


def test_abort_frees_blocks_and_the_rest_finish(model):
    trace = small_trace(n=6, shared_fraction=0.0)
    engine = Engine(model, 64, BS, clock=linear_cost())
    seqs = [engine.submit(r) for r in trace]
    for _ in range(3):
        engine.step(0.0)
    victim = next(s for s in seqs if s.status == "running" and not s.done)
    engine.abort(victim)
    assert victim.key not in engine.blocks.tables and victim.status == "aborted"
    while engine.has_work():
        engine.step(0.0)
    expected = reference(model, trace)
    assert all(s.output == expected[s.id] for s in seqs if s is not victim)
    assert engine.blocks.num_free == 64


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    from llmsys.serving.speculative import prompt_lookup, walk_greedy

    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest 3-gram match wins
    assert prompt_lookup([1, 2, 9, 8, 7, 1, 2, 6, 1, 2], 4) == [9, 8, 7, 1]  # the latest with 4 tokens after it
    assert prompt_lookup([1, 2, 3, 7, 1, 2, 3], 5) == [7, 1, 2, 3]  # none has 5: the latest
    assert prompt_lookup([5, 6, 7, 5], 3) == [6, 7, 5]  # a 1-gram match when no longer one exists
    assert prompt_lookup([1, 2, 3], 4) == [] and prompt_lookup([4], 2) == []
    chain = [-1, 0, 1]
    assert walk_greedy([4, 5, 6], chain, [4, 5, 9, 8]) == ([0, 1], [4, 5, 9])  # two kept, then the target's token
    assert walk_greedy([4, 5, 6], chain, [4, 5, 6, 8]) == ([0, 1, 2], [4, 5, 6, 8])  # all kept, plus the bonus
    assert walk_greedy([4, 5, 6], chain, [4, 5, 6, 8], stop_ids=(5,)) == ([0, 1], [4, 5])  # nothing after a stop
    # a tree: 4 and 7 under the root, 5 under 4, 6 and 2 under 7; the target's argmax at the root, then per node
    tree, parents = [4, 7, 5, 6, 2], [-1, -1, 0, 1, 1]
    assert walk_greedy(tree, parents, [7, 0, 2, 0, 0, 3]) == ([1, 4], [7, 2, 3])  # down the second branch
    assert walk_greedy(tree, parents, [7, 0, 5, 0, 0, 3]) == ([1], [7, 5])  # 5 is 4's child, not 7's
    assert walk_greedy(tree, parents, [9, 5, 6, 2, 2, 2]) == ([], [9])


@pytest.mark.parametrize("setting", ["continuous", "chunked+prefix", "overload chunked+prefix"])
def test_speculative_engine_equals_greedy_decoding(setting):
    """Prompt-lookup drafts verified in the batch leave every greedy output unchanged (sampled requests
    do not draft), take fewer steps, and survive preemption. The zoo's tiny model repeats itself a lot,
    which gives the drafter something to find."""
    from llmsys.core import zoo

    tiny = zoo.load("tiny", device="cpu")
    trace = make_trace(14, vocab_size=tiny.cfg.vocab_size, max_seq_len=64, seed=4, rate=200.0, prompt_len=(3, 20),
                       mean_output=16, output_len=(1, 40), system_len=9, shared_fraction=0.6,
                       corpus_ids=zoo.dataset()[0][:5000].tolist())
    for r in trace[::4]:
        r.temperature, r.seed = 0.8, r.id
    config, num_blocks = SETTINGS[setting]
    plain = Engine(tiny, num_blocks, BS, config, clock=linear_cost()).run(trace)
    engine = Engine(tiny, num_blocks, BS, config, clock=linear_cost(), speculate=Speculation("prompt lookup", gamma=4))
    report = engine.run(trace)
    for r, res in zip(trace, report.results):
        assert res.output == alone(tiny, r), f"request {r.id} differs under {setting}"
    assert engine.accepted > 0 and len(report.steps) < len(plain.steps)
    assert engine.blocks.num_free == num_blocks
    with pytest.raises(ValueError, match="gamma"):
        Speculation("prompt lookup", gamma=0)
    with pytest.raises(ValueError, match="Speculation"):
        Engine(tiny, 8, BS, speculate=4)


def test_engine_with_triton_decode_equals_torch(model):
    trace = small_trace(n=3, prompt_len=(3, 9), output_len=(2, 4))  # the interpreter runs kernels slowly
    outputs = [[r.output for r in Engine(model, 64, BS, attention=a, clock=linear_cost()).run(trace).results]
               for a in ("torch", "triton")]
    assert outputs[0] == outputs[1]


def test_bad_requests_are_rejected_and_the_rest_served(model):
    good = small_trace(n=3, shared_fraction=0.0)
    bad = [
        Request("too long", list(range(60)), max_tokens=10),
        Request("no tokens wanted", [1, 2, 3], max_tokens=0),
        Request("empty", [], max_tokens=3),
        Request("bad token", [1, 2, 999], max_tokens=3),
        Request(good[0].id, [4, 5, 6], max_tokens=2),  # a repeated id
    ]
    report = Engine(model, 12, BS, SchedulerConfig(), clock=linear_cost()).run(good[:1] + bad + good[1:])
    status = {r.id: (r.status, r.reason) for r in report.results[1:len(bad) + 1]}
    assert "context" in status["too long"][1] and "max_seq_len" not in status["too long"][1]
    assert "max_tokens" in status["no tokens wanted"][1]
    assert "empty" in status["empty"][1]
    assert "outside" in status["bad token"][1]
    assert "duplicate" in report.results[len(bad)].reason
    assert all(s == "rejected" for s, _ in status.values())
    expected = reference(model, good)
    served = [r for r in report.results if r.status == "finished"]
    assert [r.output for r in served] == [expected[g.id] for g in good]
    big = Request("huge", list(range(40)), max_tokens=20)  # fits the context (64), not 12 blocks of 4
    assert "KV blocks" in Engine(model, 12, BS).run([big]).results[0].reason


def test_kv_waste_paged_below_one_block_per_sequence_static_reserves(model):
    trace = small_trace(n=10, shared_fraction=0.0)
    static = Engine(model, 128, BS, SchedulerConfig(policy="static"), clock=linear_cost()).run(trace)
    cont = Engine(model, 128, BS, SchedulerConfig(), clock=linear_cost()).run(trace)
    for step in cont.steps:
        assert step.blocks_used * BS - step.slots_filled < BS * step.running or step.running == 0
    assert cont.summary()["KV waste"] < static.summary()["KV waste"]
    assert static.summary()["KV used blocks (peak)"] == blocks_for(64, BS) * 8  # whole context reserved per request


def test_static_batch_computes_finished_rows_until_it_ends(model):
    """A dense static batch: every admitted row runs (real or padding) until the batch's longest is done,
    and its reserved blocks come back only then; outputs are still those of decoding alone."""
    lengths = [(5, 2), (7, 9), (3, 4), (6, 1), (4, 6)]
    trace = [Request(i, [1 + (i + j) % 50 for j in range(p)], m) for i, (p, m) in enumerate(lengths)]
    cost = linear_cost(step_s=1e-3, per_token_s=1e-4)
    report = Engine(model, 64, BS, SchedulerConfig(policy="static", max_batch=3), clock=cost).run(trace)
    assert {r.id: r.output for r in report.results} == reference(model, trace)
    batches = [(0, 1, 2), (3, 4)]  # three rows, then the last two
    expected_steps = sum(max(lengths[i][1] for i in b) for b in batches)  # a step per token of the longest
    assert len(report.steps) == expected_steps
    start = 0
    for b in batches:
        longest = max(lengths[i][1] for i in b)
        for s in report.steps[start:start + longest]:
            assert len(s.chunks) + s.padding == len(b)  # finished rows keep computing
            assert s.blocks_used == len(b) * blocks_for(64, BS)  # and keep their reservation
            assert s.duration == cost(sum(n for _, n, _ in s.chunks) + s.padding, 0)  # padding costs like any row
        start += longest
    assert sum(s.padding for s in report.steps) == sum(max(lengths[i][1] for i in b) - lengths[i][1]
                                                       for b in batches for i in b)


def test_continuous_batching_takes_fewer_steps_than_static(model):
    trace = small_trace(n=12, shared_fraction=0.0)
    steps = {p: Engine(model, 256, BS, SchedulerConfig(policy=p, max_batch=6), clock=linear_cost()).run(trace).steps
             for p in ("static", "continuous")}
    assert len(steps["continuous"]) < len(steps["static"])
    assert all(len(s.admitted) == 0 for s in steps["static"] if s.running and s.index and s.chunks[0][2] == "decode")


@pytest.mark.parametrize("static_batch,max_batch", [(2, 4), (3, 6), (5, 5)])
def test_step_counts_predicted_from_the_lengths_are_the_engines(model, static_batch, max_batch):
    """With memory to spare and whole prompts, static batching takes Σ over its batches of the longest output, and
    continuous batching the makespan of filling max_batch slots in arrival order (list scheduling)."""
    trace = small_trace(n=13, shared_fraction=0.0)
    predicted = predicted_steps(trace, max_batch, static_batch)
    for policy, blocks in (("static", static_batch * 64 // BS), ("continuous", 512)):
        config = SchedulerConfig(policy=policy, max_batch=static_batch if policy == "static" else max_batch)
        assert len(Engine(model, blocks, BS, config, clock=linear_cost()).run(trace).steps) == predicted[policy]


def test_slo_ordering_serves_urgent_requests_first(model):
    # pairs of requests take about 10 ms on this clock: the six urgent ones can all start within 30 ms
    trace = [Request(i, [1 + i % 7] * 12, 4, arrival=0.0, ttft_slo=0.03 if i % 2 else 10.0) for i in range(12)]
    ttft, met = {}, {}
    for order in ("fcfs", "slo"):
        config = SchedulerConfig(max_batch=2, ordering=order)
        report = Engine(model, 64, BS, config, clock=linear_cost()).run(trace)
        urgent = [r for r in report.results if r.ttft_slo < 1]
        ttft[order] = sum(r.ttft for r in urgent) / len(urgent)
        met[order] = sum(r.ttft <= r.ttft_slo for r in urgent)
    assert ttft["slo"] < ttft["fcfs"] and met["slo"] == 6 > met["fcfs"]


def test_slo_ordering_serves_a_request_already_late_last(model):
    # one slot, busy for ~40 ms: when it frees, "late" has missed its deadline and "on time" can still
    # make its own, so it goes first; the late request is still served, not dropped
    trace = [Request("busy", [3] * 8, 20, arrival=0.0, ttft_slo=10.0),
             Request("late", [4] * 8, 4, arrival=0.001, ttft_slo=0.002),
             Request("on time", [5] * 8, 4, arrival=0.002, ttft_slo=1.0)]
    report = Engine(model, 64, BS, SchedulerConfig(max_batch=1, ordering="slo"), clock=linear_cost()).run(trace)
    late, on_time = report.results[1], report.results[2]
    assert on_time.token_times[0] < late.token_times[0] and on_time.ttft <= on_time.ttft_slo
    assert late.status == "finished" and len(late.output) == 4


def test_prefix_cache_persists_across_turns(model):
    engine = Engine(model, 64, BS, SchedulerConfig(prefix_caching=True), clock=linear_cost())
    first = Request("t1", list(range(1, 14)), 6)
    out = engine.run([first]).results[0].output
    second = next_turn(first, out, [7, 8, 9], id="t2", max_tokens=4)
    report = engine.run([second])
    assert report.results[0].cached_tokens >= 16  # the first turn's full blocks
    assert report.results[0].output == reference(model, [second])["t2"]


def test_timings_follow_the_engine_clock(model):
    trace = small_trace(n=6, shared_fraction=0.0)  # everyone at t = 0: the clock never idles
    cost = linear_cost(step_s=1e-3, per_token_s=1e-4)
    report = Engine(model, 64, BS, SchedulerConfig(max_batch=4), clock=cost).run(trace)
    assert [s.duration for s in report.steps] == [cost(sum(n for _, n, _ in s.chunks), 0) for s in report.steps]
    for r in report.results:
        assert len(r.token_times) == len(r.output) and r.ttft > 0
        assert math.isclose(sum(r.itl), r.finish_time - r.first_token_time)
    s = report.summary()
    assert math.isclose(s["elapsed s"], sum(step.duration for step in report.steps))
    assert math.isclose(s["throughput tok/s"], s["output tokens"] / s["elapsed s"])
    engine = Engine(model, 64, BS, clock=cost)
    stopped = engine.run(trace, max_steps=3)
    assert any(r.status == "unfinished" and "max_steps" in r.reason for r in stopped.results)
    assert engine.blocks.num_free == 64  # a stopped run gives its blocks back
    with pytest.raises(ValueError, match="clock"):
        Engine(model, 64, BS, clock="sundial")


def test_trace_is_reproducible_and_fits_the_context():
    a, b = small_trace(seed=3, rate=5.0), small_trace(seed=3, rate=5.0)
    assert [(r.prompt, r.max_tokens, r.arrival) for r in a] == [(r.prompt, r.max_tokens, r.arrival) for r in b]
    assert all(len(r.prompt) + r.max_tokens <= 64 and r.max_tokens >= 1 for r in a)
    assert all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    corpus = list(range(1000, 1500))  # "real text": consecutive ids make slices easy to recognise
    for r in small_trace(n=4, shared_fraction=0.0, corpus_ids=corpus):
        assert all(b == a + 1 for a, b in zip(r.prompt, r.prompt[1:]))
    with pytest.raises(ValueError, match="shared_fraction"):
        small_trace(shared_fraction=2.0)
    with pytest.raises(ValueError, match="chunked_prefill needs a token_budget"):
        SchedulerConfig(chunked_prefill=True)


# ---------------------------------------------------------------- KV quantization


def test_keys_quantized_per_channel_values_per_token():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 32, 8, generator=gen) * torch.linspace(0.1, 10, 8)  # channels of very different size
    v = torch.randn(2, 3, 32, 8, generator=gen)
    kq, ks = quantize_keys(k, group=16)
    vq, vs = quantize_values(v)
    assert kq.dtype == vq.dtype == torch.int8 and ks.shape == (2, 3, 2, 8) and vs.shape == (2, 3, 32)
    torch.testing.assert_close(ks.float(), (k.view(2, 3, 2, 16, 8).abs().amax(3) / 127).half().float())
    torch.testing.assert_close(vs.float(), (v.abs().amax(-1) / 127).half().float())
    k_err = (dequantize_keys(kq, ks) - k).abs().view(2, 3, 2, 16, 8)
    assert (k_err <= ks.float()[:, :, :, None] * 0.51).all()  # round to nearest: at most half a step
    assert ((dequantize_values(vq, vs) - v).abs() <= vs.float()[..., None] * 0.51).all()


def test_quantized_cache_reads_what_it_stored():
    """Attention reads the cached tokens as stored (int8 per group/token, the open key group in full
    precision) and the new tokens as computed; compare with quantizing the whole history at once."""
    gen = torch.Generator().manual_seed(0)
    g, k_all, v_all = 8, torch.randn(1, 2, 30, 4, generator=gen), torch.randn(1, 2, 30, 4, generator=gen)
    cache = QuantizedKVCache(1, 1, 2, 32, 4, group=g)
    for start, end in ((0, 11), (11, 12), (12, 21), (21, 30)):  # a prefill, a decode, two chunks
        keys, values = cache.update(0, k_all[:, :, start:end], v_all[:, :, start:end])
        done = start // g * g
        expect_k = torch.cat([dequantize_keys(*quantize_keys(k_all[:, :, :done], g)), k_all[:, :, done:end]], 2)
        expect_v = torch.cat([dequantize_values(*quantize_values(v_all[:, :, :start])), v_all[:, :, start:end]], 2)
        torch.testing.assert_close(keys, expect_k)
        torch.testing.assert_close(values, expect_v)
        cache.length = end


def test_quantized_cache_perplexity_close_to_fp(model):
    ids = torch.randint(0, 64, (2 * 32 + 1,), generator=torch.Generator().manual_seed(0))
    fp, q8 = perplexity(model, ids, 32), perplexity(model, ids, 32, quantized=True, group=16)
    assert fp != q8 and abs(q8 / fp - 1) < 0.05
    cfg = model.cfg
    cache = QuantizedKVCache.for_model(model, 2, 48, group=16)
    assert cache.nbytes == kv_bytes_per_token_int8(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16) * 48 * 2
    assert cache.nbytes < 0.6 * kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 48 * 2, bytes_per_elem=2)


def _speculate(model, cache, prompt, block, accepted, then):
    """Prefill, verify a drafted block, keep ``accepted`` of it (roll back the rest), continue."""
    model(prompt, cache)
    model(block, cache)
    cache.truncate(prompt.size(1) + accepted)
    return model(then, cache)


@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_quantized_cache_rolls_back_like_a_cache_that_never_saw_the_rejected_tokens(model, accepted):
    """Speculative decoding through an int8 cache (group 4): the block crosses a key-group boundary,
    and after the rollback the continuation reads exactly what a fresh cache fed only the accepted
    tokens reads; clone gives an independent copy, as KVCache.clone does."""
    gen = torch.Generator().manual_seed(accepted)
    prompt, block, then = (torch.randint(0, 64, (2, n), generator=gen) for n in (6, 5, 3))
    with torch.no_grad():
        cache = QuantizedKVCache.for_model(model, 2, 32, group=4)
        got = _speculate(model, cache, prompt, block, accepted, then)
        fresh = QuantizedKVCache.for_model(model, 2, 32, group=4)
        model(prompt, fresh)
        if accepted:
            model(block[:, :accepted], fresh)
        # tolerance for BLAS blocking (the block's keys were projected 5 at a time, the fresh ones
        # fewer); a key restored from int8 instead of full precision would be off by ~1e-2
        torch.testing.assert_close(got, model(then, fresh), rtol=1e-4, atol=1e-5)
        twin = cache.clone()
        step = torch.randint(0, 64, (2, 1), generator=gen)
        assert torch.equal(model(step, twin), model(step, cache)) and twin.length == cache.length
        model(step, twin)
        assert twin.length == cache.length + 1
    for c in (cache, KVCache(1, 1, 1, 8, 2)):  # the same interface as the cache it stands in for
        assert all(callable(getattr(c, name)) for name in ("update", "truncate", "clone"))
        assert {c.length, c.batch_size, c.max_len, c.nbytes} and c.clone() is not c


def test_quantized_cache_refuses_a_rollback_past_its_full_precision_keys(model):
    cache = QuantizedKVCache.for_model(model, 1, 32, group=4)
    with torch.no_grad():
        model(torch.zeros(1, 13, dtype=torch.long), cache)  # groups 0-3, 4-7, 8-11 quantized, 12 open
    assert cache.rollback_floor == 8
    cache.truncate(9)  # reopens the group 8-11 from its full-precision copy
    with pytest.raises(ValueError, match="roll back at most to 8"):
        cache.truncate(7)
    with pytest.raises(ValueError, match="truncate to 0..9"):
        cache.truncate(10)


def test_kv_bytes_per_token_published_figures():
    assert kv_cache_bytes(126, 8, 128, bytes_per_elem=2) == 516_096  # Llama-3-405B, bf16
    assert kv_cache_bytes(40, 40, 128, bytes_per_elem=2) == 819_200  # OPT-13B: 800 KB (vLLM paper)


def test_benchmark_script_runs_every_configuration(tmp_path, monkeypatch, capsys):
    """benchmarks/serving.py end to end, on the tiny zoo model and a short trace."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    summaries = bench.main(["--model", "tiny", "--requests", "6", "--slo-requests", "4", "--threads", "1",
                            "--max-batch", "4", "--json", str(tmp_path / "serving.json")])
    assert [s["config"] for s in summaries] == ["static", "continuous", "continuous + chunked",
                                                "continuous + chunked + prefix"]
    assert all(s["finished"] == 6 for s in summaries)
    out = capsys.readouterr().out
    assert "identical tokens for every request: True" in out and "(equal)" in out  # the predicted prefill cut
    result = json.loads((tmp_path / "serving.json").read_text())
    assert {"static_tok_s", "continuous_tok_s", "kv_waste", "prefix_hit_rate", "goodput"} <= set(result)
    from llmsys.course import claims  # the continuous-batching claim reads this JSON

    assert claims.continuous_over_static(result).value == result["continuous_tok_s"] / result["static_tok_s"]
    assert set(result["goodput"]) == {"fcfs", "slo"}


def test_long_session_policies(tmp_path):
    """The long session on the tiny zoo model: keeping everything computes only each turn's
    new tokens; under the budget, LRU serves while the history fits and refuses after; the window stays within
    the budget and answers every turn."""
    from llmsys.serving.served import load_served
    from llmsys.serving.sessions import long_session

    served = load_served("tiny", "fp32", 1024, device="cpu")
    rows = long_session(served, turns=6, user_words=10, answer_tokens=8, budget_blocks=12)["rows"]
    keep, lru, window = rows["keep all"], rows["LRU, budget"], rows["window"]
    assert all(r["served"] and r["same_answer"] for r in keep)
    assert all(r["computed"] < r["prompt"] for r in keep[1:])  # the history comes from the prefix cache
    assert [r["served"] for r in lru] == [r["prompt"] + 8 <= 12 * 16 for r in lru] and not lru[-1]["served"]
    assert all(r["served"] and r["peak_blocks"] <= 12 for r in window)
    assert all(r["same_share"] == 1 for r in keep) and all(r["same_share"] < 1 for r in window if not r["same_answer"])


def test_a_scheduler_in_a_described_state_holds_its_blocks_and_plans_like_the_engine():
    from llmsys.serving import scheduler_in_state

    config = SchedulerConfig(max_batch=4, chunked_prefill=True, token_budget=20)
    scheduler = scheduler_in_state(config, [("a", 10, 9), ("b", 40, 17)], [("c", 30), ("d", 5)],
                                   free_blocks=5, block_size=4)
    assert scheduler.blocks.num_free == 5  # ⌈9/4⌉ + ⌈17/4⌉ = 8 blocks held, 5 left
    assert [s.num_computed for s in scheduler.running] == [9, 17]
    # a budget of 20: a's decode first, then 19 of b's 23 prompt tokens left; nothing remains for c
    assert [(seq.id, n) for seq, n in scheduler.schedule().chunks] == [("a", 1), ("b", 19)]
