"""The notebook exercises' self-check: right answers are used, stubs and wrong answers fall back."""

import torch

from llmsys.course.exercises import check
from llmsys.course.runner import REPO


def reference(x):
    return x * 2


def test_a_correct_answer_is_used(capsys):
    def mine(x):
        return x + x
    assert check("ex", mine, reference, [(torch.ones(3),)], "hint") is mine
    assert "correct" in capsys.readouterr().out


def test_an_untouched_stub_is_not_attempted_and_falls_back(capsys):
    def stub(x):
        raise NotImplementedError("write it")
    assert check("ex", stub, reference, [(torch.ones(3),)], "hint") is reference
    assert "not attempted" in capsys.readouterr().out


def test_a_wrong_answer_gets_its_hint_and_falls_back(capsys):
    def wrong(x):
        return x * 3
    got = check("ex", wrong, reference, [(torch.ones(3),)], lambda args, got, expected: f"off by {float((got - expected)[0])}")
    assert got is reference
    assert "off by 1.0" in capsys.readouterr().out


def test_a_crash_is_reported_and_falls_back(capsys):
    def crashes(x):
        return x.reshape(7)
    assert check("ex", crashes, reference, [(torch.ones(3),)], "hint") is reference
    assert "raised RuntimeError" in capsys.readouterr().out


def test_a_known_mistake_gets_its_own_hint(capsys):
    def doubled_twice(x):
        return x * 4

    def off(x):
        return x * 5

    mistakes = {"you doubled twice": doubled_twice}
    assert check("ex", doubled_twice, reference, [(torch.ones(3),)], "generic", mistakes=mistakes) is reference
    out = capsys.readouterr().out
    assert "you doubled twice" in out and "generic" not in out
    assert check("ex", off, reference, [(torch.ones(3),)], "generic", mistakes=mistakes) is reference
    out = capsys.readouterr().out
    assert "generic" in out and "you doubled twice" not in out


def test_chapter_5_exercises_accept_a_solution_and_refuse_a_mistake(capsys):
    """The exercises written into notebook 05: both KLs, the generalized JSD, one on-policy step's loss."""
    import math

    import nbformat
    import torch.nn.functional as F

    from llmsys import distill

    namespace = {"torch": torch, "distill": distill}
    for cell in nbformat.read(REPO / "notebooks" / "05_distillation.ipynb", as_version=4).cells:
        if cell.cell_type == "code" and "check(" in cell.source:
            exec(cell.source, namespace)
    assert capsys.readouterr().out.count("not attempted") == 4
    ns = namespace

    def forward(s, t):
        ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
        return (lt.exp() * (lt - ls)).sum(-1)

    def reverse(s, t):
        return forward(t, s)

    def jsd(s, t, beta):
        ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
        m = (beta * lt.exp() + (1 - beta) * ls.exp()).log()
        return (beta * (lt.exp() * (lt - m)).sum(-1) + (1 - beta) * (ls.exp() * (ls - m)).sum(-1)).mean()

    def jsd_swapped(s, t, beta):
        return jsd(s, t, 1 - beta)

    def step_loss(new, old, teacher, mask, coef=1.0):
        advantage = (-coef * (old - teacher) * mask).detach()
        return -((new - old).exp() * advantage * mask).sum() / mask.sum()

    def step_loss_unmasked(new, old, teacher, mask, coef=1.0):
        return -((new - old).exp() * (-coef * (old - teacher))).mean()

    exercises = [  # (name, cases, library version, a right answer, a common mistake, the check's call)
        ("forward", ns["kl_cases"], distill.forward_kl, forward, reverse, None),
        ("reverse", ns["kl_cases"], distill.reverse_kl, reverse, forward, None),
        ("jsd", ns["jsd_cases"], distill.generalized_jsd, jsd, jsd_swapped, None),
        ("step", ns["step_cases"], ns["library_on_policy_loss"], step_loss, step_loss_unmasked, ns["loss_and_grad"]),
    ]
    for name, cases, reference, right, wrong, call in exercises:
        kw = {"call": call} if call else {}
        assert check(name, right, reference, cases, hint="h", **kw) is right, name
        assert check(name, wrong, reference, cases, hint="h", **kw) is reference, name
    out = capsys.readouterr().out
    assert out.count("correct") == 4 and out.count("not right yet") == 4
    # the notebook's own hints name the mistake
    check("forward KL", reverse, distill.forward_kl, ns["kl_cases"], hint="h",
          mistakes={"reverse, not forward": distill.reverse_kl})
    assert "reverse, not forward" in capsys.readouterr().out
    assert "swapped" in ns["jsd_hint"](ns["jsd_cases"][0], jsd_swapped(*ns["jsd_cases"][0]), None)
    assert math.isfinite(float(ns["library_on_policy_loss"](*ns["step_cases"][0])))
