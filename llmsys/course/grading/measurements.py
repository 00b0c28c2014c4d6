"""Trusted measurements: a tuning task's choice, measured by the grader in a clean process of its own.

A tuning task grades a *choice* the student makes (a setting, hyperparameters,
a model's trained weights), never a number the student's process computed
about it. The graded check says which reference task measures the choice::

    peak, tokens_per_s = measure(tasks.step_budget, setting)
    assert peak <= BUDGET_BYTES, "..."
    assert tokens_per_s >= 0.7 * solution_run(tokens_per_s), "..."

``measure(task, choice, *inputs)`` is ``task(choice, *inputs)`` in a
student's own kernel. At grading no kernel runs it: the kernel sends its
arguments as plain data (``encoder``), and the grader runs the task on them in
a fresh Python process that imports only ``llmsys`` (no student code),
with one thread, resource limits and a timeout, for the solution's choice and
the student's alike, in the same grading. The measured values take the places
of the names the assignment binds, which may stand only as whole operands of
asserts (``probes`` refuses anything else). The ``inputs`` (held-out prompts,
a teacher's weights) must equal those of the solution's run, and each
measurement must feed the same asserts as in the solution's run
(``judge``): only the choice is the student's.

Declaring a tuning task takes two steps:

1. a function in ``llmsys.course.tasks`` (or another ``llmsys`` module),
   decorated with ``@tuning_task``: ``task(choice, *inputs)`` refuses a bad
   choice with a ``ValueError`` that says what to change, runs the reference
   implementation on it, and returns a number or a tuple of numbers; time is
   its own process's CPU time (``llmsys.core.timing.cpu_seconds``), memory what
   it allocates (``LiveBytes``), quality a held-out loss from the library's evaluator;
2. in the lab, the student's region returns the choice as plain data (numbers,
   strings, lists, dicts, tensors), and the graded check binds
   ``x = measure(module.task, choice, *inputs)`` and asserts on ``x``, as a
   ratio to ``solution_run(x)`` where it is a speed or a loss.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .judge import Failed, Opaque, collect, decode

MEASURE_TIMEOUT = 120.0  # seconds one measurement may take, the process's start included
MAX_MEASUREMENTS = 8  # per graded cell and submission: a check makes a few; a kernel may send thousands
TASK_MARK = "__llmsys_tuning_task__"
ROOT = Path(__file__).resolve().parents[3]  # the folder that holds the llmsys package


def tuning_task(fn):
    """Mark ``fn(choice, *inputs)`` as a reference task the grader may run on a student's choice."""
    setattr(fn, TASK_MARK, True)
    return fn


def measure(task, choice, *inputs):
    """``task(choice, *inputs)``: what the grader measures of ``choice``, measured here (outside the grader)."""
    if not getattr(task, TASK_MARK, False):
        raise TypeError(f"{task!r} is not a tuning task: decorate it with @tuning_task")
    return task(choice, *inputs)


def resolve(path: str):
    """The tuning task at a dotted path under ``llmsys`` (``llmsys.course.tasks.step_budget``)."""
    if not path.startswith("llmsys."):
        raise ValueError(f"a tuning task lives in the llmsys package, not at {path!r}")
    module_name, _, attribute = path.rpartition(".")
    while module_name:
        try:
            target = importlib.import_module(module_name)
            break
        except ModuleNotFoundError:
            module_name, _, outer = module_name.rpartition(".")
            attribute = f"{outer}.{attribute}"
    else:
        raise ValueError(f"no module holds {path!r}")
    for name in attribute.split("."):
        target = getattr(target, name)
    if not getattr(target, TASK_MARK, False):
        raise ValueError(f"{path} is not a tuning task: decorate it with @tuning_task")
    return target


def encode_result(value):
    """A task's result as the probe's plain data (numbers, strings, tuples, lists, dicts of them)."""
    import numbers

    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a 0-dim tensor or a NumPy scalar
        value = value.item()
    if isinstance(value, numbers.Integral):
        return {"int": repr(int(value))}
    if isinstance(value, numbers.Real):
        return {"float": repr(float(value))}
    if isinstance(value, (tuple, list)):
        return {type(value).__name__: [encode_result(x) for x in value]}
    if isinstance(value, dict):
        return {"dict": [[encode_result(k), encode_result(x)] for k, x in value.items()]}
    raise TypeError(f"a tuning task returns numbers, got {type(value).__name__}")


def _plain_arguments(args: list) -> list:
    values = [decode(a) for a in args]

    def check(value):
        if isinstance(value, (Opaque, Failed)):
            raise ValueError(f"the choice holds {value!r}, which cannot be sent as data: give plain numbers, "
                             "strings, lists, dicts or tensors")
        for item in (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []):
            check(item)

    check(values)
    return values


def main(argv: list[str]) -> int:
    """The checker process: read a task and its arguments, run it, write its result (or why it failed)."""
    request_path, result_path = argv
    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    _limit_this_process(int(request["cpu_seconds"]))
    try:
        import torch

        torch.set_num_threads(1)  # CPU time of one thread: the same work costs the same on a loaded machine
        task = resolve(str(request["task"]))
        result = {"value": encode_result(task(*_plain_arguments(request["args"])))}
    except Exception as err:  # the task's own message says what was wrong with the choice
        result = {"error": f"{type(err).__name__}: {err}"[:500]}
    Path(result_path).write_text(json.dumps(result), encoding="utf-8")
    return 0


def _limit_this_process(cpu_seconds: int) -> None:
    """The sandbox's memory and core-dump limits, and a CPU-time limit, before any task runs."""
    from .sandbox import LIMITS

    for name in ("RLIMIT_AS", "RLIMIT_CORE"):
        resource.setrlimit(getattr(resource, name), (LIMITS[name], LIMITS[name]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))


def run_in_clean_process(task: str, args: list, timeout: float = MEASURE_TIMEOUT) -> dict:
    """``{"value": ...}`` or ``{"error": why}``: ``task(*args)`` run by a fresh interpreter of the grader's."""
    from llmsys.core.cache import cache_dir

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LLMSYS_CACHE": str(cache_dir()), "LC_ALL": "C.UTF-8"}
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from {__name__} import main; sys.exit(main(sys.argv[1:]))"
    with tempfile.TemporaryDirectory(prefix="llmsys-measure-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps({"task": task, "args": args, "cpu_seconds": int(timeout) + 1}), encoding="utf-8")
        try:
            subprocess.run([sys.executable, "-I", "-c", code, str(request), str(result)], env=env, cwd=folder,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=timeout, start_new_session=True, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"measuring it took more than the grader's {timeout:g} s"}
        if not result.exists():
            return {"error": "the measurement ended without a result (over the grader's memory or CPU limit)"}
        return json.loads(result.read_text(encoding="utf-8"))


def task_path(task: str, imports: dict) -> str:
    """The dotted path of a check's task (``tasks.step_budget``), through the names the lab's setup imports."""
    head, _, rest = task.partition(".")
    path = imports.get(head, head) + (f".{rest}" if rest else "")
    resolve(path)
    return path


def measure_outcomes(check_ids: list, outcomes: dict, tasks: dict, measurer: "Measurer") -> None:
    """The grader's measurement of every choice a graded cell sent, kept beside the cell's records.

    ``check_ids``: per cell, its check's id or None; ``tasks``: check id -> the task of each measurement site.
    """
    for index, outcome in outcomes.items():
        check_id = check_ids[index] if 0 <= index < len(check_ids) else None
        if check_id not in tasks:
            continue
        sent = collect(outcome.outputs, check_id).measures
        outcome.measured = [measurer.measure(tasks[check_id][site], args) if 0 <= site < len(tasks[check_id]) else
                            {"error": "no such measurement in this check"} for site, args in sent[:MAX_MEASUREMENTS]]
        outcome.measured += [{"error": f"over the grader's {MAX_MEASUREMENTS} measurements per check"}] * len(
            sent[MAX_MEASUREMENTS:])


class Measurer:
    """Measures each (task, arguments) once per grading, however many submissions chose it; shared by threads."""

    def __init__(self, timeout: float = MEASURE_TIMEOUT):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._done: dict[str, concurrent.futures.Future] = {}

    def measure(self, task: str, args: list) -> dict:
        key = hashlib.sha256(json.dumps([task, args], sort_keys=True).encode()).hexdigest()
        with self._lock:
            future = self._done.get(key)
            mine = future is None
            if mine:
                future = self._done[key] = concurrent.futures.Future()
        if mine:
            future.set_result(run_in_clean_process(task, args, self.timeout))
        return future.result()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
