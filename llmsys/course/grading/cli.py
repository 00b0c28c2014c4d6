"""``python -m llmsys grade SUBMISSION... [--csv PATH] [--json [PATH]] [--jobs N]``.

Exit codes: 0 when every submission was graded; 1 when some could not be
graded (not a notebook, or its lab unknown; ``--allow-ungraded`` turns this
off); 2 for a usage or setup problem, with one line saying what to change.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .classroom import DEFAULT_CELL_TIMEOUT, DEFAULT_TIMEOUT, expand_submissions, grade_many
from .report import grades_json, summary_table, write_csv
from .sandbox import SandboxUnavailable
from .submission import GradingSetupError
from .written import read_scores


class UsageError(ValueError):
    """An option the grader cannot use; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m llmsys grade",
                                     description="Grade lab notebooks, each in its own sandbox, against the lab's graded checks.")
    parser.add_argument("submissions", nargs="+", help="notebooks, or folders of notebooks")
    parser.add_argument("--reference", help="the solution notebook to grade against (default: found in --solutions)")
    parser.add_argument("--solutions", help="folder of solution notebooks (default: the repository's solutions/)")
    parser.add_argument("--extra-checks", metavar="DIR", help="folder of labNN_*.ipynb with hidden graded cells to append")
    parser.add_argument("--csv", metavar="PATH", help="write the grade table as CSV")
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-",
                        help="write the grades as JSON to PATH, or to stdout instead of the text report")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S", help="seconds per submission")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT, metavar="S", help="seconds per cell")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at the same time (one sandbox each)")
    parser.add_argument("--seed", type=int, help="seed of this grading's inputs (default: a fresh one; for reproducing a grade)")
    parser.add_argument("--manual-scores", metavar="CSV",
                        help="a copy of the --csv table with points typed over the written answers' 'pending'")
    parser.add_argument("--allow-ungraded", action="store_true",
                        help="exit 0 even when some files could not be graded (not notebooks, unknown lab)")
    parser.add_argument("--unsafe", action="store_true",
                        help="run student code without a sandbox (only where none can be made, for trusted code)")
    return parser


def validate(args) -> None:
    for name in ("timeout", "cell_timeout"):
        value = getattr(args, name)
        if not math.isfinite(value) or value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value:g}")
    if args.cell_timeout > args.timeout:
        raise UsageError(f"--cell-timeout ({args.cell_timeout:g} s) is longer than --timeout ({args.timeout:g} s) "
                         "for the whole submission")
    if args.jobs < 1:
        raise UsageError(f"--jobs must be 1 or more, got {args.jobs}")
    if args.seed is not None and not 0 <= args.seed < 2**31:
        raise UsageError(f"--seed must be between 0 and 2**31 - 1, got {args.seed}")
    for path in (args.csv, None if args.json == "-" else args.json):
        if path and not Path(path).parent.resolve().is_dir():
            raise UsageError(f"cannot write {path}: the folder {Path(path).parent} does not exist")


def main(argv=None) -> int:
    """Returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    json_to_stdout = args.json == "-"
    say = (lambda text: print(text, file=sys.stderr)) if json_to_stdout else print
    try:
        validate(args)
        if not expand_submissions(args.submissions):
            raise UsageError(f"no .ipynb files in {' '.join(args.submissions)}")
        manual_scores = read_scores(args.manual_scores) if args.manual_scores else None
        reports = grade_many(args.submissions, jobs=args.jobs, reference_path=args.reference,
                             solutions_dir=args.solutions, extra_checks=args.extra_checks,
                             cell_timeout=args.cell_timeout, timeout=args.timeout, unsafe=args.unsafe, salt=args.seed,
                             manual_scores=manual_scores)
    except (UsageError, GradingSetupError, FileNotFoundError, SandboxUnavailable) as err:
        say(f"error: {err}")
        return 2
    for report in reports:  # every sandbox is gone by now
        say(report.format() + "\n")
    say(summary_table(reports))
    if args.csv:
        write_csv(reports, args.csv)
        say(f"wrote {args.csv}")
    if json_to_stdout:
        print(grades_json(reports))
    elif args.json:
        Path(args.json).write_text(grades_json(reports) + "\n", encoding="utf-8")
        say(f"wrote {args.json}")
    ungraded = [r for r in reports if r.ungraded]
    if ungraded and not args.allow_ungraded:
        say(f"error: {len(ungraded)} file(s) could not be graded ({', '.join(r.submission for r in ungraded)}); "
            "fix them or pass --allow-ungraded")
        return 1
    return 0
