"""Written answers: reported as pending with the student's text; scores typed in by the instructor merged back.

The grade table (``--csv``) has, for each written answer, a column with its
score ("pending") and one with the student's text. The instructor replaces
"pending" with points in a copy of that table and grades again with
``--manual-scores thatcopy.csv``: the points count toward the totals.
"""

from __future__ import annotations

import csv
from pathlib import Path

from .. import labs
from .report import STATUS_FAILED, STATUS_PENDING, STATUS_SCORED
from .submission import GradingSetupError

MAX_ANSWER_CHARS = 5000  # of a student's written answer kept in the report


def read_written_answers(solution_nb, submission_nb, report, scores: dict) -> None:
    """Fill each written answer of the report: the student's text, and a score if the instructor gave one."""
    lab = labs.build_lab(solution_nb)
    cell_ids = {labs.tag_value(c, "id"): c.get("id") for c in lab.cells if labs.is_written(c)}
    stubs = {labs.tag_value(c, "id"): labs.source_text(c).strip() for c in lab.cells if labs.is_written(c)}
    for check in (c for c in report.checks if c.written):
        cell = next((c for c in submission_nb.cells if c.get("cell_type") == "markdown"
                     and (labs.tag_value(c, "id") == check.id or c.get("id") == cell_ids.get(check.id))), None)
        text = labs.source_text(cell).strip() if cell is not None else ""
        if not text or text == stubs.get(check.id):
            check.status, check.message = STATUS_FAILED, ("not answered: the answer cell is missing" if cell is None
                                                          else "not answered: the cell still holds the prompt")
            continue
        check.answer = text[:MAX_ANSWER_CHARS]
        given = scores.get((report.student, check.id))
        if given is None:
            check.status, check.message = STATUS_PENDING, "written answer: to be scored by the instructor"
        else:
            if not 0 <= given <= check.points:
                raise GradingSetupError(f"manual score {given} for {report.student}'s {check.id!r} is outside "
                                        f"0..{check.points}")
            check.status, check.score, check.message = STATUS_SCORED, given, "scored by the instructor"


def read_scores(path: str | Path) -> dict[tuple[str, str], int]:
    """{(student, check id): points} from a grade table whose written-answer columns hold numbers.

    Cells left "pending" or empty are skipped; anything else must be a whole number.
    """
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as err:
        raise GradingSetupError(f"cannot read manual scores {path}: {err.strerror or err}") from None
    if rows and "student" not in rows[0]:
        raise GradingSetupError(f"{path}: manual scores need a 'student' column (use the table --csv writes)")
    answered = {column[: -len(" answer")] for column in (rows[0] if rows else {}) if column.endswith(" answer")}
    scores = {}
    for line, row in enumerate(rows, start=2):
        for check_id in answered:
            value = (row.get(check_id) or "").strip()
            if value in ("", "pending"):
                continue
            if not value.isdigit():
                raise GradingSetupError(f"{path}, line {line}: the score of {check_id!r} must be a whole number of "
                                        f"points or 'pending', got {value!r}")
            scores[(row["student"], check_id)] = int(value)
    return scores
