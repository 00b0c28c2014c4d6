"""Scoring one submission's run: each graded check judged on plain data, and notes on the student's own cells."""

from __future__ import annotations

from . import judge, kernel
from .report import STATUS_FAILED, STATUS_PASSED, STATUS_SKIPPED, shorten

MAX_CELL_NOTES = 5  # failing student cells listed per submission
KERNEL_DIED = "the kernel died while running this cell (os._exit(), a crash, or out of memory)"
BLOCKED = {  # errors the sandbox causes, and what the cell tried
    "Read-only file system": "to write outside its own folder", "Network is unreachable": "to reach the network",
    "name resolution": "to reach the network", "Connection refused": "to reach another machine or process",
    "File too large": "to write a file over the size limit", "No space left on device": "to fill the disk",
    "MemoryError": "to use more memory than the limit", "Permission denied": "to touch what it may not",
}


def score(job, cell_timeout: float, timeout: float) -> None:
    """Fill ``job.report`` from its run: each check judged against the lab's reference run; notes on the student's cells."""
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
            records = judge.collect(outcome.outputs, cell.check.id, outcome.measured)
            verdict = judge.judge(job.lab.specs[cell.check.id], records, job.lab.reference_run.get(cell.check.id))
            if verdict is None:
                result.status, result.score = STATUS_PASSED, result.points
            else:
                result.status = STATUS_FAILED
                result.message = shorten(f"the grader's evaluation failed: {verdict}")
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
