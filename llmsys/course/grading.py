"""The autograder: run a submission's code against the lab's own graded checks.

``python -m llmsys grade SUBMISSION... [--csv grades.csv] [--json [PATH]]``

For each submitted notebook:

1. Find the lab it answers: ``--reference``, else the lab name the generator
   stored in the notebook's metadata, else ``labNN`` in the file name, looked
   up in ``solutions/``.
2. Merge: the graded check cells always come from the lab, never from the
   submission. The student's code cells are matched to the lab's cells by cell
   id (Jupyter keeps ids when a cell is edited), or by order when there are no
   ids, and each graded check runs after the student cells that precede it in
   the lab. A graded cell the submission edited, deleted or reordered is
   reported, and the lab's copy runs instead.
3. Run the merged notebook with nbval (``--nbval-lax``) in a subprocess, on a
   temporary copy, with a per-cell timeout (nbval interrupts the cell) and a
   per-submission timeout (the process group is killed). A small pytest plugin
   records every cell's outcome as it happens, so a run that is killed still
   reports what it got through.
4. Score: a graded check earns its points when its cell runs without raising.
   nbval runs every cell even after one fails, so each check is graded on its
   own. If a cell takes the kernel down (``os._exit()``, a crash, running out
   of memory, an infinite loop that ignores interrupts) and checks follow it,
   that cell is left out and the notebook runs again from the start, at most
   ``MAX_RERUNS`` times.

A submission that is not JSON, not a notebook, or too large gets zero with the
reason; the grader reads the submission once and never writes to it.

GPU-only checks (tag ``gpu``) are skipped on a machine without CUDA and shown
as "skipped: no GPU". Their points count toward the maximum only where they
run, so a CPU grade is out of the CPU checks' points and is not lowered by a
missing GPU; grade on a GPU machine to include them.

The grader runs student code with the instructor's permissions: it protects
against mistakes (loops, crashes, exits, huge outputs), not against a
submission written to attack the machine. Grade in a container for that.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from . import labs

DEFAULT_CELL_TIMEOUT = 120.0  # seconds a single cell may run
DEFAULT_TIMEOUT = 900.0  # seconds a whole submission may take, reruns included
MAX_RERUNS = 2  # reruns after a cell took the kernel down
MAX_SUBMISSION_BYTES = 64_000_000  # larger files are refused unread
MESSAGE_LIMIT = 500  # characters kept of any error message
MAX_CELL_NOTES = 5  # failing student cells listed per submission

STATUS_PASSED, STATUS_FAILED, STATUS_SKIPPED, STATUS_NOT_RUN = "passed", "failed", "skipped", "not run"
NO_GPU = "skipped: no GPU"
KERNEL_DIED = "the kernel died while running this cell (os._exit(), a crash, or out of memory)"
# Runs first in every graded notebook. In Jupyter, exit() stops the kernel a
# moment after the cell returns, so a later cell would take the blame; the
# grader keeps the kernel, and the reply's "ask_exit" payload reports the call.
GRADER_SETUP = ('get_ipython().ask_exit = lambda: get_ipython().payload_manager.write_payload('
                '{"source": "ask_exit", "keepkernel": True})')


class GradingSetupError(ValueError):
    """A problem with the instructor's input (reference, extra checks), not the submission."""


class NotANotebook(ValueError):
    """The submission cannot be read as a notebook; the message says why."""


# ---------------------------------------------------------------- reports


@dataclass
class CheckResult:
    id: str
    points: int
    score: int = 0
    status: str = STATUS_NOT_RUN
    message: str = ""
    hidden: bool = False
    gpu: bool = False


@dataclass
class GradeReport:
    submission: str
    student: str
    lab: str | None = None
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def score(self) -> int:
        return sum(c.score for c in self.checks)

    @property
    def max_score(self) -> int:
        """Points of the checks that ran or should have run; skipped GPU checks are left out."""
        return sum(c.points for c in self.checks if c.status != STATUS_SKIPPED)

    def check(self, check_id: str) -> CheckResult:
        for check in self.checks:
            if check.id == check_id:
                return check
        raise KeyError(f"no check {check_id!r} in this report; it has {[c.id for c in self.checks]}")

    def to_dict(self) -> dict:
        return {
            "student": self.student,
            "submission": self.submission,
            "lab": self.lab,
            "score": self.score,
            "max_score": self.max_score,
            "checks": [asdict(c) for c in self.checks],
            "notes": list(self.notes),
            "seconds": round(self.seconds, 2),
        }

    def format(self) -> str:
        lines = [f"{self.submission}  student={self.student}  lab={self.lab or '?'}  "
                 f"score {self.score}/{self.max_score}  ({self.seconds:.1f} s)"]
        for c in self.checks:
            earned = "-" if c.status == STATUS_SKIPPED else str(c.score)
            name = c.id + (" (hidden)" if c.hidden else "")
            line = f"  {c.status:<8} {earned:>3}/{c.points:<3} {name}"
            lines.append(line + (f": {c.message}" if c.message else ""))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def shorten(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """One readable line of at most about ``limit`` characters."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(text)).strip()  # ANSI colours
    if len(text) > limit:
        text = text[:limit] + f" ... [{len(text) - limit} more characters]"
    return text


def student_name(path: Path, lab: str | None = None) -> str:
    """The file name without the lab's name, else the folder's name.

    ``alice_lab00_warmup.ipynb`` and ``lab00_warmup_alice.ipynb`` -> ``alice``;
    ``bob/lab00_warmup.ipynb`` -> ``bob``.
    """
    stem = path.stem
    at = stem.lower().find(lab.lower()) if lab else -1
    if at >= 0:
        stem = stem[:at] + stem[at + len(lab):]
    else:
        stem = re.sub(r"lab\d+[a-z]*", "", stem, count=1, flags=re.IGNORECASE)
    return stem.strip(" _-.") or path.parent.name or path.stem


# ------------------------------------------------------------- reading files


def read_submission(path: Path):
    """The submission as a v4 notebook, or NotANotebook with the reason."""
    size = path.stat().st_size
    if size > MAX_SUBMISSION_BYTES:
        raise NotANotebook(f"the file is {size / 1e6:.0f} MB, over the {MAX_SUBMISSION_BYTES / 1e6:.0f} MB limit; "
                           "clear the outputs (Edit > Clear Outputs of All Cells), save and submit again")
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise NotANotebook(f"not a notebook: the file is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise NotANotebook(f"not a notebook: the file is not valid JSON ({err.msg} at line {err.lineno}, "
                           f"column {err.colno}); submit the .ipynb file Jupyter saves") from None
    if not isinstance(data, dict) or "nbformat" not in data:
        raise NotANotebook("not a notebook: the file is JSON but not a Jupyter notebook (no 'nbformat' field)")
    try:
        nb = nbformat.convert(nbformat.from_dict(data), 4)
    except Exception as err:  # any unreadable structure is the submission's fault
        raise NotANotebook(f"not a notebook: {shorten(type(err).__name__ + ': ' + str(err), 200)}") from None
    if not isinstance(nb.get("cells"), list):
        raise NotANotebook("not a notebook: it has no list of cells")
    for number, cell in enumerate(nb.cells, start=1):
        source = cell.get("source", "") if isinstance(cell, dict) else None
        if not isinstance(source, (str, list)) or (isinstance(source, list) and not all(isinstance(s, str) for s in source)):
            raise NotANotebook(f"not a notebook: cell {number} has no readable source")
        cell["source"] = labs.source_text(cell)
    return nb


def repo_solutions_dir() -> Path:
    """``solutions/`` next to the package (a source checkout), else in the working directory."""
    beside_package = Path(__file__).resolve().parents[2] / "solutions"
    return beside_package if beside_package.is_dir() else Path("solutions")


def lab_id(text: str) -> tuple[int, str] | None:
    """``alice_lab00b_kernels`` -> (0, "b"): the lab's number and letter, if the text names one."""
    match = re.search(r"lab(\d+)([a-z]*)", text, re.IGNORECASE)
    return (int(match.group(1)), match.group(2).lower()) if match else None


def find_lab_file(folder: Path, hint: str) -> Path | None:
    """The notebook in ``folder`` for the lab that ``hint`` (a file or lab name) names, or None.

    A lab's full name inside the hint wins (``alice_lab00_warmup`` holds
    ``lab00_warmup``); else the lab id must match (``lab00`` is
    ``lab00_warmup``, not ``lab00b_kernels``).
    """
    notebooks = sorted(folder.glob("*.ipynb"))
    named = [p for p in notebooks if p.stem.lower() in hint.lower()]
    if named:
        return max(named, key=lambda p: len(p.stem))
    wanted = lab_id(hint)
    found = [p for p in notebooks if wanted is not None and lab_id(p.stem) == wanted]
    if len(found) > 1:
        raise GradingSetupError(f"{folder} has several notebooks for the lab in {hint!r}: {[p.name for p in found]}")
    return found[0] if found else None


def find_reference(path: Path, nb, solutions_dir: Path) -> Path:
    """Which lab a submission answers, by its metadata or its file name."""
    metadata = nb.get("metadata") if nb is not None else None
    mark = metadata.get("llmsys") if isinstance(metadata, dict) else None
    stored = mark.get("lab") if isinstance(mark, dict) else None
    for hint in (stored if isinstance(stored, str) else "", path.stem):
        reference = find_lab_file(solutions_dir, hint) if hint else None
        if reference is not None:
            return reference
    raise LookupError(f"could not tell which lab this is: no lab in {solutions_dir} matches; name the file "
                      "labNN_<topic>.ipynb (or <student>_labNN_<topic>.ipynb) or pass --reference")


def read_instructor_notebook(path: Path, what: str):
    try:
        return nbformat.read(str(path), as_version=4)
    except Exception as err:
        raise GradingSetupError(f"cannot read {what} {path}: {err}") from None


# ------------------------------------------------------------------ merging


@dataclass
class MergedCell:
    """One code cell of the notebook the grader runs, and where it came from."""

    source: str
    label: str  # how the report names the cell
    cell_id: str | None = None
    check: labs.Check | None = None
    hidden: bool = False
    skip_reason: str | None = None


def normalized(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def first_line(source: str) -> str:
    line = next((s.strip() for s in source.splitlines() if s.strip()), "")
    return line if len(line) <= 40 else line[:37] + "..."


def cell_id(cell) -> str | None:
    value = cell.get("id")
    return value if isinstance(value, str) else None


def merge(solution_nb, submission_nb, extra_nb=None, gpu: bool = True) -> tuple[list[MergedCell], list[str]]:
    """The cells to run: the student's code, with the lab's graded checks in place.

    Returns the cells and notes for the report. Solution code never enters the
    merged notebook: a lab cell the submission lacks is put back from the
    student copy, and only when it holds no answer (imports, helpers).
    """
    lab = labs.build_lab(solution_nb)
    checks = labs.graded_checks(lab)
    check_index = {c.id: k for k, c in enumerate(checks)}
    check_cells = [c for c in lab.cells if labs.is_graded(c)]
    names_by_cell_id = {cell.id: check.id for cell, check in zip(check_cells, checks)}
    names_by_source = {normalized(cell.source): check.id for cell, check in zip(check_cells, checks)}

    # Each ungraded lab code cell belongs to segment k: it runs before check k.
    lab_code, segment_of, checks_above = [], {}, 0
    for cell in lab.cells:
        if labs.is_graded(cell):
            checks_above += 1
        elif cell.cell_type == "code":
            lab_code.append(cell)
            segment_of[cell.id] = checks_above

    walk, notes = [], []  # the submission's code cells: (position, cell, check name or None)
    for position, cell in enumerate(submission_nb.cells):
        if cell.get("cell_type") != "code":
            continue
        name = _graded_name(cell, names_by_cell_id, names_by_source)
        if name is not None and name not in check_index:
            notes.append(f"cell {position + 1} is tagged as graded check {name!r}, which this lab does not have; it ran as your code")
            name = None
        walk.append((position, cell, name))
    notes += _graded_cell_notes(checks, check_cells, walk, check_index)

    segments = _assign_segments(walk, segment_of, check_index, len(checks))
    present = {cell_id(cell) for _, cell, name in walk if name is None}
    if present & segment_of.keys():  # ids tell which lab cells the submission lacks
        answer_ids = {mine.id for mine, theirs in zip(lab.cells, solution_nb.cells) if labs.has_solution_region(theirs)}
        for lab_cell in lab_code:
            if lab_cell.id in present:
                continue
            start = first_line(lab_cell.source)
            if lab_cell.id in answer_ids:
                notes.append(f"the answer cell starting {start!r} is missing from the submission")
            else:
                _restore(segments[segment_of[lab_cell.id]], lab_cell, lab_code)
                notes.append(f"the lab's cell starting {start!r} was missing from the submission and was put back")

    cells = [MergedCell(GRADER_SETUP, "the grader's setup cell")]
    for k, (check, check_cell) in enumerate(zip(checks, check_cells)):
        cells += segments[k] + [_check_cell(check_cell, check, gpu)]
    cells += segments[len(checks)]
    if extra_nb is not None:
        cells += _extra_cells(extra_nb, check_index, gpu)
    return cells, notes


def _graded_name(cell, names_by_cell_id: dict[str, str], names_by_source: dict[str, str]) -> str | None:
    """The check a submitted cell is: by its tags, its cell id, or (with neither) its unchanged source."""
    if labs.GRADE_TAG in labs.cell_tags(cell) and labs.tag_value(cell, "id"):
        return labs.tag_value(cell, "id")
    return names_by_cell_id.get(cell_id(cell)) or names_by_source.get(normalized(cell.source))


def _graded_cell_notes(checks, check_cells, walk, check_index) -> list[str]:
    notes = []
    for check, lab_cell in zip(checks, check_cells):
        copies = [cell for _, cell, name in walk if name == check.id]
        if not copies:
            notes.append(f"graded check {check.id!r} was deleted from the submission; the lab's check was used")
        elif any(normalized(c.source) != normalized(lab_cell.source) for c in copies):
            notes.append(f"graded check {check.id!r} was modified in the submission; the lab's check was used "
                         "(code written inside a graded cell does not run)")
    order = [check_index[name] for _, _, name in walk if name is not None]
    if order != sorted(order):
        notes.append("graded checks were reordered in the submission; they ran in the lab's order")
    return notes


def _assign_segments(walk, segment_of, check_index, n_checks) -> list[list[MergedCell]]:
    """Put each student cell before the lab check that should run after it.

    A cell whose id is a lab cell's id goes where that lab cell is; a new cell
    follows the cell or the graded check above it in the submission. With no
    usable ids and no graded cells to go by, the i-th student cell takes the
    place of the i-th ungraded lab cell.
    """
    segments: list[list[MergedCell]] = [[] for _ in range(n_checks + 1)]
    by_id = any(cell_id(cell) in segment_of for _, cell, name in walk if name is None)
    by_order = not by_id and all(name is None for _, _, name in walk)
    lab_segments = list(segment_of.values()) or [0]
    current, nth = 0, 0
    for position, cell, name in walk:
        if name is not None:
            current = max(current, check_index[name] + 1)
            continue
        if by_id:
            current = segment_of.get(cell_id(cell), current)
        elif by_order:
            current = lab_segments[min(nth, len(lab_segments) - 1)]
        nth += 1
        label = f"your cell {position + 1} ({first_line(cell.source)!r})"
        segments[current].append(MergedCell(cell.source, label, cell_id(cell)))
    return segments


def _restore(segment: list[MergedCell], lab_cell, lab_code) -> None:
    """Insert a lab cell after the nearest lab cell above it that is in this segment."""
    above = lab_code[: lab_code.index(lab_cell)]
    ids = [c.cell_id for c in segment]
    at = 0
    for previous in reversed(above):
        if previous.id in ids:
            at = ids.index(previous.id) + 1
            break
    label = f"the lab's cell {first_line(lab_cell.source)!r}"
    segment.insert(at, MergedCell(lab_cell.source, label, lab_cell.id))


def _check_cell(cell, check: labs.Check, gpu: bool, hidden: bool = False) -> MergedCell:
    skip = NO_GPU if check.gpu and not gpu else None
    kind = "hidden check" if hidden else "graded check"
    return MergedCell(labs.source_text(cell), f"{kind} {check.id!r}", cell_id(cell), check, hidden, skip)


def _extra_cells(extra_nb, check_index, gpu: bool) -> list[MergedCell]:
    """Instructor-only cells appended after the lab: hidden checks and their helpers."""
    extra_checks = labs.graded_checks(extra_nb, "extra checks")
    clash = [c.id for c in extra_checks if c.id in check_index]
    if clash:
        raise GradingSetupError(f"extra checks reuse ids of the lab's checks: {clash}; rename them")
    cells, graded = [], iter(extra_checks)
    for cell in extra_nb.cells:
        if labs.is_graded(cell):
            cells.append(_check_cell(cell, next(graded), gpu, hidden=True))
        elif cell.cell_type == "code":
            cells.append(MergedCell(labs.source_text(cell), f"hidden setup cell {first_line(labs.source_text(cell))!r}"))
    return cells


def merged_notebook(cells: list[MergedCell], left_out: set[int] = frozenset()):
    """The notebook nbval runs. Cells to skip carry nbval's ``nbval-skip`` tag."""
    nb = nbformat.v4.new_notebook()
    for index, merged in enumerate(cells):
        cell = nbformat.v4.new_code_cell(merged.source)
        if merged.skip_reason or index in left_out:
            cell.metadata["tags"] = ["nbval-skip"]
        nb.cells.append(cell)
    return nb


# ---------------------------------------------------------------- running


@dataclass
class CellOutcome:
    """What the results plugin saw for one cell."""

    status: str  # passed, failed or skipped
    message: str = ""
    timed_out: bool = False  # the cell ran past the per-cell timeout
    kernel_lost: bool = False  # the kernel died or was shut down during this cell
    kernel_gone: bool = False  # the kernel was already gone when the cell started
    exit_called: bool = False  # the cell called exit() or quit()


@dataclass
class RunResult:
    outcomes: dict[int, CellOutcome]
    running: int | None = None  # the cell that was running when the run was killed
    killed: bool = False  # the per-submission timeout ended the run
    error: str = ""  # the run failed before reporting cells


def run_notebook(nb, workdir: Path, cell_timeout: float, seconds_left: float) -> RunResult:
    """Run a notebook with nbval in a subprocess; kill it after ``seconds_left``."""
    workdir.mkdir(parents=True)
    notebook, results, log = workdir / "merged.ipynb", workdir / "results.jsonl", workdir / "pytest.log"
    notebook.write_text(labs.notebook_text(nb), encoding="utf-8")
    (workdir / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    package_parent = str(Path(__file__).resolve().parents[2])
    # Hiding rfc3987_syntax saves about a second per submission: jsonschema
    # (imported by nbformat) compiles its IRI grammar at import when it is
    # installed, and notebooks have no IRIs to check.
    bootstrap = (f"import sys; sys.modules['rfc3987_syntax'] = None; sys.path.insert(0, {package_parent!r}); "
                 "from llmsys.course.grading import child_main; sys.exit(child_main(sys.argv[1:]))")
    command = [sys.executable, "-c", bootstrap, str(results), str(notebook), str(cell_timeout)]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(command, cwd=workdir, env=_child_env(workdir), stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(seconds_left, 0.1))
            killed = False
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            returncode, killed = proc.wait(), True
    outcomes, running, kernel_pid = _read_results(results)
    if killed or returncode not in (0, 1):
        _kill_group(kernel_pid)  # an orphaned kernel would keep running the student's code
    error = ""
    if not outcomes and not killed and returncode not in (0, 1):
        error = f"pytest exited with code {returncode}: {shorten(_tail(log), 800)}"
    return RunResult(outcomes, running if killed else None, killed, error)


def _child_env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_CORE_"))}
    env.update(
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",  # only nbval: no xdist, timeout or user plugins
        JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),  # connection files die with the temp dir
        IPYTHONDIR=str(workdir / "ipython"),  # no user startup files, no shared history database
        JUPYTER_PLATFORM_DIRS="1",
        PYDEVD_DISABLE_FILE_VALIDATION="1",
        MPLBACKEND="Agg",
    )
    return env


def _kill_group(pid: int | None) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, size: int = 2000) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode("utf-8", "replace")


def _read_results(path: Path) -> tuple[dict[int, CellOutcome], int | None, int | None]:
    outcomes, running, kernel_pid = {}, None, None
    if not path.exists():
        return outcomes, running, kernel_pid
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short when the run was killed
        if record["event"] == "kernel":
            kernel_pid = record["pid"]
        elif record["event"] == "start":
            running = record["cell"]
        elif record["event"] == "result":
            outcomes[record["cell"]] = CellOutcome(**record["outcome"])
            running = None
    return outcomes, running, kernel_pid


def execute(cells: list[MergedCell], workdir: Path, cell_timeout: float, deadline: float) -> tuple[dict[int, CellOutcome], RunResult, set[int]]:
    """Run the merged cells; rerun without a cell that took the kernel down.

    Returns the outcome of every cell that reported, the last run, and the
    cells that were left out of the reruns.
    """
    left_out: dict[int, CellOutcome] = {}
    for attempt in range(MAX_RERUNS + 1):
        run = run_notebook(merged_notebook(cells, set(left_out)), workdir / f"run{attempt}", cell_timeout,
                           deadline - time.monotonic())
        lost = next((i for i, o in sorted(run.outcomes.items()) if o.kernel_lost and i not in left_out), None)
        checks_after = lost is not None and any(c.check and not c.skip_reason for c in cells[lost + 1 :])
        if run.killed or not checks_after or attempt == MAX_RERUNS or deadline - time.monotonic() < 1:
            break
        left_out[lost] = run.outcomes[lost]
    outcomes = dict(run.outcomes)
    outcomes.update(left_out)
    return outcomes, run, set(left_out)


# ---------------------------------------------------------------- grading


@functools.lru_cache(maxsize=1)
def has_gpu() -> bool:
    from llmsys.device import has_cuda

    return has_cuda()


def grade(submission_path, reference_path=None, *, solutions_dir=None, extra_checks=None,
          cell_timeout: float = DEFAULT_CELL_TIMEOUT, timeout: float = DEFAULT_TIMEOUT,
          gpu: bool | None = None) -> GradeReport:
    """Grade one submitted notebook against its lab; never raises for a bad submission.

    ``reference_path``: the solution notebook (default: found in ``solutions_dir``).
    ``extra_checks``: a folder of ``labNN_*.ipynb`` notebooks whose cells are
    appended as hidden checks. ``gpu``: whether ``gpu`` checks run (default:
    whether CUDA is available). Raises GradingSetupError only for a problem
    with the reference or the extra checks.
    """
    start = time.monotonic()
    path = Path(submission_path)
    report = GradeReport(submission=str(path), student=student_name(path))
    try:
        _grade_into(report, path, reference_path, solutions_dir, extra_checks, cell_timeout, timeout, gpu, start)
    except GradingSetupError:
        raise
    except Exception as err:  # a submission must never crash the grader
        report.notes.append(f"grader error: {shorten(f'{type(err).__name__}: {err}', 300)}")
        for check in report.checks:
            if check.status == STATUS_NOT_RUN and not check.message:
                check.message = "not run: grader error (see notes)"
    report.seconds = time.monotonic() - start
    return report


def _grade_into(report, path, reference_path, solutions_dir, extra_checks, cell_timeout, timeout, gpu, start):
    try:
        submission, unreadable = read_submission(path), None
    except NotANotebook as err:
        submission, unreadable = None, str(err)
    except OSError as err:
        submission, unreadable = None, f"cannot read the file: {err.strerror or err}"

    if reference_path is None:
        solutions = Path(solutions_dir or repo_solutions_dir())
        if not solutions.is_dir():
            raise GradingSetupError(f"no solutions folder at {solutions}; pass --solutions DIR or --reference FILE")
        try:
            reference_path = find_reference(path, submission, solutions)
        except LookupError as err:
            report.notes += [unreadable] if unreadable else []
            report.notes.append(str(err))
            return
    reference_path = Path(reference_path)
    solution = read_instructor_notebook(reference_path, "reference lab")
    report.lab = reference_path.stem
    report.student = student_name(path, report.lab)
    extra = None
    if extra_checks is not None:
        extra_file = find_lab_file(Path(extra_checks), reference_path.stem)
        extra = read_instructor_notebook(extra_file, "extra checks") if extra_file else None
    try:  # the instructor's notebooks must be valid labs before any student is graded with them
        labs.build_lab(solution, reference_path.stem)
        lab_checks = labs.graded_checks(solution, str(reference_path))
        hidden_checks = labs.graded_checks(extra, "extra checks") if extra is not None else []
    except ValueError as err:
        raise GradingSetupError(str(err)) from None
    report.checks = [CheckResult(c.id, c.points, gpu=c.gpu) for c in lab_checks]
    report.checks += [CheckResult(c.id, c.points, hidden=True, gpu=c.gpu) for c in hidden_checks]
    if gpu is None:
        gpu = has_gpu() if any(c.gpu for c in report.checks) else False
    for check in report.checks:
        if check.gpu and not gpu:
            check.status, check.message = STATUS_SKIPPED, NO_GPU

    if unreadable:
        report.notes.append(unreadable)
        for check in report.checks:
            if check.status == STATUS_NOT_RUN:
                check.message = "not graded: the submission could not be read (see notes)"
        return
    cells, notes = merge(solution, submission, extra, gpu)
    report.notes += notes

    workdir = Path(tempfile.mkdtemp(prefix="llmsys-grade-"))
    try:
        outcomes, last_run, left_out = execute(cells, workdir, cell_timeout, start + timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if last_run.error:
        report.notes.append(f"grader error: {last_run.error}")
    _score(report, cells, outcomes, last_run, left_out, cell_timeout, timeout)


def _score(report, cells, outcomes, last_run, left_out, cell_timeout, timeout) -> None:
    results = {c.id: c for c in report.checks}
    lost_in = next((cells[i].label for i, o in sorted(last_run.outcomes.items())
                    if o.kernel_lost and i not in left_out), "an earlier cell")
    failing_cells = []
    for index, cell in enumerate(cells):
        outcome = outcomes.get(index)
        message = _describe(outcome, cell_timeout, lost_in) if outcome else ""
        if outcome and outcome.exit_called:
            report.notes.append(f"{cell.label} called exit(); the grader ignored it, but in Jupyter it stops the "
                                "kernel and every variable is lost")
        if index in left_out:
            report.notes.append(f"{cell.label}: {message}; it was left out and the notebook ran again from the "
                                "start so that the checks after it could run")
        elif cell.check is None and outcome and outcome.status == STATUS_FAILED:
            failing_cells.append(f"{cell.label}: {shorten(message, 200)}")
        if cell.check is None:
            continue
        result = results[cell.check.id]
        if cell.skip_reason:
            result.status, result.message = STATUS_SKIPPED, cell.skip_reason
        elif outcome is None:
            result.message = _not_run_reason(last_run, cells, timeout)
        elif outcome.status == STATUS_PASSED:
            result.status, result.score = STATUS_PASSED, result.points
        else:
            result.status = STATUS_NOT_RUN if outcome.kernel_gone else STATUS_FAILED
            result.message = message
    for line in failing_cells[:MAX_CELL_NOTES]:
        report.notes.append(line)
    if len(failing_cells) > MAX_CELL_NOTES:
        report.notes.append(f"... and {len(failing_cells) - MAX_CELL_NOTES} more of your cells failed")


def _describe(outcome: CellOutcome, cell_timeout: float, lost_in: str) -> str:
    if outcome.kernel_gone:
        return f"not run: the kernel had died in {lost_in}"
    if outcome.timed_out and outcome.kernel_lost:
        return f"timed out after {cell_timeout:g} s and ignored the interrupt; the kernel was shut down"
    if outcome.timed_out:
        return f"timed out after {cell_timeout:g} s (the per-cell limit) and was interrupted"
    if outcome.kernel_lost:
        return KERNEL_DIED
    return outcome.message


def _not_run_reason(run: RunResult, cells, timeout: float) -> str:
    if run.killed:
        during = f" while running {cells[run.running].label}" if run.running is not None else ""
        return f"not run: grading stopped at the {timeout:g} s limit for a submission{during}"
    if run.error:
        return "not run: grader error (see notes)"
    return "not run"


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


def grade_many(paths, *, jobs: int = 1, on_report=None, **options) -> list[GradeReport]:
    """Grade every submission (folders expanded), ``jobs`` at a time, in input order."""
    submissions = expand_submissions(paths)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        reports = []
        for report in pool.map(lambda p: grade(p, **options), submissions):
            reports.append(report)
            if on_report:
                on_report(report)
    return reports


# ------------------------------------------------------------- grade tables


def check_columns(reports: list[GradeReport]) -> list[str]:
    columns = []
    for report in reports:
        columns += [c.id for c in report.checks if c.id not in columns]
    return columns


def table_rows(reports: list[GradeReport]) -> list[dict]:
    """One row per submission: student, file, lab, points per check, total, max, notes."""
    columns = check_columns(reports)
    rows = []
    for report in reports:
        row = {"student": report.student, "file": report.submission, "lab": report.lab or ""}
        by_id = {c.id: c for c in report.checks}
        for column in columns:
            check = by_id.get(column)
            row[column] = "" if check is None else ("skipped" if check.status == STATUS_SKIPPED else check.score)
        row.update(total=report.score, max=report.max_score, notes=" | ".join(report.notes))
        rows.append(row)
    return rows


def write_csv(reports: list[GradeReport], path) -> None:
    rows = table_rows(reports)
    fields = ["student", "file", "lab", *check_columns(reports), "total", "max", "notes"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def grades_json(reports: list[GradeReport]) -> str:
    return json.dumps({"submissions": [r.to_dict() for r in reports], "table": table_rows(reports)}, indent=1)


def summary_table(reports: list[GradeReport]) -> str:
    """A plain-text table across submissions: score, max and the checks that did not pass."""
    header = ("student", "lab", "score", "max", "seconds", "not passed")
    rows = [(r.student, r.lab or "?", str(r.score), str(r.max_score), f"{r.seconds:.1f}",
             ", ".join(c.id for c in r.checks if c.status in (STATUS_FAILED, STATUS_NOT_RUN)) or "-")
            for r in reports]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    out = io.StringIO()
    for row in [header, *rows]:
        cells = [row[i].ljust(widths[i]) if i < 2 else row[i].rjust(widths[i]) for i in range(len(widths))]
        out.write("  ".join(cells) + "  " + row[-1] + "\n")
    return out.getvalue()


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m llmsys grade",
                                     description="Grade lab notebooks against the lab's own graded checks.")
    parser.add_argument("submissions", nargs="+", help="notebooks, or folders of notebooks")
    parser.add_argument("--reference", help="the solution notebook to grade against (default: found in --solutions)")
    parser.add_argument("--solutions", help="folder of solution notebooks (default: the repository's solutions/)")
    parser.add_argument("--extra-checks", metavar="DIR", help="folder of labNN_*.ipynb with hidden graded cells to append")
    parser.add_argument("--csv", metavar="PATH", help="write the grade table as CSV")
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-",
                        help="write the grades as JSON to PATH, or to stdout instead of the text report")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S", help="seconds per submission")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT, metavar="S", help="seconds per cell")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at the same time")
    return parser


def main(argv=None) -> int:
    """``python -m llmsys grade``; returns the exit code (2 for a usage or setup problem)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    json_to_stdout = args.json == "-"
    say = (lambda text: print(text, file=sys.stderr)) if json_to_stdout else print
    options = dict(reference_path=args.reference, solutions_dir=args.solutions, extra_checks=args.extra_checks,
                   cell_timeout=args.cell_timeout, timeout=args.timeout)
    try:
        if not expand_submissions(args.submissions):
            say(f"error: no .ipynb files in {' '.join(args.submissions)}")
            return 2
        reports = grade_many(args.submissions, jobs=args.jobs, on_report=lambda r: say(r.format() + "\n"), **options)
    except (GradingSetupError, FileNotFoundError) as err:
        say(f"error: {err}")
        return 2
    say(summary_table(reports))
    if args.csv:
        write_csv(reports, args.csv)
        say(f"wrote {args.csv}")
    if json_to_stdout:
        print(grades_json(reports))
    elif args.json:
        Path(args.json).write_text(grades_json(reports) + "\n", encoding="utf-8")
        say(f"wrote {args.json}")
    return 0


# ---------------------------------------------------- inside the pytest subprocess


def child_main(argv: list[str]) -> int:
    """Entry point of the grading subprocess: nbval plus the results plugin."""
    import pytest

    results, notebook, cell_timeout = argv
    _detect_dead_kernels()
    args = [notebook, "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={cell_timeout}",
            "-p", "nbval.plugin", "-p", "no:cacheprovider", "-q", "--tb=no", "-W", "ignore",
            f"--rootdir={Path(notebook).parent}", "-c", str(Path(notebook).parent / "pytest.ini")]
    return int(pytest.main(args, plugins=[_results_plugin(results)]))


def _detect_dead_kernels() -> None:
    """Make nbval notice a dead kernel within a second instead of waiting out the cell timeout.

    nbval blocks on the kernel's reply for the whole cell timeout; when the
    kernel process has exited (``os._exit()``, a segfault) no reply will come.
    Waiting in one-second slices and checking the process in between lets the
    wait end early; nbval then reports the cell as failed and stops the kernel.
    The kernel's replies also show when a cell called exit().
    """
    from queue import Empty

    from nbval.kernel import RunningKernel

    wait = RunningKernel.get_message

    def get_message(self, stream, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                message = wait(self, stream, timeout=step)
            except Empty:
                if not self.is_alive():
                    self.died = True
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            payload = message.get("content", {}).get("payload", []) if stream == "shell" else []
            if any(isinstance(p, dict) and p.get("source") == "ask_exit" for p in payload):
                self.exit_called = True
            return message

    RunningKernel.get_message = get_message


def _results_plugin(path: str):
    """A pytest plugin that appends one JSON line per event, flushed at once,
    so that a run killed at the submission timeout still leaves its results."""
    import pytest

    class ResultsPlugin:
        def __init__(self):
            self.file = open(path, "a", encoding="utf-8")
            self.timed_out_before = False
            self.kernel_recorded = False

        def write(self, **record):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

        def pytest_runtest_logstart(self, nodeid, location):
            self.write(event="start", cell=_cell_number(nodeid))

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_call(self, item):
            self.timed_out_before = bool(getattr(item.parent, "timed_out", False))

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_makereport(self, item, call):
            report = yield
            kernel = getattr(item.parent, "kernel", None)
            if call.when == "setup" and call.excinfo is None:
                if not self.kernel_recorded and kernel is not None:
                    self.kernel_recorded = True
                    pid = getattr(getattr(getattr(kernel, "km", None), "provisioner", None), "pid", None)
                    self.write(event="kernel", pid=pid)
            elif call.when == "setup" and not call.excinfo.errisinstance(pytest.skip.Exception):
                message = f"could not start the kernel: {call.excinfo.typename}: {call.excinfo.value}"
                self.write(event="result", cell=_cell_number(item.nodeid),
                           outcome={"status": STATUS_FAILED, "message": shorten(message)})
            elif call.when == "setup":
                self.write(event="result", cell=_cell_number(item.nodeid), outcome={"status": STATUS_SKIPPED})
            elif call.when == "call":
                outcome = self.outcome(item, call, kernel)
                self.write(event="result", cell=_cell_number(item.nodeid), outcome=outcome)
            return report

        def outcome(self, item, call, kernel) -> dict:
            exit_called = bool(getattr(kernel, "exit_called", False))
            if exit_called:
                kernel.exit_called = False
            if call.excinfo is None:
                return {"status": STATUS_PASSED, "exit_called": exit_called}
            if call.excinfo.errisinstance(pytest.skip.Exception):
                return {"status": STATUS_SKIPPED}
            error = next((o for o in (getattr(item, "test_outputs", None) or []) if o.get("output_type") == "error"), None)
            message = f"{error['ename']}: {error['evalue']}" if error else f"{call.excinfo.value}"
            alive = kernel is not None and kernel.is_alive()
            return {
                "status": STATUS_FAILED,
                "message": shorten(message),
                "timed_out": bool(getattr(item.parent, "timed_out", False)) and not self.timed_out_before
                and not getattr(kernel, "died", False),
                "kernel_lost": not alive and "Kernel dead on test start" not in str(call.excinfo.value),
                "kernel_gone": "Kernel dead on test start" in str(call.excinfo.value),
                "exit_called": exit_called,
            }

    return ResultsPlugin()


def _cell_number(nodeid: str) -> int:
    """nbval names items ``<file>::Cell <n>``, n counting code cells from 0."""
    return int(nodeid.rsplit("Cell ", 1)[1])
