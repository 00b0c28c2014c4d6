"""The README's tables of exercises, labs, points and tuning tasks are computed, and current."""

import shutil
from pathlib import Path

import nbformat
import pytest

from llmsys.course import labs, syllabus

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_tables_are_current(capsys):
    assert syllabus.main_write(check=True, readme=ROOT / "README.md") == 0, capsys.readouterr().out


def test_exercises_and_predictions_are_read_from_the_cells():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('f = exercises.check("first", f, ref, cases, hint)'),
        nbformat.v4.new_code_cell('g = exercises.check(\n    "second", g, ref, cases, hint)\nmy_prediction = None'),
        nbformat.v4.new_markdown_cell('exercises.check("not code", ...)\nmy_prediction = 1'),
    ])
    assert syllabus.chapter_exercises(nb) == ["first", "second"]
    assert syllabus.chapter_predictions(nb) == 1


def test_a_lab_change_changes_the_tables(tmp_path):
    """Points, regions and a tuning tag added to a lab show up in both tables."""
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    source = ROOT / "solutions" / "lab07_adamw.ipynb"
    before = syllabus.lab_work(source)
    nb = labs.read_notebook(source)
    graded = next(cell for cell in nb.cells if labs.is_graded(cell))
    check = labs.check_of(graded)
    graded.metadata["tags"] = [t for t in labs.cell_tags(graded) if not t.startswith("points=")] + [f"points={check.points + 5}",
                                                                                                     "tuning"]
    nb.cells.append(nbformat.v4.new_code_cell("x = 1\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION"))
    nbformat.write(nb, solutions / source.name)
    (after,) = syllabus.all_labs(solutions)
    assert (after.points, after.regions, after.checks) == (before.points + 5, before.regions + 1, before.checks)
    assert after.tuning == (check.id, *before.tuning)
    assert f"| `lab07_adamw` | 7 | {before.regions + 1} | {before.checks} | {before.points + 5} |" in syllabus.lab_table([after])
    chapter_row = next(line for line in syllabus.chapter_table(ROOT / "notebooks", [after]).splitlines() if line.startswith("| 7 |"))
    assert f"`lab07_adamw`: {before.checks} checks, {before.points + 5} points" in chapter_row and f"`{check.id}`" in chapter_row


def test_a_stale_or_unmarked_readme_is_reported(tmp_path, capsys):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    begin, end = syllabus.markers("lab-work")
    text = readme.read_text()
    readme.write_text(text.replace(end, "| a row someone typed |\n" + end))
    assert syllabus.main_write(check=True, readme=readme) == 1
    assert "stale" in capsys.readouterr().out
    assert syllabus.main_write(check=False, readme=readme) == 0
    assert readme.read_text() == text
    readme.write_text(text.replace(begin, ""))
    assert syllabus.main_write(check=True, readme=readme) == 2
    assert "marker lines for the instructors' table" in capsys.readouterr().out
    with pytest.raises(ValueError, match="lab<chapter number>"):
        bad = tmp_path / "labX_oops.ipynb"
        shutil.copy(ROOT / "solutions" / "lab07_adamw.ipynb", bad)
        syllabus.lab_work(bad)


def test_a_chapter_in_two_notebooks_lists_its_lab_in_the_first_row_only():
    table = syllabus.chapter_table(ROOT / "notebooks", syllabus.all_labs(ROOT / "solutions"))
    rows = [line for line in table.splitlines() if line.startswith("| 9 |")]
    assert len(rows) == 2 and "`lab09_serving`" in rows[0] and "lab09" not in rows[1], rows
