"""Planning speculative decoding from cost curves: the dtype, drafter and γ that the measured
costs favour, against Leviathan et al.'s speedup where the costs are those the theorem assumes."""

import pytest

from llmsys import specdec as sd
from llmsys.specdec import planning

FLAT = {k: 1.0 for k in planning.KS}  # memory-bound: scoring k tokens costs one step
LINEAR = {k: float(k) for k in planning.KS}  # compute-bound: k tokens cost k steps


def test_a_flat_curve_gives_leviathans_speedup():
    plan = sd.plan({"bf16": FLAT}, {"draft": (0.7, 0.05)}, max_gamma=8)
    best = max(range(1, 9), key=lambda g: sd.expected_speedup(0.7, g, 0.05))
    assert plan.gamma == best and plan.speedup == pytest.approx(sd.expected_speedup(0.7, best, 0.05))
    assert plan.dtype == "bf16" and plan.drafter == "draft"


def test_a_compute_bound_curve_makes_drafting_pointless():
    plan = sd.plan({"bf16": LINEAR}, {"lookup": (0.9, 0.0)})
    assert plan.gamma == 0 and plan.speedup == 1.0 and "plain decoding" in plan.describe()


def test_an_emulated_bf16_loses_to_a_memory_bound_fp32():
    """bf16 steps are faster alone, but verification is nearly linear in k; fp32 steps cost
    1.5× and stay flat: the plan drafts in fp32 and counts its speedup against plain bf16."""
    curves = {"bfloat16": LINEAR, "float32": {k: 1.5 for k in planning.KS}}
    plan = sd.plan(curves, {"suffix": (0.8, 0.0)})
    assert plan.dtype == "float32" and plan.baseline == "bfloat16"
    assert plan.speedup == pytest.approx(sd.expected_tokens(0.8, plan.gamma) / 1.5)


def test_the_better_drafter_wins_and_costs_are_interpolated():
    curves = {"fp32": {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.1, 16: 4.1}}
    plan = sd.plan(curves, {"weak": (0.3, 0.0), "strong": (0.85, 0.0)})
    assert plan.drafter == "strong"
    assert planning.call_cost(curves["fp32"], 6) == pytest.approx(1.7)
    assert planning.call_cost(curves["fp32"], 20) == pytest.approx(5.1)


def test_bad_plans_raise_clear_errors():
    with pytest.raises(ValueError, match="k = 1"):
        sd.plan({"fp32": {2: 1.0}}, {})
    with pytest.raises(ValueError, match="acceptance"):
        sd.plan({"fp32": FLAT}, {"d": (1.5, 0.0)})


def test_a_tree_keeps_the_nodes_that_pay_for_their_place_in_the_call():
    curve = {1: 1.0, 2: 1.0, 4: 1.4}  # a second token is free, then each costs a fifth of a step
    # tokens per step with 1, 2, 3 nodes: 1.9, 2.4 / 1.2 = 2.0, 2.5 / 1.4 = 1.79
    assert sd.best_tree_size([0.9, 0.5, 0.1], curve) == 2
    assert sd.best_tree_size([0.9, 0.9, 0.9], curve) == 3  # 3.7 / 1.4 = 2.64
    assert sd.best_tree_size([0.9, 0.9, 0.9], curve, draft_seconds=1.0) == 0  # drafting costs more than it saves
    assert sd.best_tree_size([0.9] * 5, {1: 1.0, 2: 2.0, 8: 8.0}) == 0  # compute-bound: plain decoding
    assert sd.best_tree_size([], curve) == 0
    # rates 1.9, 1.5, 1.81, 2.125: the third token's step up is paid back by the fourth
    assert sd.best_tree_size([0.9, 0.5, 0.5, 0.5], {1: 1.0, 2: 1.0, 3: 1.6, 5: 1.6}) == 4
    assert sd.best_tree_size([0.0], {1: 1.0, 2: 1.0}) == 0  # a node that never pays is not verified
    with pytest.raises(ValueError, match="chances"):
        sd.best_tree_size([1.5], curve)
    for bad in ({}, {1: 1.0}, {1: 0.0, 2: 0.0}):
        with pytest.raises(ValueError, match="cost curve"):
            sd.best_tree_size([0.5], bad)


def test_the_sampled_ceiling_is_one_over_the_vocabulary_for_a_uniform_target_and_one_for_a_certain_one():
    import torch

    from test_specdec import make_model  # tests/ is on sys.path: pytest puts it there

    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[5, 4]])]
    uniform = make_model(vocab=16, sharpness=0.0)  # a zero LM head: every token 1/16
    ceiling = sd.sampled_ceiling(uniform, prompts, 8, top=4)
    assert ceiling["p_max"] == pytest.approx(1 / 16) and ceiling["p_top"] == pytest.approx(4 / 16)
    assert ceiling["chain_tokens"] == pytest.approx(sum(16.0 ** -i for i in range(6)), rel=1e-3)
    certain = sd.sampled_ceiling(make_model(vocab=16, sharpness=1e4), prompts, 8)
    # 5 deep: 6 tokens per call from the first 4 positions, then 5, 4, 3, 2 as the answer runs out
    assert certain["p_max"] > 0.999 and certain["chain_tokens"] == pytest.approx((4 * 6 + 5 + 4 + 3 + 2) / 8, rel=1e-3)
    with pytest.raises(ValueError, match="at least one prompt"):
        sd.sampled_ceiling(uniform, [], 8)
    with pytest.raises(ValueError, match="top"):
        sd.sampled_ceiling(uniform, prompts, 8, top=17)


def test_the_sampled_ceiling_reads_the_target_at_each_answer_position():
    import torch

    from test_specdec import make_model

    target, prompt = make_model(vocab=16, sharpness=3.0), torch.tensor([[1, 2, 3]])
    out, _ = sd.autoregressive_decode(target, prompt, 3, 1.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = torch.softmax(target(out[:, :-1])[0, 2:].float(), -1)  # the 3 answer positions
    a, b, c = probs.max(-1).values.tolist()
    ceiling = sd.sampled_ceiling(target, [prompt], 3, top=2)
    assert ceiling["p_max"] == pytest.approx((a + b + c) / 3)
    assert ceiling["p_top"] == pytest.approx(probs.topk(2, -1).values.sum(-1).mean().item())
    assert ceiling["chain_tokens"] == pytest.approx((1 + a + a * b + a * b * c + 1 + b + b * c + 1 + c) / 3)
