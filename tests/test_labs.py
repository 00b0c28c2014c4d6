"""The lab generator, and the integrity of every lab in solutions/.

Integrity: every graded check passes on the solution and fails on the student
stub, so no check is vacuous. Both tests iterate over solutions/*.ipynb, so a
new lab is covered without new code.
"""

import ast
import copy
import difflib
import importlib
import inspect
import re
import textwrap
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
        if labs.is_hidden(theirs):
            assert mine.cell_type == "markdown" and labs.check_of(theirs).id in mine.source
        elif labs.is_graded(theirs):
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


DO_NOTHING = ("inputs", "zeros")


def do_nothing_source(source: str, returns: str) -> str:
    """A cell whose solution regions do nothing: a region in a function returns the function's first argument
    (``returns="inputs"``) or zero times it (``"zeros"``); any other region is ``pass``."""
    tree = parsed(source)
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def stub_for(line_number: int) -> str:
        around = [f for f in functions if f.lineno < line_number <= f.end_lineno]
        if not around:
            return "pass"
        function = max(around, key=lambda f: f.lineno)  # the innermost
        names = [a.arg for a in function.args.posonlyargs + function.args.args if a.arg not in ("self", "cls", "ctx")]
        if not names or function.name == "__init__":
            return "pass"
        return f"return {names[0]}" if returns == "inputs" else f"return 0 * {names[0]}"

    out = []
    for number, line in enumerate(source.splitlines(), start=1):
        if line.strip().startswith(labs.BEGIN_MARKER):
            out.append(line[: len(line) - len(line.lstrip())] + stub_for(number))
        out.append(line)
    return labs.stub_source("\n".join(out), stub=[])


def do_nothing_copy(solution_nb, returns: str):
    nb = copy.deepcopy(solution_nb)
    for cell in nb.cells:
        if labs.has_solution_region(cell):
            cell.source = do_nothing_source(labs.source_text(cell), returns)
    return labs.build_lab(nb)


def test_do_nothing_regions_return_their_input_or_zeros():
    source = "def f(x, y):\n    z = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n" \
             "### BEGIN SOLUTION\nK = 3\n### END SOLUTION"
    for returns, want in [("inputs", [4, 4]), ("zeros", [0, 0])]:
        namespace = {}
        exec(do_nothing_source(source, returns), namespace)
        assert [namespace["f"](4, 5), namespace["f"](4, 0)] == want and "K" not in namespace


@pytest.fixture(scope="module", params=SOLUTIONS, ids=lambda p: p.stem)
def graded_lab(request, tmp_path_factory):
    """The solution, the student stub and two do-nothing submissions of one lab, graded together as the
    instructor's grader does (each in its own sandbox, on the inputs of salt SALT, judged against the solution's run)."""
    if grading.unavailable_reason():
        pytest.skip(f"no sandbox on this machine: {grading.unavailable_reason()}")
    solution = request.param
    folder = tmp_path_factory.mktemp(solution.stem)
    nothing = []
    for returns in DO_NOTHING:
        path = folder / f"{returns}_{solution.name}"
        path.write_text(labs.notebook_text(do_nothing_copy(read(solution), returns)), encoding="utf-8")
        nothing.append(path)
    solved, stub, *did_nothing = grading.grade_many([solution, ROOT / "labs" / solution.name, *nothing],
                                                    reference_path=solution, salt=SALT, cell_timeout=CELL_TIMEOUT,
                                                    timeout=TIMEOUT)
    return solved, stub, did_nothing


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


def test_a_do_nothing_submission_scores_zero(graded_lab):
    for report in graded_lab[2]:
        passed = [c.id for c in report.checks if c.status == grading.STATUS_PASSED]
        assert passed == [], f"{Path(report.submission).name}: these checks pass on regions that do nothing: {passed}"
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
    assert (out / "llmsys" / "core" / "model.py").is_file() and (out / "README.md").is_file()
    assert not any(part in ("solutions", "tests", "fixtures", "extra_checks") for f in files for part in f.split("/"))
    assert not any(labs.BEGIN_MARKER in (out / f).read_text(encoding="utf-8", errors="replace")
                   for f in files if f.endswith(".ipynb"))
    assert labs.main_release(out) == 2  # never mixed into an old release
    assert "not an empty folder" in capsys.readouterr().out


# --- What a student copy must not show: hidden checks stay hidden ---------------------------------------

def code_cells(nb):
    return [labs.source_text(c) for c in nb.cells if c.cell_type == "code"]


def parsed(source: str):
    try:
        return ast.parse(source)
    except SyntaxError:  # IPython magics; a lab's code cells are plain Python otherwise
        return ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))


def definitions(sources) -> dict[str, str]:
    """{name: its body as ast.unparse writes it} for every function and class the sources define."""
    found = {}
    for source in sources:
        for node in ast.walk(parsed(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                found[node.name] = "\n".join(ast.unparse(s) for s in body)
    return found


def near_copy(body: str, bodies) -> bool:
    return any(difflib.SequenceMatcher(None, body, other, autojunk=False).ratio() > 0.85 for other in bodies)


def is_literal(node) -> bool:
    """A value written down rather than computed: constants, and lists, tuples and arithmetic of them."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(is_literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return is_literal(node.left) and is_literal(node.right)
    return False


def expected_literals(source: str, shown: bool) -> set[str]:
    """The literal values that a check compares with (``got == 2 + 2 + 4``, ``assert_close(x, [0.5, 1.0])``),
    leaving out what says nothing about an answer: small whole numbers, booleans, None, tolerances. Unless the
    check itself is ``shown``, a lone number or a short list (``32``, ``[1]``) is left out too: it is as likely to
    be an input written elsewhere in the lab as the answer."""
    sides = []
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In)) for op in node.ops):
            sides += [node.left, *node.comparators]  # a bound (<, <=) is a tolerance, not an answer
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("assert_close", "isclose", "allclose")):
            sides += node.args[:2]
    found = set()
    for side in sides:
        if not is_literal(side):
            continue
        text = ast.unparse(side)
        if not isinstance(side, ast.BinOp):
            value = ast.literal_eval(side)
            if isinstance(value, (bool, type(None), str)) or (isinstance(value, int) and -10 <= value <= 10):
                continue
            if not shown and (isinstance(value, (int, float)) or len(text) < 6):
                continue
        found.add(text)
    return found


def library_sources(solution_nb) -> dict[str, str]:
    """{dotted name: source} of the library functions a lab declares as answers."""
    policy = solution_nb.metadata.get("llmsys", {}).get("library_answers", {})
    sources = {}
    for name in sorted({n for names in policy.values() for n in names if n.startswith("llmsys.")}):
        module_name, _, attribute = name.rpartition(".")
        while module_name:
            try:
                target = importlib.import_module(module_name)
                break
            except ImportError:
                module_name, _, rest = module_name.rpartition(".")
                attribute = f"{rest}.{attribute}"
        for part in attribute.split("."):
            target = getattr(target, part)
        sources[name] = textwrap.dedent(inspect.getsource(target))
    return sources


def answer_leaks(solution_nb, lab_nb) -> list[str]:
    """Everything of a lab's answers that its student copy shows, one line each."""
    problems = []
    student_code = code_cells(lab_nb)
    student_bodies = definitions(student_code)
    student_text = "\n".join([ast.unparse(parsed(s)) for s in student_code] +
                             [labs.source_text(c) for c in lab_nb.cells if c.cell_type == "markdown"])
    graded = [c for c in solution_nb.cells if labs.is_graded(c)]
    for cell in graded:
        check = labs.check_of(cell)
        defined = definitions([labs.source_text(cell)])
        if not check.hidden and defined:
            problems.append(f"public check {check.id!r} defines {sorted(defined)}: a reference implementation; tag it hidden")
        for name, body in defined.items():
            if check.hidden and near_copy(body, student_bodies.values()):
                problems.append(f"the student copy holds the body of {name!r} from hidden check {check.id!r}")
        for literal in expected_literals(labs.source_text(cell), shown=not check.hidden):
            if re.search(r"(?<![\w.])" + re.escape(literal) + r"(?![\w.])", student_text):
                problems.append(f"the student copy shows {literal}, an expected value of check {check.id!r}")
    for name, source in library_sources(solution_nb).items():
        for body in definitions([source]).values():
            if len(body.splitlines()) > 1 and near_copy(body, student_bodies.values()):
                problems.append(f"the student copy holds the source of {name}, which the lab declares as an answer")
    return problems


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_student_copy_shows_no_reference_implementation_or_expected_value(solution):
    nb = read(solution)
    assert answer_leaks(nb, labs.build_lab(nb, solution.stem)) == []


def test_leak_finder_finds_planted_leaks():
    def lab_with(check_source, hidden=True, self_check="print('ok')"):
        check = graded_cell("memory", source=check_source)
        check.metadata["tags"] += ["hidden"] if hidden else []
        region = nbformat.v4.new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x * 2\n    ### END SOLUTION")
        return nbformat.v4.new_notebook(cells=[region, nbformat.v4.new_code_cell(self_check), check])

    clean = lab_with("assert f(3) == 2 + 2 + 2")
    assert answer_leaks(clean, labs.build_lab(clean)) == []
    shown = lab_with("assert f(3) == 2 + 2 + 2", hidden=False)
    assert "2 + 2 + 2" in " ".join(answer_leaks(shown, labs.build_lab(shown)))
    echoed = lab_with("assert f(3) == 2 + 2 + 2", self_check="assert f(3) == 2 + 2 + 2, 'try again'")
    assert "expected value" in " ".join(answer_leaks(echoed, labs.build_lab(echoed)))
    reference = "def ref(x):\n    y = x + x\n    return y * 1\nassert f(5) == ref(5)"
    public = lab_with(reference, hidden=False)
    assert "defines ['ref']" in " ".join(answer_leaks(public, labs.build_lab(public)))
    copied = lab_with(reference, self_check="def mine(x):\n    y = x + x\n    return y * 1")
    assert "body of 'ref'" in " ".join(answer_leaks(copied, labs.build_lab(copied)))
    library = lab_with("assert f(3) == 6", self_check=inspect.getsource(labs.stub_source))
    library.metadata["llmsys"] = {"library_answers": {"memory": ["llmsys.course.labs.stub_source"]}}
    assert "declares as an answer" in " ".join(answer_leaks(library, labs.build_lab(library)))


def test_hidden_checks_leave_the_student_copy_and_reach_the_grader():
    solution = read(LAB00)
    graded = [c for c in solution.cells if labs.is_graded(c)]
    graded[0].metadata["tags"].append("hidden")
    student = labs.build_lab(solution, "lab00_warmup")
    placeholder = next(c for c in student.cells if c.id == graded[0].id)
    assert placeholder.cell_type == "markdown" and labs.check_of(graded[0]).id in placeholder.source
    assert labs.source_text(graded[0]) not in labs.notebook_text(student)
    cells, notes = grading.merge(solution, student, gpu=False)
    hidden = [c for c in cells if c.check is not None and c.check.id == labs.check_of(graded[0]).id]
    assert len(hidden) == 1 and hidden[0].hidden and hidden[0].source == labs.source_text(graded[0])
    assert not any("deleted" in note for note in notes), notes


# --- No lab repeats a chapter exercise -------------------------------------------------------------------

CHAPTERS = sorted((ROOT / "solutions" / "chapters").glob("*.ipynb"))


def solution_regions(source: str) -> list[str]:
    """The code between each pair of solution markers, dedented, blank lines and comments dropped."""
    regions, current = [], None
    for line in source.splitlines():
        marker = line.strip()
        if marker.startswith(labs.BEGIN_MARKER):
            current = []
        elif marker.startswith(labs.END_MARKER):
            regions.append("\n".join(current))
            current = None
        elif current is not None and marker and not marker.startswith("#"):
            current.append(marker)
    return regions


def top_level_names(source: str) -> set[str]:
    return {node.name for node in parsed(source).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def chapter_exercises() -> list[tuple[str, str, set[str], list[str]]]:
    """(chapter, exercise, the names its cell defines, its solution regions) for every exercise cell."""
    found = []
    for path in CHAPTERS:
        for cell in read(path).cells:
            name = labs.tag_value(cell, "exercise")
            if cell.cell_type == "code" and name:
                source = labs.source_text(cell)
                found.append((path.stem, name, {name} | top_level_names(source), solution_regions(source)))
    return found


def lab_answers(nb) -> list[tuple[set[str], str]]:
    """(names defined in the cell, one solution region) for every region of a lab."""
    return [(top_level_names(labs.source_text(cell)), region) for cell in nb.cells if labs.has_solution_region(cell)
            for region in solution_regions(labs.source_text(cell))]


def repeats(nb, exercises) -> list[str]:
    problems = []
    for names, region in lab_answers(nb):
        for chapter, exercise, exercise_names, exercise_regions in exercises:
            same_name = names & exercise_names
            if same_name:
                problems.append(f"{sorted(same_name)} is chapter {chapter}'s exercise {exercise!r}")
            elif any(len(region) > 40 and difflib.SequenceMatcher(None, region, theirs, autojunk=False).ratio() > 0.7
                     for theirs in exercise_regions):
                problems.append(f"a region defining {sorted(names)} is nearly chapter {chapter}'s answer to {exercise!r}")
    return problems


def test_there_are_chapter_exercises_to_compare_with():
    assert len(chapter_exercises()) >= 12


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_no_lab_repeats_a_chapter_exercise(solution):
    assert repeats(read(solution), chapter_exercises()) == []


def test_repeat_finder_finds_a_renamed_copy_and_a_reused_name():
    exercise = ("06_grpo", "group_advantages", {"group_advantages"},
                ["grouped = rewards.float().view(-1, group_size)\nadvantages = grouped - grouped.mean(dim=1, keepdim=True)\n"
                 "return advantages.view(-1)"])
    renamed = nbformat.v4.new_code_cell("def baseline(r, g):\n    ### BEGIN SOLUTION\n"
                                        "    grouped = r.float().view(-1, g)\n    advantages = grouped - grouped.mean(dim=1, keepdim=True)\n"
                                        "    return advantages.view(-1)\n    ### END SOLUTION")
    same_name = nbformat.v4.new_code_cell("def group_advantages(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION")
    other = nbformat.v4.new_code_cell("def trainer(p):\n    ### BEGIN SOLUTION\n    return p.train()\n    ### END SOLUTION")
    assert "nearly" in " ".join(repeats(nbformat.v4.new_notebook(cells=[renamed]), [exercise]))
    assert "exercise 'group_advantages'" in " ".join(repeats(nbformat.v4.new_notebook(cells=[same_name]), [exercise]))
    assert repeats(nbformat.v4.new_notebook(cells=[other]), [exercise]) == []


# Submissions that hand a graded task to the library's own answer: a subclass, thin wrappers, a loop of library steps.
LIBRARY_SUBMISSIONS = {
    "lab03_lora": {
        "class LoRALinear(": ("from llmsys import lora\n\n\nclass LoRALinear(lora.LoRALinear):\n"
                              "    def __init__(self, base, r, alpha, generator=None):\n"
                              "        super().__init__(base, r, alpha, generator=generator)\n"),
        "def quantize_nf4(": ("from llmsys.lora import quant\n\nNF4 = quant.nf4_code()\n\n\n"
                              "def quantize_nf4(x, blocksize=64):\n    return quant.quantize_nf4(x, blocksize)\n\n\n"
                              "def dequantize_nf4(packed, absmax, shape, blocksize=64):\n"
                              "    return quant.dequantize_nf4(packed, absmax, shape, blocksize)\n"),
    },
    "lab06_grpo": {
        "def train_on_budget(": (
            "def train_on_budget(policy, tokenizer, task, sample_budget, seed=0):\n"
            "    cfg = rl.dr_grpo_config(prompts_per_step=8, max_new_tokens=3, lr=1e-2, beta=0.0)\n"
            "    optimizer = rl.make_grpo_optimizer(policy, cfg)\n"
            "    generator, problems = torch.Generator().manual_seed(seed), random.Random(seed)\n"
            "    for _ in range(sample_budget // 64):\n"
            "        rl.grpo_step(policy, policy, optimizer, tokenizer, task, task.sample(8, problems), cfg, generator)\n"
            "    return policy\n"),
    },
}
LIBRARY_ANSWERED = {"lab03_lora": {"lora_init", "lora_forward", "lora_matches_reference", "lora_merge_unmerge",
                                   "nf4_invariants", "nf4_matches_bitsandbytes"},
                    "lab06_grpo": {"trainer_raises_first_digit", "trainer_raises_next_digit", "trainer_is_seeded"}}


def library_submission(lab: str):
    nb = read(ROOT / "labs" / f"{lab}.ipynb")
    replaced = set()
    for cell in nb.cells:
        for start, code in LIBRARY_SUBMISSIONS[lab].items():
            if cell.cell_type == "code" and start in cell.source:
                cell.source = code
                replaced.add(start)
    assert replaced == set(LIBRARY_SUBMISSIONS[lab]), "the lab's answer cells moved"
    return nb


def test_the_library_subclass_and_wrappers_do_the_lab03_tasks_where_the_library_is_whole():
    namespace = {}
    for code in LIBRARY_SUBMISSIONS["lab03_lora"].values():
        exec(code, namespace)
    import torch
    from torch import nn

    layer = namespace["LoRALinear"](nn.Linear(8, 4), r=2, alpha=4)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), layer.base(x) + 2.0 * x @ layer.lora_A.T @ layer.lora_B.T)
    w = torch.randn(2, 64)
    packed, absmax = namespace["quantize_nf4"](w)
    assert (namespace["dequantize_nf4"](packed, absmax, w.shape) - w).abs().max() <= 0.2 * absmax.max()


@pytest.mark.parametrize("lab", sorted(LIBRARY_SUBMISSIONS))
def test_a_submission_that_calls_the_library_answer_scores_nothing_for_it(lab, tmp_path):
    if grading.unavailable_reason():
        pytest.skip(f"no sandbox on this machine: {grading.unavailable_reason()}")
    path = tmp_path / f"{lab}.ipynb"
    path.write_text(labs.notebook_text(library_submission(lab)), encoding="utf-8")
    report, = grading.grade_many([path], reference_path=ROOT / "solutions" / f"{lab}.ipynb", salt=SALT,
                                 cell_timeout=CELL_TIMEOUT, timeout=TIMEOUT)
    checks = {c.id: c for c in report.checks}
    assert {i: checks[i].status for i in LIBRARY_ANSWERED[lab]} == dict.fromkeys(LIBRARY_ANSWERED[lab], grading.STATUS_FAILED)
    assert all("not available in this lab" in checks[i].message for i in LIBRARY_ANSWERED[lab]), (
        {i: checks[i].message for i in LIBRARY_ANSWERED[lab]})
