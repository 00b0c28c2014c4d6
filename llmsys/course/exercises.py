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
    return got == expected


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
        expected = call(reference, copy.deepcopy(args))
        try:
            got = call(student, copy.deepcopy(args))
        except NotImplementedError:
            print(f"{name}: not attempted. The notebook continues with the library's {library}.")
            return reference
        except Exception as err:  # a learner's bug: say what happened, keep the notebook running
            print(f"{name}: your function raised {type(err).__name__}: {err}\n"
                  f"  The notebook continues with the library's {library}.")
            return reference
        if not _close(got, expected, rtol, atol):
            known = [text for text, mistaken in (mistakes or {}).items()
                     if _close(got, call(mistaken, copy.deepcopy(args)), rtol, atol)]
            text = known[0] if known else hint(copy.deepcopy(args), got, expected) if callable(hint) else hint
            print(f"{name}: not right yet. Hint: {text}\n  The notebook continues with the library's {library}.")
            return reference
    print(f"{name}: correct, {len(cases)} cases agree with {library}. The notebook uses your version.")
    return student
