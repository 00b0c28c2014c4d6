"""Run the merged cells in a kernel inside the sandbox, driven from the grader's process.

The grader's process is the Jupyter client (nbclient): it sends each cell and
reads the replies and outputs over ZeroMQ sockets in a folder the sandbox
shares (``ipc`` transport, so no network is needed). It never runs student code.
The kernel, and everything it starts, lives in the sandbox (``sandbox.py``).

Per cell: a timeout (the kernel is interrupted; a kernel that ignores the
interrupt is shut down). Per submission: a deadline (the sandbox is killed). A
cell that takes the kernel down (``os._exit()``, a crash, out of memory) is
reported, and the caller may run the notebook again without it.

The course runner (``runner.run_notebook``) also executes notebooks with
nbclient, but it runs trusted chapters in the learner's own environment, stops
at the first error and keeps every output for the HTML copy. This runs
untrusted code: a sandboxed kernel over sockets, every cell even after one
fails, timeouts that end in a shut-down kernel, and only the probe records
and errors kept. The two share nbclient, not a loop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from . import sandbox
from .report import shorten

MAX_RECORD_BYTES = 16_000_000  # one output a graded cell sends (as JSON); a bigger one fails its check
MAX_SUBMISSION_BYTES = 64_000_000  # all a submission's kept outputs together: the grader's memory per sandbox
INTERRUPT_GRACE = 5.0  # seconds a timed-out cell gets to stop after the interrupt
TIMED_OUT = "CellTimedOut"  # the error nbclient reports for a cell it interrupted
STARTUP_TIMEOUT = 120.0
_slots = iter(range(1, 10**9))
_slot_lock = threading.Lock()


@dataclass
class CellOutcome:
    """What happened to one cell."""

    status: str  # "ok", "error" or "not run"
    message: str = ""
    timed_out: bool = False  # ran past the per-cell timeout and was interrupted
    kernel_lost: bool = False  # the kernel died or was shut down during this cell
    exit_called: bool = False  # the cell called exit() or quit()
    outputs: list = field(default_factory=list)
    measured: list = field(default_factory=list)  # the grader's measurements of what a graded cell sent


@dataclass
class RunResult:
    outcomes: dict[int, CellOutcome]
    running: int | None = None  # the cell that was running when the deadline came
    killed: bool = False  # the per-submission deadline ended the run
    error: str = ""  # the kernel could not start
    seconds: float = 0.0  # wall time of the whole submission, reruns included


def _kernel_manager(workdir: Path, isolated: bool, readonly: list[str], env: dict, cpu_seconds: int):
    """A Jupyter kernel manager whose kernel starts in the sandbox (or, unsafe, as a plain process)."""
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    kernel_dir = workdir / "kernel"
    kernel_dir.mkdir(mode=0o755)
    connection = kernel_dir / "connection.json"
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", str(connection)]
    with _slot_lock:
        slot = next(_slots) % 50_000
    if isolated:
        config = workdir / "sandbox.json"
        sandbox.write_config(config, root=workdir / "root", kernel_dir=kernel_dir, argv=argv, slot=slot,
                             readonly=readonly, cpu_seconds=cpu_seconds, env=env)
        (workdir / "root").mkdir()
        argv = sandbox.sandbox_argv(config)
        if os.geteuid() == 0:
            os.chown(kernel_dir, sandbox.SANDBOX_UID_BASE + slot, -1)  # the kernel creates its sockets here
    spec = KernelSpec(argv=argv, display_name="sandboxed python", language="python", interrupt_mode="message")
    km = AsyncKernelManager(transport="ipc", ip=str(kernel_dir / "socket"), connection_file=str(connection))
    km._kernel_spec = spec
    km.write_connection_file()
    os.chmod(connection, 0o644)
    return km, kernel_dir


def run_cells(sources: list[str], skip: set[int], workdir: Path, *, cell_timeout: float, deadline: float,
              isolated: bool, readonly: list[str], env: dict, setup_cells: int = 0) -> RunResult:
    """Run the cells in order in a fresh kernel; cells in ``skip`` are not sent.

    The first ``setup_cells`` are the grader's (imports): they get the startup
    time limit, so a cell's limit measures the student's code, not the import.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    from .probes import PROBE_MIME

    class CappedClient(NotebookClient):
        """Keeps only probe records and errors, each under a cap, as they arrive (a cell may print gigabytes)."""

        kept_bytes = 0

        def output(self, outs, msg, display_id, cell_index):
            out = self.capped(msg["msg_type"], msg.get("content", {}))
            if out is not None:
                outs.append(out)
            return out

        def capped(self, msg_type, content):
            if msg_type == "error":
                return nbformat.v4.new_output("error", ename=str(content.get("ename"))[:200],
                                              evalue=str(content.get("evalue"))[:10_000], traceback=[])
            record = content.get("data", {}).get(PROBE_MIME) if msg_type in ("display_data", "execute_result") else None
            if record is None:
                return None
            size = len(json.dumps(record))
            if size > MAX_RECORD_BYTES or self.kept_bytes + size > MAX_SUBMISSION_BYTES:
                cell = record.get("cell") if isinstance(record, dict) and isinstance(record.get("cell"), str) else None
                why = (f"an output of {size / 1e6:.0f} MB is over the grader's cap of {MAX_RECORD_BYTES / 1e6:.0f} MB"
                       if size > MAX_RECORD_BYTES else
                       f"the submission's outputs passed the grader's cap of {MAX_SUBMISSION_BYTES / 1e6:.0f} MB")
                record = {"cell": cell, "event": "refused", "why": why + "; check values are small: send less"}
                size = 0
            self.kept_bytes += size
            return nbformat.v4.new_output("display_data", data={PROBE_MIME: record})

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    cpu_seconds = int(max(deadline - time.monotonic(), 1) * (os.cpu_count() or 1)) + 60
    km, kernel_dir = _kernel_manager(workdir, isolated, readonly, env, cpu_seconds)
    replies: dict[int, dict] = {}
    client = CappedClient(nb, km=km, timeout=cell_timeout, allow_errors=True, startup_timeout=int(STARTUP_TIMEOUT),
                            interrupt_on_timeout=True, error_on_timeout={"ename": TIMED_OUT, "evalue": "", "traceback": []},
                            iopub_timeout=INTERRUPT_GRACE, raise_on_iopub_timeout=False,
                            on_cell_executed=lambda cell, cell_index, execute_reply: replies.__setitem__(cell_index, execute_reply))
    result = RunResult({})
    try:
        launch = dict(env=env if not isolated else {"PATH": env["PATH"]}, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, cwd=str(workdir))
        with client.setup_kernel(**launch):
            _lock_kernel_dir(kernel_dir)
            for index, cell in enumerate(nb.cells):
                if index in skip:
                    continue
                left = deadline - time.monotonic()
                if left <= 0.5:
                    result.killed, result.running = True, index
                    break
                limit = STARTUP_TIMEOUT if index < setup_cells else cell_timeout
                client.timeout = max(1, int(min(limit, left)))
                try:
                    client.execute_cell(cell, index)
                except DeadKernelError:
                    result.outcomes[index] = CellOutcome("error", kernel_lost=True, outputs=_kept(cell.outputs))
                    break
                reply = replies.get(index) or {}
                if reply.get("content", {}).get("ename") == TIMED_OUT:
                    if deadline - time.monotonic() <= 0.5:
                        result.killed, result.running = True, index
                        break
                    lost = not _answers_again(client)
                    result.outcomes[index] = CellOutcome("error", timed_out=True, kernel_lost=lost, outputs=_kept(cell.outputs))
                    if lost:
                        break
                    continue
                result.outcomes[index] = _outcome(replies.get(index), cell.outputs)
    except Exception as err:  # the kernel did not start, or the connection broke
        if not result.outcomes:
            result.error = shorten(f"{type(err).__name__}: {err}", 500)
    finally:
        _stop(km)
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _lock_kernel_dir(kernel_dir: Path) -> None:
    """Once the kernel has made its sockets, the shared folder takes no new files from it."""
    if os.geteuid() == 0:
        os.chown(kernel_dir, 0, -1)
    os.chmod(kernel_dir, 0o755)


def _answers_again(client) -> bool:
    """After an interrupt: True when the kernel runs a new request within the grace time."""
    from queue import Empty

    from nbclient.util import run_sync

    msg_id = client.kc.execute("pass", store_history=False)
    deadline = time.monotonic() + INTERRUPT_GRACE
    while (left := deadline - time.monotonic()) > 0:
        try:
            reply = run_sync(client.kc.shell_channel.get_msg)(timeout=left)
        except Empty:
            return False
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            return True
    return False


def _outcome(reply: dict | None, outputs: list) -> CellOutcome:
    content = (reply or {}).get("content", {})
    exit_called = any(isinstance(p, dict) and p.get("source") == "ask_exit" for p in content.get("payload", []) or [])
    error = next((o for o in outputs if o.get("output_type") == "error"), None)
    if content.get("status") == "ok" and error is None:
        return CellOutcome("ok", exit_called=exit_called, outputs=_kept(outputs))
    if error is not None:
        message = f"{error.get('ename')}: {error.get('evalue')}"
    else:
        message = f"{content.get('ename', 'error')}: {content.get('evalue', '')}"
    return CellOutcome("error", shorten(message), exit_called=exit_called, outputs=_kept(outputs))


def _kept(outputs: list) -> list:
    """The probe records and errors; the rest (a cell may print megabytes) is dropped."""
    from .probes import PROBE_MIME

    return [o for o in outputs if PROBE_MIME in o.get("data", {}) or o.get("output_type") == "error"]


def _stop(km) -> None:
    """Kill the sandbox: its init, and with it every process the submission started."""
    from nbclient.util import run_sync

    try:
        run_sync(km.shutdown_kernel)(now=True)
    except Exception:
        pass
    try:
        run_sync(km.cleanup_resources)()
    except Exception:
        pass


def new_workdir() -> Path:
    # directly under /tmp whatever TMPDIR says: the kernel's unix sockets live here, and a socket
    # path may not exceed 107 bytes (a deep TMPDIR gives "File name too long" from zmq)
    return Path(tempfile.mkdtemp(prefix="llmsys-grade-", dir="/tmp" if os.path.isdir("/tmp") else None))
