"""The class list: a CSV with a ``username`` column, and optional columns for the LMS.

::

    username,name,email,section,lms_id,sis_id,role
    alice,Alice Liddell,alice@uni.edu,A,1001,S1001,student
    prof,Ada Lovelace,,,,,instructor

``username`` is the login on the hub and the student's folder in the exchange;
``name``, ``section``, ``lms_id`` (Canvas's numeric ID, Moodle's ID number) and
``sis_id`` feed the gradebook; ``role`` is ``student`` (the default) or
``instructor`` (an admin on the hub, no folder, no grade). A file with one
``username`` per line under that header is a valid roster.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

# A POSIX login name: it names a folder, a system user and a spawner's environment, so no '/' or '..'.
USERNAME = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
COLUMNS = ("username", "name", "email", "section", "lms_id", "sis_id", "role")
ROLES = ("student", "instructor")


class RosterError(ValueError):
    """A class list the classroom tools cannot use; the message says what to change."""


@dataclass(frozen=True)
class Person:
    username: str
    name: str = ""
    email: str = ""
    section: str = ""
    lms_id: str = ""
    sis_id: str = ""
    role: str = "student"


def read_roster(path: str | Path) -> list[Person]:
    """Everyone in the class list, in file order; raises RosterError naming the line to fix."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # utf-8-sig: spreadsheets write a BOM
            reader = csv.DictReader(f)
            header = [h.strip() for h in reader.fieldnames or []]
            rows = list(reader)
    except OSError as err:
        raise RosterError(f"cannot read the class list {path}: {err.strerror or err}") from None
    if "username" not in header:
        raise RosterError(f"{path}: the first line must be a header with a 'username' column "
                          f"(optional: {', '.join(COLUMNS[1:])}); it is {','.join(header) or 'empty'}")
    unknown = sorted(set(header) - set(COLUMNS))
    if unknown:
        raise RosterError(f"{path}: unknown column(s) {', '.join(unknown)}; the columns are {', '.join(COLUMNS)}")
    people, seen = [], set()
    for line, row in enumerate(rows, start=2):
        fields = {key.strip(): (value or "").strip() for key, value in row.items() if key is not None}
        if not any(fields.values()):
            continue
        person = Person(**{key: value for key, value in fields.items() if value})
        if not USERNAME.match(person.username):
            raise RosterError(f"{path}, line {line}: username {person.username!r} is not a login name "
                              "(lowercase letters, digits, '_', '.', '-', starting with a letter or '_', at most 32)")
        if person.username in seen:
            raise RosterError(f"{path}, line {line}: {person.username!r} is listed twice")
        if person.role not in ROLES:
            raise RosterError(f"{path}, line {line}: role {person.role!r} must be one of {', '.join(ROLES)}")
        seen.add(person.username)
        people.append(person)
    if not any(p.role == "student" for p in people):
        raise RosterError(f"{path}: no students in the class list")
    return people


def students(people: list[Person]) -> list[Person]:
    return [p for p in people if p.role == "student"]
