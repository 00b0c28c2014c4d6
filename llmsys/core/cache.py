"""Where the course keeps what it builds (models, tokenizer, ledger), and how it
writes there without ever leaving a half-written file behind.

The entry store: ``entry(name, spec_hash, build_fn, parse_fn)`` builds an entry once and
caches it in ``cache_dir()/zoo/<name>/`` with a ``manifest.json`` that records the hash of
what built it and the sha256 of every file. An entry is written to a temporary folder and
renamed into place only when complete; a corrupted, partial or stale entry is detected on
load, reported with a ``CacheWarning`` and rebuilt, never half-loaded. Building holds a file
lock, so two processes asking for the same entry build it once. Chapters register their
own entries through it (the zoo's models, the real model, an EAGLE head, a student).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

# Bump to invalidate every cached entry when the way entries are built changes.
FORMAT_VERSION = 1


def cache_dir() -> Path:
    """``$LLMSYS_CACHE`` if set, else ``$XDG_CACHE_HOME/llmsys`` or ``~/.cache/llmsys``."""
    root = os.environ.get("LLMSYS_CACHE")
    if root:
        path = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(xdg) / "llmsys"
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename over ``path``:
    a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive flock on ``path`` (created if missing), so that processes running side by
    side (chapters, pytest-xdist workers) take turns at a read-modify-write or a build."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    """The file's sha256 in hex, read in 1 MiB chunks (model files are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- the entry store


class CacheWarning(UserWarning):
    """A cached entry was corrupted, partial or stale and is being rebuilt."""


class InvalidEntry(Exception):
    """An entry exists but cannot be trusted (another format, a stale hash, a bad file)."""


def entry(name: str, spec_hash: str, build_fn, parse_fn, force: bool = False, progress: bool = True):
    """Build once and cache: the entry ``name`` parsed by ``parse_fn``, built first when it is
    missing, stale (its manifest holds another ``spec_hash``) or damaged.

    ``build_fn(folder, progress) -> dict`` writes the entry's files into ``folder`` (a temporary
    folder renamed into place only when complete) and returns extra manifest fields;
    ``parse_fn(folder, manifest, files) -> value`` turns the verified files (name -> bytes)
    into what the caller wants."""
    if not force:
        with contextlib.suppress(FileNotFoundError, InvalidEntry):
            return read_entry(name, spec_hash, parse_fn)
    with file_lock(entries_dir() / f".{name}.lock"):
        problem = None
        if not force:  # someone may have built it while we waited for the lock
            try:
                return read_entry(name, spec_hash, parse_fn)
            except FileNotFoundError:
                pass
            except InvalidEntry as e:
                problem = str(e)
        if problem:
            warnings.warn(f"llmsys cache: {name!r} {problem}; rebuilding it", CacheWarning, stacklevel=3)
        _build_entry(name, spec_hash, build_fn, progress)
        return read_entry(name, spec_hash, parse_fn)


def read_entry(name: str, spec_hash: str, parse_fn):
    """Verify manifest, spec hash and every file's sha256, then parse; builds nothing.

    Raises FileNotFoundError if there is no entry, InvalidEntry if there is a broken one."""
    folder = entry_dir(name)
    if not folder.is_dir():
        raise FileNotFoundError(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest.get("format") != FORMAT_VERSION:
            raise InvalidEntry("was written by another version of llmsys")
        if manifest.get("spec_hash") != spec_hash:
            raise InvalidEntry("is stale (its spec or tokenizer changed)")
        files = {}
        for file_name, sha in manifest["files"].items():
            files[file_name] = (folder / file_name).read_bytes()
            if hashlib.sha256(files[file_name]).hexdigest() != sha:
                raise InvalidEntry(f"is corrupted ({file_name} does not match its sha256)")
        return parse_fn(folder, manifest, files)
    except InvalidEntry:
        raise
    except Exception as e:  # missing or unreadable manifest/files, bad JSON, bad tensors
        raise InvalidEntry(f"is corrupted or partial ({type(e).__name__}: {e})") from e


def read_manifest(name: str, spec_hash: str) -> dict | None:
    """The verified manifest of entry ``name``, or None when it is missing or invalid."""
    with contextlib.suppress(FileNotFoundError, InvalidEntry):
        return read_entry(name, spec_hash, lambda folder, manifest, files: manifest)
    return None


def entries_dir() -> Path:
    path = cache_dir() / "zoo"
    path.mkdir(parents=True, exist_ok=True)
    return path


def entry_dir(name: str) -> Path:
    """The folder of the entry ``name`` (it may not exist yet)."""
    return entries_dir() / name


def spec_hash(spec) -> str:
    """A stable hash of a JSON-able description of how an entry is built (include FORMAT_VERSION in it)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def tensor_bytes(obj) -> bytes:
    """``obj`` (tensors, dicts of tensors) as the bytes torch.save writes."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _build_entry(name: str, spec_hash: str, build_fn, progress: bool) -> None:
    """Build into a temporary folder and rename it into place only when complete."""
    root = entries_dir()
    for leftover in root.glob(f".{name}.*"):  # debris of an interrupted build (we hold the lock)
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-"))
    try:
        extra = build_fn(tmp, progress)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if not p.name.startswith(".")}
        manifest = {"name": name, "format": FORMAT_VERSION, "spec_hash": spec_hash, "files": files,
                    "torch_version": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
        atomic_write_json(tmp / "manifest.json", manifest)
        final = root / name
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.old-"))
            os.replace(final, old / name)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
