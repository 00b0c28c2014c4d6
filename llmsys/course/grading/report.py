"""Grade reports: one per submission, and the class tables (text, CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import asdict, dataclass, field

MESSAGE_LIMIT = 500  # characters kept of any error message
STATUS_PASSED, STATUS_FAILED, STATUS_SKIPPED, STATUS_NOT_RUN = "passed", "failed", "skipped", "not run"
STATUS_PENDING, STATUS_SCORED = "pending", "scored"  # a written answer, before and after the instructor scores it


@dataclass
class CheckResult:
    id: str
    points: int
    score: int = 0
    status: str = STATUS_NOT_RUN
    message: str = ""
    hidden: bool = False
    gpu: bool = False
    written: bool = False
    answer: str = ""  # a written answer's text, for the instructor


@dataclass
class GradeReport:
    submission: str
    student: str
    lab: str | None = None
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    sha256: str = ""  # of the submitted file, read once before grading
    ungraded: str = ""  # why the grader could not grade it (unreadable, unknown lab); empty when graded
    salt: int | None = None  # the seed of this grading's inputs: `grade --seed SALT` draws them again

    @property
    def score(self) -> int:
        return sum(c.score for c in self.checks)

    @property
    def max_score(self) -> int:
        """Points of the checks that ran or should have run; skipped GPU checks are left out."""
        return sum(c.points for c in self.checks if c.status != STATUS_SKIPPED)

    def check(self, check_id: str) -> CheckResult:
        for check in self.checks:
            if check.id == check_id:
                return check
        raise KeyError(f"no check {check_id!r} in this report; it has {[c.id for c in self.checks]}")

    def to_dict(self) -> dict:
        return {
            "student": self.student,
            "submission": self.submission,
            "lab": self.lab,
            "score": self.score,
            "max_score": self.max_score,
            "checks": [asdict(c) for c in self.checks],
            "notes": list(self.notes),
            "seconds": round(self.seconds, 2),
            "sha256": self.sha256,
            "ungraded": self.ungraded,
            "salt": self.salt,
        }

    def format(self) -> str:
        lines = [f"{self.submission}  student={self.student}  lab={self.lab or '?'}  "
                 f"score {self.score}/{self.max_score}  ({self.seconds:.1f} s)  salt={self.salt}"]
        for c in self.checks:
            earned = "-" if c.status == STATUS_SKIPPED else str(c.score)
            name = c.id + (" (hidden)" if c.hidden else "")
            line = f"  {c.status:<8} {earned:>3}/{c.points:<3} {name}"
            lines.append(line + (f": {c.message}" if c.message else ""))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def shorten(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """One readable line of at most about ``limit`` characters."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(text)).strip()  # ANSI colours
    if len(text) > limit:
        text = text[:limit] + f" ... [{len(text) - limit} more characters]"
    return text


# ------------------------------------------------------------- grade tables


def check_columns(reports: list[GradeReport]) -> list[str]:
    """One column per check; a written answer's text follows its score."""
    columns = []
    for report in reports:
        for check in report.checks:
            if check.id not in columns:
                columns += [check.id, f"{check.id} answer"] if check.written else [check.id]
    return columns


def table_rows(reports: list[GradeReport]) -> list[dict]:
    """One row per submission: student, file, lab, points per check, total, max, notes."""
    columns = check_columns(reports)
    rows = []
    for report in reports:
        row = {"student": report.student, "file": report.submission, "lab": report.lab or "", "sha256": report.sha256,
               "salt": "" if report.salt is None else report.salt}
        by_id = {c.id: c for c in report.checks}
        for check_id in (c for c in columns if " " not in c):  # ids have no spaces; "<id> answer" columns do
            check = by_id.get(check_id)
            row[check_id] = "" if check is None else (check.status if check.status in (STATUS_SKIPPED, STATUS_PENDING)
                                                      else check.score)
            if check is not None and check.written:
                row[f"{check_id} answer"] = check.answer
        row.update(total=report.score, max=report.max_score, notes=" | ".join(report.notes))
        rows.append(row)
    return rows


def write_csv(reports: list[GradeReport], path) -> None:
    rows = table_rows(reports)
    fields = ["student", "file", "lab", "sha256", "salt", *check_columns(reports), "total", "max", "notes"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)


def grades_json(reports: list[GradeReport]) -> str:
    return json.dumps({"submissions": [r.to_dict() for r in reports], "table": table_rows(reports)}, indent=1)


def summary_table(reports: list[GradeReport]) -> str:
    """A plain-text table across submissions: score, max and the checks that did not pass."""
    header = ("student", "lab", "score", "max", "seconds", "not passed")
    rows = [(r.student, r.lab or "?", str(r.score), str(r.max_score), f"{r.seconds:.1f}",
             ", ".join(c.id + (" (pending)" if c.status == STATUS_PENDING else "") for c in r.checks
                       if c.status in (STATUS_FAILED, STATUS_NOT_RUN, STATUS_PENDING)) or "-")
            for r in reports]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    out = io.StringIO()
    for row in [header, *rows]:
        cells = [row[i].ljust(widths[i]) if i < 2 else row[i].rjust(widths[i]) for i in range(len(widths))]
        out.write("  ".join(cells) + "  " + row[-1] + "\n")
    return out.getvalue()


