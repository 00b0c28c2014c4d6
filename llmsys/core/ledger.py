"""The running ledger: for every technique, what memory it saves, what
communication it adds and what it trades off, with evidence from this machine.

The rows and their numbers at a reference scale live in ``llmsys.core.techniques``.
Chapter runs call ``record(...)`` with an analytic estimate, the value they saw
and the *kind* of that evidence:

* ``measured``: observed on this machine (bytes a hand-written ring sent, wall time
  of a real collective, peak bytes, tokens per second);
* ``counted``: payload sizes seen by a dispatcher, without timing anything;
* ``modelled``: a formula or a simulator. A formula checked against itself is never
  ``measured``.

Each record carries the machine, date and versions it came from; ``show`` marks
records from another machine (foreign) or other versions (stale). Measurements
persist in ``<cache>/ledger.json``, so the table grows as the reader works through
the course: HTML in a notebook, text in a terminal, JSON for tools.
"""

from __future__ import annotations

import datetime
import html
import json
import math
import os
import platform
import socket
import textwrap
from functools import cache
from pathlib import Path

from llmsys.core.accounting import GB
from llmsys.core.cache import atomic_write_json, cache_dir, file_lock
from llmsys.core.techniques import ROWS

KINDS = ("measured", "counted", "modelled")
FORMAT_VERSION = 2
_BY_NAME = {row.technique: row for row in ROWS}


class LedgerError(RuntimeError):
    """The ledger file cannot be read; it is left untouched."""


def ledger_path() -> Path:
    return cache_dir() / "ledger.json"


@cache
def origin() -> dict:
    """Where a record comes from: this machine and the versions that produced it."""
    import torch

    from llmsys import __version__

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    machine = f"{socket.gethostname()} ({platform.machine()}, {os.cpu_count()} cores, {gpu})"
    return {"machine": machine, "llmsys": __version__, "torch": torch.__version__}


def load_measurements(path: Path | None = None) -> dict[str, dict]:
    """Measurements recorded so far, by technique. A missing file is an empty ledger;
    an unreadable one raises LedgerError and is never overwritten."""
    path = Path(path or ledger_path())
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        measurements = data["measurements"]
        if not isinstance(measurements, dict):
            raise TypeError("'measurements' is not an object")
    except (ValueError, KeyError, TypeError) as err:
        raise LedgerError(
            f"The ledger file {path} is not a valid ledger ({err}). It was left as it is: "
            f"move it away (or delete it) to start a fresh ledger, or fix the JSON by hand."
        ) from err
    return measurements


def record(technique: str, estimate: float | None, measured: float, unit: str = "", note: str = "",
           kind: str = "measured", path: Path | None = None) -> dict:
    """Write one piece of evidence for a row of ``ROWS`` and return it.

    ``estimate`` is the analytic figure (None where there is none), ``measured`` what
    this run saw, ``kind`` one of ``KINDS``; the ratio measured/estimate is derived.
    """
    if technique not in _BY_NAME:
        raise KeyError(f"no ledger row named {technique!r}; known rows: {', '.join(_BY_NAME)}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not math.isfinite(float(measured)):
        raise ValueError(f"measured value for {technique!r} is not finite: {measured}")
    path = Path(path or ledger_path())
    entry = {
        "estimate": None if estimate is None else float(estimate),
        "measured": float(measured),
        "unit": unit,
        "note": note,
        "kind": kind,
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        **origin(),
    }
    with file_lock(path.with_name(f".{path.name}.lock")):  # chapters running side by side record at once
        measurements = load_measurements(path)
        measurements[technique] = entry
        atomic_write_json(path, {"version": FORMAT_VERSION, "measurements": measurements})
    return entry


def ratio(entry: dict) -> float | None:
    estimate = entry.get("estimate")
    if not estimate:
        return None
    return entry["measured"] / estimate


def provenance(entry: dict) -> str:
    """'' for a record of this machine and these versions, else what differs."""
    here = origin()
    if entry.get("machine") != here["machine"]:
        return f"foreign: {entry.get('machine', 'unknown machine')}"
    if (entry.get("llmsys"), entry.get("torch")) != (here["llmsys"], here["torch"]):
        return f"stale: llmsys {entry.get('llmsys')}, torch {entry.get('torch')}"
    return ""


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


def _gb(x: float | None) -> str:
    return "—" if x is None else f"{x / GB:+.3g} GB"


def entries(upto: int | None = None, path: Path | None = None) -> list[dict]:
    """The table as plain data: one dict per technique up to chapter ``upto`` (all if None)."""
    measurements = load_measurements(path)
    table = []
    for row in ROWS:
        if upto is not None and row.chapter > upto:
            continue
        m = measurements.get(row.technique)
        table.append({
            "chapter": row.chapter, "technique": row.technique, "saves": row.saves, "adds": row.adds,
            "trades": row.trades, "use_when": row.use_when, "baseline": row.baseline,
            "scale": row.scale.name if row.scale else None,
            "memory_saved_per_gpu_bytes": row.saves_bytes, "comm_added_per_step_bytes": row.adds_bytes,
            "evidence": row.evidence,
            "record": None if m is None else {**m, "ratio": ratio(m), "provenance": provenance(m)},
        })
    return table


def _evidence_text(e: dict) -> str:
    m = e["record"]
    if m is None:
        return f"{e['evidence']}: not run yet"
    unit = f" [{m['unit']}]" if m.get("unit") else ""
    mark = f" ({m['provenance']})" if m["provenance"] else ""
    return (f"{m.get('kind', 'measured')}: {e['evidence']}{unit}: estimate {_fmt(m['estimate'])}, "
            f"seen {_fmt(m['measured'])}, ratio {_fmt(m['ratio'])}; {m['when'][:10]}{mark}")


def _at_scale(e: dict) -> str:
    if e["memory_saved_per_gpu_bytes"] is None:
        return "no figure at the reference scale"
    return (f"memory/GPU {_gb(e['memory_saved_per_gpu_bytes'])}, comm/step {_gb(e['comm_added_per_step_bytes'])}"
            f" vs {e['baseline']}")


class Table:
    """What ``show`` displays: HTML in a notebook, text in a terminal."""

    COLUMNS = ["ch", "technique", "saves (memory)", "adds (communication)", "trades off", "use it when",
               "at the reference scale", "evidence"]

    def __init__(self, upto: int | None = None, path: Path | None = None):
        self.upto = upto
        self.body = entries(upto, path)

    def cells(self, e: dict) -> list[str]:
        return [str(e["chapter"]), e["technique"], e["saves"], e["adds"], e["trades"], e["use_when"],
                _at_scale(e), _evidence_text(e)]

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in self.cells(e))
                       + "</tr>" for e in self.body)
        scales = sorted({e["scale"] for e in self.body if e["scale"]})
        caption = "Running ledger" + (f" up to chapter {self.upto}" if self.upto is not None else "")
        caption += "; reference scales: " + "; ".join(scales)
        return (f"<table class='llmsys-ledger'><caption>{html.escape(caption)}</caption><thead><tr>{head}</tr>"
                f"</thead><tbody>{body}</tbody></table>")

    def __str__(self) -> str:
        # Terminal: one block per technique, so saves / adds / trades keep their words.
        lines = []
        for e in self.body:
            lines.append(f"ch{e['chapter']} {e['technique']}")
            for label, text in zip(["saves", "adds", "trades", "use when", "at scale", "evidence"],
                                   [e["saves"], e["adds"], e["trades"], e["use_when"], _at_scale(e),
                                    _evidence_text(e)]):
                lines += textwrap.wrap(text or "—", 100, initial_indent=f"  {label:<9}", subsequent_indent=" " * 11)
        scales = sorted({e["scale"] for e in self.body if e["scale"]})
        return "\n".join(["Reference scales: " + "; ".join(scales), *lines])

    __repr__ = __str__


def plot(upto: int | None = None, path: Path | None = None, ax=None):
    """Memory saved per GPU against communication added per step, one point per technique."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 5))[1]
    for e in entries(upto, path):
        if e["memory_saved_per_gpu_bytes"] is None:
            continue
        x, y = e["comm_added_per_step_bytes"] / GB, e["memory_saved_per_gpu_bytes"] / GB
        ax.scatter(x, y)
        ax.annotate(e["technique"], (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xscale("symlog")
    ax.set_yscale("symlog")
    ax.set_xlabel("communication added per GPU per step (GB)")
    ax.set_ylabel("memory saved per GPU (GB)")
    ax.set_title("What each technique buys and costs, at the reference scale")
    return ax


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


def show(upto: int | None = None, path: Path | None = None) -> None:
    """Display the running table up to chapter ``upto`` (use ``Table`` to keep it)."""
    table = Table(upto, path)
    if _in_notebook():
        from IPython.display import display

        display(table)
    else:
        print(table)
