"""Merging: the student's code cells with the lab's graded checks in place.

The graded check cells always come from the lab, never from the submission.
The student's code cells are matched to the lab's cells by cell id (Jupyter
keeps ids when a cell is edited), or by order when there are no ids, and each
graded check runs after the student cells that precede it in the lab. A graded
cell the submission edited, deleted or reordered is reported, and the lab's
copy runs instead. Solution code never enters the merged notebook.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import labs
from .submission import GradingSetupError

NO_GPU = "skipped: no GPU"
# Runs first in every graded notebook. In Jupyter, exit() stops the kernel a
# moment after the cell returns, so a later cell would take the blame; the
# grader keeps the kernel, and the reply's "ask_exit" payload reports the call.
GRADER_SETUP = ('get_ipython().ask_exit = lambda: get_ipython().payload_manager.write_payload('
                '{"source": "ask_exit", "keepkernel": True})')


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
    lab = labs.build_lab(solution_nb, keep_hidden=True)
    checks = [c for c in labs.graded_checks(lab) if not c.written]  # written answers are read, not run
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
    lab_order = {cell.id: k for k, cell in enumerate(lab_code)}
    if any(_in_lab_order(segment, lab_order) for segment in segments):
        notes.append("your cells were reordered; the lab's cells ran in the lab's order, each of your new cells "
                     "after the cell above it")
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
        cells += segments[k] + [_check_cell(check_cell, check, gpu, check.hidden)]
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
        if not copies and not check.hidden:  # a hidden check is never in the student's copy
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


def _in_lab_order(segment: list[MergedCell], lab_order: dict[str, int]) -> bool:
    """Sort a segment's cells by the lab's order, each new cell after the lab cell above it; True if that moved any.

    The same mutation then scores the same in every lab, whatever order the
    student saved the cells in.
    """
    keys, anchor = [], -1
    for sequence, cell in enumerate(segment):
        anchor = lab_order.get(cell.cell_id, anchor)
        keys.append((anchor, cell.cell_id not in lab_order, sequence))
    order = sorted(range(len(segment)), key=keys.__getitem__)
    segment[:] = [segment[i] for i in order]
    return order != sorted(order)


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
    extra_checks = [c for c in labs.graded_checks(extra_nb, "extra checks") if not c.written]
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
