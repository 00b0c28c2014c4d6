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
