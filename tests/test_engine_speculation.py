"""Speculative decoding inside the serving engine: per-request suffix drafters whose trees are
verified in the batched step leave greedy outputs token for token as the engine without drafts
gives them, keep no block a rejected draft took, and verify only the draft tokens whose chance of
acceptance pays for them on the engine's measured step costs."""

import math

import pytest
import torch

from llmsys.core import zoo
from llmsys.serving import (Engine, Request, SchedulerConfig, Speculation, StepCosts, blocks_for, linear_cost,
                            step_costs)
from llmsys.specdec import agentic, ridge_point

BS = 4  # small blocks: drafts cross block boundaries often, so rolling back their blocks matters

SETTINGS = {
    "continuous": (SchedulerConfig(max_batch=4), 256),
    "chunked+prefix": (SchedulerConfig(chunked_prefill=True, token_budget=48, prefix_caching=True), 256),
    "preemption": (SchedulerConfig(max_batch=4), 70),  # too few blocks for four: running requests are preempted
}


@pytest.fixture(scope="module")
def target():
    return zoo.load("target", device="cpu").float()


def agentic_requests(model, max_tokens: int = 40, prompt_len: int = 120) -> list[Request]:
    """The first turns of four agent sessions (a stdlib function to edit, a schema to query), each asked twice
    as an agent retrying would (the second time the workload trie knows the first answer), one of them sampled."""
    tok = zoo.tokenizer()
    prompts = [tok.encode(s.steps[0]([]))[:prompt_len] for s in agentic.sessions(4)]
    requests = [Request(f"{i}/{attempt}", p, max_tokens) for attempt in range(2) for i, p in enumerate(prompts)]
    requests[2].temperature, requests[2].seed = 0.8, 7
    return requests


def assert_cache_holds(engine, seq):
    """The paged cache holds the keys and values of the sequence's computed tokens, each at its own position,
    as the model computes them in one pass: an accepted branch of a tree was moved behind its root."""
    model, n = engine.model, seq.num_computed
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([seq.tokens[:n]]), cache)
    for layer in range(model.cfg.n_layers):
        k, v = engine.cache.gather(layer, engine.blocks.table(seq.key), n)  # (n_kv, n, hs)
        assert torch.allclose(k, cache.k[layer][0, :, :n], atol=1e-4), (seq.id, layer)
        assert torch.allclose(v, cache.v[layer][0, :, :n], atol=1e-4), (seq.id, layer)


def run_stepwise(engine, requests):
    """Serve the requests step by step, checking after every step that each running sequence's cache holds its
    tokens' keys and values and no block past its tokens (those of rejected drafts went back). {id: sequence}."""
    seqs = [engine.submit(r) for r in requests]
    while engine.has_work():
        engine.step(0.0)
        for seq in engine.scheduler.running:
            assert len(engine.blocks.table(seq.key)) <= blocks_for(len(seq.tokens), BS), seq.id
            assert_cache_holds(engine, seq)
    return {s.id: s for s in seqs}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_suffix_drafting_in_the_engine_keeps_greedy_outputs_and_frees_every_block(target, setting):
    config, num_blocks = SETTINGS[setting]
    requests = agentic_requests(target)
    plain = Engine(target, num_blocks, BS, config, clock=linear_cost()).run(requests)
    engine = Engine(target, num_blocks, BS, config, clock=linear_cost(), speculate=Speculation("suffix", nodes=12))
    got = run_stepwise(engine, requests)
    for r, res in zip(requests, plain.results):
        assert got[r.id].output == res.output, f"request {r.id} differs under {setting}"
    assert setting != "preemption" or any(seq.preemptions for seq in got.values())
    assert engine.accepted > 0 and engine.drafted > engine.accepted  # trees: most nodes are alternatives
    assert engine.blocks.num_free == num_blocks and not engine.blocks.tables
    assert not engine.speculator.drafters  # every request's drafter went when it ended
    assert engine.speculator.workload.workload.root.children  # and the finished outputs joined the workload trie


def test_the_engine_counts_fewer_steps_with_drafts(target):
    requests = [r for r in agentic_requests(target) if r.temperature == 0]
    config = SchedulerConfig(max_batch=1)
    plain = Engine(target, 256, BS, config, clock=linear_cost()).run(requests)
    fast = Engine(target, 256, BS, config, clock=linear_cost(), speculate=Speculation("suffix")).run(requests)
    assert [r.output for r in fast.results] == [r.output for r in plain.results]
    assert len(fast.steps) < 0.8 * len(plain.steps)


def roofline(ridge: float, ks=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> dict:
    """A step-cost curve flat up to ``ridge`` tokens, then one unit of time per ``ridge`` tokens."""
    return {k: max(1.0, k / ridge) for k in ks}


def costs_on(ridge: float) -> StepCosts:
    """Step costs on that roofline: drafting is nearly free below the ridge; past it a draft token costs 1/ridge."""
    sizes = (1, 2, 4, 8, 16, 32)
    return StepCosts({b: max(1.0, b / ridge) for b in sizes}, {b: 0.0 for b in sizes},
                     {b: (0.01 if b < ridge else 1 / ridge) for b in sizes})


def test_the_ridge_point_is_where_the_curve_stops_being_flat():
    assert ridge_point(roofline(10)) == pytest.approx(10)
    assert ridge_point({1: 1.0, 8: 1.1, 16: 1.1}) == math.inf  # memory-bound all along
    assert ridge_point({k: 0.5 * k for k in (1, 4, 16)}) == pytest.approx(1)  # compute-bound from the first token
    for bad in ({1: 1.0}, {0: 1.0, 4: 2.0}, {1: 1.0, 2: -1.0}):
        with pytest.raises(ValueError, match="cost curve"):
            ridge_point(bad)


def test_a_sequence_keeps_the_drafts_whose_expected_saving_most_exceeds_their_cost():
    sizes = (1, 2, 4, 8)
    costs = StepCosts({b: 1.0 for b in sizes}, {b: 0.3 for b in sizes}, {b: 0.1 for b in sizes})
    # one decode costs 1 per token: a token kept with chance c saves c and costs 0.1, drafting at all 0.3
    assert costs.worth_keeping(1, [0.9, 0.8, 0.5, 0.1]) == 3  # 0.8 + 0.7 + 0.4 - 0.3 beats adding 0.0
    assert costs.worth_keeping(1, [0.3, 0.1]) == 0  # 0.2 saved does not pay the 0.3 for drafting at all
    assert costs.worth_keeping(1, [0.9], drafting=0.6) == 0  # a slow drafter's time counts: 0.9 - 0.7 - 0.3 < 0
    assert costs.worth_keeping(8, [0.9, 0.9]) == 0  # 8 decodes cost 1/8 per token: a draft saves at most 0.11
    compute_bound = costs_on(1)
    assert compute_bound.worth_keeping(4, [1.0, 1.0, 1.0]) == 0  # a draft costs what a decode does per token
    with pytest.raises(ValueError, match="per_draft"):
        StepCosts({1: 1.0, 2: 1.0}, {1: 0.1, 2: 0.1}, {1: 0.1})
    with pytest.raises(ValueError, match="costs"):
        Speculation(costs={1: 1.0, 2: 2.0})


def test_speculation_switches_off_when_the_step_is_compute_bound(target):
    requests = [r for r in agentic_requests(target) if r.temperature == 0]
    config = SchedulerConfig(max_batch=8)
    plain = Engine(target, 256, BS, config, clock=linear_cost()).run(requests)
    bound = Engine(target, 256, BS, config, clock=linear_cost(), speculate=Speculation(costs=costs_on(1)))
    report = bound.run(requests)
    assert bound.drafted == 0 and bound.speculator.switched_off > 0 and len(report.steps) == len(plain.steps)

    # flat up to 4 tokens, then 1/4 per token: from 4 decodes on a draft costs what a decode does per token and
    # never pays; one or two decodes pay 1/2 or 1 per token and a draft 0.01
    capped = Engine(target, 256, BS, config, clock=linear_cost(), speculate=Speculation(costs=costs_on(4)))
    report = capped.run(requests)
    assert [r.output for r in report.results] == [r.output for r in plain.results]
    decode_steps = [s for s in report.steps if all(kind == "decode" for *_, kind in s.chunks)]
    assert all(sum(n for _, n, _ in s.chunks) == len(s.chunks) for s in decode_steps if len(s.chunks) >= 4)
    assert any(sum(n for _, n, _ in s.chunks) > 4 for s in decode_steps if len(s.chunks) <= 2)  # past the ridge
    assert capped.speculator.switched_off > 0


def test_the_step_costs_are_measured_on_engine_steps(target):
    costs = step_costs(target, context=64, sizes=(1, 4, 16), drafts=4, reps=1)
    assert sorted(costs.plain) == sorted(costs.per_draft) == [1, 4, 16] and all(s > 0 for s in costs.plain.values())
    assert costs.plain[16] > 1.3 * costs.plain[1]  # each step timed its own batch: 16 decodes cost more than 1
    assert costs.worth_keeping(1, [0.99] * 4) >= costs.worth_keeping(16, [0.99] * 4)  # fuller steps keep fewer
    Speculation(costs=costs)  # costs the engine accepts
