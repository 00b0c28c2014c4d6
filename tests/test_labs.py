"""The lab generator, and the integrity of every lab in solutions/.

Integrity: every graded check passes on the solution and fails on the student
stub, so no check is vacuous. Both tests iterate over solutions/*.ipynb, so a
new lab is covered without new code.
"""

import ast
import copy
from pathlib import Path

import nbformat
import pytest

from llmsys.course import grading, labs

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LAB00 = ROOT / "solutions" / "lab00_warmup.ipynb"
# Lab cells take well under a second; the limits only stop a runaway lab.
CELL_TIMEOUT, TIMEOUT = 120, 600
# A grading draws the seed of its inputs; a test fixes one, so that a failure can be rerun as it was.
SALT = 100


def read(path):
    return nbformat.read(str(path), as_version=4)


def split_lines(nb) -> tuple[set[str], set[str]]:
    """(lines inside solution regions, lines outside them), stripped."""
    inside_lines, outside_lines, inside = set(), set(), False
    for cell in nb.cells:
        for line in labs.source_text(cell).splitlines():
            if line.strip().startswith(labs.BEGIN_MARKER):
                inside = True
            elif line.strip().startswith(labs.END_MARKER):
                inside = False
            else:
                (inside_lines if inside else outside_lines).add(line.strip())
    return inside_lines, outside_lines


def test_labs_folder_is_up_to_date(capsys):
    code = labs.main_build(check=True, solutions_dir=ROOT / "solutions", labs_dir=ROOT / "labs")
    assert code == 0, capsys.readouterr().out


def test_there_is_at_least_the_warmup_lab():
    assert LAB00 in SOLUTIONS


@pytest.mark.parametrize("path", sorted((ROOT / "labs").glob("*.ipynb")) + SOLUTIONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebooks_are_committed_without_outputs(path):
    for index, cell in enumerate(read(path).cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {index} has outputs"


def test_stub_keeps_indentation_and_the_code_around_regions():
    source = "\n".join([
        "def area(w, h):",
        "    scale = 1",
        "    ### BEGIN SOLUTION",
        "    return w * h * scale",
        "    ### END SOLUTION",
        "",
        "### BEGIN SOLUTION",
        "UNIT = 'm2'",
        "### END SOLUTION",
        "print('ok')",
    ])
    stub = labs.stub_source(source)
    assert stub.splitlines() == [
        "def area(w, h):",
        "    scale = 1",
        "    " + labs.STUB_COMMENT,
        "    " + labs.STUB_RAISE,
        "",
        labs.STUB_COMMENT,
        labs.STUB_RAISE,
        "print('ok')",
    ]
    ast.parse(stub)
    namespace = {}
    exec("\n".join(stub.splitlines()[:4]), namespace)  # the function alone
    with pytest.raises(NotImplementedError):
        namespace["area"](2, 3)


@pytest.mark.parametrize("source, problem", [
    ("### BEGIN SOLUTION\nx = 1", "no matching"),
    ("x = 1\n### END SOLUTION", "has no"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "inside the region"),
])
def test_unbalanced_markers_are_refused(source, problem):
    with pytest.raises(ValueError, match=problem):
        labs.stub_source(source, "lab99 cell 3")


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_student_copy_strips_answers_and_outputs_and_keeps_checks(solution):
    nb = read(solution)
    for number, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):  # as if run before saving
        cell.execution_count = number + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
    before = copy.deepcopy(nb)
    lab = labs.build_lab(nb, solution.stem)

    assert nb == before, "build_lab must not modify its input"
    assert [c.id for c in lab.cells] == [c.id for c in nb.cells]
    assert lab.metadata["llmsys"]["lab"] == solution.stem
    text = labs.notebook_text(lab)
    assert labs.BEGIN_MARKER not in text and labs.END_MARKER not in text
    inside, outside = split_lines(nb)
    answers = inside - outside - {""}
    assert answers, "a lab needs at least one solution region"
    stub_lines = {line.strip() for cell in lab.cells for line in cell.source.splitlines()}
    assert answers.isdisjoint(stub_lines), "solution code leaked into the student copy"
    for mine, theirs in zip(lab.cells, nb.cells):
        if mine.cell_type == "code":
            assert mine.outputs == [] and mine.execution_count is None
        if labs.is_graded(theirs):
            assert mine.source == theirs.source and labs.cell_tags(mine) == labs.cell_tags(theirs)
    assert labs.notebook_text(labs.build_lab(nb, solution.stem)) == text, "the build must be deterministic"


def graded_cell(check_id="ok", points="1", source="assert True"):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["grade", f"id={check_id}", f"points={points}"]
    return cell


@pytest.mark.parametrize("cells, problem", [
    ([nbformat.v4.new_code_cell("x = 1")], "no graded cells"),
    ([graded_cell(points="two")], "points=<n>"),
    ([graded_cell(points="0")], "points=<n>"),
    ([graded_cell(check_id="has space")], "id=<name>"),
    ([graded_cell(), graded_cell()], "unique"),
    ([graded_cell(source="### BEGIN SOLUTION\nx = 1\n### END SOLUTION")], "must not contain a solution"),
    ([graded_cell(), nbformat.v4.new_markdown_cell("### BEGIN SOLUTION\nThe answer.\n### END SOLUTION")], "written answers only"),
])
def test_malformed_labs_are_refused(cells, problem):
    with pytest.raises(ValueError, match=problem):
        labs.build_lab(nbformat.v4.new_notebook(cells=cells), "lab99_bad")


def test_build_and_check_name_stale_missing_and_extra_files(tmp_path, capsys):
    solutions, built = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    (solutions / "lab00_warmup.ipynb").write_bytes(LAB00.read_bytes())
    (solutions / "lab01_copy.ipynb").write_bytes(LAB00.read_bytes())

    assert labs.main_build(check=True, solutions_dir=solutions, labs_dir=built) == 1
    out = capsys.readouterr().out
    assert f"missing: {built / 'lab00_warmup.ipynb'}" in out and f"missing: {built / 'lab01_copy.ipynb'}" in out

    assert labs.main_build(check=False, solutions_dir=solutions, labs_dir=built) == 0
    assert labs.main_build(check=True, solutions_dir=solutions, labs_dir=built) == 0
    capsys.readouterr()

    nb = read(solutions / "lab01_copy.ipynb")
    nb.cells[0].source += "\nOne more sentence."
    nbformat.write(nb, str(solutions / "lab01_copy.ipynb"))
    (built / "lab99_old.ipynb").write_text("{}", encoding="utf-8")
    assert labs.main_build(check=True, solutions_dir=solutions, labs_dir=built) == 1
    out = capsys.readouterr().out
    assert f"stale: {built / 'lab01_copy.ipynb'}" in out and f"extra: {built / 'lab99_old.ipynb'}" in out
    assert "lab00_warmup" not in out

    assert labs.main_build(check=False, solutions_dir=solutions, labs_dir=built) == 0
    assert (built / "lab99_old.ipynb").exists(), "a build never deletes files in labs/"
    assert "One more sentence." in (built / "lab01_copy.ipynb").read_text(encoding="utf-8")


@pytest.fixture(scope="module", params=SOLUTIONS, ids=lambda p: p.stem)
def graded_lab(request):
    """The solution and the student stub of one lab, graded together as the instructor's grader does
    (each in its own sandbox, on the inputs of salt SALT, judged against the solution's run)."""
    if grading.unavailable_reason():
        pytest.skip(f"no sandbox on this machine: {grading.unavailable_reason()}")
    solution = request.param
    solved, stub = grading.grade_many([solution, ROOT / "labs" / solution.name], reference_path=solution, salt=SALT,
                                      cell_timeout=CELL_TIMEOUT, timeout=TIMEOUT)
    return solved, stub


def test_every_check_passes_on_the_solution(graded_lab):
    report = graded_lab[0]
    ran = [c for c in report.checks if c.status != grading.STATUS_SKIPPED and not c.written]
    assert ran, "no graded check ran"
    assert {c.id: c.message for c in ran if c.status != grading.STATUS_PASSED} == {}
    # a written answer waits for the instructor, with the model answer as its text
    written = [c for c in report.checks if c.written]
    assert all(c.status == grading.STATUS_PENDING and c.score == 0 and c.answer.strip() for c in written)
    assert report.score == sum(c.points for c in ran) == report.max_score - sum(c.points for c in written)
    for check in report.checks:
        if check.status == grading.STATUS_SKIPPED:
            assert check.gpu and not grading.has_gpu() and check.message == grading.NO_GPU


def test_every_check_fails_on_the_student_stub(graded_lab):
    report = graded_lab[1]
    ran = [c for c in report.checks if c.status != grading.STATUS_SKIPPED]
    assert ran, "no graded check ran"
    vacuous = [c.id for c in ran if c.status == grading.STATUS_PASSED]
    assert vacuous == [], f"these checks pass without any answer: {vacuous}"
    assert all(c.status == grading.STATUS_FAILED and c.message for c in ran), [(c.id, c.status, c.message) for c in ran]
    assert report.score == 0


def test_labs_build_works_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert labs.main_build(check=True) == 0
    assert "up to date" in capsys.readouterr().out


def test_release_holds_what_students_get_and_nothing_else(tmp_path, capsys):
    out = tmp_path / "release"
    assert labs.main_release(out) == 0
    assert sorted(p.name for p in (out / "labs").iterdir()) == sorted(p.name for p in SOLUTIONS)
    for path in (out / "labs").iterdir():
        assert path.read_text(encoding="utf-8") == (ROOT / "labs" / path.name).read_text(encoding="utf-8")
    files = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    assert (out / "llmsys" / "model.py").is_file() and (out / "README.md").is_file()
    assert not any(part in ("solutions", "tests", "fixtures", "extra_checks") for f in files for part in f.split("/"))
    assert not any(labs.BEGIN_MARKER in (out / f).read_text(encoding="utf-8", errors="replace")
                   for f in files if f.endswith(".ipynb"))
    assert labs.main_release(out) == 2  # never mixed into an old release
    assert "not an empty folder" in capsys.readouterr().out
