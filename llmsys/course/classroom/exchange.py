"""Hand out, collect, return: one folder per student in an exchange folder.

::

    EXCHANGE/alice/lab00_warmup.ipynb           the copy handed out (the student works in it)
    EXCHANGE/alice/submit/lab00_warmup.ipynb    the student saves a copy here to submit
    EXCHANGE/alice/feedback/lab00_warmup.html   the grade report, put back by ``labs return``

    COLLECTED/lab00_warmup/submitted/alice/lab00_warmup.ipynb   the latest readable version: what ``grade`` reads
    COLLECTED/lab00_warmup/history/alice/20260302T170412.123456Z_3f9c1a7e2b4d.ipynb   every version seen
    COLLECTED/lab00_warmup/collected.json       times, hashes, late flags

A submission's time is its file's status-change time (``st_ctime``), which the
kernel sets on every write and a user cannot set back (``touch -d`` changes
only the modification time); it is that of the server's clock, not of anything
the student's code reports. Collecting never deletes or overwrites a version:
run it as often as you like (a resubmission adds a version), and a deadline
moved later re-flags every version from its stored time. Folders the students
own are entered without following links, so a student's symlink can neither
show another student's work nor make the instructor's process write elsewhere.
A version that is not a notebook (nbformat cannot read it) is kept in the
history and flagged, and the last readable version stays the graded copy.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import stat
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

SUBMIT, FEEDBACK = "submit", "feedback"
MAX_SUBMISSION_BYTES = 64 * 2**20  # a lab with outputs cleared is well under 1 MB
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class ExchangeError(ValueError):
    """A folder or option the exchange cannot use; the message says what to change."""


def parse_deadline(text: str) -> datetime:
    """An ISO 8601 time with its UTC offset (a time without one would depend on the machine's zone)."""
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ExchangeError(f"--deadline {text!r} is not an ISO 8601 time; write e.g. 2026-03-02T17:00+01:00") from None
    if moment.tzinfo is None:
        raise ExchangeError(f"--deadline {text!r} has no UTC offset; add one, e.g. {text.strip()}+01:00 or "
                            f"{text.strip()}Z for UTC")
    return moment.astimezone(timezone.utc)


def utc_text(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def how_late(seconds: float) -> str:
    minutes = round(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    parts = [f"{days} d"] * bool(days) + [f"{hours} h"] * bool(hours) + [f"{minutes} min"]
    return " ".join(parts) if seconds >= 60 else f"{seconds:.0f} s"


# ------------------------------------------------------- student folders


def system_user(username: str):
    """The user's uid and gid where this process may hand folders to them (root, and the user exists)."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(username)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def is_link(name: str, folder_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextmanager
def student_folder(exchange: Path, username: str, *parts: str, create: bool = False):
    """A file descriptor of EXCHANGE/username/parts..., every step opened without following links."""
    fds = [os.open(exchange, DIR_FLAGS)]
    owner = system_user(username)
    try:
        for name in (username, *parts):
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=fds[-1])
                    if owner:
                        os.chown(name, *owner, dir_fd=fds[-1], follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                fds.append(os.open(name, DIR_FLAGS, dir_fd=fds[-1]))
            except OSError as err:  # ELOOP (a link), ENOTDIR, ENOENT
                where = exchange / username / Path(*parts)
                if err.errno in (errno.ELOOP, errno.ENOTDIR) and is_link(name, fds[-1]):
                    raise ExchangeError(f"{where} is a link, not a folder; it must be a real folder") from None
                raise ExchangeError(f"{where}: not a folder of the exchange ({err.strerror}); "
                                    "it must be a real folder, not a link") from None
        yield fds[-1]
    finally:
        for fd in reversed(fds):
            os.close(fd)


def write_new(folder_fd: int, name: str, data: bytes, owner=None, replace: bool = False) -> bool:
    """Write a file in a folder the student owns; False when it exists and ``replace`` is off."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_TRUNC if replace else os.O_EXCL)
    try:
        fd = os.open(name, flags, 0o644, dir_fd=folder_fd)
    except FileExistsError:  # O_EXCL refuses a link too, even one that points nowhere
        if is_link(name, folder_fd):
            raise ExchangeError(f"{name} is a link, not a file; remove it") from None
        return False
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise ExchangeError(f"{name} is a link, not a file; remove it") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ExchangeError(f"{name} in a student's folder is not a regular file; remove it")
        os.write(fd, data)
        if owner:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)
    return True


# ----------------------------------------------------------------- release


def release(lab_texts: dict[str, str], usernames: list[str], exchange: str | Path) -> list[str]:
    """A copy of each lab in each student's folder; a copy already there is the student's work and is kept.
    A student whose folder cannot be used (a link) gets a "not released" line; the others go on."""
    exchange = Path(exchange)
    exchange.mkdir(parents=True, exist_ok=True)
    exchange.chmod(0o711)  # students reach their own folder; they cannot list the others
    lines = []
    for username in usernames:
        owner = system_user(username)
        try:
            with student_folder(exchange, username, SUBMIT, create=True):
                pass
            with student_folder(exchange, username, FEEDBACK, create=True):
                pass
            with student_folder(exchange, username) as folder:
                for name, text in lab_texts.items():
                    written = write_new(folder, name, text.encode("utf-8"), owner)
                    lines.append(f"{username}: {name} "
                                 f"{'released' if written else 'kept (already there; never overwritten)'}")
        except (ExchangeError, OSError) as err:
            lines.append(f"{username}: not released: {err}")
    return lines


# ----------------------------------------------------------------- collect


def read_submission(exchange: Path, username: str, lab: str):
    """(bytes, submitted_at) of the student's submission, or None; never follows links, never waits on a pipe."""
    name = f"{lab}.ipynb"
    try:
        with student_folder(exchange, username, SUBMIT) as folder:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            except FileNotFoundError:
                return None
            try:
                for _ in range(5):  # the student may be saving right now: read until the file holds still
                    before = os.fstat(fd)
                    if not stat.S_ISREG(before.st_mode):
                        raise ExchangeError(f"{exchange / username / SUBMIT / name} is not a regular file")
                    if before.st_size > MAX_SUBMISSION_BYTES:
                        raise ExchangeError(f"{exchange / username / SUBMIT / name} is {before.st_size / 2**20:.0f} MB, "
                                            f"over {MAX_SUBMISSION_BYTES // 2**20} MB: ask the student to clear outputs "
                                            "and submit again (it stays in their folder)")
                    data = os.pread(fd, before.st_size + 1, 0)
                    after = os.fstat(fd)
                    if (before.st_ctime_ns, before.st_size) == (after.st_ctime_ns, after.st_size) == \
                            (after.st_ctime_ns, len(data)):
                        break
                else:
                    raise ExchangeError(f"{exchange / username / SUBMIT / name} kept changing while it was read; "
                                        "collect again")
                submitted = max(after.st_ctime_ns, after.st_mtime_ns) / 1e9
                return data, datetime.fromtimestamp(submitted, timezone.utc)
            finally:
                os.close(fd)
    except ExchangeError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:  # the submission is a link
            raise ExchangeError(f"{exchange / username / SUBMIT / name} is a link, not a file; "
                                "the student must save the notebook itself") from None
        raise


def is_notebook(data: bytes) -> bool:
    """Whether nbformat reads these bytes as a notebook (garbage, or a notebook with text appended, is not)."""
    import nbformat

    try:
        nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception:  # noqa: BLE001 - nbformat raises many kinds (JSON, schema, version, Unicode)
        return False
    return True


def read_ledger(root: Path, lab: str) -> dict:
    """COLLECTED/<lab>/collected.json, or a new ledger."""
    path = root / "collected.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else \
        {"lab": lab, "deadline": None, "students": {}}


def collect(exchange: str | Path, out: str | Path, lab: str, deadline: datetime | None = None,
            now: datetime | None = None) -> dict:
    """Copy every new submission of ``lab`` out of the exchange; returns the ledger (also in collected.json).

    Problems with one student's folder (a link, a huge file) are recorded for
    that student and do not stop the others.
    """
    exchange, root = Path(exchange), Path(out) / lab
    if not exchange.is_dir():
        raise ExchangeError(f"no exchange folder at {exchange}; hand the lab out first with `labs release --to`")
    ledger_path = root / "collected.json"
    ledger = read_ledger(root, lab)
    if deadline is not None:
        ledger["deadline"] = utc_text(deadline)
    due = parse_deadline(ledger["deadline"]) if ledger["deadline"] else None
    collected_at = utc_text(now or datetime.now(timezone.utc))
    folders = [p for p in exchange.iterdir() if (p.is_dir() or p.is_symlink()) and not p.name.startswith(".")]
    for folder in sorted(folders):
        username = folder.name
        entry = ledger["students"].setdefault(username, {"versions": [], "problem": ""})
        try:
            found = read_submission(exchange, username, lab)
            entry["problem"] = ""
        except ExchangeError as err:
            entry["problem"] = str(err)
            continue
        if found is None:
            continue
        data, submitted_at = found
        digest = hashlib.sha256(data).hexdigest()
        if any(v["sha256"] == digest for v in entry["versions"]):
            continue
        stamp = utc_text(submitted_at).replace("-", "").replace(":", "")
        history = root / "history" / username / f"{stamp}_{digest[:12]}.ipynb"
        history.parent.mkdir(parents=True, exist_ok=True)
        history.write_bytes(data)
        entry["versions"].append({"submitted_at": utc_text(submitted_at), "collected_at": collected_at,
                                  "sha256": digest, "file": str(history.relative_to(root)),
                                  "notebook": is_notebook(data)})
        entry["versions"].sort(key=lambda v: v["submitted_at"])
    for username, entry in ledger["students"].items():
        for version in entry["versions"]:
            late = (parse_deadline(version["submitted_at"]) - due).total_seconds() if due else 0.0
            version["late"] = late > 0
            version["late_by"] = how_late(late) if late > 0 else ""
        if entry["versions"] and not entry["versions"][-1].get("notebook", True) and not entry["problem"]:
            kept = graded_version(entry)
            entry["problem"] = (f"problem: not a notebook (the version of {entry['versions'][-1]['submitted_at']}); "
                                + (f"graded: the version of {kept['submitted_at']}" if kept else "nothing to grade"))
        graded = graded_version(entry)
        if graded:  # the latest readable version is graded; a newer one replaces it, the history keeps both
            latest = root / "submitted" / username / f"{lab}.ipynb"
            latest.parent.mkdir(parents=True, exist_ok=True)
            temporary = latest.with_suffix(".tmp")
            temporary.write_bytes((root / graded["file"]).read_bytes())
            temporary.replace(latest)
    root.mkdir(parents=True, exist_ok=True)
    temporary = ledger_path.with_suffix(".tmp")
    temporary.write_text(json.dumps(ledger, indent=1) + "\n", encoding="utf-8")
    temporary.replace(ledger_path)
    return ledger


def graded_version(entry: dict) -> dict | None:
    """The latest version that is a notebook: the one graded."""
    return next((v for v in reversed(entry["versions"]) if v.get("notebook", True)), None)


def collected_rows(ledger: dict) -> list[dict]:
    """One row per student: the graded (latest readable) version's time and lateness, and how many versions."""
    rows = []
    for username, entry in sorted(ledger["students"].items()):
        latest = graded_version(entry)
        rows.append({"username": username,
                     "status": entry["problem"] and "problem" or ("missing" if latest is None else
                                                                  "late" if latest["late"] else "on time"),
                     "submitted_at": latest["submitted_at"] if latest else "",
                     "late_by": latest["late_by"] if latest else "", "versions": len(entry["versions"]),
                     "problem": entry["problem"]})
    return rows


# ------------------------------------------------------------------ return


def return_feedback(feedback_dir: str | Path, exchange: str | Path) -> list[str]:
    """FEEDBACK/<user>/<lab>.html into EXCHANGE/<user>/feedback/; a regrade's page replaces the old one."""
    feedback_dir, exchange = Path(feedback_dir), Path(exchange)
    if not feedback_dir.is_dir():
        raise ExchangeError(f"no feedback folder at {feedback_dir}; write it with `grade ... --feedback {feedback_dir}`")
    lines = []
    for page in sorted(feedback_dir.glob("*/*.html")):
        username = page.parent.name
        if not (exchange / username).is_dir():
            lines.append(f"{username}: no folder in {exchange}; {page.name} not returned")
            continue
        try:
            with student_folder(exchange, username, FEEDBACK, create=True) as folder:
                write_new(folder, page.name, page.read_bytes(), system_user(username), replace=True)
        except (ExchangeError, OSError) as err:  # one student's folder never stops the others'
            lines.append(f"{username}: {page.name} not returned: {err}")
            continue
        lines.append(f"{username}: {page.name} returned")
    return lines
