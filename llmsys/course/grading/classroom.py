"""Grading a class: read and hash every submission, run each in its sandbox, judge, then report.

1. Every submission is read once and hashed before the first kernel starts.
2. Its lab is found (``--reference``, else the generator's mark in the
   metadata, else ``labNN`` in the file name); a submission that cannot be read
   or whose lab cannot be told is reported as ungraded.
3. Each lab's solution runs once per grading, in a sandbox, on inputs drawn
   for this grading (the seeds of the graded cells change every time).
4. Each submission runs in a sandbox of its own, ``jobs`` at a time; a cell
   that takes the kernel down is left out and the notebook runs again.
5. The choices a tuning task's check sent are measured by the grader in
   clean processes of its own (``measurements.py``), the solution's too.
6. Each submission is judged as its sandbox finishes (``scoring.score``:
   ``judge.judge`` in this process, on plain data), and its records dropped;
   the reports are handed out when every sandbox is gone.
"""

from __future__ import annotations

import concurrent.futures
import functools
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import labs
from . import encoder, judge, kernel, measurements, probes, sandbox, sides
from .answers import declared_answers, library_answer_notes, library_without_answers, needed_by_lab
from .written import read_written_answers
from .merge import GRADER_SETUP, NO_GPU, MergedCell, merge, normalized
from .report import STATUS_SKIPPED, CheckResult, GradeReport
from .scoring import score
from .submission import (GradingSetupError, NotANotebook, find_lab_file, find_reference, read_instructor_notebook,
                         read_submission, repo_solutions_dir, snapshot, student_name)

DEFAULT_CELL_TIMEOUT = 120.0  # seconds a single cell may run
DEFAULT_TIMEOUT = 900.0  # seconds a whole submission may take, reruns included
MAX_RERUNS = 2  # reruns after a cell took the kernel down
@functools.lru_cache(maxsize=1)
def has_gpu() -> bool:
    from llmsys.core.device import has_cuda

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
    library: Path | None = None  # for students' kernels: llmsys without the lab's declared answers
    kept_answers: set = field(default_factory=set)  # declared answers the lab's own cells call: kept, detected
    trusted: set = field(default_factory=set)  # names the lab's setup binds to modules, constants, pure helpers
    later: dict = field(default_factory=dict)  # check id -> names the lab's later cells read without assigning
    imports: dict = field(default_factory=dict)  # name -> the dotted module or object the lab's setup imports as it
    measures: dict = field(default_factory=dict)  # check id -> the tuning task of each measurement site


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
        job.report.salt = salt
        for check in job.report.checks:
            if check.gpu and not gpu:
                check.status, check.message = STATUS_SKIPPED, NO_GPU
        if job.lab is not None and job.submission is not None:
            job.cells, notes = merge(job.lab.solution, job.submission, job.lab.extra, gpu)
            job.report.notes += notes
            read_written_answers(job.lab.solution, job.submission, job.report, manual_scores or {})
    libraries = Path(tempfile.mkdtemp(prefix="llmsys-library-"))
    try:
        return _grade_jobs(jobs_list, jobs, salt, gpu, libraries, start, cell_timeout=cell_timeout, timeout=timeout,
                           isolated=not unsafe)
    finally:
        shutil.rmtree(libraries, ignore_errors=True)


def _grade_jobs(jobs_list: list[Job], jobs: int, salt: int, gpu: bool, libraries: Path, start: float, *,
                cell_timeout: float, timeout: float, isolated: bool) -> list[GradeReport]:
    """Run the solutions and the submissions in sandboxes, judge each as it finishes; the reports."""
    libraries.chmod(0o755)  # read by the sandboxes' own users
    to_run = {id(j.lab): j.lab for j in jobs_list if j.cells}.values()
    reference_cells = {id(lab): _reference_cells(lab, gpu, salt) for lab in to_run}
    for n, lab in enumerate(to_run):
        names = declared_answers(lab.solution)
        answer_sources = {normalized(labs.source_text(c)) for c in lab.solution.cells if labs.has_solution_region(c)}
        cells = reference_cells[id(lab)]
        lab_code = [source for cell, source in zip(cells, _sources(cells, salt, lab, student=True)[1:])
                    if normalized(cell.source) not in answer_sources]
        lab.kept_answers = needed_by_lab(names, lab_code, [labs.source_text(c) for c in lab.solution.cells
                                                           if labs.has_solution_region(c)])
        taken = sorted(set(names) - lab.kept_answers)
        lab.library = library_without_answers(taken, libraries / str(n)) if taken else None
    for job in (j for j in jobs_list if j.cells and j.lab.kept_answers):
        job.report.notes += [f"the lab's own cells call {', '.join(sorted(job.lab.kept_answers))}, so the library "
                             "keeps it in this lab; code of yours that uses it gets zero for its check"]
        job.report.notes += library_answer_notes(job.lab.solution, job.submission, job.report, job.lab.kept_answers)
    measurer = measurements.Measurer()  # one measurement per distinct choice in this grading
    run = functools.partial(_run, cell_timeout=cell_timeout, timeout=timeout, isolated=isolated, measurer=measurer)
    # The solution is the instructor's: it gets the default limits even when students get tighter ones.
    # A notebook the same as another (the solution graded as a submission, a copied one) runs once.
    run_solution = functools.partial(_run, cell_timeout=max(cell_timeout, DEFAULT_CELL_TIMEOUT),
                                     timeout=max(timeout, DEFAULT_TIMEOUT), isolated=isolated, measurer=measurer)
    runs: dict = {}  # what the kernel runs -> its run

    def submit(cells, runner, sources, lab, library=None):
        # Sources are instrumented here, in one thread: CPython 3.11's ast.parse is not thread-safe
        # ("AST constructor recursion depth mismatch" when two threads parse at once).
        key = tuple(sources)
        if key not in runs:
            runs[key] = pool.submit(runner, cells, sources, library=library, lab=lab)
        return runs[key]

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        references = {}  # id(lab) -> (merged cells as the solution, its future)
        for lab in to_run:
            cells = reference_cells[id(lab)]
            references[id(lab)] = (cells, submit(cells, run_solution, _sources(cells, salt, lab, lab.specs), lab))
        by_future: dict = {}
        for job in (j for j in jobs_list if j.cells):
            reference_cells, reference_future = references[id(job.lab)]
            # the solution itself, where no library answer is taken away from it: its run is the reference's
            same = [c.source for c in job.cells] == [c.source for c in reference_cells] and job.lab.library is None
            future = reference_future if same else submit(job.cells, run, _sources(job.cells, salt, job.lab, student=True),
                                                          job.lab, job.lab.library)
            by_future.setdefault(future, []).append(job)
        try:
            for lab in to_run:
                cells, future = references[id(lab)]
                _check_reference(lab, cells, future.result())
            # Judged as each sandbox finishes, then its records dropped: memory does not grow with the class.
            for future in concurrent.futures.as_completed(by_future):
                for job in by_future[future]:
                    job.run, job.outcomes, job.left_out = future.result()
                    score(job, cell_timeout, timeout)
                for outcome in future.result()[1].values():
                    outcome.outputs = []
        except BaseException:
            for future in runs.values():
                future.cancel()
            raise
    # Every sandbox is gone: the reports are handed out.
    for job in jobs_list:
        job.report.seconds = (job.run.seconds if job.run else 0.0) or (time.monotonic() - start) / max(len(jobs_list), 1)
    return [j.report for j in jobs_list]
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
    checks = [CheckResult(c.id, c.points, hidden=c.hidden, gpu=c.gpu, written=c.written) for c in lab_checks]
    checks += [CheckResult(c.id, c.points, hidden=True, gpu=c.gpu) for c in hidden_checks]
    return Lab(reference, solution, extra, checks)


def _sources(cells: list[MergedCell], salt: int, lab: Lab, specs: dict | None = None, student: bool = False) -> list[str]:
    """What the kernel runs: the setup cells, then the cells with each graded check instrumented.

    ``student``: the graded checks as a student's kernel runs them (no expected value computed there).
    """
    sources = [GRADER_SETUP, encoder.kernel_setup(salt)]
    for cell in cells[1:]:
        if cell.check is None:
            sources.append(cell.source)
            continue
        try:
            done = probes.instrument(cell.source, cell.check.id, lab.trusted, lab.later.get(cell.check.id, set()))
        except SyntaxError as err:
            raise GradingSetupError(f"graded check {cell.check.id!r} is not valid Python: {err}") from None
        except ValueError as err:
            raise GradingSetupError(f"graded check {cell.check.id!r}: {err}") from None
        if specs is not None:
            specs[cell.check.id] = done.specs
            try:
                lab.measures[cell.check.id] = [measurements.task_path(task, lab.imports) for task in done.measures]
            except (ImportError, AttributeError, ValueError) as err:
                raise GradingSetupError(f"graded check {cell.check.id!r} measures with a task the grader cannot "
                                        f"run: {err}") from None
        sources.append(done.student if student else done.reference)
    return sources


def _run(cells: list[MergedCell], sources: list[str], *, cell_timeout, timeout, isolated, library: Path | None = None,
         lab: Lab, measurer: measurements.Measurer):
    """Run merged cells (instrumented as ``sources``) in a sandbox, rerun without a cell that took the kernel down;
    then measure the choices the graded cells sent."""
    start = time.monotonic()
    deadline = start + timeout
    offset = len(sources) - len(cells)  # the probe setup cell shifts indices by one
    skip = {i + offset for i, c in enumerate(cells) if c.skip_reason}
    left_out: dict[int, kernel.CellOutcome] = {}
    import llmsys.kernels  # its modules live in the checkout's top-level kernels/ (or the installed copy)

    code = [str(library)] if library else [str(Path(labs.__file__).resolve().parents[1]), *llmsys.kernels.__path__]
    readonly = [*sandbox.python_paths(), *code, str(_cache_dir())]
    env = sandbox.kernel_env({"PYTHONPATH": str(library or Path(labs.__file__).resolve().parents[2]),
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
    measurements.measure_outcomes([c.check and c.check.id for c in cells], result.outcomes, lab.measures, measurer)
    result.running = None if result.running is None else result.running - offset
    result.seconds = time.monotonic() - start
    return result, result.outcomes, set(left_out)


def _cache_dir() -> Path:
    from llmsys.core.cache import cache_dir

    return cache_dir().resolve()


def _reference_cells(lab: Lab, gpu: bool, salt: int) -> list[MergedCell]:
    """The solution as a submission; its run on this grading's inputs is the expected side of every check."""
    cells, _ = merge(lab.solution, lab.solution, lab.extra, gpu)
    answer_sources = {normalized(labs.source_text(c)) for c in lab.solution.cells if labs.has_solution_region(c)}
    setup = [c.source for c in cells[1:] if c.check is None and normalized(c.source) not in answer_sources]
    lab.trusted, lab.imports = sides.trusted_names(setup), sides.imported_names(setup)
    for index, cell in enumerate(cells):
        if cell.check is not None:
            lab.later[cell.check.id] = set().union(set(), *(sides.read_before_assigned(c.source) for c in cells[index + 1:]))
    return cells


def _check_reference(lab: Lab, cells: list[MergedCell], run) -> None:
    """Keep the solution's records; a check the solution fails is the instructor's problem."""
    result, outcomes, _ = run
    lab.reference_run = {}
    for index, cell in enumerate(cells):
        if cell.check is None or cell.skip_reason:
            continue
        outcome = outcomes.get(index)
        records = judge.collect(outcome.outputs, cell.check.id, outcome.measured) if outcome else judge.CellRecords()
        failure = (outcome.message if outcome and outcome.status != "ok" else None) or \
            judge.judge(lab.specs[cell.check.id], records, None)
        if failure or outcome is None:
            raise GradingSetupError(f"{lab.path.name}: the solution fails check {cell.check.id!r} on this grading's "
                                    f"inputs: {failure or result.error or 'not run'}")
        lab.reference_run[cell.check.id] = records
