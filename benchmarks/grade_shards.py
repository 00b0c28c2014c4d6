"""A class graded in one run vs in shards (separate processes, as on separate machines), then merged.

    python benchmarks/grade_shards.py --students 40 --shards 2 --json shards.json

Each student hands in lab00's correct fixture with a cell of its own (the
grader runs identical notebooks once). Both ways run side by side on
this machine with the same seed: one `grade --jobs N` run, and N `grade
--shard K/N --jobs 1` processes at once followed by `grade merge`. Prints the
wall times and their ratio, checks the merged report equals the single one
(timings aside), and writes the numbers to --json; asserts nothing else.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SUBMISSION = ROOT / "tests" / "fixtures" / "submissions" / "correct_lab00_warmup.ipynb"


def grade(*args):
    return subprocess.Popen([sys.executable, "-m", "llmsys", "grade", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=40)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--unsafe", action="store_true", help="grade without the sandbox (where none can be made)")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    unsafe = ["--unsafe"] * args.unsafe
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(args.students):
            nb = nbformat.read(str(SUBMISSION), as_version=4)
            nb.cells.append(nbformat.v4.new_code_cell(f"student = {i}"))
            (tmp / "class" / f"student{i:03d}").mkdir(parents=True)
            nbformat.write(nb, str(tmp / "class" / f"student{i:03d}" / "lab00_warmup.ipynb"))
        start = time.perf_counter()
        one = grade(tmp / "class", "--jobs", args.shards, "--seed", args.seed, "--json", tmp / "one.json", *unsafe)
        assert one.wait() == 0, "the single run failed"
        single = time.perf_counter() - start
        start = time.perf_counter()
        shards = [grade(tmp / "class", "--seed", args.seed, "--shard", f"{k}/{args.shards}",
                        "--json", tmp / f"shard{k}.json", *unsafe) for k in range(args.shards)]
        assert [p.wait() for p in shards] == [0] * args.shards, "a shard failed"
        merge = grade("merge", *(tmp / f"shard{k}.json" for k in range(args.shards)), "--json", tmp / "merged.json")
        assert merge.wait() == 0, "the merge failed"
        sharded = time.perf_counter() - start

        def without_times(path):
            data = json.loads(path.read_text())
            for report in data["submissions"]:
                report.pop("seconds")
            return data
        same = without_times(tmp / "one.json") == without_times(tmp / "merged.json")
    result = {"students": args.students, "shards": args.shards, "single_run_jobs": args.shards,
              "single_run_s": round(single, 1), "sharded_s": round(sharded, 1),
              "sharded_over_single": round(sharded / single, 3), "merged_equals_single": same}
    print(f"{args.students} submissions of lab00: one run with --jobs {args.shards} {single:.1f} s; "
          f"{args.shards} shards with --jobs 1 + merge {sharded:.1f} s; ratio {sharded / single:.2f}; "
          f"merged report equals the single one: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
