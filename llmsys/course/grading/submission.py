"""Reading a submission: its bytes once (hashed), its notebook, its student and its lab."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import nbformat

from .. import labs
from ..runner import REPO
from .report import shorten

MAX_SUBMISSION_BYTES = 64_000_000  # larger files are refused unread


class GradingSetupError(ValueError):
    """A problem with the instructor's input (reference, extra checks), not the submission."""


class NotANotebook(ValueError):
    """The submission cannot be read as a notebook; the message says why."""


def snapshot(path: Path) -> tuple[bytes | None, str, str | None]:
    """The submission's bytes, their SHA-256, and why it cannot be read (or None).

    Read once, before any kernel starts: what is graded is what was hashed.
    """
    try:
        size = path.stat().st_size
        if size > MAX_SUBMISSION_BYTES:
            return None, "", (f"the file is {size / 1e6:.0f} MB, over the {MAX_SUBMISSION_BYTES / 1e6:.0f} MB limit; "
                              "clear the outputs (Edit > Clear Outputs of All Cells), save and submit again")
        raw = path.read_bytes()
    except OSError as err:
        return None, "", f"cannot read the file: {err.strerror or err}"
    return raw, hashlib.sha256(raw).hexdigest(), None


def read_submission(raw: bytes):
    """The submission's bytes as a v4 notebook, or NotANotebook with the reason."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise NotANotebook(f"not a notebook: the file is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise NotANotebook(f"not a notebook: the file is not valid JSON ({err.msg} at line {err.lineno}, "
                           f"column {err.colno}); submit the .ipynb file Jupyter saves") from None
    if not isinstance(data, dict) or "nbformat" not in data:
        raise NotANotebook("not a notebook: the file is JSON but not a Jupyter notebook (no 'nbformat' field)")
    try:
        nb = nbformat.convert(nbformat.from_dict(data), 4)
    except Exception as err:  # any unreadable structure is the submission's fault
        raise NotANotebook(f"not a notebook: {shorten(type(err).__name__ + ': ' + str(err), 200)}") from None
    if not isinstance(nb.get("cells"), list):
        raise NotANotebook("not a notebook: it has no list of cells")
    for number, cell in enumerate(nb.cells, start=1):
        source = cell.get("source", "") if isinstance(cell, dict) else None
        if not isinstance(source, (str, list)) or (isinstance(source, list) and not all(isinstance(s, str) for s in source)):
            raise NotANotebook(f"not a notebook: cell {number} has no readable source")
        cell["source"] = labs.source_text(cell)
    return nb


def repo_solutions_dir() -> Path:
    """``solutions/`` next to the package (a source checkout), else in the working directory."""
    beside_package = REPO / "solutions"
    return beside_package if beside_package.is_dir() else Path("solutions")


def lab_id(text: str) -> tuple[int, str] | None:
    """``alice_lab00b_kernels`` -> (0, "b"): the lab's number and letter, if the text names one."""
    match = re.search(r"lab(\d+)([a-z]*)", text, re.IGNORECASE)
    return (int(match.group(1)), match.group(2).lower()) if match else None


def find_lab_file(folder: Path, hint: str) -> Path | None:
    """The notebook in ``folder`` for the lab that ``hint`` (a file or lab name) names, or None.

    A lab's full name inside the hint wins (``alice_lab00_warmup`` holds
    ``lab00_warmup``); else the lab id must match (``lab00`` is
    ``lab00_warmup``, not ``lab00b_kernels``).
    """
    notebooks = sorted(folder.glob("*.ipynb"))
    named = [p for p in notebooks if p.stem.lower() in hint.lower()]
    if named:
        return max(named, key=lambda p: len(p.stem))
    wanted = lab_id(hint)
    found = [p for p in notebooks if wanted is not None and lab_id(p.stem) == wanted]
    if len(found) > 1:
        raise GradingSetupError(f"{folder} has several notebooks for the lab in {hint!r}: {[p.name for p in found]}")
    return found[0] if found else None


def find_reference(path: Path, nb, solutions_dir: Path) -> tuple[Path, str | None]:
    """Which lab a submission answers, and a note when its metadata and file name disagree.

    The generator's mark in the metadata wins (a renamed file is still found);
    a file name that names another lab is reported, never silently overridden.
    """
    metadata = nb.get("metadata") if nb is not None else None
    mark = metadata.get("llmsys") if isinstance(metadata, dict) else None
    stored = mark.get("lab") if isinstance(mark, dict) else None
    by_mark = find_lab_file(solutions_dir, stored) if isinstance(stored, str) and stored else None
    by_name = find_lab_file(solutions_dir, path.stem)
    if by_mark is not None:
        note = None
        if by_name is not None and by_name != by_mark:
            note = (f"the notebook's metadata says {by_mark.stem} but the file name says {by_name.stem}; "
                    f"graded as {by_mark.stem}")
        return by_mark, note
    if by_name is not None:
        return by_name, None
    raise LookupError(f"could not tell which lab this is: no lab in {solutions_dir} matches; name the file "
                      "labNN_<topic>.ipynb (or <student>_labNN_<topic>.ipynb) or pass --reference")


def read_instructor_notebook(path: Path, what: str):
    try:
        return nbformat.read(str(path), as_version=4)
    except Exception as err:
        raise GradingSetupError(f"cannot read {what} {path}: {err}") from None


def student_name(path: Path, lab: str | None = None) -> str:
    """The file name without the lab's name, else the folder's name.

    ``alice_lab00_warmup.ipynb`` and ``lab00_warmup_alice.ipynb`` -> ``alice``;
    ``bob/lab00_warmup.ipynb`` -> ``bob``.
    """
    stem = path.stem
    at = stem.lower().find(lab.lower()) if lab else -1
    if at >= 0:
        stem = stem[:at] + stem[at + len(lab):]
    else:
        stem = re.sub(r"lab\d+[a-z]*", "", stem, count=1, flags=re.IGNORECASE)
    return stem.strip(" _-.") or path.parent.name or path.stem
