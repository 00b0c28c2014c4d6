"""A lab in nbgrader's source format, so an instructor can hand it out and grade it with nbgrader instead.

nbgrader (its docs: "Creating and grading assignments") reads the same
``### BEGIN SOLUTION`` / ``### END SOLUTION`` markers this course uses, and
each cell's role from ``metadata.nbgrader`` (schema version 3): an answer cell
is ``solution``, a graded check is ``grade`` and ``locked`` with its
``points``, a written answer is both ``solution`` and ``grade`` (scored by
hand), and a hidden check's source goes between ``### BEGIN HIDDEN TESTS`` and
``### END HIDDEN TESTS``. A check tagged ``gpu`` passes by printing "skipped" on
a machine without CUDA, which nbgrader would count as earned, so it is exported
as an ungraded cell. nbgrader itself is not needed to write the file.

Graded checks run as plain ``assert``s under nbgrader: its grading believes the
student's process, which this course's own ``grade`` never does.
"""

from __future__ import annotations

import copy
from pathlib import Path

from .. import labs

SCHEMA_VERSION = 3


def nbgrader_cell_metadata(cell) -> dict | None:
    """The ``nbgrader`` metadata of one solution-notebook cell, or None for a plain cell."""
    base = {"schema_version": SCHEMA_VERSION, "task": False}
    if labs.is_written(cell):
        check = labs.check_of(cell)
        return {**base, "grade": True, "solution": True, "locked": False, "grade_id": check.id, "points": check.points}
    if labs.is_graded(cell):
        check = labs.check_of(cell)
        if check.gpu:
            return None
        return {**base, "grade": True, "solution": False, "locked": True, "grade_id": check.id, "points": check.points}
    if labs.has_solution_region(cell):
        return {**base, "grade": False, "solution": True, "locked": False, "grade_id": str(cell.get("id"))}
    return None


def to_nbgrader(solution_nb):
    """nbgrader's source notebook for a solution notebook (the input is not modified)."""
    labs.build_lab(solution_nb)  # the same validation as the course's own student copies
    nb = copy.deepcopy(solution_nb)
    for index, cell in enumerate(nb.cells):
        nb.cells[index] = cell = labs.clean_cell(cell, index)
        metadata = nbgrader_cell_metadata(cell)
        if metadata is None:
            continue
        cell.metadata["nbgrader"] = metadata
        if labs.is_graded(cell) and labs.HIDDEN_TAG in labs.cell_tags(cell):
            cell.source = f"### BEGIN HIDDEN TESTS\n{cell.source}\n### END HIDDEN TESTS"
    return nb


def export_lab(solution_path: str | Path, course_dir: str | Path) -> Path:
    """COURSE/source/<lab>/<lab>.ipynb, and an nbgrader_config.py naming nothing else if none is there."""
    solution_path, course_dir = Path(solution_path), Path(course_dir)
    if not solution_path.is_file():
        raise FileNotFoundError(f"no solution notebook at {solution_path}")
    name = solution_path.stem
    out = course_dir / "source" / name / f"{name}.ipynb"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(labs.notebook_text(to_nbgrader(labs.read_notebook(solution_path))), encoding="utf-8")
    config = course_dir / "nbgrader_config.py"
    if not config.exists():
        config.write_text("c = get_config()  # noqa: F821\nc.CourseDirectory.root = __file__.rsplit('/', 1)[0]\n",
                          encoding="utf-8")
    return out
