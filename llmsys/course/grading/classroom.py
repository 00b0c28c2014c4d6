"""Grading a class: read and hash every submission, run each in its sandbox, judge, then report.

1. Every submission is read once and hashed before the first kernel starts.
2. Its lab is found (``--reference``, else the generator's mark in the
   metadata, else ``labNN`` in the file name); a submission that cannot be read
   or whose lab cannot be told is reported as ungraded.
3. Each lab's solution runs once per grading, in a sandbox, on inputs drawn
   for this grading (the seeds of the graded cells change every time).
4. Each submission runs in a sandbox of its own, ``jobs`` at a time; a cell
   that takes the kernel down is left out and the notebook runs again.
5. Only when every sandbox is gone are the checks judged (``judge.judge``,
   in this process, on plain data) and the reports handed out.
"""

from __future__ import annotations

import concurrent.futures
import functools
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import labs
from . import judge, kernel, probes, sandbox
from .answers import library_answer_notes
from .written import read_written_answers
from .merge import GRADER_SETUP, NO_GPU, MergedCell, merge
from .report import STATUS_FAILED, STATUS_PASSED, STATUS_SKIPPED, CheckResult, GradeReport, shorten
from .submission import (GradingSetupError, NotANotebook, find_lab_file, find_reference, read_instructor_notebook,
                         read_submission, repo_solutions_dir, snapshot, student_name)

DEFAULT_CELL_TIMEOUT = 120.0  # seconds a single cell may run
DEFAULT_TIMEOUT = 900.0  # seconds a whole submission may take, reruns included
MAX_RERUNS = 2  # reruns after a cell took the kernel down
MAX_CELL_NOTES = 5  # failing student cells listed per submission
KERNEL_DIED = "the kernel died while running this cell (os._exit(), a crash, or out of memory)"
BLOCKED = {  # errors the sandbox causes, and what the cell tried
    "Read-only file system": "to write outside its own folder", "Network is unreachable": "to reach the network",
    "name resolution": "to reach the network", "Connection refused": "to reach another machine or process",
    "File too large": "to write a file over the size limit", "No space left on device": "to fill the disk",
    "MemoryError": "to use more memory than the limit", "Permission denied": "to touch what it may not",
}


@functools.lru_cache(maxsize=1)
def has_gpu() -> bool:
    from llmsys.device import has_cuda

    return has_cuda()


@dataclass
class Lab:
    """A lab as graded: its solution, hidden checks, and the instrumented check cells."""

    path: Path
    solution: object
    extra: object | None
    checks: list[CheckResult]
    specs: dict[str, list] = field(default_factory=dict)  # check id -> what judge() needs
    reference_run: dict | None = None  # check id -> CellRecords from the solution's run


@dataclass
class Job:
    report: GradeReport
    lab: Lab | None = None
    submission: object | None = None
    cells: list[MergedCell] = field(default_factory=list)
    outcomes: dict = field(default_factory=dict)
    run: kernel.RunResult | None = None
    left_out: set = field(default_factory=set)


def expand_submissions(paths) -> list[Path]:
    """Files as given; folders become the notebooks inside them (checkpoints skipped)."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.exists():
            found.append(path)
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
    return found


def grade(submission_path, reference_path=None, **options) -> GradeReport:
    """Grade one submitted notebook against its lab; never raises for a bad submission."""
    return grade_many([submission_path], reference_path=reference_path, **options)[0]


def grade_many(paths, *, jobs: int = 1, reference_path=None, solutions_dir=None, extra_checks=None,
               cell_timeout: float = DEFAULT_CELL_TIMEOUT, timeout: float = DEFAULT_TIMEOUT,
               gpu: bool | None = None, unsafe: bool = False, salt: int | None = None,
               manual_scores: dict | None = None) -> list[GradeReport]:
    """Grade every submission (folders expanded), ``jobs`` sandboxes at a time; reports in input order.

    ``reference_path``: the solution notebook (default: found in ``solutions_dir``).
    ``extra_checks``: a folder of ``labNN_*.ipynb`` whose cells are appended as
    hidden checks. ``gpu``: whether ``gpu`` checks run (default: whether CUDA
    is available). ``unsafe``: run kernels without a sandbox (only where none
    can be made). ``salt``: the seed of this grading's inputs (default: drawn).
    ``manual_scores``: {(student, check id): points} for written answers (``written.read_scores``).
    Raises GradingSetupError for a problem with the instructor's input, and
    sandbox.SandboxUnavailable when no sandbox can be made and ``unsafe`` is off.
    """
    if not unsafe and sandbox.unavailable_reason():
        raise sandbox.SandboxUnavailable(f"{sandbox.unavailable_reason()}; grading runs student code, so it needs "
                                         "the sandbox (pass --unsafe to grade without one, only for trusted code)")
    salt = secrets.randbelow(2**31) if salt is None else salt
    start = time.monotonic()
    loaded: dict = {}  # one Lab per reference notebook in this grading
    jobs_list = [_prepare(path, reference_path, solutions_dir, extra_checks, loaded) for path in expand_submissions(paths)]
    labs_used = {id(j.lab): j.lab for j in jobs_list if j.lab is not None}.values()
    if gpu is None:
        gpu = any(c.gpu for lab in labs_used for c in lab.checks) and has_gpu()
    for job in jobs_list:
        for check in job.report.checks:
            if check.gpu and not gpu:
                check.status, check.message = STATUS_SKIPPED, NO_GPU
        if job.lab is not None and job.submission is not None:
            job.cells, notes = merge(job.lab.solution, job.submission, job.lab.extra, gpu)
            job.report.notes += notes + library_answer_notes(job.lab.solution, job.submission, job.report)
            read_written_answers(job.lab.solution, job.submission, job.report, manual_scores or {})
    run = functools.partial(_run, cell_timeout=cell_timeout, timeout=timeout, isolated=not unsafe)
    # The solution is the instructor's: it gets the default limits even when students get tighter ones.
    # A notebook the same as another (the solution graded as a submission, a copied one) runs once.
    run_solution = functools.partial(_run, cell_timeout=max(cell_timeout, DEFAULT_CELL_TIMEOUT),
                                     timeout=max(timeout, DEFAULT_TIMEOUT), isolated=not unsafe)
    runs: dict = {}  # what the kernel runs -> its run

    def submit(cells, runner):
        # Sources are instrumented here, in one thread: CPython 3.11's ast.parse is not thread-safe
        # ("AST constructor recursion depth mismatch" when two threads parse at once).
        key = tuple(_sources(cells, salt))
        if key not in runs:
            runs[key] = pool.submit(runner, cells, list(key))
        return runs[key]

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        to_run = {id(j.lab): j.lab for j in jobs_list if j.cells}.values()
        references = [(lab, cells, submit(cells, run_solution)) for lab in to_run
                      for cells in [_reference_cells(lab, gpu, salt)]]
        pending = [(job, submit(job.cells, run)) for job in jobs_list if job.cells]
        for job, future in pending:
            job.run, job.outcomes, job.left_out = future.result()
        for lab, cells, future in references:
            _check_reference(lab, cells, future.result())
    # Every sandbox is gone: judge and report.
    for job in jobs_list:
        if job.cells:
            _score(job, cell_timeout, timeout)
        job.report.seconds = (job.run.seconds if job.run else 0.0) or (time.monotonic() - start) / max(len(jobs_list), 1)
    return [j.report for j in jobs_list]


def _prepare(path: Path, reference_path, solutions_dir, extra_checks, loaded: dict) -> Job:
    raw, digest, unreadable = snapshot(path)
    report = GradeReport(submission=str(path), student=student_name(path), sha256=digest)
    submission = None
    if raw is not None:
        try:
            submission = read_submission(raw)
        except NotANotebook as err:
            unreadable = str(err)
    if reference_path is None:
        solutions = Path(solutions_dir or repo_solutions_dir())
        if not solutions.is_dir():
            raise GradingSetupError(f"no solutions folder at {solutions}; pass --solutions DIR or --reference FILE")
        try:
            reference, note = find_reference(path, submission, solutions)
        except LookupError as err:
            report.notes += [unreadable] if unreadable else []
            report.ungraded = str(err)
            report.notes.append(str(err))
            return Job(report)
        report.notes += [note] if note else []
    else:
        reference = Path(reference_path)
    key = reference.resolve()
    if key not in loaded:
        loaded[key] = _load_lab(key, Path(extra_checks).resolve() if extra_checks else None)
    lab = loaded[key]
    report.lab, report.student = lab.path.stem, student_name(path, lab.path.stem)
    report.checks = [CheckResult(**vars(c)) for c in lab.checks]
    if unreadable:
        report.ungraded = unreadable
        report.notes.append(unreadable)
        for check in report.checks:
            check.message = "not graded: the submission could not be read (see notes)"
        return Job(report, lab)
    return Job(report, lab, submission)


def _load_lab(reference: Path, extra_dir: Path | None) -> Lab:
    solution = read_instructor_notebook(reference, "reference lab")
    extra = None
    if extra_dir is not None:
        extra_file = find_lab_file(extra_dir, reference.stem)
        extra = read_instructor_notebook(extra_file, "extra checks") if extra_file else None
    try:  # the instructor's notebooks must be valid labs before any student is graded with them
        labs.build_lab(solution, reference.stem)
        lab_checks = labs.graded_checks(solution, str(reference))
        hidden_checks = labs.graded_checks(extra, "extra checks") if extra is not None else []
    except ValueError as err:
        raise GradingSetupError(str(err)) from None
    checks = [CheckResult(c.id, c.points, gpu=c.gpu, written=c.written) for c in lab_checks]
    checks += [CheckResult(c.id, c.points, hidden=True, gpu=c.gpu) for c in hidden_checks]
    return Lab(reference, solution, extra, checks)


def _sources(cells: list[MergedCell], salt: int, specs: dict | None = None) -> list[str]:
    """What the kernel runs: the setup cells, then the cells with each graded check instrumented."""
    sources = [GRADER_SETUP, probes.kernel_setup(salt)]
    for cell in cells[1:]:
        if cell.check is None:
            sources.append(cell.source)
            continue
        try:
            source, check_specs = probes.instrument(cell.source, cell.check.id)
        except SyntaxError as err:
            raise GradingSetupError(f"graded check {cell.check.id!r} is not valid Python: {err}") from None
        except ValueError as err:
            raise GradingSetupError(f"graded check {cell.check.id!r}: {err}") from None
        if specs is not None:
            specs[cell.check.id] = check_specs
        sources.append(source)
    return sources


def _run(cells: list[MergedCell], sources: list[str], *, cell_timeout, timeout, isolated):
    """Run merged cells (instrumented as ``sources``) in a sandbox; rerun without a cell that took the kernel down."""
    start = time.monotonic()
    deadline = start + timeout
    offset = len(sources) - len(cells)  # the probe setup cell shifts indices by one
    skip = {i + offset for i, c in enumerate(cells) if c.skip_reason}
    left_out: dict[int, kernel.CellOutcome] = {}
    import llmsys.kernels  # its modules live in the checkout's top-level kernels/ (or the installed copy)

    readonly = [*sandbox.python_paths(), str(Path(labs.__file__).resolve().parents[1]), *llmsys.kernels.__path__,
                str(_cache_dir())]
    env = sandbox.kernel_env({"PYTHONPATH": str(Path(labs.__file__).resolve().parents[2]),
                              "LLMSYS_CACHE": str(_cache_dir())})
    for attempt in range(MAX_RERUNS + 1):
        result = kernel.run_cells(sources, skip | {i + offset for i in left_out}, kernel.new_workdir(),
                                  cell_timeout=cell_timeout, deadline=deadline, isolated=isolated,
                                  readonly=readonly, env=env, setup_cells=offset + 1)
        outcomes = {i - offset: o for i, o in result.outcomes.items() if i >= offset}
        lost = next((i for i, o in sorted(outcomes.items()) if o.kernel_lost and i not in left_out), None)
        checks_after = lost is not None and any(c.check and not c.skip_reason for c in cells[lost + 1:])
        if result.killed or not checks_after or attempt == MAX_RERUNS or deadline - time.monotonic() < 1:
            break
        left_out[lost] = outcomes[lost]
    result.outcomes = {**outcomes, **left_out}
    result.running = None if result.running is None else result.running - offset
    result.seconds = time.monotonic() - start
    return result, result.outcomes, set(left_out)


def _cache_dir() -> Path:
    from llmsys.cache import cache_dir

    return cache_dir().resolve()


def _reference_cells(lab: Lab, gpu: bool, salt: int) -> list[MergedCell]:
    """The solution as a submission; its run on this grading's inputs is the expected side of every check."""
    cells, _ = merge(lab.solution, lab.solution, lab.extra, gpu)
    _sources(cells, salt, lab.specs)
    return cells


def _check_reference(lab: Lab, cells: list[MergedCell], run) -> None:
    """Keep the solution's records; a check the solution fails is the instructor's problem."""
    result, outcomes, _ = run
    lab.reference_run = {}
    for index, cell in enumerate(cells):
        if cell.check is None or cell.skip_reason:
            continue
        outcome = outcomes.get(index)
        records = judge.collect(outcome.outputs, cell.check.id) if outcome else judge.CellRecords()
        failure = (outcome.message if outcome and outcome.status != "ok" else None) or \
            judge.judge(lab.specs[cell.check.id], records, None)
        if failure or outcome is None:
            raise GradingSetupError(f"{lab.path.name}: the solution fails check {cell.check.id!r} on this grading's "
                                    f"inputs: {failure or result.error or 'not run'}")
        lab.reference_run[cell.check.id] = records


def _score(job: Job, cell_timeout: float, timeout: float) -> None:
    report, cells, outcomes, run = job.report, job.cells, job.outcomes, job.run
    if run.error:
        report.notes.append(f"grader error: {run.error}")
    results = {c.id: c for c in report.checks}
    lost_in = next((cells[i].label for i, o in sorted(outcomes.items()) if o.kernel_lost and i not in job.left_out),
                   "an earlier cell")
    failing_cells = []
    for index, cell in enumerate(cells):
        outcome = outcomes.get(index)
        message = _describe(outcome, cell_timeout, lost_in) if outcome else ""
        if outcome and outcome.exit_called:
            report.notes.append(f"{cell.label} called exit(); the grader ignored it, but in Jupyter it stops the "
                                "kernel and every variable is lost")
        if index in job.left_out:
            report.notes.append(f"{cell.label}: {message}; it was left out and the notebook ran again from the "
                                "start so that the checks after it could run")
        elif cell.check is None and outcome and outcome.status != "ok":
            failing_cells.append(f"{cell.label}: {shorten(message, 200)}")
            tried = next((what for error, what in BLOCKED.items() if error in message), None)
            if tried:
                report.notes.append(f"{cell.label} tried {tried}, which the sandbox blocks")
        if cell.check is None:
            continue
        result = results[cell.check.id]
        if cell.skip_reason:
            result.status, result.message = STATUS_SKIPPED, cell.skip_reason
        elif outcome is None:
            result.message = _not_run_reason(run, cells, timeout)
        elif outcome.status != "ok" or outcome.kernel_lost:
            result.status, result.message = STATUS_FAILED, message or "the cell failed"
        elif result.status != STATUS_FAILED:  # a library answer may have failed it already
            verdict = judge.judge(job.lab.specs[cell.check.id], judge.collect(outcome.outputs, cell.check.id),
                                   job.lab.reference_run.get(cell.check.id))
            if verdict is None:
                result.status, result.score = STATUS_PASSED, result.points
            else:
                result.status = STATUS_FAILED
                result.message = shorten(f"the kernel reported no error, but the grader's own evaluation failed: {verdict}")
    for line in failing_cells[:MAX_CELL_NOTES]:
        report.notes.append(line)
    if len(failing_cells) > MAX_CELL_NOTES:
        report.notes.append(f"... and {len(failing_cells) - MAX_CELL_NOTES} more of your cells failed")


def _describe(outcome: kernel.CellOutcome, cell_timeout: float, lost_in: str) -> str:
    if outcome.timed_out and outcome.kernel_lost:
        return f"timed out after {cell_timeout:g} s and ignored the interrupt; the kernel was shut down"
    if outcome.timed_out:
        return f"timed out after {cell_timeout:g} s (the per-cell limit) and was interrupted"
    if outcome.kernel_lost:
        return KERNEL_DIED
    return outcome.message


def _not_run_reason(run: kernel.RunResult, cells, timeout: float) -> str:
    if run.killed:
        during = f" while running {cells[run.running].label}" if run.running is not None and run.running < len(cells) else ""
        return f"not run: grading stopped at the {timeout:g} s limit for a submission{during}"
    if run.error:
        return "not run: grader error (see notes)"
    return "not run: the kernel had died in an earlier cell"
