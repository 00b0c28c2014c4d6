"""Chapter notebooks with exercises: ``notebooks/NN_name.ipynb`` from ``solutions/chapters/``.

A chapter that has exercises has one source, ``solutions/chapters/NN_name.ipynb``, that
holds the worked solutions between the markers labs use (see ``llmsys.course.labs``).
The learner's copy in ``notebooks/`` is generated from it with the labs' stub generator.
Chapters without a source are not touched.

Tags name the parts of an exercise, so tests can run them alone:

- ``exercise=<name>``: the cell the learner writes (it holds a solution region);
- ``check=<name>``: its self-check cell (``llmsys.course.exercises.check``);
- ``exercise-setup``: the cells an exercise needs run first (imports, inputs).

An exercise cell keeps, in its metadata under ``llmsys``, wrong answers of different kinds
(``wrong_answers``: a list of ``{"code": the cell's code with a typical mistake, "hint": a
phrase the self-check's hint must contain}``); the tests run each one, and the generated
copy drops them.
"""

from __future__ import annotations

import copy
from pathlib import Path

from llmsys.course import labs

SOURCES_DIR = labs.REPO / "solutions" / "chapters"
NOTEBOOKS_DIR = labs.REPO / "notebooks"
TEST_ONLY_METADATA = "llmsys"  # the planted wrong answer and its expected hint


def build_chapter(source_nb, where: str = "chapter source"):
    """The learner's copy of a chapter source: outputs stripped, solution regions stubbed."""
    nb = copy.deepcopy(source_nb)
    nb.nbformat, nb.nbformat_minor = 4, max(5, int(nb.get("nbformat_minor", 5)))
    nb.cells = [labs.clean_cell(cell, i) for i, cell in enumerate(source_nb.cells)]
    regions = 0
    for index, cell in enumerate(nb.cells):
        cell.metadata.pop(TEST_ONLY_METADATA, None)
        has_marker = any(line.strip().startswith((labs.BEGIN_MARKER, labs.END_MARKER))
                         for line in cell.source.splitlines())
        if cell.cell_type != "code":
            if has_marker:  # only code cells are stubbed; a marker here would ship the answer
                raise ValueError(f"{where}, cell {index}: solution markers work in code cells only")
            continue
        regions += labs.has_solution_region(cell)
        cell.source = labs.stub_source(cell.source, f"{where}, cell {index}")
    if not regions:
        raise ValueError(f"{where}: no solution region; a chapter source needs at least one exercise")
    return nb


def expected_chapters(sources_dir: str | Path = SOURCES_DIR) -> dict[str, str]:
    """{file name: text of its learner's copy} for every chapter source."""
    sources_dir = Path(sources_dir)
    if not sources_dir.is_dir():
        raise FileNotFoundError(f"no chapter sources at {sources_dir}")
    return {path.name: labs.notebook_text(build_chapter(labs.read_notebook(path), str(path)))
            for path in sorted(sources_dir.glob("*.ipynb"))}


def main_build(check: bool, sources_dir: str | Path = SOURCES_DIR, notebooks_dir: str | Path = NOTEBOOKS_DIR) -> int:
    """``python -m llmsys chapters build [--check]``: write or verify the generated chapters.

    Returns the exit code: 2 for a broken source, with ``check`` 1 when a chapter
    is stale or missing (each is printed), else 0."""
    notebooks_dir = Path(notebooks_dir)
    try:
        expected = expected_chapters(sources_dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}")
        return 2
    stale = labs.write_generated(expected, notebooks_dir, check)
    for line in stale:
        print(line)
    if stale:
        print(f"edit {sources_dir}/, not {notebooks_dir}/, then run `python -m llmsys chapters build`")
        return 1
    if check:
        print(f"{notebooks_dir}/ is up to date with {sources_dir}/ ({len(expected)} chapter(s))")
    return 0
