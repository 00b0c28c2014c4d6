"""Self-checks for the exercises inside chapter notebooks.

A chapter exercise is a function the learner writes, starting from a stub that raises
``NotImplementedError``. ``check`` runs it on fixed inputs against the library's version and
returns the function the rest of the notebook should use: the learner's when it is right, the
library's when the stub is untouched ("not attempted", so Run All still works) or when the
answer is wrong (after a hint that says what to look at).
"""

from __future__ import annotations

import torch


def _close(got, expected, rtol: float, atol: float) -> bool:
    if isinstance(expected, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.shape == expected.shape
                and torch.allclose(got.double(), expected.double(), rtol=rtol, atol=atol))
    if isinstance(expected, (tuple, list)):
        return (isinstance(got, (tuple, list)) and len(got) == len(expected)
                and all(_close(g, e, rtol, atol) for g, e in zip(got, expected)))
    return got == expected


def check(name: str, student, reference, cases, hint, rtol: float = 1e-5, atol: float = 1e-6,
          library: str | None = None):
    """Compare ``student(*args)`` with ``reference(*args)`` for every args tuple in ``cases``.

    ``hint(args, got, expected) -> str`` explains a wrong answer (or a fixed string); ``library``
    names the reference in messages (default: its module and name). Prints the verdict; returns
    ``student`` when every case agrees, else ``reference``."""
    library = library or f"{reference.__module__}.{reference.__name__}"
    for args in cases:
        expected = reference(*args)
        try:
            got = student(*args)
        except NotImplementedError:
            print(f"{name}: not attempted. The notebook continues with the library's {library}.")
            return reference
        except Exception as err:  # a learner's bug: say what happened, keep the notebook running
            print(f"{name}: your function raised {type(err).__name__}: {err}\n"
                  f"  The notebook continues with the library's {library}.")
            return reference
        if not _close(got, expected, rtol, atol):
            text = hint(args, got, expected) if callable(hint) else hint
            print(f"{name}: not right yet. Hint: {text}\n  The notebook continues with the library's {library}.")
            return reference
    print(f"{name}: correct, {len(cases)} cases agree with {library}. The notebook uses your version.")
    return student
