"""The server's engine policies without HTTP: fair prefill (a capped share of each step's token budget
per prompt, decodes first) and a failure while sampling one request ending that request alone."""

import pytest
import torch

import llmsys.serving.sampling as sampling_module
from llmsys.core.model import ModelConfig, Transformer
from llmsys.serving import (Engine, Request, SchedulerConfig, Speculation, linear_cost, make_trace,
                            scheduler_in_state)

BS = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 3.0 / p.size(1) ** 0.5)  # well-separated logits: greedy never hinges on rounding
    return m


def alone(model, r):
    return model.generate(torch.tensor([r.prompt]), r.max_tokens)[0, len(r.prompt):].tolist()


def plan_of(cap, running, waiting, budget=256):
    config = SchedulerConfig(chunked_prefill=True, token_budget=budget, prefill_cap=cap)
    plan = scheduler_in_state(config, running, waiting, max_seq_len=16384).schedule()
    return {seq.id: n for seq, n in plan.chunks}


def test_a_long_prefill_no_longer_starves_a_short_prompt():
    running, waiting = [("long", 8000, 512)], [("short", 16)]
    assert plan_of(None, running, waiting) == {"long": 256}  # the old policy: the short one waits
    fair = plan_of(64, running, waiting)
    assert fair == {"long": 64, "short": 16}  # it runs now, in a short step: its first token comes soon


def test_capped_prefills_share_the_budget_after_the_decodes():
    # two decodes (9 tokens, 8 computed), two long prompts: decodes first, each prompt its capped share first
    running = [("p1", 4000, 0), ("d1", 9, 8), ("p2", 4000, 0), ("d2", 9, 8)]
    chunks = plan_of(64, running, [("s", 40)], budget=200)
    assert chunks["d1"] == chunks["d2"] == 1 and chunks["s"] == 40
    assert chunks["p1"] == chunks["p2"] == 64  # no top-up in a step that carries a whole prompt
    assert plan_of(64, [("alone", 4000, 0)], [])["alone"] == 256  # alone, a prompt takes the whole budget
    both = plan_of(64, running, [], budget=200)  # long prompts alone share the whole budget, first come first
    assert both == {"d1": 1, "d2": 1, "p1": 200 - 2 - 64, "p2": 64}
    tight = plan_of(64, running, [("s", 40)], budget=100)  # too small for all: the decodes still run
    assert tight["d1"] == tight["d2"] == 1 and tight["p1"] == 64 and sum(tight.values()) == 100


def test_prefill_cap_is_checked():
    with pytest.raises(ValueError, match="prefill_cap"):
        SchedulerConfig(token_budget=64, prefill_cap=16)  # needs chunked_prefill
    with pytest.raises(ValueError, match="prefill_cap"):
        SchedulerConfig(chunked_prefill=True, token_budget=64, prefill_cap=0)


@pytest.mark.parametrize("cap", [1, 3, 8])
def test_capped_prefill_decodes_as_each_request_alone(model, cap):
    trace = make_trace(24, vocab_size=64, max_seq_len=128, seed=1, rate=200.0, prompt_len=(4, 60), output_len=(1, 20))
    config = SchedulerConfig(max_batch=6, chunked_prefill=True, token_budget=16, prefill_cap=cap, prefix_caching=True)
    engine = Engine(model, 96, BS, config, clock=linear_cost())
    report = engine.run(trace)
    assert all(r.status == "finished" and r.output == alone(model, q) for r, q in zip(report.results, trace))
    assert max(sum(n for _, n, _ in s.chunks) for s in report.steps) <= 16
    assert engine.blocks.allocator.num_used == 0


def test_a_failed_draw_fails_only_its_own_request(model, monkeypatch):
    real = sampling_module.sample

    def faulty(logits, temperature, *args, **kwargs):
        if temperature == 0.7:
            raise RuntimeError("probability tensor contains inf")
        return real(logits, temperature, *args, **kwargs)

    monkeypatch.setattr(sampling_module, "sample", faulty)
    good = [Request(f"g{i}", [3 + i, 5, 7, 9], 12) for i in range(3)]
    bad = Request("bad", [1, 2, 3], 12, temperature=0.7, seed=1)
    sampled = Request("sampled", [4, 4, 4], 12, temperature=1.0, seed=1)
    engine = Engine(model, 64, BS, SchedulerConfig(max_batch=8), clock=linear_cost())
    report = engine.run(good[:2] + [bad, sampled] + good[2:])
    by_id = report.by_id
    assert by_id["bad"].status == "failed" and "inf" in by_id["bad"].reason and not by_id["bad"].output
    assert all(by_id[r.id].status == "finished" and by_id[r.id].output == alone(model, r) for r in good)
    assert by_id["sampled"].status == "finished" and len(by_id["sampled"].output) == 12
    assert engine.blocks.allocator.num_used == 0  # the failed request's blocks were freed


def test_the_engine_refuses_what_would_break_a_step(model):
    engine = Engine(model, 64, BS)
    assert "seed" in engine.check(Request("s", [1, 2], 4, temperature=1.0, seed=2**64))
    assert "temperature" in engine.check(Request("t", [1, 2], 4, temperature=float("inf")))
    assert "temperature" in engine.check(Request("n", [1, 2], 4, temperature=float("nan")))
    assert engine.check(Request("ok", [1, 2], 4, temperature=1.0, seed=2**64 - 1)) == ""


def penalised_alone(model, r):
    """Greedy decoding alone with OpenAI's penalties, written out: logit - frequency * count - presence * seen."""
    out = []
    for _ in range(r.max_tokens):
        logits = model(torch.tensor([r.prompt + out]))[0, -1]
        counts = torch.zeros_like(logits)
        for t in out:
            counts[t] += 1
        out.append(int((logits - r.frequency_penalty * counts - r.presence_penalty * (counts > 0).float()).argmax()))
    return out


def test_penalties_match_their_definition(model):
    requests = [Request("f", [5, 6, 7], 20, frequency_penalty=1.5), Request("p", [5, 6, 7], 20, presence_penalty=2.0),
                Request("both", [9, 1], 16, presence_penalty=-0.5, frequency_penalty=0.7),
                Request("none", [5, 6, 7], 20)]
    engine = Engine(model, 64, BS, SchedulerConfig(max_batch=4), clock=linear_cost(),
                    speculate=Speculation("prompt lookup", gamma=3))
    report = engine.run(requests)
    for r in requests:
        assert report.by_id[r.id].output == penalised_alone(model, r), r.id
    assert report.by_id["f"].output != report.by_id["none"].output  # the penalty changed the answer
    assert "penalty" in engine.check(Request("x", [1], 4, presence_penalty=2.5))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_models_own(model, temperature):
    r = Request("lp", [5, 6, 7, 8], 10, temperature=temperature, seed=3, logprobs=3)
    engine = Engine(model, 64, BS, SchedulerConfig(chunked_prefill=True, token_budget=3), clock=linear_cost(),
                    speculate=Speculation("prompt lookup", gamma=2))
    seq = engine.submit(r)
    while engine.has_work():
        engine.step(0.0)
    logp = torch.log_softmax(model(torch.tensor([r.prompt + seq.output]))[0, len(r.prompt) - 1:-1].float(), -1)
    assert len(seq.logprobs) == len(seq.output) == 10
    for i, (token, (lp, top)) in enumerate(zip(seq.output, seq.logprobs)):
        assert lp == pytest.approx(logp[i, token].item(), abs=1e-4)
        assert [t for t, _ in top] == logp[i].topk(3).indices.tolist()
        assert [v for _, v in top] == pytest.approx(logp[i].topk(3).values.tolist(), abs=1e-4)
        if temperature == 0:
            assert top[0][0] == token


def choices(prompt, n, max_tokens, **kw):
    """n requests for one prompt (the n choices of one API request), seeds seed, seed + 1, ..."""
    seed = kw.pop("seed", None)
    return [Request(f"c{i}", prompt, max_tokens, seed=None if seed is None else seed + i, **kw) for i in range(n)]


def serve_group(engine, group):
    seqs, peak = engine.submit_group(group), 0
    while engine.has_work():
        peak = max(peak, engine.step(0.0).blocks_used)
    return seqs, peak


def test_choices_share_the_prompt_blocks_copy_on_write(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # 2 full blocks of 4 and a partial one
    group = choices(prompt, 3, 8)
    engine = Engine(model, 64, BS, SchedulerConfig(chunked_prefill=True, token_budget=64), clock=linear_cost())
    seqs = engine.submit_group(group)
    engine.step(0.0)  # the prompt: the first choice computes it, the others fork its blocks
    tables = [engine.blocks.table(s.key) for s in seqs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [engine.blocks.allocator.ref_counts[b] for b in tables[0]] == [3, 3, 3]
    engine.step(0.0)  # each choice writes its first token into the partial block: copies, the full ones stay shared
    tables = [engine.blocks.table(s.key) for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    while engine.has_work():
        engine.step(0.0)
    assert all(s.output == alone(model, group[0]) for s in seqs)
    assert engine.scheduler.prefill_computed == len(prompt)  # once, not three times
    assert engine.blocks.allocator.num_used == 0 and not any(engine.blocks.allocator.ref_counts)
    separate, peak_separate = Engine(model, 64, BS, SchedulerConfig(chunked_prefill=True, token_budget=64),
                                     clock=linear_cost()), 0
    for r in choices(prompt, 3, 8):
        separate.submit(r)
    while separate.has_work():
        peak_separate = max(peak_separate, separate.step(0.0).blocks_used)
    _, peak_shared = serve_group(Engine(model, 64, BS, SchedulerConfig(chunked_prefill=True, token_budget=64),
                                        clock=linear_cost()), choices(prompt, 3, 8))
    assert peak_shared == peak_separate - 2 * 2  # the two full prompt blocks are held once, not three times


def test_each_choice_draws_as_its_own_request_alone(model):
    prompt = [7, 2, 9, 4, 4, 1]
    engine = Engine(model, 64, BS, SchedulerConfig(chunked_prefill=True, token_budget=4), clock=linear_cost())
    seqs, _ = serve_group(engine, choices(prompt, 3, 12, temperature=1.0, seed=5, logprobs=2))
    for seq in seqs:
        solo = Engine(model, 64, BS, clock=linear_cost()).run([seq.request]).results[0]
        assert seq.output == solo.output and len(seq.logprobs) == 12
    assert len({tuple(s.output) for s in seqs}) > 1  # different seeds, different answers


def test_aborted_choices_leave_the_others_running_and_free_everything(model):
    engine = Engine(model, 64, BS, SchedulerConfig(chunked_prefill=True, token_budget=4), clock=linear_cost())
    group = choices(list(range(1, 12)), 4, 6)
    seqs = engine.submit_group(group)
    engine.step(0.0)  # the first choice's prompt is half done
    engine.abort(seqs[0])  # the next choice prefills the prompt for the rest
    engine.abort(seqs[2])  # a choice not forked yet
    while engine.has_work():
        engine.step(0.0)
    assert [s.status for s in seqs] == ["aborted", "finished", "aborted", "finished"]
    assert seqs[1].output == seqs[3].output == alone(model, group[0])
    assert engine.blocks.allocator.num_used == 0
    assert "max_batch" in engine.check_group(choices([1, 2], 40, 4))
    assert "KV blocks" in Engine(model, 8, BS).check_group(choices(list(range(1, 12)), 4, 12))


def test_a_paused_step_lets_a_newcomer_in_after_one_layer(model):
    """A 64-token chunk costs 64 ms on the cost-model clock; a 4-token prompt arrives 10 ms into it. Paused after
    the first of the model's 2 layers (32 ms), the newcomer's step runs then: its first token at 36 ms, not after
    the whole chunk. The paused step's own time stays 64 ms: pausing moves work, it adds none."""
    def clock(n_tokens, n_seqs):
        return 1e-3 * n_tokens

    long, short = Request("long", list(range(1, 61)) * 2, 2), Request("short", [5, 6, 7, 8], 2, arrival=0.01)
    ttft = {}
    for pause in (False, True):
        config = SchedulerConfig(chunked_prefill=True, token_budget=64, prefill_cap=64, pause_for_arrivals=pause)
        engine = Engine(model, 64, BS, config, clock=clock)
        report = engine.run([long, short])
        assert [r.output for r in report.results] == [alone(model, long), alone(model, short)]
        assert engine.blocks.allocator.num_used == 0
        ttft[pause] = next(r.ttft for r in report.results if r.id == "short")
        if pause:
            first, paused_for = report.steps[:2]
            assert [c[0] for c in paused_for.chunks] == ["short"] and paused_for.start == pytest.approx(0.032)
            assert first.duration == pytest.approx(0.064)
    assert ttft[True] == pytest.approx(0.036 - 0.01)
    assert ttft[False] > 0.064 - 0.01


@pytest.mark.parametrize("clock", ["cost model", "cpu"])
def test_paused_steps_decode_as_each_request_alone(model, clock):
    """Requests arriving during long prompts' steps run in paused-for steps; every output stays greedy decoding's
    alone (a running sequence computed in both steps, or a block freed under the paused one, would change it)."""
    trace = make_trace(24, vocab_size=64, max_seq_len=128, seed=3, rate=400.0, prompt_len=(4, 100), output_len=(1, 20))
    config = SchedulerConfig(max_batch=8, chunked_prefill=True, token_budget=32, prefill_cap=16, prefix_caching=True,
                             pause_for_arrivals=True)
    engine = Engine(model, 160, BS, config, clock=linear_cost() if clock == "cost model" else "cpu")
    report = engine.run(trace)
    assert all(r.status == "finished" and r.output == alone(model, q) for r, q in zip(report.results, trace))
    spans = sorted((s.start, s.start + s.duration) for s in report.steps)
    paused_for = sum(b[0] < a[1] - 1e-12 for a, b in zip(spans, spans[1:]))  # a step starting inside another
    assert paused_for > 0 and engine.blocks.allocator.num_used == 0


def test_pause_for_arrivals_is_checked():
    with pytest.raises(ValueError, match="pause_for_arrivals"):
        SchedulerConfig(policy="static", pause_for_arrivals=True)
    with pytest.raises(ValueError, match="pause_for_arrivals"):
        SchedulerConfig(pause_for_arrivals="yes")
