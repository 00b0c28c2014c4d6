"""Chapter exercises: generated copies are current, and every self-check tells right from wrong.

For each exercise of each chapter source in solutions/chapters/, the chapter's setup cells and
the exercises before it (solved) run in a fresh namespace, then the exercise cell itself in
several versions: the worked solution must pass its self-check, the generated stub must be
reported "not attempted", and each wrong answer kept in the cell's metadata (at least three, of
different kinds) must get a hint that names its mistake. Only these cells run, never a whole
notebook. One exercise per chapter builds the chapter's central mechanism whole.
"""

import contextlib
import io
from pathlib import Path

import nbformat
import pytest
import torch

from llmsys.course import chapters, labs

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / chapters.SOURCES_DIR).glob("*.ipynb"))


def exercises_of(nb) -> list[tuple[str, object, object]]:
    """(name, exercise cell, check cell) in notebook order."""
    found = []
    for cell in nb.cells:
        name = labs.tag_value(cell, "exercise")
        if name:
            found.append([name, cell, None])
        name = labs.tag_value(cell, "check")
        if name:
            assert found and found[-1][0] == name and found[-1][2] is None, f"check={name} must follow exercise={name}"
            found[-1][2] = cell
    return [tuple(f) for f in found]


CASES = [(path, name) for path in SOURCES for name, _, _ in exercises_of(nbformat.read(path, as_version=4))]


def run(code: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<cell>", "exec"), namespace)
    return out.getvalue()


def test_generated_chapters_are_current(capsys):
    assert chapters.main_build(check=True, sources_dir=ROOT / chapters.SOURCES_DIR, notebooks_dir=ROOT / "notebooks") == 0, \
        capsys.readouterr().out


def solution_lines(cell) -> int:
    """Lines between the solution markers, blank lines and comments left out."""
    lines, inside = 0, False
    for line in labs.source_text(cell).splitlines():
        stripped = line.strip()
        if stripped.startswith((labs.BEGIN_MARKER, labs.END_MARKER)):
            inside = stripped.startswith(labs.BEGIN_MARKER)
        elif inside and stripped and not stripped.startswith("#"):
            lines += 1
    return lines


def test_chapter_sources_have_three_exercises_each_with_three_wrong_answers():
    assert {p.name for p in SOURCES} <= {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    for path in SOURCES:
        items = exercises_of(nbformat.read(path, as_version=4))
        assert len(items) >= 3, path.name
        for name, exercise, check in items:
            assert check is not None, f"{path.name}: exercise {name} has no check cell"
            assert labs.has_solution_region(exercise), f"{path.name}: exercise {name} has no solution region"
            wrong = exercise.metadata["llmsys"]["wrong_answers"]
            assert len(wrong) >= 3 and all(w["code"] and w["hint"] for w in wrong), f"{path.name}: {name}"
            assert len({w["code"] for w in wrong}) == len(wrong), f"{path.name}: {name} repeats a wrong answer"


def test_every_chapter_has_its_central_mechanism_built_whole():
    for path in SOURCES:
        whole = [(name, solution_lines(exercise)) for name, exercise, _ in exercises_of(nbformat.read(path, as_version=4))
                 if exercise.metadata["llmsys"].get("whole")]
        assert whole, f"{path.name}: no exercise marked whole (metadata llmsys.whole)"
        for name, lines in whole:
            assert 20 <= lines <= 80, f"{path.name}: {name} has {lines} lines of solution; a whole mechanism has 20-80"


def test_a_stale_chapter_is_reported(tmp_path, capsys):
    sources, built = tmp_path / "sources", tmp_path / "notebooks"
    sources.mkdir(), built.mkdir()
    (sources / SOURCES[0].name).write_bytes(SOURCES[0].read_bytes())
    assert chapters.main_build(check=True, sources_dir=sources, notebooks_dir=built) == 1
    assert "missing" in capsys.readouterr().out
    assert chapters.main_build(check=False, sources_dir=sources, notebooks_dir=built) == 0
    text = (built / SOURCES[0].name).read_text()
    assert "### BEGIN SOLUTION" not in text and labs.STUB_COMMENT in text and '"wrong"' not in text
    assert chapters.main_build(check=True, sources_dir=sources, notebooks_dir=built) == 0


@pytest.mark.parametrize("path, name", CASES, ids=[f"{p.stem}:{n}" for p, n in CASES])
def test_self_check_tells_solution_stub_and_wrong_answer_apart(path, name):
    torch.set_num_threads(1)
    nb = nbformat.read(path, as_version=4)
    items = exercises_of(nb)
    setup = [labs.source_text(c) for c in nb.cells if "exercise-setup" in labs.cell_tags(c)]
    index = [n for n, _, _ in items].index(name)
    _, exercise, check = items[index]
    solution = labs.source_text(exercise)
    wrong = exercise.metadata["llmsys"]["wrong_answers"]
    versions = [("solution", solution, None), ("stub", labs.stub_source(solution), None)]
    versions += [(f"wrong answer {i}", w["code"], w["hint"]) for i, w in enumerate(wrong)]
    for version, code, hint in versions:
        namespace = {}
        for text in setup:
            run(text, namespace)
        for _, before, before_check in items[:index]:  # earlier exercises, solved
            run(labs.source_text(before), namespace)
            run(labs.source_text(before_check), namespace)
        run(code, namespace)
        printed = run(labs.source_text(check), namespace)
        if version == "solution":
            assert f"{name}: correct" in printed, printed
        elif version == "stub":
            assert f"{name}: not attempted" in printed, printed
        else:
            assert f"{name}: not right yet. Hint:" in printed and hint in printed, f"{version}: {printed}"


def test_chapter_sources_are_committed_without_outputs():
    for path in SOURCES:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


def test_the_pipeline_simulator_runs_a_hand_written_order():
    from llmsys.parallel import pipeline

    orders = pipeline.one_f_one_b_orders(4, 8)
    assert pipeline.simulate("1f1b", 4, 8, orders=orders).slots == pipeline.simulate("1f1b", 4, 8).slots
    backward_first = [order[::-1] for order in orders]  # every backward before its own forward
    with pytest.raises(RuntimeError, match="deadlocks"):
        pipeline.simulate("1f1b", 4, 8, orders=backward_first)
    with pytest.raises(ValueError, match="one list per device"):
        pipeline.simulate("1f1b", 4, 8, orders=orders[:3])
