"""The lab generator: student copies in ``labs/`` from the solutions in ``solutions/``.

A lab has one source, ``solutions/labNN_<topic>.ipynb``. Inside its code cells
the answer sits between two marker lines::

    def rms_norm(x, weight, eps=1e-6):
        ### BEGIN SOLUTION
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        ### END SOLUTION

and the student copy gets, at the same indentation::

    def rms_norm(x, weight, eps=1e-6):
        # YOUR CODE HERE
        raise NotImplementedError("...")

A graded check is a code cell whose tags (cell metadata ``tags``) are ``grade``,
``id=<name>`` and ``points=<n>``, plus ``gpu`` for a check that needs CUDA. It
must ``assert`` (or ``assert_close``) what a right answer satisfies: the grader
judges those statements.

A graded check tagged ``hidden`` (as nbgrader's hidden tests) holds what a
student must not see: a reference implementation, the expected value of a
graded case. The student copy gets a one-line markdown cell in its place,
saying what is graded there at submission; the grader runs the solution's
cell (``build_lab(..., keep_hidden=True)``). Public self-checks (small
hand-computed cases, shapes, known mistakes) stay in the student copy.

A written answer ("explain why ...") is a markdown cell tagged ``written``,
``id=<name>`` and ``points=<n>``; its model answer sits between the same
markers, and the student copy gets ``*Write your answer here.*`` in its place.
The grader reports it as pending, with the student's text, for the instructor
to score by hand.

Student copies are written deterministically (outputs stripped, execution
counts cleared, nbformat's stable JSON layout), so ``main_build(check=True)``
can compare file contents and name every stale, missing or extra file.
"""

from __future__ import annotations

import copy
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .runner import REPO

BEGIN_MARKER = "### BEGIN SOLUTION"
END_MARKER = "### END SOLUTION"
STUB_COMMENT = "# YOUR CODE HERE"
STUB_RAISE = 'raise NotImplementedError("replace this line with your code")'

GRADE_TAG = "grade"
GPU_TAG = "gpu"
HIDDEN_TAG = "hidden"
WRITTEN_TAG = "written"
STUB_ANSWER = "*Write your answer here.*"
LAB_NAME = re.compile(r"lab\d+", re.IGNORECASE)
CHECK_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Cell metadata that only records one run of the notebook on one machine.
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")


@dataclass(frozen=True)
class Check:
    """One graded check cell: its name, its points, and whether it needs a GPU."""

    id: str
    points: int
    gpu: bool = False
    written: bool = False  # a written answer, scored by hand
    hidden: bool = False  # in the solution only; runs at grading


def cell_tags(cell) -> list[str]:
    metadata = cell.get("metadata")
    tags = metadata.get("tags") if isinstance(metadata, dict) else None
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def is_graded(cell) -> bool:
    return cell.get("cell_type") == "code" and GRADE_TAG in cell_tags(cell)


def is_written(cell) -> bool:
    return cell.get("cell_type") == "markdown" and WRITTEN_TAG in cell_tags(cell)


def is_hidden(cell) -> bool:
    return is_graded(cell) and HIDDEN_TAG in cell_tags(cell)


def hidden_placeholder(cell):
    """What the student copy shows where a hidden check stands: what is graded, not how."""
    check = check_of(cell)
    points = f"{check.points} point{'s' if check.points > 1 else ''}"
    text = f"*Graded at submission: hidden check `{check.id}` ({points}{', GPU' if check.gpu else ''}).*"
    return nbformat.v4.new_markdown_cell(text, id=cell.id, metadata={"tags": [HIDDEN_TAG]})


def tag_value(cell, key: str) -> str | None:
    """The value of a ``key=value`` tag, or None."""
    for tag in cell_tags(cell):
        if tag.startswith(key + "="):
            return tag[len(key) + 1 :]
    return None


def check_of(cell, where: str = "") -> Check:
    """Read a graded cell's tags; raise a clear error if they are malformed."""
    check_id = tag_value(cell, "id")
    points = tag_value(cell, "points")
    if not check_id or not CHECK_ID.match(check_id):
        raise ValueError(
            f"{where}: a graded cell needs an 'id=<name>' tag with letters, digits, "
            f"'_' or '-' (got {check_id!r}); tags are {cell_tags(cell)}"
        )
    if points is None or not points.isdigit() or int(points) <= 0:
        raise ValueError(
            f"{where}: graded cell {check_id!r} needs a 'points=<n>' tag with a "
            f"positive whole number (got {points!r})"
        )
    return Check(check_id, int(points), GPU_TAG in cell_tags(cell), is_written(cell), is_hidden(cell))


def graded_checks(nb, where: str = "notebook") -> list[Check]:
    """The graded checks and written answers of a notebook in order; ids must be unique."""
    checks = []
    for index, cell in enumerate(nb.cells):
        if is_graded(cell) or is_written(cell):
            check = check_of(cell, f"{where}, cell {index}")
            if any(c.id == check.id for c in checks):
                raise ValueError(f"{where}: two graded cells have id={check.id}; ids must be unique")
            checks.append(check)
    return checks


def source_text(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def has_solution_region(cell) -> bool:
    return cell.get("cell_type") == "code" and any(
        line.strip().startswith(BEGIN_MARKER) for line in source_text(cell).splitlines()
    )


def stub_source(source: str, where: str = "cell", stub: list[str] = (STUB_COMMENT, STUB_RAISE)) -> str:
    """Replace every solution region by a stub at the marker's indentation."""
    lines = source.splitlines()
    out: list[str] = []
    begin_line = None
    for number, line in enumerate(lines, start=1):
        marker = line.strip()
        if marker.startswith(BEGIN_MARKER):
            if begin_line is not None:
                raise ValueError(
                    f"{where}: '{BEGIN_MARKER}' on line {number} is inside the region "
                    f"opened on line {begin_line}; close it with '{END_MARKER}' first"
                )
            begin_line = number
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + line for line in stub]
        elif marker.startswith(END_MARKER):
            if begin_line is None:
                raise ValueError(f"{where}: '{END_MARKER}' on line {number} has no '{BEGIN_MARKER}' before it")
            begin_line = None
        elif begin_line is None:
            out.append(line)
    if begin_line is not None:
        raise ValueError(f"{where}: '{BEGIN_MARKER}' on line {begin_line} has no matching '{END_MARKER}'")
    return "\n".join(out)


def clean_cell(cell, index: int):
    """A copy of the cell as it is committed: no outputs, no run metadata, an id."""
    cell = copy.deepcopy(cell)
    cell.setdefault("metadata", {})
    for key in VOLATILE_CELL_METADATA:
        cell.metadata.pop(key, None)
    # nbformat 4.5 requires ids; the grader matches a student's cells to the
    # lab's by id, so a missing one gets a name that is stable across builds.
    if not cell.get("id"):
        cell["id"] = f"cell-{index}"
    cell.source = source_text(cell)
    if cell.cell_type == "code":
        cell.outputs = []
        cell.execution_count = None
    return cell


def build_lab(solution_nb, name: str | None = None, keep_hidden: bool = False):
    """The student copy of a solution notebook (the input is not modified).

    ``name`` (for example ``"lab00_warmup"``) is stored in the notebook's
    metadata so the grader can tell which lab a renamed submission is.
    ``keep_hidden`` keeps the hidden checks as they are: the copy the grader
    runs, never one a student gets.
    """
    where = name or "solution notebook"
    checks = graded_checks(solution_nb, where)
    if not checks:
        raise ValueError(f"{where}: no graded cells; tag at least one code cell with 'grade', 'id=<name>', 'points=<n>'")
    lab = copy.deepcopy(solution_nb)
    lab.nbformat, lab.nbformat_minor = 4, max(5, int(lab.get("nbformat_minor", 5)))
    lab.cells = [clean_cell(cell, i) for i, cell in enumerate(solution_nb.cells)]
    for index, cell in enumerate(lab.cells):
        if is_written(cell):
            cell.source = stub_source(cell.source, f"{where}, cell {index}", [STUB_ANSWER])
            continue
        if cell.cell_type != "code":
            if any(line.strip().startswith((BEGIN_MARKER, END_MARKER)) for line in cell.source.splitlines()):
                # only code cells are stubbed; a marker here would ship the answer
                raise ValueError(f"{where}, cell {index}: solution markers work in code cells and written answers only, "
                                 f"not in other {cell.cell_type} cells (tag a written answer 'written')")
            continue
        if is_graded(cell) and has_solution_region(cell):
            raise ValueError(f"{where}, cell {index}: graded cell {tag_value(cell, 'id')!r} must not contain a solution region")
        if is_hidden(cell) and not keep_hidden:
            lab.cells[index] = hidden_placeholder(cell)
            continue
        cell.source = stub_source(cell.source, f"{where}, cell {index}")
    if name:
        lab.metadata["llmsys"] = {"lab": name}
    return lab


def notebook_text(nb) -> str:
    """nbformat's own stable JSON layout (sorted keys, one-space indent) plus a newline."""
    return nbformat.writes(nb) + "\n"


def read_notebook(path: str | Path):
    return nbformat.read(str(path), as_version=4)


def lab_name(path: str | Path) -> str:
    return Path(path).stem


def expected_labs(solutions_dir: str | Path) -> dict[str, str]:
    """{file name: text of its student copy} for every notebook in ``solutions_dir``."""
    solutions_dir = Path(solutions_dir)
    if not solutions_dir.is_dir():
        raise FileNotFoundError(f"no solutions folder at {solutions_dir}; labs are built from a source checkout")
    labs = {}
    for path in sorted(solutions_dir.glob("*.ipynb")):
        if not LAB_NAME.match(path.stem):
            raise ValueError(f"{path}: lab notebooks are named labNN_<topic>.ipynb")
        labs[path.name] = notebook_text(build_lab(read_notebook(path), lab_name(path)))
    return labs


def write_generated(expected: dict[str, str], out_dir: Path, check: bool) -> list[str]:
    """Bring ``out_dir`` to ``expected`` ({file name: text}), or with ``check`` only list
    what differs: one "stale: PATH" or "missing: PATH" line per file."""
    problems = []
    for name, text in expected.items():
        path = out_dir / name
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        if check:
            problems.append(f"{'stale' if path.exists() else 'missing'}: {path}")
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return problems


def main_build(check: bool, solutions_dir: str | Path | None = None, labs_dir: str | Path | None = None) -> int:
    """``python -m llmsys labs build [--check]``: write or verify ``labs/``.

    The folders default to the repository's ``solutions/`` and ``labs/``,
    whatever the working directory.

    Returns the exit code: with ``check``, 1 when a lab is stale, missing or
    has no solution (each is printed), else 0. Without ``check`` the stale and
    missing labs are written; extra files are reported but never deleted,
    since a student may keep work in them.
    """
    solutions_dir = Path(solutions_dir) if solutions_dir is not None else REPO / "solutions"
    labs_dir = Path(labs_dir) if labs_dir is not None else REPO / "labs"
    try:
        expected = expected_labs(solutions_dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}")
        return 2
    problems = write_generated(expected, labs_dir, check)
    extra = sorted(p for p in labs_dir.glob("*.ipynb") if p.name not in expected) if labs_dir.is_dir() else []
    for path in extra:
        message = f"extra: {path} has no solution in {solutions_dir}"
        if check:
            problems.append(message)
        else:
            print(f"warning: {message}; remove it if it is an old lab")
    for line in problems:
        print(line)
    if problems:
        print(f"{labs_dir}/ is out of date: run `python -m llmsys labs build`")
        return 1
    if check:
        print(f"{labs_dir}/ is up to date ({len(expected)} lab(s))")
    return 0


def main_release(out: str | Path, solutions_dir: str | Path | None = None) -> int:
    """``python -m llmsys labs release --out DIR``: what students get, and nothing else.

    DIR receives the student copies (built fresh from ``solutions/``, so never
    stale), the ``llmsys`` package they import, ``pyproject.toml`` and
    ``README.md``. No solutions, no hidden checks, no tests. DIR must be new
    or empty, so an old release is never mixed with a new one.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: {out} exists and is not an empty folder; choose a new folder for the release")
        return 2
    try:
        expected = expected_labs(Path(solutions_dir) if solutions_dir is not None else REPO / "solutions")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}")
        return 2
    (out / "labs").mkdir(parents=True)
    for name, text in expected.items():
        (out / "labs" / name).write_text(text, encoding="utf-8")
    shutil.copytree(REPO / "llmsys", out / "llmsys", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).is_file():
            shutil.copyfile(REPO / name, out / name)
    print(f"wrote {len(expected)} lab(s), the llmsys package, pyproject.toml and README.md to {out}")
    return 0
