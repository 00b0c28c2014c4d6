"""The course's command line: ``python -m llmsys {info,doctor,zoo,course,claims,ledger,labs,chapters,grade,classroom,serve,serve-router}``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def cmd_info(args) -> int:
    from llmsys.core import device
    from llmsys.course import doctor

    for key, value in device.summary().items():
        print(f"{key:<20} {value}")
    print()
    facts = doctor.found()
    print("\n".join(doctor.describe(facts)))
    print()
    print(device.gpu_cells_note())
    print()
    for number, title, gpu_cells, how in doctor.chapter_readiness(facts):
        print(f"  ch{number} {title:<24} GPU cells: {gpu_cells} -> {how}")
    return 0


def usage_error(command: str, message: str) -> int:
    """One line on stderr and the exit status of a misused command."""
    print(f"python -m llmsys {command}: error: {message}", file=sys.stderr)
    return 2


def cmd_doctor(args) -> int:
    from llmsys.course import doctor

    try:
        outcomes = doctor.run(args.out, require_gpu=args.gpu, only=args.steps)
    except ValueError as error:
        return usage_error("doctor", str(error))
    return 1 if any(o.status == "FAILED" for o in outcomes) else 0


def cmd_zoo(args) -> int:
    from llmsys.course import catalog

    unknown = [name for name in args.names if name not in catalog.names()]
    if unknown:
        return usage_error("zoo", f"no zoo model named {', '.join(map(repr, unknown))}; choose from {', '.join(catalog.names())}")
    catalog.build(args.names or None, force=args.force)
    print(catalog.report())
    return 0


def cmd_course(args) -> int:
    from llmsys.course.runner import CHAPTERS, run_course

    unknown = sorted(set(args.chapters or []) - {c.number for c in CHAPTERS})
    if unknown:
        return usage_error("course", f"no chapter {', '.join(map(str, unknown))}; "
                                     f"chapters are {', '.join(str(n) for n in sorted({c.number for c in CHAPTERS}))}")
    if args.jobs is not None and args.jobs < 1:
        return usage_error("course", f"--jobs must be 1 or more, got {args.jobs}")
    results = run_course(args.chapters, args.out, stop_on_error=args.stop_on_error, jobs=args.jobs)
    return 1 if any(r.error for r in results) else 0


def cmd_claims(args) -> int:
    from llmsys.core.cache import atomic_write_json
    from llmsys.course import claims

    if args.chapter is not None and args.chapter not in range(12):
        return usage_error("claims", f"--chapter {args.chapter} is not a chapter; use 0 to 11")
    verdicts = claims.table(args.chapter)
    print(claims.format_table(verdicts))
    if args.json:
        atomic_write_json(Path(args.json), [v.as_dict() for v in verdicts])
        print(f"wrote {args.json}")
    return 0


def cmd_ledger(args) -> int:
    from llmsys.core import ledger
    from llmsys.course.runner import CHAPTERS

    numbers = sorted({c.number for c in CHAPTERS})
    if args.upto is not None and args.upto not in numbers:
        return usage_error("ledger", f"--upto {args.upto} is not a chapter; use one of {', '.join(map(str, numbers))}")
    if args.json:
        print(json.dumps(ledger.entries(upto=args.upto), indent=1))
    else:
        ledger.show(upto=args.upto)
    return 0


def cmd_labs(args) -> int:
    from llmsys.course import labs
    from llmsys.course.classroom import cli as classroom

    if args.labs_command == "release" and args.to:
        if not args.users:
            return usage_error("labs release", "--to EXCHANGE needs --users FILE (the class list)")
        return classroom.cmd_release(args)
    if args.labs_command == "release":
        if args.users or args.lab:
            return usage_error("labs release", "--users and --lab go with --to EXCHANGE, not --out")
        return labs.main_release(args.out)
    if args.labs_command in ("collect", "return"):
        return {"collect": classroom.cmd_collect, "return": classroom.cmd_return}[args.labs_command](args)
    return labs.main_build(check=args.check)


def cmd_chapters(args) -> int:
    from llmsys.course import chapters, syllabus

    return chapters.main_build(check=args.check) or syllabus.main_write(check=args.check)


def cmd_serve(args) -> int:
    from llmsys.serving.api import run_server
    from llmsys.serving.served import load_served

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host}, reachable from other machines; there is no authentication",
              file=sys.stderr)
    for name in ("port", "max_num_seqs", "kv_blocks", "block_size", "token_budget"):
        value = getattr(args, name)
        if value < 1 or (name == "port" and value > 65535):
            return usage_error("serve", f"--{name.replace('_', '-')} must be a positive integer"
                                        f"{' up to 65535' * (name == 'port')}, got {value}")
    try:
        served = load_served(args.model, args.dtype, args.context)
    except (ValueError, KeyError) as e:
        return usage_error("serve", str(e))
    run_server(served, args.host, args.port, args.drain, num_blocks=args.kv_blocks, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_queue=args.max_queue, token_budget=args.token_budget)
    return 0


def cmd_serve_router(args) -> int:
    from llmsys.serving.replica_health import Timeouts
    from llmsys.serving.router import run_router

    if not 1 <= args.port <= 65535:
        return usage_error("serve-router", f"--port must be a positive integer up to 65535, got {args.port}")
    try:
        timeouts = Timeouts(connect=args.connect_timeout, first_byte=args.first_byte_timeout,
                            stream_idle=args.stream_idle_timeout, health=args.health_timeout,
                            interval=args.health_interval, read=args.read_timeout)
        run_router(args.replicas, args.host, args.port, args.policy, replica_blocks=args.replica_blocks,
                   timeouts=timeouts, block_size=args.block_size, cache_threshold=args.cache_threshold,
                   balance_abs=args.balance_abs, balance_rel=args.balance_rel)
    except ValueError as e:
        return usage_error("serve-router", str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grade"]:  # the grader owns its own options
        from llmsys.course import grading

        return grading.main(argv[1:])

    parser = argparse.ArgumentParser(prog="python -m llmsys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="what this machine has and how each chapter's GPU cells run here").set_defaults(run=cmd_info)

    p = sub.add_parser("doctor", help="self-check of this machine (a GPU server) before class: one line per step")
    p.add_argument("--gpu", action="store_true", help="a missing GPU is a failure, not a reason to skip")
    p.add_argument("--out", default="doctor_out", help="folder for the logs and summary.txt")
    from llmsys.course.doctor import STEPS

    p.add_argument("--steps", nargs="+", metavar="STEP",
                   help=f"run only these steps (default: all): {', '.join(s.name for s in STEPS)}")
    p.set_defaults(run=cmd_doctor)

    p = sub.add_parser("zoo", help="build (if needed) and report the embedded models")
    p.add_argument("names", nargs="*", help="models to build (default: all)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(run=cmd_zoo)

    p = sub.add_parser("course", help="run chapter notebooks headless and print the running ledger")
    p.add_argument("--chapters", type=int, nargs="+", help="chapter numbers (default: all)")
    p.add_argument("--out", default="course_out", help="folder for executed notebooks and HTML")
    p.add_argument("--stop-on-error", action="store_true", help="stop at the first failing chapter")
    p.add_argument("--jobs", type=int, help="chapters run side by side, the cores split between them "
                                            "(default: 2 where there are 2 cores or more)")
    p.set_defaults(run=cmd_course)

    p = sub.add_parser("claims", help="the lectures' central claims, their experiments and verdicts on this machine")
    p.add_argument("--chapter", type=int, help="one chapter's claims only")
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    p.set_defaults(run=cmd_claims)

    p = sub.add_parser("ledger", help="print the running comparison table")
    p.add_argument("--upto", type=int, help="last chapter to include")
    p.add_argument("--json", action="store_true", help="print the table as JSON (for tools)")
    p.set_defaults(run=cmd_ledger)

    p = sub.add_parser("labs", help="generate student labs from solutions/")
    lab_sub = p.add_subparsers(dest="labs_command", required=True)
    b = lab_sub.add_parser("build", help="write labs/ from solutions/")
    b.add_argument("--check", action="store_true", help="only check that labs/ is up to date")
    b.set_defaults(run=cmd_labs)
    r = lab_sub.add_parser("release", help="write what students get (labs and the llmsys package, no solutions) to a "
                                           "folder, or a copy of each lab into each student's exchange folder")
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="a new or empty folder for the course as students get it")
    where.add_argument("--to", metavar="EXCHANGE", help="the exchange: one folder per student (see --users)")
    r.add_argument("--users", metavar="FILE", help="the class list (CSV with a username column), with --to")
    r.add_argument("--lab", nargs="+", metavar="NAME", help="only these labs, e.g. lab00_warmup (default: all), with --to")
    r.set_defaults(run=cmd_labs)
    r = lab_sub.add_parser("collect", help="copy submissions out of the exchange: late ones flagged, every version kept")
    r.add_argument("--from", dest="from_", required=True, metavar="EXCHANGE")
    r.add_argument("--to", required=True, metavar="DIR", help="writes DIR/<lab>/submitted/<student>/<lab>.ipynb")
    r.add_argument("--lab", required=True, help="the lab, e.g. lab00_warmup")
    r.add_argument("--deadline", metavar="ISO", help="e.g. 2026-03-02T17:00+01:00 (kept for later collects)")
    r.set_defaults(run=cmd_labs)
    r = lab_sub.add_parser("return", help="put each student's feedback page (grade --feedback) into their folder")
    r.add_argument("--from", dest="from_", required=True, metavar="FEEDBACK", help="the folder of grade --feedback")
    r.add_argument("--to", required=True, metavar="EXCHANGE")
    r.set_defaults(run=cmd_labs)

    p = sub.add_parser("chapters", help="generate chapter notebooks with exercises from solutions/chapters/")
    chapter_sub = p.add_subparsers(dest="chapters_command", required=True)
    b = chapter_sub.add_parser("build", help="write notebooks/ from solutions/chapters/ and the README's chapter and lab tables")
    b.add_argument("--check", action="store_true", help="only check that notebooks/ and those tables are up to date")
    b.set_defaults(run=cmd_chapters)

    sub.add_parser("grade", help="grade submissions (see `python -m llmsys grade --help`; `grade merge` for shards)")

    p = sub.add_parser("classroom", help="run a class: a JupyterHub config, gradebook CSVs, an nbgrader export")
    from llmsys.course.classroom.cli import add_commands

    add_commands(p.add_subparsers(dest="classroom_command", required=True))

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a model (chapter 9's engine)")
    p.add_argument("--model", default="smollm2", help="a zoo model: smollm2 (the real chat model) or tiny/draft/target")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--context", type=int, default=None, help="context limit in tokens (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    p.add_argument("--max-queue", type=int, default=64, help="accepted requests waiting beyond those; more get 429")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV cache size in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--token-budget", type=int, default=256, help="tokens per engine step (chunked prefill)")
    p.add_argument("--drain", type=float, default=30.0, help="seconds running requests get to finish on shutdown")
    p.set_defaults(run=cmd_serve)

    p = sub.add_parser("serve-router", help="one OpenAI-compatible address in front of serve replicas, routing "
                                             "each request to the replica holding its prompt's prefix")
    p.add_argument("--replicas", nargs="+", required=True, metavar="URL", help="the replicas, e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="prefix", choices=("prefix", "round-robin"))
    p.add_argument("--block-size", type=int, default=16, help="the replicas' --block-size (prefix hashes per block)")
    p.add_argument("--replica-blocks", type=int, default=512, help="the replicas' --kv-blocks (how much each holds)")
    p.add_argument("--cache-threshold", type=float, default=0.3,
                   help="share of the prompt a replica must hold for its prefix to decide")
    p.add_argument("--balance-abs", type=int, default=8, help="loads differing by more requests than this (and ...")
    p.add_argument("--balance-rel", type=float, default=1.5, help="... by more than this ratio) go to the least loaded")
    p.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to open a connection to a replica")
    p.add_argument("--first-byte-timeout", type=float, default=5.0,
                   help="seconds without a reply's headers (or a stream's first event) before the replica's "
                        "health is checked: a hung one is marked down and the request sent elsewhere; a working "
                        "one is waited for")
    p.add_argument("--stream-idle-timeout", type=float, default=10.0,
                   help="seconds between two events of a stream before the replica's health is checked (a hung one "
                        "ends the stream with an error event); long streams are never cut while events arrive")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds a replica gets to answer /health")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between background health checks")
    p.add_argument("--read-timeout", type=float, default=600.0,
                   help="the longest silence accepted from a replica that passes its health checks")
    p.set_defaults(run=cmd_serve_router)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
