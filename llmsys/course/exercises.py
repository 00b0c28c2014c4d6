"""Self-checks for the exercises inside chapter notebooks (not graded: labs are).

``check`` runs the learner's function and the library's on the same cases. It returns the
function the rest of the notebook should use: the learner's when it is right, the library's
when the exercise is untouched ("not attempted") or wrong (after a hint), so Run All always
reaches the end.
"""

from __future__ import annotations

import math


def _close(a, b, tol: float) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if hasattr(a, "tolist") or hasattr(b, "tolist"):
        return _close(a.tolist() if hasattr(a, "tolist") else a, b.tolist() if hasattr(b, "tolist") else b, tol)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    return a == b


def check(name: str, mine, reference, cases: list[tuple], mistakes: dict[str, object] | None = None,
          hint: str = "", tol: float = 1e-6):
    """Compare ``mine(*case)`` with ``reference(*case)`` on every case.

    ``mistakes`` maps a hint to a function implementing a common wrong version: when the
    learner's output matches it, that hint is printed. Returns the function to use next."""
    where = reference.__name__ if reference.__module__ == "__main__" else f"{reference.__module__}.{reference.__name__}"
    outputs = []
    for case in cases:
        try:
            outputs.append(mine(*case))
        except NotImplementedError:
            print(f"{name}: not attempted; the notebook continues with {where}.")
            return reference
        except Exception as err:  # the learner's code may fail in any way: report it, keep going
            print(f"{name}: your function raised {type(err).__name__}: {err}. {hint} Using {where} for now.")
            return reference
    wrong = [i for i, (case, got) in enumerate(zip(cases, outputs)) if not _close(got, reference(*case), tol)]
    if not wrong:
        print(f"{name}: correct on all {len(cases)} cases; the notebook uses your function.")
        return mine
    case, got = cases[wrong[0]], outputs[wrong[0]]
    for mistake_hint, mistaken in (mistakes or {}).items():
        if _close(got, mistaken(*case), tol):
            print(f"{name}: not yet. {mistake_hint} Using {where} for now.")
            return reference
    print(f"{name}: not yet: on case {wrong[0] + 1} you returned {got!r}, the library {reference(*case)!r}. "
          f"{hint} Using {where} for now.")
    return reference
