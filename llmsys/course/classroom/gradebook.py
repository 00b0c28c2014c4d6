"""Grades for the LMS: the CSV layouts Canvas and Moodle import, and a generic one.

- Canvas ("Grades > Import", Canvas Instructor Guide "How do I import grades
  in the Gradebook?"): ``Student, ID, SIS User ID, Section, <assignment>``;
  Canvas matches a row by ``ID`` or ``SIS User ID``, and a column it does not
  know becomes a new assignment.
- Moodle ("Grades > Import > CSV file", Moodle docs "Grade import"): one user
  identifier column (``Username``, ``Email address`` or ``ID number``, chosen at
  import as "Map from") and one grade column per grade item.
- generic: every roster field, the score, the maximum, lateness from ``labs collect``.

A submission the grader could not read (``ungraded``: not a notebook, an unknown lab) has no
score, not a zero: its cell stays blank and ``ungraded_students`` names it.

Written answers must be scored first (``grade --manual-scores``): a total with
a pending answer in it is not a grade, so the export refuses it and names who.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .exchange import collected_rows
from .roster import Person, students

FORMATS = ("canvas", "moodle", "generic")
MOODLE_IDENTIFIERS = {"username": "Username", "email": "Email address", "lms_id": "ID number"}


class GradebookError(ValueError):
    """Grades that cannot be exported as asked; the message says what to change."""


def read_grades(path: str | Path) -> list[dict]:
    """The reports of ``grade --json`` (or ``grade merge --json``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return list(data["submissions"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise GradebookError(f"{path} is not a grades file written by `grade --json` ({err})") from None


def scores_by_student(reports: list[dict], people: list[Person], lab: str | None) -> tuple[str, dict[str, dict]]:
    """(the lab, {username: report}); every report must be a rostered student's and fully scored."""
    labs_found = sorted({r["lab"] for r in reports if r.get("lab")})
    if lab is None:
        if len(labs_found) != 1:
            raise GradebookError(f"the grades hold {len(labs_found)} labs ({', '.join(labs_found) or 'none'}); "
                                 "choose one with --lab")
        lab = labs_found[0]
    chosen = [r for r in reports if r.get("lab") == lab]
    if not chosen:
        raise GradebookError(f"no grades for lab {lab!r}; the grades hold {', '.join(labs_found) or 'no lab'}")
    known = {p.username for p in students(people)}
    strangers = sorted({r["student"] for r in chosen} - known)
    if strangers:
        raise GradebookError(f"graded but not students in the class list: {', '.join(strangers)}; add them to the "
                             "roster (or rename their submissions to their usernames)")
    by_student = {}
    for report in chosen:
        if report["student"] in by_student:
            raise GradebookError(f"{report['student']} has two graded submissions of {lab}; grade one of them")
        pending = [c["id"] for c in report["checks"] if c["status"] == "pending"]
        if pending:
            raise GradebookError(f"{report['student']}'s written answer(s) {', '.join(pending)} are still pending: "
                                 "score them and grade again with --manual-scores")
        by_student[report["student"]] = report
    return lab, by_student


def gradebook_rows(fmt: str, reports: list[dict], people: list[Person], assignment: str | None = None,
                   lab: str | None = None, collected: dict | None = None,
                   moodle_identifier: str = "username") -> tuple[list[str], list[list]]:
    """(header, rows) of the export; a student without a graded submission gets an empty grade."""
    if fmt not in FORMATS:
        raise GradebookError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    lab, by_student = scores_by_student(reports, people, lab)
    column = assignment or lab
    graded = {name: report for name, report in by_student.items() if not report.get("ungraded")}
    score = lambda person: graded[person.username]["score"] if person.username in graded else ""  # noqa: E731
    if fmt == "canvas":
        unmatched = [p.username for p in students(people) if not (p.lms_id or p.sis_id)]
        if unmatched:
            raise GradebookError(f"Canvas matches students by ID or SIS User ID; the class list has neither for "
                                 f"{', '.join(unmatched)} (fill its lms_id or sis_id column)")
        return (["Student", "ID", "SIS User ID", "Section", column],
                [[p.name or p.username, p.lms_id, p.sis_id, p.section, score(p)] for p in students(people)])
    if fmt == "moodle":
        if moodle_identifier not in MOODLE_IDENTIFIERS:
            raise GradebookError(f"Moodle identifies users by {', '.join(MOODLE_IDENTIFIERS)}; got {moodle_identifier!r}")
        missing = [p.username for p in students(people) if not getattr(p, moodle_identifier)]
        if missing:
            raise GradebookError(f"no {moodle_identifier} in the class list for {', '.join(missing)}")
        return ([MOODLE_IDENTIFIERS[moodle_identifier], column],
                [[getattr(p, moodle_identifier), score(p)] for p in students(people)])
    lateness = {row["username"]: row for row in collected_rows(collected)} if collected else {}
    header = ["username", "name", "email", "section", "lms_id", "sis_id", "lab", "score", "max_score", "status",
              "submitted_at", "late_by", "versions"]
    rows = []
    for p in students(people):
        report = by_student.get(p.username)
        handed_in = lateness.get(p.username, {})
        status = ("ungraded" if report and report.get("ungraded") else handed_in.get("status", "graded")) if report \
            else handed_in.get("status", "missing")
        rows.append([p.username, p.name, p.email, p.section, p.lms_id, p.sis_id, lab, score(p),
                     report["max_score"] if report else "", status, handed_in.get("submitted_at", ""),
                     handed_in.get("late_by", ""), handed_in.get("versions", "")])
    return header, rows


def ungraded_students(reports: list[dict], people: list[Person], lab: str | None = None) -> list[str]:
    """Who handed in a file the grader could not read (their grade cells are blank)."""
    _, by_student = scores_by_student(reports, people, lab)
    return sorted(name for name, report in by_student.items() if report.get("ungraded"))


def write_gradebook(path: str | Path, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
