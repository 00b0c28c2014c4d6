"""The autograder on deliberately broken submissions of lab00, its merge rules, its judge, its command line.

tests/fixtures/submissions/ holds one lab00 submission per way a student can
break things (see its README). The folder is graded once per module, with the
hidden checks of tests/fixtures/extra_checks/, and each test reads its report.
With pytest-xdist, run this file with ``--dist loadscope`` so that happens once.
Submissions written to attack the grader are in test_grading_attacks.py.
"""

import copy
import csv
import hashlib
import json
import time
from pathlib import Path

import nbformat
import pytest

from llmsys.course import grading, labs
from llmsys.course.grading import encoder, judge, probes

needs_sandbox = pytest.mark.skipif(grading.unavailable_reason() is not None,
                                   reason=f"no sandbox on this machine: {grading.unavailable_reason()}")

ROOT = Path(__file__).resolve().parents[1]
SUBMISSIONS = ROOT / "tests" / "fixtures" / "submissions"
EXTRA_CHECKS = ROOT / "tests" / "fixtures" / "extra_checks"
LAB00 = ROOT / "solutions" / "lab00_warmup.ipynb"
CELL_TIMEOUT = 10  # the infinite loop costs this much
HIDDEN = "rmsnorm_float64"
CPU_CHECKS = {"rmsnorm_matches_reference", "rmsnorm_eps", "bytes_per_param", "training_memory_7b", HIDDEN}

# For each fixture: the checks that must pass, and words the report must contain.
EXPECTED = {
    "correct": (CPU_CHECKS, []),
    "syntax_error": ({"bytes_per_param", "training_memory_7b"}, ["SyntaxError", "name 'rms_norm' is not defined"]),
    # the kernel no longer evaluates math.isclose (the grader does): a right training_memory_gb passes without math
    "import_error": ({"bytes_per_param", "training_memory_7b"}, ["ModuleNotFoundError", "mathh"]),
    "infinite_loop": (CPU_CHECKS - {"training_memory_7b"}, [f"timed out after {CELL_TIMEOUT} s"]),
    # bytes_per_param is a hidden check now: never in a student's copy, so deleting it is no news
    "deleted_graded_cell": (CPU_CHECKS, ["was missing from the submission and was put back"]),
    "edited_assert": ({"rmsnorm_matches_reference", "rmsnorm_eps", HIDDEN}, ["'bytes_per_param' was modified", "got 14"]),
    "exit": (CPU_CHECKS, ["called exit()", "SystemExit: done with part 1"]),
    "os_exit": (CPU_CHECKS, ["the kernel died", "ran again"]),
    "megabytes": (CPU_CHECKS, ["ValueError: yyy", "more characters"]),
    "not_json": (set(), ["not valid JSON"]),
    "not_notebook": (set(), ["not a Jupyter notebook"]),
}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def graded():
    """Grade the fixtures folder once: {fixture name: report}, plus the files' digests before."""
    if grading.unavailable_reason():
        pytest.skip(f"no sandbox on this machine: {grading.unavailable_reason()}")
    before = {p.name: digest(p) for p in SUBMISSIONS.iterdir()}
    reports = grading.grade_many([SUBMISSIONS], jobs=2, extra_checks=EXTRA_CHECKS, cell_timeout=CELL_TIMEOUT,
                                 timeout=300, gpu=False)
    assert all(r.sha256 == before[Path(r.submission).name] for r in reports)
    print("\n" + grading.summary_table(reports))  # the grading time of each submission
    by_name = {Path(r.submission).name.replace("_lab00_warmup.ipynb", ""): r for r in reports}
    return before, by_name


def report_text(report) -> str:
    return "\n".join([*report.notes, *(c.message for c in report.checks)])


def test_every_fixture_is_graded(graded):
    _, reports = graded
    assert set(reports) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_gets_the_right_score_and_reason(graded, name):
    report = graded[1][name]
    passing, words = EXPECTED[name]
    assert report.lab == "lab00_warmup" and report.student == name
    assert {c.id for c in report.checks if c.status == grading.STATUS_PASSED} == passing, report.format()
    assert report.score == sum(c.points for c in report.checks if c.id in passing)
    assert report.max_score == sum(c.points for c in report.checks if not c.gpu)
    for check in report.checks:
        if check.gpu:
            assert check.status == grading.STATUS_SKIPPED and check.message == grading.NO_GPU
        elif check.id not in passing:
            assert check.score == 0 and check.message, f"{check.id} failed without a reason"
    for word in words:
        assert word in report_text(report), report.format()


def test_submissions_are_never_written(graded):
    before, _ = graded
    assert {p.name: digest(p) for p in SUBMISSIONS.iterdir()} == before


def test_huge_outputs_give_a_small_report(graded):
    report = graded[1]["megabytes"]
    assert len(json.dumps(report.to_dict())) < 20_000
    assert all(len(text) < 2 * grading.MESSAGE_LIMIT for text in [*report.notes, *(c.message for c in report.checks)])


def test_hidden_checks_are_appended_and_counted(graded):
    report = graded[1]["correct"]
    hidden = report.check(HIDDEN)
    assert hidden.hidden and hidden.status == grading.STATUS_PASSED
    assert report.max_score == sum(c.points for c in report.checks if c.status != grading.STATUS_SKIPPED)
    assert hidden.points > 0 and report.score == report.max_score
    assert HIDDEN not in (ROOT / "labs" / "lab00_warmup.ipynb").read_text(encoding="utf-8")


def test_grade_table_as_csv_and_json(graded, tmp_path):
    reports = list(graded[1].values())
    grading.write_csv(reports, tmp_path / "grades.csv")
    with open(tmp_path / "grades.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["student"] for r in rows] == [r.student for r in reports]
    for row, report in zip(rows, reports):
        assert int(row["total"]) == report.score and int(row["max"]) == report.max_score
        for check in report.checks:
            assert row[check.id] == ("skipped" if check.status == grading.STATUS_SKIPPED else str(check.score))
    data = json.loads(grading.grades_json(reports))
    assert [s["score"] for s in data["submissions"]] == [r.score for r in reports]
    assert data["submissions"][0]["checks"][0].keys() >= {"id", "points", "score", "status", "message", "hidden"}


def test_command_line_writes_csv_and_json(tmp_path, capsys):
    unreadable = [SUBMISSIONS / "not_json_lab00_warmup.ipynb", SUBMISSIONS / "not_notebook_lab00_warmup.ipynb"]
    argv = [*map(str, unreadable), "--csv", str(tmp_path / "g.csv"), "--json", str(tmp_path / "g.json")]
    assert grading.main(argv) == 1  # files that could not be graded: not a clean run
    out = capsys.readouterr().out
    assert "not valid JSON" in out and "student" in out  # the per-submission report and the summary table
    assert out.strip().splitlines()[-1].startswith("error: 2 file(s) could not be graded")
    with open(tmp_path / "g.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(r["student"], r["total"]) for r in rows] == [("not_json", "0"), ("not_notebook", "0")]
    assert [r["sha256"] for r in rows] == [digest(p) for p in unreadable]
    data = json.loads((tmp_path / "g.json").read_text(encoding="utf-8"))
    assert [s["ungraded"].startswith("not a notebook") for s in data["submissions"]] == [True, True]

    assert grading.main([str(unreadable[0]), "--json", "--allow-ungraded"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["submissions"][0]["student"] == "not_json"
    assert "not valid JSON" in captured.err


@pytest.mark.parametrize("options, says", [
    (["--timeout", "-5"], "--timeout must be a positive number of seconds, got -5"),
    (["--timeout", "nan"], "--timeout must be a positive number"),
    (["--cell-timeout", "0"], "--cell-timeout must be a positive number of seconds, got 0"),
    (["--cell-timeout", "inf"], "--cell-timeout must be a positive number"),
    (["--cell-timeout", "100", "--timeout", "50"], "--cell-timeout (100 s) is longer than --timeout (50 s)"),
    (["--jobs", "0"], "--jobs must be 1 or more, got 0"),
    (["--seed", "-1"], "--seed must be between 0"),
    (["--csv", "/no/such/folder/g.csv"], "cannot write /no/such/folder/g.csv"),
])
def test_command_line_refuses_bad_options_in_one_line(options, says, capsys):
    submission = str(SUBMISSIONS / "not_json_lab00_warmup.ipynb")
    assert grading.main([submission, *options]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("error: ") and says in out, out


def test_command_line_refuses_missing_files_and_bad_references(tmp_path, capsys):
    assert grading.main([str(tmp_path / "missing.ipynb")]) == 2
    assert grading.main([str(tmp_path)]) == 2  # a folder without notebooks
    submission = str(SUBMISSIONS / "not_json_lab00_warmup.ipynb")
    assert grading.main([submission, "--reference", str(tmp_path / "nope.ipynb")]) == 2
    assert grading.main([submission, "--cell-timeout", "soon"]) == 2
    captured = capsys.readouterr()
    assert "error: no such file" in captured.out and "cannot read reference lab" in captured.out
    assert "no .ipynb files" in captured.out and "invalid float value" in captured.err


def test_an_unknown_lab_is_ungraded_and_fails_the_run(tmp_path, capsys):
    nb = nbformat.read(str(SUBMISSIONS / "correct_lab00_warmup.ipynb"), as_version=4)
    del nb.metadata["llmsys"]
    nbformat.write(nb, str(tmp_path / "homework.ipynb"))
    report = grading.grade(tmp_path / "homework.ipynb")
    assert report.lab is None and report.score == report.max_score == 0
    assert "could not tell which lab" in report.ungraded and "could not tell which lab" in report_text(report)
    assert grading.main([str(tmp_path / "homework.ipynb")]) == 1
    assert "could not be graded" in capsys.readouterr().out
    nb.metadata["llmsys"] = {"lab": "lab00_warmup"}  # the generator's mark finds it whatever the file name
    assert grading.find_reference(tmp_path / "homework.ipynb", nb, LAB00.parent) == (LAB00, None)


def test_metadata_and_file_name_that_disagree_are_noted():
    nb = nbformat.read(str(SUBMISSIONS / "correct_lab00_warmup.ipynb"), as_version=4)
    reference, note = grading.find_reference(Path("alice_lab03_lora.ipynb"), nb, LAB00.parent)
    assert reference == LAB00
    assert "metadata says lab00_warmup but the file name says lab03_lora" in note


def test_labs_are_found_by_name_then_by_id(tmp_path):
    for name in ["lab00_warmup", "lab00b_kernels", "lab03_lora"]:
        (tmp_path / f"{name}.ipynb").write_text("{}", encoding="utf-8")
    find = lambda hint: grading.find_lab_file(tmp_path, hint).stem  # noqa: E731
    assert find("alice_lab00_warmup") == find("lab0") == find("LAB00_final") == "lab00_warmup"
    assert find("alice_lab00b_kernels") == find("lab00b") == "lab00b_kernels"
    assert find("lab3_alice") == "lab03_lora"
    assert grading.find_lab_file(tmp_path, "homework") is None
    (tmp_path / "lab03_lora_v2.ipynb").write_text("{}", encoding="utf-8")
    with pytest.raises(grading.GradingSetupError, match="several notebooks"):
        grading.find_lab_file(tmp_path, "lab03")


@pytest.mark.parametrize("path, student", [
    ("alice_lab00_warmup.ipynb", "alice"),
    ("lab00_warmup-alice.ipynb", "alice"),
    ("bob/lab00_warmup.ipynb", "bob"),
    ("submissions/carol_lab0.ipynb", "carol"),
])
def test_student_names_come_from_the_file_name(path, student):
    assert grading.student_name(Path(path), "lab00_warmup") == student


# ----------------------------------------------------------------- merging


def lab00():
    return nbformat.read(str(LAB00), as_version=4)


def student_copy():
    return nbformat.read(str(SUBMISSIONS / "correct_lab00_warmup.ipynb"), as_version=4)


def run_order(cells):
    """What runs, as (kind, name or source) pairs."""
    return [("check", c.check.id) if c.check else ("code", c.source) for c in cells]


def fresh_copy():
    """The student copy of lab00 as the generator writes it now (hidden checks are not in it)."""
    return labs.build_lab(lab00())


def test_graded_cells_come_from_the_lab():
    submission = fresh_copy()
    lab_checks = {c.id: c.source for c in lab00().cells if labs.is_graded(c)}  # hidden ones too: from the lab
    for cell in submission.cells:
        if labs.is_graded(cell):
            cell.source = "assert True"
    cells, notes = grading.merge(lab00(), submission)
    assert {c.check.id: c.source for c in cells if c.check} == lab_checks
    assert sum("was modified" in n for n in notes) == sum(labs.is_graded(c) for c in submission.cells)
    student_sources = [c.source for c in submission.cells if c.cell_type == "code" and not labs.is_graded(c)]
    assert [c.source for c in cells[1:] if not c.check] == student_sources


def test_solution_code_never_runs_for_the_student():
    stub = nbformat.read(str(ROOT / "labs" / "lab00_warmup.ipynb"), as_version=4)
    stub.cells = [c for c in stub.cells if c.id != "rmsnorm-solution"]  # even when the answer cell is deleted
    cells, notes = grading.merge(lab00(), stub)
    merged = "\n".join(c.source for c in cells)
    assert labs.BEGIN_MARKER not in merged and "rsqrt" not in merged
    assert any("answer cell starting 'def rms_norm" in n for n in notes)


def test_a_deleted_setup_cell_is_put_back_in_place():
    submission = student_copy()
    submission.cells = [c for c in submission.cells if c.id != "setup"]
    cells, notes = grading.merge(lab00(), submission)
    reference, _ = grading.merge(lab00(), student_copy())
    assert run_order(cells) == run_order(reference)
    assert any("was missing from the submission and was put back" in n for n in notes)


def test_reordered_checks_run_in_the_lab_order():
    submission = student_copy()
    code = [i for i, c in enumerate(submission.cells) if labs.is_graded(c)]
    first, last = code[0], code[-1]
    submission.cells[first], submission.cells[last] = submission.cells[last], submission.cells[first]
    cells, notes = grading.merge(lab00(), submission)
    reference, _ = grading.merge(lab00(), student_copy())
    assert [c.check.id for c in cells if c.check] == [c.check.id for c in reference if c.check]
    assert any("reordered" in n for n in notes)


def test_reordered_lab_cells_run_in_the_lab_order():
    submission = student_copy()
    at = {c.get("id"): i for i, c in enumerate(submission.cells)}
    solution, check = at["rmsnorm-solution"], at["rmsnorm-self-check"]  # the self-check moved above the answer
    submission.cells[solution], submission.cells[check] = submission.cells[check], submission.cells[solution]
    helper = nbformat.v4.new_code_cell("SCALE = 3  # the student's own, below the answer")
    submission.cells.insert(check + 1, helper)
    cells, notes = grading.merge(lab00(), submission)
    names = {helper.id: "helper", "3f9c1a7e": "scratch"}  # the fixture's own scratch cell was below the self-check
    order = [names.get(c.cell_id, c.cell_id) for c in cells[1:6]]
    # new cells follow the lab cell above them in the submission (now the answer), lab cells keep the lab's order
    assert order == ["setup", "rmsnorm-solution", "helper", "scratch", "rmsnorm-self-check"]
    assert any("reordered" in n for n in notes)


def test_a_notebook_without_ids_or_tags_is_merged_by_order():
    submission = fresh_copy()
    submission.nbformat_minor = 4
    for cell in submission.cells:
        del cell["id"]
        cell.metadata = {}
    cells, notes = grading.merge(lab00(), submission)
    reference, _ = grading.merge(lab00(), fresh_copy())
    assert run_order(cells) == run_order(reference)
    assert notes == []


def test_a_new_cell_runs_before_the_check_below_it():
    submission = student_copy()
    at = next(i for i, c in enumerate(submission.cells) if c.get("id") == "training_memory_7b")
    helper = nbformat.v4.new_code_cell("GB = 1e9  # a helper of the student's own")
    submission.cells.insert(at, helper)
    order = run_order(grading.merge(lab00(), submission)[0])
    assert order.index(("code", helper.source)) == order.index(("check", "training_memory_7b")) - 1


def test_gpu_checks_are_skipped_without_a_gpu():
    for gpu in (False, True):
        cells, _ = grading.merge(lab00(), student_copy(), gpu=gpu)
        skipped = {c.check.id for c in cells if c.skip_reason == grading.NO_GPU}
        assert skipped == ({c.id for c in labs.graded_checks(lab00()) if c.gpu} if not gpu else set())
    assert skipped == set() and any(c.gpu for c in labs.graded_checks(lab00()))


def test_extra_checks_may_not_reuse_lab_check_ids():
    extra = nbformat.read(str(EXTRA_CHECKS / "lab00_warmup.ipynb"), as_version=4)
    clash = copy.deepcopy(extra)
    for cell in clash.cells:
        if labs.is_graded(cell):
            cell.metadata.tags = ["grade", "id=bytes_per_param", "points=1"]
    with pytest.raises(grading.GradingSetupError, match="bytes_per_param"):
        grading.merge(lab00(), student_copy(), clash)
    cells, _ = grading.merge(lab00(), student_copy(), extra)
    assert cells[-1].hidden and cells[-1].check.id == HIDDEN


# -------------------------------------------- limits, on a tiny lab without torch


def tiny_lab(tmp_path: Path, student_cells: list[str]) -> tuple[Path, Path]:
    """A one-check lab (``answer = 42``) and a submission made of the given cells."""
    answer = nbformat.v4.new_code_cell("### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION")
    answer.id = "answer"
    check = nbformat.v4.new_code_cell("assert answer == 42, f'got {answer}'")
    check.id = "check"
    check.metadata["tags"] = ["grade", "id=answer_is_42", "points=3"]
    reference = tmp_path / "lab90_tiny.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[answer, check]), str(reference))
    cells = [nbformat.v4.new_code_cell(source) for source in student_cells] + [copy.deepcopy(check)]
    submission = tmp_path / "student_lab90_tiny.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(submission))
    return reference, submission


@needs_sandbox
def test_written_answers_are_pending_then_scored_from_the_table(tmp_path, capsys):
    reference, submission = tiny_lab(tmp_path, ["answer = 42"])
    question = nbformat.v4.new_markdown_cell("Why 42?\n\n### BEGIN SOLUTION\nIt answers everything.\n### END SOLUTION")
    question.id, question.metadata["tags"] = "why", ["written", "id=why_42", "points=2"]
    lab = nbformat.read(str(reference), as_version=4)
    lab.cells.append(question)
    nbformat.write(lab, str(reference))
    stub = labs.build_lab(lab).cells[-1]
    assert stub.source == "Why 42?\n\n" + labs.STUB_ANSWER and "answers everything" not in stub.source
    answered = nbformat.read(str(submission), as_version=4)
    answered.cells.append(copy.deepcopy(stub))
    answered.cells[-1].source = "Why 42?\n\nBecause 6 x 7 = 42."
    nbformat.write(answered, str(submission))
    answered.cells[-1].source = stub.source  # a classmate who left the prompt as it was
    nbformat.write(answered, str(tmp_path / "other_lab90_tiny.ipynb"))

    table = tmp_path / "grades.csv"
    argv = [str(submission), str(tmp_path / "other_lab90_tiny.ipynb"), "--reference", str(reference), "--csv", str(table)]
    assert grading.main(argv) == 0
    with open(table, newline="", encoding="utf-8") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert rows["student"]["why_42"] == "pending" and rows["student"]["why_42 answer"].endswith("Because 6 x 7 = 42.")
    assert (rows["student"]["total"], rows["student"]["max"]) == ("3", "5")
    assert rows["other"]["why_42"] == "0" and rows["other"]["why_42 answer"] == ""
    assert "why_42 (pending)" in capsys.readouterr().out

    rows["student"]["why_42"] = "2"  # the instructor's score, typed over "pending"
    with open(tmp_path / "scored.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows["student"]))
        writer.writeheader()
        writer.writerows(rows.values())
    reports = grading.grade_many([submission], reference_path=reference,
                                 manual_scores=grading.read_scores(tmp_path / "scored.csv"))
    assert reports[0].check("why_42").status == grading.STATUS_SCORED and reports[0].score == reports[0].max_score == 5

    rows["student"]["why_42"] = "two"
    with open(tmp_path / "scored.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows["student"]))
        writer.writeheader()
        writer.writerows(rows.values())
    capsys.readouterr()
    assert grading.main([*argv[:4], "--manual-scores", str(tmp_path / "scored.csv")]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "must be a whole number of points or 'pending', got 'two'" in out


IGNORES_INTERRUPTS = """
import time
while True:
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        pass
"""

PRINTS_FOREVER = """
import time
while True:
    try:
        print("still going", flush=True)
        time.sleep(0.05)
    except KeyboardInterrupt:
        pass
"""


@needs_sandbox
def test_a_cell_that_ignores_the_interrupt_is_shut_down_and_left_out(tmp_path):
    reference, submission = tiny_lab(tmp_path, [IGNORES_INTERRUPTS, "answer = 42"])
    report = grading.grade(submission, reference, cell_timeout=2, timeout=120)
    assert report.check("answer_is_42").status == grading.STATUS_PASSED, report.format()
    assert "ignored the interrupt" in report_text(report) and "ran again" in report_text(report)


@needs_sandbox
def test_a_submission_past_its_time_limit_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the grader's work folder, to find its processes
    reference, submission = tiny_lab(tmp_path, [PRINTS_FOREVER, "answer = 42"])
    report = grading.grade(submission, reference, cell_timeout=2, timeout=8)
    check = report.check("answer_is_42")
    assert check.status == grading.STATUS_NOT_RUN and check.score == 0
    assert "8 s limit" in check.message
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([reference.name, submission.name])
    if Path("/proc").is_dir():  # no kernel or pytest process of this grading survives it
        deadline = time.monotonic() + 10
        while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.2)  # SIGKILL is sent; the exit itself may take a moment
        assert processes_mentioning(str(tmp_path)) == []


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if text.encode() in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
    return found


# ------------------------------------------------ the judge, without a kernel


def run_instrumented(source: str, namespace: dict, salt: int = 7, student: bool = True,
                     trusted=frozenset({"torch", "math"})) -> judge.CellRecords:
    """Run an instrumented cell here, as a kernel would (a student's, or the solution's), and collect what it sends."""
    import IPython.display

    sent = []
    done = probes.instrument(source, "c", set(trusted))
    original = IPython.display.publish_display_data
    IPython.display.publish_display_data = lambda data: sent.append({"data": json.loads(json.dumps(data))})
    try:
        exec(encoder.kernel_setup(salt), namespace)  # the encoder takes its references now
    finally:
        IPython.display.publish_display_data = original
    try:
        exec(done.student if student else done.reference, namespace)
    except AssertionError:
        pass
    return judge.collect(sent, "c")


CHECK = """
import torch, math
gen = torch.Generator().manual_seed(1)
x = torch.randn(3, 4, generator=gen)
want = x + x
got = double(x)
assert isinstance(got, torch.Tensor) and got.shape == x.shape
torch.testing.assert_close(got, want)
assert count() == 16, "sixteen"
"""


def honest(namespace):
    namespace.update(double=lambda x: 2 * x, count=lambda: 16)
    return namespace


def verdict_on(namespace, check=CHECK):
    specs = probes.instrument(check, "c", {"torch", "math"}).specs
    reference = run_instrumented(check, honest({}), student=False)
    return judge.judge(specs, run_instrumented(check, namespace), reference)


def test_the_judge_passes_right_values_and_fails_wrong_ones():
    assert verdict_on(honest({})) is None
    assert "line 8" in verdict_on(honest({}) | {"double": lambda x: 3 * x})
    assert "line 9: sixteen" in verdict_on(honest({}) | {"count": lambda: 15}) and "15" in verdict_on(honest({}) | {"count": lambda: 15})


def test_the_students_kernel_never_computes_an_expected_value():
    done = probes.instrument(CHECK, "c", {"torch", "math"})
    assert "want" in done.reference and "want" not in done.student  # the statement that only feeds it is left out
    assert "16" not in done.student and "sixteen" not in done.student
    # x was handed to double(), which may change it in place: x.shape stays the student's; want comes from the solution
    assert [s.expected for s in done.specs] == [set(), {1}, set()]
    namespace = honest({})
    run_instrumented(CHECK, namespace)
    assert "want" not in namespace


def test_an_expected_side_the_student_computed_is_a_relation_judged_on_both_runs():
    check = "y = double(x)\nz = double(y)\nassert z.shape == y.shape\ntorch.testing.assert_close(z, y + y)"
    done = probes.instrument(check, "c", {"torch"})
    assert [s.expected for s in done.specs] == [set(), set()]  # y comes from the student's code
    # in place: adamw_step(theta, ...) changes theta; theta stays the student's wherever it stands
    check = "theta = torch.ones(3)\nstart = theta.clone()\nstep(theta)\ntorch.testing.assert_close(start - 1, theta)"
    assert probes.instrument(check, "c", {"torch"}).specs[0].expected == set()
    check = "theta = torch.ones(3)\nstart = theta.clone()\nstep(theta)\ntorch.testing.assert_close(theta, start - 1)"
    assert probes.instrument(check, "c", {"torch"}).specs[0].expected == {1}


def test_a_hijacked_probe_has_no_expected_value_to_copy():
    # the kernel's probe replaced by one that copies whatever it can find named like an expected value over the actual one
    hijack = {"double": lambda x: x}
    namespace = honest({}) | hijack
    records = run_instrumented(CHECK + "\nwant_seen = 'want' in globals()", namespace)
    assert namespace["want_seen"] is False
    assert "line 8" in judge.judge(probes.instrument(CHECK, "c", {"torch", "math"}).specs, records,
                                   run_instrumented(CHECK, honest({}), student=False))


def test_the_judge_ignores_patched_comparisons_and_always_equal_objects():
    import torch

    class AlwaysEqual(int):
        def __eq__(self, other):
            return True

    specs, reference = probes.instrument(CHECK, "c", {"torch", "math"}).specs, run_instrumented(CHECK, honest({}), student=False)
    original = torch.testing.assert_close
    try:  # patched in the kernel only: the grader is another process
        torch.testing.assert_close = lambda *a, **k: None
        records = run_instrumented(CHECK, honest({}) | {"double": lambda x: x})
    finally:
        torch.testing.assert_close = original
    assert "line 8: Tensor-likes are not close" in judge.judge(specs, records, reference)
    assert "line 9" in verdict_on(honest({}) | {"count": lambda: AlwaysEqual(3)})  # sent as an opaque object


def test_the_encoder_keeps_its_own_references_and_refuses_tensor_subclasses():
    import torch

    class Liar(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return torch.full((3, 4), 2.0) if func.__name__ in ("detach", "cpu", "numpy") else \
                super().__torch_function__(func, types, args, kwargs or {})

    assert "subclass of torch.Tensor" in verdict_on(honest({}) | {"double": lambda x: (2 * x).as_subclass(Liar)})
    detach, numpy_save = torch.Tensor.detach, __import__("numpy").save
    namespace = honest({}) | {"double": lambda x: x}
    records = None
    try:  # patched after the encoder was installed: it does not call them
        exec(encoder.kernel_setup(7), {})
        torch.Tensor.detach = lambda self: (2 * self.data)
        records = run_instrumented("import torch\ntorch.Tensor.detach = lambda self: 2 * self.data\n" + CHECK, namespace)
    finally:
        torch.Tensor.detach = detach
    assert records is not None and numpy_save is __import__("numpy").save


def test_a_cell_that_stops_early_or_runs_asserts_a_different_number_of_times_fails():
    specs = probes.instrument(CHECK, "c", {"torch", "math"}).specs
    reference = run_instrumented(CHECK, honest({}), student=False)
    silent = judge.CellRecords(began=True)
    assert judge.judge(specs, silent, reference) == "the check stopped before its end"
    assert judge.judge(specs, judge.CellRecords(), reference) == "the check did not run"
    doubled = run_instrumented(CHECK, honest({}))
    doubled.asserts[0] *= 2
    assert "ran more times than in the solution's run" in judge.judge(specs, doubled, reference)
    doubled.asserts[0] = []
    assert "ran 0 time(s), 1 in the solution's run" in judge.judge(specs, doubled, reference)
    assert judge.judge(specs, judge.CellRecords(began=True, refused="over the cap"), reference) == "over the cap"


def test_an_operand_that_raises_fails_only_the_assert_that_needs_it():
    check = "got = f()\nassert got is None or got.shape == (2,)\nassert g() == 1"
    specs = probes.instrument(check, "c", {"torch"}).specs
    good = {"f": lambda: None, "g": lambda: 1}
    reference = run_instrumented(check, dict(good), student=False)
    assert judge.judge(specs, run_instrumented(check, dict(good)), reference) is None  # got.shape raised, unneeded
    failing = run_instrumented(check, {"f": lambda: None, "g": lambda: 1 / 0})
    assert "ZeroDivisionError" in judge.judge(specs, failing, reference)


def test_seeds_in_graded_cells_are_drawn_per_grading_and_the_salt_repeats_them():
    source = "import torch\nx = torch.Generator().manual_seed(1)\nv = torch.randn(2, generator=x)\nassert v is not None"
    for namespace, salt in [(ns1 := {}, 1), (ns2 := {}, 2), (ns3 := {}, 1)]:
        assert run_instrumented(source, namespace, salt=salt).ended
    assert not bool((ns1["v"] == ns2["v"]).all()) and bool((ns1["v"] == ns3["v"]).all())


def test_values_travel_as_data_only():
    with pytest.raises(ValueError):
        judge.decode({"pickle": "gASV"})
    assert isinstance(judge.decode({"opaque": "Allocator"}), judge.Opaque)
    import base64

    raw = base64.b64encode(b"\0" * 16).decode()
    for descr, shape in [("|O", [2]), ("<f8", [3]), ("<f8", [-2])]:  # objects would unpickle; bytes must fit the shape
        with pytest.raises(ValueError):
            judge.decode({"array": raw, "descr": descr, "shape": shape})
    assert judge.decode({"array": raw, "descr": "<f8", "shape": [2]}).tolist() == [0.0, 0.0]


MEASURED = """
throughput = throughput_of_run()
assert throughput >= 0.5 * solution_run(throughput), "too slow"
peak = peak_bytes()
assert peak <= solution_run(peak) + 100
"""


def measured_verdict(mine: dict, theirs: dict | None):
    specs = probes.instrument(MEASURED, "c").specs
    def run(values, student):
        return run_instrumented(MEASURED, {"solution_run": grading.solution_run, "throughput_of_run": lambda: values["tps"],
                                           "peak_bytes": lambda: values["peak"]} | values.get("extra", {}), student=student)
    return judge.judge(specs, run(mine, theirs is not None), run(theirs, False) if theirs is not None else None)


def test_a_measured_outcome_is_graded_as_a_ratio_of_the_solutions_run():
    solution = {"tps": 100.0, "peak": 1000}
    assert measured_verdict({"tps": 60.0, "peak": 1000}, solution) is None
    assert measured_verdict({"tps": 200.0, "peak": 1100}, solution) is None  # the + 100 on the right side counts
    slow = measured_verdict({"tps": 40.0, "peak": 1000}, solution)
    assert "line 3: too slow" in slow and "(40.0; the solution's run gives 100.0)" in slow
    assert "line 5" in measured_verdict({"tps": 100.0, "peak": 1101}, solution)
    assert measured_verdict(solution, None) is None  # the solution's own run is compared with itself


def test_a_kernel_cannot_choose_the_reference_value():
    forged = {"tps": 40.0, "peak": 1000, "extra": {"solution_run": lambda value: 0}}
    assert "line 3" in measured_verdict(forged, {"tps": 100.0, "peak": 1000})


@pytest.mark.parametrize("test", ["assert solution_run(x)", "assert x >= max(1, solution_run(x))",
                                  "assert x >= f(solution_run(x)) * 2"])
def test_solution_run_outside_arithmetic_on_a_side_is_refused(test):
    with pytest.raises(ValueError, match="solution_run"):
        probes.instrument(test, "c")


# ------------------------------------------- library answers: not in the student's copy


@pytest.mark.parametrize("solution", sorted((ROOT / "solutions").glob("lab*.ipynb")), ids=lambda p: p.stem)
def test_the_students_library_has_no_declared_answer_and_everything_else(solution, tmp_path):
    import subprocess
    import sys

    from llmsys.course.grading import answers

    names = answers.declared_answers(nbformat.read(str(solution), as_version=4))
    if not names:
        pytest.skip(f"{solution.stem} declares no library answers")
    answers.library_without_answers(names, tmp_path)
    probe = f"""
import importlib, inspect, pkgutil
import llmsys
assert llmsys.__file__.startswith({str(tmp_path)!r}), llmsys.__file__
for module in pkgutil.walk_packages(llmsys.__path__, "llmsys."):  # the rest of the library still imports
    if ".course" not in module.name and "kernels" not in module.name:
        importlib.import_module(module.name)
for name in {names!r}:
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    for attribute in parts[cut:]:
        target = getattr(target, attribute)
    function = target.__init__ if isinstance(target, type) else target
    required = [p for p in inspect.signature(function).parameters.values() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]
    try:
        target(*[None] * len(required))
    except NotImplementedError as err:
        assert "not available in this lab: write it yourself (llmsys." in str(err), err  # an alias names the other
    else:
        raise AssertionError(name + " still runs")
"""
    result = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin",
                            "LLMSYS_CACHE": str(tmp_path / "cache")}, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_answers_the_labs_own_code_calls_stay_and_are_detected():
    from llmsys.course.grading import answers

    lab_code = ["from llmsys import zero as library\nlibrary.FullyShardedDataParallel(model)",
                "from llmsys.core.tokenizer import BPETokenizer\nBPETokenizer.train(text, 300)"]
    names = ["llmsys.zero.FullyShardedDataParallel", "llmsys.core.tokenizer.BPETokenizer.train", "llmsys.core.model.RMSNorm"]
    assert answers.needed_by_lab(names, lab_code, []) == set(names[:2])
    assert answers.needed_by_lab(names, ["BPETokenizer.train(text, 300)"], ["from llmsys.core.tokenizer import BPETokenizer"]) == {names[1]}
    assert answers.needed_by_lab(names, ["RMSNorm(8)"], []) == set()  # the student's own class of that name
