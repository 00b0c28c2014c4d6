"""What grading costs: seconds per lab00 submission (sandbox and plain kernels, side by side) and the grader's peak memory.

    python benchmarks/grading.py [--submissions 40] [--flooders 2] [--jobs 2] [--no-compare] [--json PATH]

Grades ``--submissions`` copies of the correct lab00 submission (each with a
cell of its own) in one class run with the sandbox; ``--flooders`` of them
also publish 48 records of 10 MB each, as a student who wants to take the
grader down would. It prints seconds per submission and the grader's peak
resident memory (goal: at most 1 GB for 40 submissions: records are judged
and dropped per submission, each under a cap). Unless ``--no-compare``, the
same class is graded with ``--unsafe`` (plain kernels, same judging) and the
ratio is printed. A class run also runs the solution once (the expected side
of every check); its share is included, as it is for an instructor.
"""

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import nbformat

from llmsys.course import grading

CORRECT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "submissions" / "correct_lab00_warmup.ipynb"
FLOOD = """from IPython.display import publish_display_data
for _ in range(48):
    publish_display_data({"application/vnd.llmsys.probe+json": {"cell": "rmsnorm_eps", "event": "x", "pad": "x" * 10_000_000}})"""


def class_run(folder: Path, jobs: int, unsafe: bool) -> tuple[float, list]:
    start = time.perf_counter()
    reports = grading.grade_many([folder], jobs=jobs, unsafe=unsafe, cell_timeout=120, timeout=600)
    return time.perf_counter() - start, reports


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=40, help="copies of the correct lab00 submission")
    parser.add_argument("--flooders", type=int, default=2, help="of them, how many publish 480 MB of records")
    parser.add_argument("--jobs", type=int, default=2, help="sandboxes at a time")
    parser.add_argument("--no-compare", action="store_true", help="skip the run without a sandbox")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args()
    if args.submissions < 1 or args.jobs < 1 or not 0 <= args.flooders <= args.submissions:
        parser.error("--submissions and --jobs must be 1 or more, --flooders between 0 and --submissions")
    if grading.unavailable_reason():
        parser.error(f"no sandbox on this machine: {grading.unavailable_reason()}")
    folder = Path(tempfile.mkdtemp(prefix="llmsys-bench-"))
    try:
        for n in range(args.submissions):  # one cell of their own each: identical notebooks would run once
            nb = nbformat.read(str(CORRECT), as_version=4)
            nb.cells.append(nbformat.v4.new_code_cell(FLOOD if n < args.flooders else f"student = {n}"))
            nbformat.write(nb, str(folder / f"student{n}_lab00_warmup.ipynb"))
        rows, before = {}, peak_mb()
        for label, unsafe in [("sandbox", False)] + ([] if args.no_compare else [("no sandbox", True)]):
            seconds, reports = class_run(folder, args.jobs, unsafe)
            assert all(r.score == r.max_score > 0 for r in reports), [r.format() for r in reports]
            rows[label] = seconds / args.submissions
            if label == "sandbox":
                peak = peak_mb()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"lab00, {args.submissions} submissions ({args.flooders} sending 480 MB each), jobs={args.jobs} "
          "(solution run included)")
    for label, seconds in rows.items():
        print(f"  {label:<11} {seconds:6.2f} s per submission")
    if "no sandbox" in rows:
        print(f"  sandbox / no sandbox: {rows['sandbox'] / rows['no sandbox']:.2f}x")
    print(f"  grader's peak memory: {peak:.0f} MB (before grading: {before:.0f} MB; goal <= 1024 MB)")
    if args.json:
        Path(args.json).write_text(json.dumps({"submissions": args.submissions, "flooders": args.flooders,
                                               "jobs": args.jobs, "seconds_per_submission": rows,
                                               "peak_memory_mb": peak, "memory_before_mb": before}, indent=1) + "\n")


if __name__ == "__main__":
    main()
