"""Library answers: a submission that calls the library's own implementation for a task.

A lab's solution notebook lists, per graded check, the ``llmsys`` names that
answer it, in its metadata::

    "llmsys": {"library_answers": {"rmsnorm_matches_reference": ["llmsys.model.RMSNorm"]}}

A submission whose own code cells use one of them gets the check's note "used
the reference implementation ..." and, by the lab's policy, zero for it. The
scan reads the student's code (imports and names), so it catches the plain
use, not code written to hide it: that stays for the instructor to read.
"""

from __future__ import annotations

import ast

from .. import labs
from .merge import normalized
from .report import STATUS_FAILED


def library_answer_notes(solution_nb, submission_nb, report) -> list[str]:
    """Fail the checks whose answer the submission took from the library; notes saying so."""
    mark = solution_nb.metadata.get("llmsys", {}) if isinstance(solution_nb.metadata, dict) else {}
    policy = mark.get("library_answers", {}) if isinstance(mark, dict) else {}
    if not policy:
        return []
    lab_sources = {normalized(labs.source_text(c)) for c in labs.build_lab(solution_nb).cells}
    student_code = [c.source for c in submission_nb.cells if c.get("cell_type") == "code"
                    and not labs.is_graded(c) and normalized(c.source) not in lab_sources]
    used = set().union(*(_names_used(source) for source in student_code)) if student_code else set()
    notes, checks = [], {c.id: c for c in report.checks}
    for check_id, answers in policy.items():
        found = [name for name in answers if _refers_to(used, name)]
        if found and check_id in checks:
            check = checks[check_id]
            check.status, check.score = STATUS_FAILED, 0
            check.message = f"used the reference implementation {found[0]} (the lab's policy gives zero for it)"
            notes.append(f"{check_id}: your code uses {found[0]}, the library's answer to this task")
    return notes


def _names_used(source: str) -> set[str]:
    """Dotted names the code imports or touches: ``llmsys.model.RMSNorm``, ``model.RMSNorm``, ``RMSNorm``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            used |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            used |= {alias.name for alias in node.names}
        elif isinstance(node, (ast.Attribute, ast.Name)):
            used.add(ast.unparse(node))
    return used


def _refers_to(used: set[str], answer: str) -> bool:
    """Whether the code imports ``answer`` or names it by a tail of its dotted path after importing llmsys."""
    if answer in used:
        return True
    imports_library = any(name == "llmsys" or name.startswith("llmsys.") for name in used)
    parts = answer.split(".")
    tails = {".".join(parts[i:]) for i in range(1, len(parts))}
    return imports_library and any(name in tails or name.endswith("." + parts[-1]) for name in used)
