"""The command line of a class: ``classroom hub|gradebook|nbgrader`` and ``labs release --to|collect|return``.

Each returns an exit code: 0 done, 1 done with students to look at (a
problem in a folder, feedback with no folder to go to), 2 for input to fix
(one line saying what).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .exchange import ExchangeError, collect, collected_rows, parse_deadline, read_ledger, release, return_feedback
from .gradebook import FORMATS, GradebookError, gradebook_rows, read_grades, ungraded_students, write_gradebook
from .hub import HubError, devices_from, plan_hub, write_hub
from .roster import RosterError, read_roster, students

PROBLEMS = (ExchangeError, GradebookError, HubError, RosterError, FileNotFoundError)


def fail(command: str, error: Exception | str) -> int:
    print(f"python -m llmsys {command}: error: {error}", file=sys.stderr)
    return 2


def add_commands(sub) -> None:
    """The ``classroom`` subcommands, on an argparse subparsers object."""
    p = sub.add_parser("hub", help="write a JupyterHub config for a class on one GPU server")
    p.add_argument("--users", required=True, help="the class list (CSV with a username column)")
    p.add_argument("--out", required=True, help="folder for jupyterhub_config.py and its files")
    share = p.add_mutually_exclusive_group()
    share.add_argument("--gpus", type=int, help="GPUs to deal out (default: those nvidia-smi lists; 0: none)")
    share.add_argument("--mig", metavar="UUID,...", help="MIG slices to deal out, by UUID (nvidia-smi -L)")
    p.add_argument("--exchange", default="/srv/llmsys/exchange", help="the students' folders (labs release --to)")
    p.add_argument("--course-env", help="the environment the course is installed in (default: this one)")
    p.add_argument("--cpus", type=float, default=2.0, help="CPU cores per student")
    p.add_argument("--memory", default="16G", help="memory per student, e.g. 16G")
    p.add_argument("--idle-minutes", type=int, default=60, help="stop idle kernels and servers after this long")
    p.add_argument("--auth", default="pam", choices=("pam", "shared-password"),
                   help="system logins, or one class password read from $LLMSYS_HUB_PASSWORD at start")
    p.add_argument("--spawner", default="systemd", choices=("systemd", "local"),
                   help="systemd enforces the limits; local (no systemd) only passes them on")
    p.add_argument("--ip", default="127.0.0.1", help="address the hub listens on (put TLS in front of it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--shards", type=int, default=4, help="array tasks in the Slurm grading script")
    p.add_argument("--force", action="store_true", help="overwrite the files of an earlier hub in --out")
    p.set_defaults(run=cmd_hub)

    p = sub.add_parser("gradebook", help="a CSV of one lab's grades for Canvas, Moodle, or anything")
    p.add_argument("grades", help="the JSON of `grade --json` or `grade merge --json`")
    p.add_argument("--users", required=True, help="the class list")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="the CSV to write")
    p.add_argument("--lab", help="the lab (needed when the grades hold several)")
    p.add_argument("--assignment", help="the column's name in the LMS (default: the lab's name)")
    p.add_argument("--collected", help="collected.json of `labs collect`: lateness in the generic CSV")
    p.add_argument("--moodle-id", default="username", choices=("username", "email", "lms_id"),
                   help="the class list column Moodle matches users by")
    p.add_argument("--allow-ungraded", action="store_true",
                   help="exit 0 even when some submissions could not be graded (their cells stay blank)")
    p.set_defaults(run=cmd_gradebook)

    p = sub.add_parser("nbgrader", help="a lab in nbgrader's source format, to run it in nbgrader instead")
    p.add_argument("lab", help="a solution notebook, e.g. solutions/lab00_warmup.ipynb")
    p.add_argument("--out", required=True, help="nbgrader's course folder; writes source/<lab>/<lab>.ipynb")
    p.set_defaults(run=cmd_nbgrader)


def cmd_hub(args) -> int:
    try:
        people = read_roster(args.users)
        plan = plan_hub(people, devices_from(args.gpus, args.mig), Path(args.exchange).resolve(),
                        args.course_env or sys.prefix, cpus=args.cpus, memory=args.memory,
                        idle_minutes=args.idle_minutes, ip=args.ip, port=args.port, authenticator=args.auth,
                        spawner=args.spawner)
        if args.shards < 1:
            raise HubError(f"--shards must be 1 or more, got {args.shards}")
    except PROBLEMS as error:
        return fail("classroom hub", error)
    try:
        written = write_hub(plan, args.out, args.shards, force=args.force)
    except HubError as error:
        return fail("classroom hub", error)
    except OSError as error:
        return fail("classroom hub", f"cannot write --out {args.out}: {error.strerror}; choose a writable folder")
    for path in written:
        print(f"wrote {path}")
    for username, entry in plan["users"].items():
        gpu = entry["environment"]["CUDA_VISIBLE_DEVICES"] or "none"
        share = entry["environment"].get("LLMSYS_GPU_MEMORY_FRACTION", "-")
        print(f"  {username:<16} GPU {gpu:<12} memory share {share}")
    return 0


def cmd_gradebook(args) -> int:
    import json

    try:
        people = read_roster(args.users)
        collected = json.loads(Path(args.collected).read_text(encoding="utf-8")) if args.collected else None
        reports = read_grades(args.grades)
        header, rows = gradebook_rows(args.format, reports, people, args.assignment, args.lab,
                                      collected, args.moodle_id)
    except PROBLEMS as error:
        return fail("classroom gradebook", error)
    try:
        write_gradebook(args.out, header, rows)
    except OSError as error:
        return fail("classroom gradebook", f"cannot write --out {args.out}: {error.strerror}; choose a writable path")
    grade = header.index("score") if args.format == "generic" else len(header) - 1
    blank = [row[0] for row in rows if row[grade] == ""]
    print(f"wrote {args.out}: {len(rows)} student(s), {len(blank)} without a grade"
          + (f" ({', '.join(blank)})" if blank else ""))
    unreadable = ungraded_students(reports, people, args.lab)
    if unreadable:
        print(f"not graded (the grader could not read their file; cell left blank): {', '.join(unreadable)}")
        return 0 if args.allow_ungraded else 1
    return 0


def cmd_nbgrader(args) -> int:
    from .nbgrader_export import export_lab

    try:
        path = export_lab(args.lab, args.out)
    except (ValueError, FileNotFoundError) as error:
        return fail("classroom nbgrader", error)
    print(f"wrote {path}; in {args.out}: nbgrader generate_assignment {Path(path).parent.name}")
    return 0


def known_labs(asked: list[str]) -> dict[str, str]:
    """{file name: student copy} of the labs asked for (all when none), or ExchangeError naming the real ones."""
    from .. import labs
    from ..runner import REPO

    texts = labs.expected_labs(REPO / "solutions")
    unknown = sorted(set(asked) - {Path(name).stem for name in texts})
    if unknown:
        raise ExchangeError(f"no lab {', '.join(unknown)}; labs are {', '.join(Path(n).stem for n in texts)}")
    return {name: text for name, text in texts.items() if not asked or Path(name).stem in asked}


def cmd_release(args) -> int:
    try:
        people = read_roster(args.users)
        lines = release(known_labs(args.lab or []), [p.username for p in students(people)], args.to)
    except (*PROBLEMS, ValueError) as error:
        return fail("labs release", error)
    print("\n".join(lines))
    return 1 if any("not released" in line for line in lines) else 0


def cmd_collect(args) -> int:
    try:
        known_labs([args.lab])
        deadline = parse_deadline(args.deadline) if args.deadline else None
        before = read_ledger(Path(args.to) / args.lab, args.lab)["deadline"]
        ledger = collect(args.from_, args.to, args.lab, deadline)
    except PROBLEMS as error:
        return fail("labs collect", error)
    rows = collected_rows(ledger)
    if before and ledger["deadline"] != before:
        print(f"deadline changed from {before} to {ledger['deadline']}")
    print(f"{args.lab}: deadline {ledger['deadline'] or 'none'}; graded copies in {Path(args.to) / args.lab / 'submitted'}")
    for row in rows:
        extra = f"  {row['late_by']} late" if row["late_by"] else ""
        print(f"  {row['username']:<16} {row['status']:<8} {row['submitted_at'] or '-':<28} "
              f"versions {row['versions']}{extra}{'  ' + row['problem'] if row['problem'] else ''}")
    return 1 if any(row["problem"] for row in rows) else 0


def cmd_return(args) -> int:
    try:
        lines = return_feedback(args.from_, args.to)
    except PROBLEMS as error:
        return fail("labs return", error)
    print("\n".join(lines))
    return 1 if any("not returned" in line for line in lines) else 0
