"""What the sandbox costs: lab00 submissions graded with and without it, side by side in one run.

    python benchmarks/grading.py [--submissions 4] [--jobs 1] [--json PATH]

Grades ``--submissions`` copies of the correct lab00 submission (each with a
cell of its own) in one class run with the sandbox, then the same with ``--unsafe`` (plain kernels, same
trusted judging), and prints seconds per submission for each and their ratio.
A class run also runs the solution once (the expected side of every check);
its share is included, as it is for an instructor.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import nbformat

from llmsys.course import grading

CORRECT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "submissions" / "correct_lab00_warmup.ipynb"


def class_run(folder: Path, jobs: int, unsafe: bool) -> tuple[float, list]:
    start = time.perf_counter()
    reports = grading.grade_many([folder], jobs=jobs, unsafe=unsafe, cell_timeout=120, timeout=600)
    return time.perf_counter() - start, reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=4, help="copies of the correct lab00 submission")
    parser.add_argument("--jobs", type=int, default=1, help="sandboxes at a time")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args()
    if args.submissions < 1 or args.jobs < 1:
        parser.error("--submissions and --jobs must be 1 or more")
    if grading.unavailable_reason():
        parser.error(f"no sandbox on this machine: {grading.unavailable_reason()}")
    folder = Path(tempfile.mkdtemp(prefix="llmsys-bench-"))
    try:
        for n in range(args.submissions):  # one cell of their own each: identical notebooks would run once
            nb = nbformat.read(str(CORRECT), as_version=4)
            nb.cells.append(nbformat.v4.new_code_cell(f"student = {n}"))
            nbformat.write(nb, str(folder / f"student{n}_lab00_warmup.ipynb"))
        rows = {}
        for label, unsafe in [("sandbox", False), ("no sandbox", True)]:
            seconds, reports = class_run(folder, args.jobs, unsafe)
            assert all(r.score == r.max_score > 0 for r in reports), [r.format() for r in reports]
            rows[label] = seconds / args.submissions
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ratio = rows["sandbox"] / rows["no sandbox"]
    print(f"lab00, {args.submissions} submissions, jobs={args.jobs} (solution run included)")
    for label, seconds in rows.items():
        print(f"  {label:<11} {seconds:6.2f} s per submission")
    print(f"  sandbox / no sandbox: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"submissions": args.submissions, "jobs": args.jobs,
                                               "seconds_per_submission": rows, "ratio": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
