"""What a learner writes, chapter by chapter, read from the notebooks and the labs themselves.

Two tables in the README come from here, each between a pair of marker lines: the chapter
map's (exercises, predict-then-run questions, labs, graded points and tuning tasks per
chapter) and the instructors' guide's (every lab's graded checks, points, GPU-only points,
written answers and tuning tasks, with totals). ``python -m llmsys chapters build``
rewrites them and ``--check`` fails when they are stale, so they change with the next
exercise, check or point anyone adds.

- An exercise is a self-check call ``exercises.check("<name>", ...)`` in a chapter notebook.
- A prediction is a ``my_prediction = ...`` line (the "predict, then run" questions).
- A lab belongs to the chapter its number names (``lab00b_kernels`` to chapter 0); its graded
  checks and written answers are those the grader counts (``labs.graded_checks``); a graded
  check tagged ``tuning`` is a tuning task, graded by a measured outcome.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from llmsys.course import claims, labs
from llmsys.course.runner import CHAPTERS

README = labs.REPO / "README.md"
TUNING_TAG = "tuning"
EXERCISE_CALL = re.compile(r"""\bcheck\(\s*["']([^"']+)["']""")
PREDICTION = re.compile(r"^my_prediction\s*=", re.MULTILINE)
TABLES = {"chapter-work": "the chapter map's table", "lab-work": "the instructors' table",
          "claims": "the lectures' claims"}


@dataclass(frozen=True)
class LabWork:
    """One lab's graded work, as the grader counts it."""

    name: str
    chapter: int
    regions: int  # solution regions the learner writes (### BEGIN SOLUTION ... ### END SOLUTION)
    checks: int  # graded code checks
    points: int  # all points, written answers included
    gpu_points: int  # points of checks that need CUDA (not in a CPU grade)
    written: int  # written answers, scored by hand
    tuning: tuple[str, ...]  # ids of the tuning tasks


def chapter_exercises(nb) -> list[str]:
    """The names of a chapter's exercises, in notebook order."""
    return [name for cell in nb.cells if cell.cell_type == "code" for name in EXERCISE_CALL.findall(labs.source_text(cell))]


def chapter_predictions(nb) -> int:
    return sum(len(PREDICTION.findall(labs.source_text(cell))) for cell in nb.cells if cell.cell_type == "code")


def lab_work(path: Path) -> LabWork:
    nb = labs.read_notebook(path)
    number = re.match(r"lab(\d+)", path.stem)
    if not number:
        raise ValueError(f"{path.name}: a lab's file name starts with lab<chapter number>, e.g. lab03_lora.ipynb")
    checks = labs.graded_checks(nb, path.name)
    tuning = tuple(labs.check_of(cell).id for cell in nb.cells if labs.is_graded(cell) and TUNING_TAG in labs.cell_tags(cell))
    regions = sum(line.strip().startswith(labs.BEGIN_MARKER) for cell in nb.cells if cell.cell_type == "code"
                  for line in labs.source_text(cell).splitlines())
    return LabWork(path.stem, int(number.group(1)), regions, sum(not c.written for c in checks), sum(c.points for c in checks),
                   sum(c.points for c in checks if c.gpu), sum(c.written for c in checks), tuning)


def all_labs(solutions_dir: Path) -> list[LabWork]:
    return [lab_work(path) for path in sorted(Path(solutions_dir).glob("lab*.ipynb"))]


def chapter_table(notebooks_dir: Path, lab_list: list[LabWork]) -> str:
    rows = ["| ch | exercises in the chapter (self-checked) | predict, then run | labs: graded checks, points | tuning tasks |",
            "|---|---|---|---|---|"]
    listed = set()  # a chapter in two notebooks lists its labs in the first one's row
    for chapter in CHAPTERS:
        nb = labs.read_notebook(Path(notebooks_dir) / chapter.notebook)
        names = chapter_exercises(nb)
        mine = [lab for lab in lab_list if lab.chapter == chapter.number and lab.name not in listed]
        listed |= {lab.name for lab in mine}
        lab_cells = ", ".join(f"`{lab.name}`: {lab.checks} checks, {lab.points} points" for lab in mine) or "—"
        tuning = ", ".join(f"`{t}`" for lab in mine for t in lab.tuning) or "—"
        exercise_cell = f"{len(names)}: " + ", ".join(f"`{n}`" for n in names) if names else "—"
        rows.append(f"| {chapter.number} | {exercise_cell} | {chapter_predictions(nb) or '—'} | {lab_cells} | {tuning} |")
    return "\n".join(rows)


def lab_table(lab_list: list[LabWork]) -> str:
    rows = ["| lab | chapter | regions you write | graded checks | points | of which GPU-only | written answers | tuning tasks |",
            "|---|---|---|---|---|---|---|---|"]
    for lab in lab_list:
        rows.append(f"| `{lab.name}` | {lab.chapter} | {lab.regions} | {lab.checks} | {lab.points} | {lab.gpu_points or '—'} | "
                    f"{lab.written or '—'} | {len(lab.tuning) or '—'} |")
    rows.append(f"| **all {len(lab_list)} labs** | | {sum(lab.regions for lab in lab_list)} | {sum(lab.checks for lab in lab_list)} | {sum(lab.points for lab in lab_list)} | "
                f"{sum(lab.gpu_points for lab in lab_list)} | {sum(lab.written for lab in lab_list)} | "
                f"{sum(len(lab.tuning) for lab in lab_list)} |")
    return "\n".join(rows)


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- BEGIN {name}: written by `python -m llmsys chapters build`, do not edit by hand -->",
            f"<!-- END {name} -->")


def with_tables(text: str, tables: dict[str, str]) -> str:
    """The README's text with each generated table replaced between its markers."""
    for name, table in tables.items():
        begin, end = markers(name)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            raise ValueError(f"README.md needs the marker lines for {TABLES[name]}, once each and in order:\n{begin}\n{end}")
        head, rest = text.split(begin)
        _, tail = rest.split(end)
        text = f"{head}{begin}\n{table}\n{end}{tail}"
    return text


def expected_readme(readme: Path = README, notebooks_dir: Path = labs.REPO / "notebooks",
                    solutions_dir: Path = labs.REPO / "solutions") -> str:
    lab_list = all_labs(solutions_dir)
    return with_tables(Path(readme).read_text(), {"chapter-work": chapter_table(notebooks_dir, lab_list),
                                                  "lab-work": lab_table(lab_list), "claims": claims.readme_table()})


def main_write(check: bool, readme: Path = README) -> int:
    """Write (or with ``check`` verify) the README's generated tables; the exit code."""
    try:
        expected = expected_readme(readme)
    except ValueError as err:
        print(f"error: {err}")
        return 2
    if Path(readme).read_text() == expected:
        if check:
            print(f"{Path(readme).name}: the chapter and lab tables are up to date")
        return 0
    if check:
        print(f"{Path(readme).name}: the chapter and lab tables are stale; run `python -m llmsys chapters build`")
        return 1
    Path(readme).write_text(expected)
    print(f"wrote the chapter and lab tables in {readme}")
    return 0
