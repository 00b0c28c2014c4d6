"""``python -m llmsys grade SUBMISSION... [--csv PATH] [--json [PATH]] [--jobs N] [--feedback DIR]``.

A large class across machines: ``grade ... --shard K/N --seed S --json shardK.json``
on each of N machines (the same submissions and seed everywhere), then
``grade merge shard*.json --csv grades.csv --json grades.json``: the same
tables as one run. Shard K grades every N-th submission from the K-th in the
order one run would grade them (folders expanded, sorted by path).

Exit codes: 0 when every submission was graded; 1 when some could not be
graded (not a notebook, or its lab unknown; ``--allow-ungraded`` turns this
off); 2 for a usage or setup problem, with one line saying what to change.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .classroom import DEFAULT_CELL_TIMEOUT, DEFAULT_TIMEOUT, expand_submissions, grade_many
from .report import CheckResult, GradeReport, grades_json, summary_table, write_csv
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
    parser.add_argument("--feedback", metavar="DIR", help="write each student's report as DIR/<student>/<lab>.html")
    parser.add_argument("--shard", metavar="K/N", help="grade only shard K of N (0 <= K < N); needs --seed and --json")
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
    if args.shard is not None:
        parse_shard(args.shard)
        if args.seed is None or not args.json or args.json == "-":
            raise UsageError("--shard needs --seed S (every shard draws the same inputs) and --json PATH (for `grade merge`)")


def parse_shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise UsageError(f"--shard must be K/N with 0 <= K < N, e.g. 0/4, got {text!r}")
    return int(k), int(n)


def shard_of(paths: list[Path], shard: str | None) -> list[Path]:
    """Every N-th submission from the K-th, in the order one run grades them: a partition of the class."""
    if shard is None:
        return paths
    k, n = parse_shard(shard)
    return paths[k::n]


def report_from_dict(data: dict) -> GradeReport:
    """A report as ``GradeReport.to_dict`` wrote it (score and max are recomputed from the checks)."""
    fields = {key: value for key, value in data.items() if key not in ("checks", "score", "max_score")}
    return GradeReport(**fields, checks=[CheckResult(**check) for check in data["checks"]])


def main(argv=None) -> int:
    """Returns the exit code."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    say = (lambda text: print(text, file=sys.stderr)) if args.json == "-" else print
    try:
        validate(args)
        submissions = expand_submissions(args.submissions)
        if not submissions:
            raise UsageError(f"no .ipynb files in {' '.join(args.submissions)}")
        manual_scores = read_scores(args.manual_scores) if args.manual_scores else None
        reports = grade_many(shard_of(submissions, args.shard), jobs=args.jobs, reference_path=args.reference,
                             solutions_dir=args.solutions, extra_checks=args.extra_checks,
                             cell_timeout=args.cell_timeout, timeout=args.timeout, unsafe=args.unsafe, salt=args.seed,
                             manual_scores=manual_scores)
    except (UsageError, GradingSetupError, FileNotFoundError, SandboxUnavailable) as err:
        say(f"error: {err}")
        return 2
    if args.shard is not None:
        shard = {"shard": args.shard, "submissions": [r.to_dict() for r in reports]}
        Path(args.json).write_text(json.dumps(shard, indent=1) + "\n", encoding="utf-8")
        say(f"wrote shard {args.shard} ({len(reports)} submission(s)) to {args.json}; combine with `grade merge`")
        return 0
    return finish(reports, args, say)


def finish(reports: list[GradeReport], args, say) -> int:
    """Print the reports and write the tables and feedback a run asked for; the exit code."""
    for report in reports:  # every sandbox is gone by now
        say(report.format() + "\n")
    say(summary_table(reports))
    if args.feedback:
        from ..classroom.feedback import write_feedback

        pages = write_feedback([r.to_dict() for r in reports], args.feedback)
        say(f"wrote {len(pages)} feedback page(s) to {args.feedback}")
    if args.csv:
        write_csv(reports, args.csv)
        say(f"wrote {args.csv}")
    if args.json == "-":
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


def merge_main(argv) -> int:
    """``grade merge SHARD.json... [--csv PATH] [--json [PATH]] [--feedback DIR]``: one run's tables from N shards."""
    parser = argparse.ArgumentParser(prog="python -m llmsys grade merge",
                                     description="Combine the --json files of `grade --shard K/N` runs into one report.")
    parser.add_argument("shards", nargs="+", help="the JSON file of every shard, 0 to N-1")
    parser.add_argument("--csv", metavar="PATH")
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-")
    parser.add_argument("--feedback", metavar="DIR")
    parser.add_argument("--allow-ungraded", action="store_true")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    say = (lambda text: print(text, file=sys.stderr)) if args.json == "-" else print
    try:
        reports = merge_shards(args.shards)
    except UsageError as err:
        say(f"error: {err}")
        return 2
    return finish(reports, args, say)


def merge_shards(paths) -> list[GradeReport]:
    """The reports of all N shards, in the order one run gives them; every shard once, one seed."""
    shards = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            k, n = parse_shard(data["shard"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"{path} is not a shard written by `grade --shard K/N --json` ({err})") from None
        if k in shards:
            raise UsageError(f"shard {k}/{n} is given twice ({shards[k][0]} and {path})")
        shards[k] = (path, n, [report_from_dict(r) for r in data["submissions"]])
    counts = {n for _, n, _ in shards.values()}
    if len(counts) != 1:
        raise UsageError(f"the shards come from different splits: N = {sorted(counts)}")
    n = counts.pop()
    missing = sorted(set(range(n)) - set(shards))
    if missing:
        raise UsageError(f"shard(s) {', '.join(f'{k}/{n}' for k in missing)} missing; merge needs all {n}")
    salts = {r.salt for _, _, reports in shards.values() for r in reports}
    if len(salts) > 1:
        raise UsageError(f"the shards were graded with different seeds {sorted(salts)}; grade them again with one --seed")
    merged = []  # submission i of one run is submission i // n of shard i % n
    for i in range(sum(len(reports) for _, _, reports in shards.values())):
        reports = shards[i % n][2]
        if i // n >= len(reports):
            raise UsageError(f"shard {i % n}/{n} has {len(reports)} submission(s), too few for its place: "
                             "were all shards given the same submissions?")
        merged.append(reports[i // n])
    return merged
