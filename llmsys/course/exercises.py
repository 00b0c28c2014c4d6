"""Self-checks for the exercises inside chapter notebooks.

A chapter exercise is a function the learner writes, starting from a stub that raises
``NotImplementedError``. ``check`` runs it on fixed inputs against the library's version and
returns the function the rest of the notebook should use: the learner's when it is right, the
library's when the stub is untouched ("not attempted", so Run All still works) or when the
answer is wrong (after a hint that says what to look at).
"""

from __future__ import annotations

import copy
import math

import torch


def _close(got, expected, rtol: float, atol: float) -> bool:
    if isinstance(expected, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.shape == expected.shape
                and torch.allclose(got.double(), expected.double(), rtol=rtol, atol=atol))
    if isinstance(expected, (tuple, list)):
        return (isinstance(got, (tuple, list)) and len(got) == len(expected)
                and all(_close(g, e, rtol, atol) for g, e in zip(got, expected)))
    if isinstance(expected, dict):
        return (isinstance(got, dict) and got.keys() == expected.keys()
                and all(_close(got[k], expected[k], rtol, atol) for k in expected))
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return math.isclose(got, expected, rel_tol=rtol, abs_tol=atol)
    if hasattr(expected, "tolist"):  # numpy arrays and scalars
        return hasattr(got, "tolist") and _close(torch.as_tensor(got.tolist()), torch.as_tensor(expected.tolist()),
                                                 rtol, atol)
    return bool(got == expected)


def agrees(got, expected, rtol: float, atol: float) -> bool:
    """``got`` matches ``expected``; an answer whose comparison itself fails (a tensor where a
    number belongs, an object with a broken ``==``) does not match."""
    try:
        return _close(got, expected, rtol, atol)
    except Exception:
        return False


def tensors_in(value) -> list:
    """The tensors inside an argument (nested in tuples, lists and dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def changed_argument(student_args, reference_args, rtol: float, atol: float):
    """The position of the first argument whose tensors ended differently after the learner's
    call than after the library's (an input mutated that must not be), else None."""
    for position, (mine, theirs) in enumerate(zip(student_args, reference_args)):
        mine, theirs = tensors_in(mine), tensors_in(theirs)
        same = len(mine) == len(theirs) and all(
            a.shape == b.shape and torch.allclose(a.detach().double(), b.detach().double(), rtol, atol, equal_nan=True)
            for a, b in zip(mine, theirs))
        if not same:
            return position
    return None


GENERIC_HINT = ("your answer differs from the library's on this case; compare shapes, dtypes and each term "
                "of the formula with the docstring")


def explain(got, args, expected, hint, mistakes, call, rtol, atol) -> str:
    """The hint for a wrong answer: a known mistake's own text when the answer equals that
    mistake's, else ``hint``'s. A hint is code too, and an answer of an unexpected kind (a
    list for a scalar, a wrong shape) can break it; then a generic hint, never a crash."""
    try:
        for text, mistaken in (mistakes or {}).items():
            if agrees(got, call(mistaken, copy.deepcopy(args)), rtol, atol):
                return text
        return hint(copy.deepcopy(args), got, expected) if callable(hint) else hint
    except Exception:
        return GENERIC_HINT


def call_with(fn, args):
    """The default way to run a function on one case: its return value."""
    return fn(*args)


def check(name: str, student, reference, cases, hint, rtol: float = 1e-5, atol: float = 1e-6, call=call_with,
          library: str | None = None, mistakes: dict | None = None):
    """Compare ``student(*args)`` with ``reference(*args)`` for every args tuple in ``cases``.

    Each side gets its own deep copy of ``args``, so a function that updates its inputs in
    place (an optimizer step) cannot change what the other side sees. ``call(fn, args)``
    says what to compare (default: the return value; for an in-place rule, return the
    updated tensors). ``hint(args, got, expected) -> str`` explains a wrong answer (or a
    fixed string). ``mistakes`` maps a hint to a function that makes a common mistake: when
    the learner's answer equals that function's, its hint is the one printed. ``library``
    names the library's version in the messages (default: the reference's own name). Prints
    the verdict; returns ``student`` when every case agrees, else ``reference``."""
    library = library or f"{reference.__module__}.{reference.__name__}"
    for args in cases:
        reference_args, student_args = copy.deepcopy(args), copy.deepcopy(args)
        expected = call(reference, reference_args)
        try:
            got = call(student, student_args)
        except NotImplementedError:
            print(f"{name}: not attempted. The notebook continues with the library's {library}.")
            return reference
        except Exception as err:  # a learner's bug: say what happened, keep the notebook running
            print(f"{name}: your function raised {type(err).__name__}: {err}\n"
                  f"  The notebook continues with the library's {library}.")
            return reference
        right = agrees(got, expected, rtol, atol)
        changed = changed_argument(student_args, reference_args, rtol, atol) if right else None
        if not right or changed is not None:  # a right result that mutated an input it must leave alone is wrong
            text = (explain(got, args, expected, hint, mistakes, call, rtol, atol) if not right else
                    f"your function changed its argument {changed} in place, where the library's leaves it as it "
                    f"was; work on a copy (e.g. `x = x.clone()`)")
            print(f"{name}: not right yet. Hint: {text}\n  The notebook continues with the library's {library}.")
            return reference
    print(f"{name}: correct, {len(cases)} cases agree with {library}. The notebook uses your version.")
    return student
