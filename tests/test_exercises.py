"""The notebook exercises' self-check: right answers are used, stubs and wrong answers fall back."""

import torch

from llmsys.course.exercises import check


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



def test_a_hint_that_breaks_on_an_odd_answer_gives_a_generic_hint(capsys):
    def per_position(x):
        return x.repeat(2)  # a tensor of the wrong shape where the hint expects a number

    def hint(args, got, expected):
        return f"off by {float(got) - float(expected)}"  # float() of a 6-element tensor raises

    assert check("ex", per_position, reference, [(torch.ones(3),)], hint) is reference
    out = capsys.readouterr().out
    assert "not right yet. Hint:" in out and "compare shapes" in out


def test_an_answer_whose_comparison_raises_is_wrong_not_a_crash(capsys):
    class Weird:
        def __eq__(self, other):
            raise RuntimeError("no comparing me")

    assert check("ex", lambda x: Weird(), lambda x: 3, [(1,)], "hint") is not None
    assert "not right yet" in capsys.readouterr().out


def test_an_answer_that_mutates_its_input_is_caught(capsys):
    def doubled_in_place(x):
        return x.mul_(2)

    assert check("ex", doubled_in_place, reference, [(torch.ones(3),)], "hint") is reference
    assert "changed its argument 0 in place" in capsys.readouterr().out


def test_an_in_place_rule_that_matches_the_library_is_not_called_a_mutation(capsys):
    def step(p):
        p.sub_(1.0)

    def my_step(p):
        p -= 1.0

    assert check("ex", my_step, step, [(torch.ones(3),)], "hint", call=lambda fn, args: (fn(*args), args[0])[1]) is my_step
    assert "correct" in capsys.readouterr().out
