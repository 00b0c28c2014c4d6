"""Run N worker processes with torch.distributed, and count what they send.

A chapter cell writes one function ``fn(rank, world_size, ...)`` and runs it on
every rank::

    def demo(rank, world_size):
        x = torch.full((4,), float(rank))
        dist.all_reduce(x)
        return x

    launch(demo, world_size=2)      # -> [tensor([1., 1., 1., 1.]), tensor(...)]

- ``launch`` starts the processes, joins the process group (gloo for workers
  that compute on CPU tensors, the default even on a GPU machine; NCCL, one
  GPU per rank, when the caller says ``accelerator=True`` and every rank can
  own a GPU, as ``llmsys.core.device.dist_backend`` decides), returns each
  rank's result in rank order, and turns every way a run can go wrong (an
  exception, a crashed rank, a deadlock) into an error that says which rank
  and what to check, with every child process cleaned up.
- ``torchrun_main`` is the same entry point for scripts started by torchrun,
  falling back to ``launch`` when run as plain ``python script.py``.
- ``cpu_mesh`` / ``device_mesh`` build a named DeviceMesh with a checked shape.

What the workers send is counted by ``llmsys.core.comm.CommCounter``.
"""

from __future__ import annotations

import datetime
import math
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch._dynamo  # noqa: F401  every gloo collective imports it on first use (seconds); forked ranks inherit it
import torch.distributed as dist

from llmsys.core import device as _device

__all__ = [
    "free_port",
    "launch",
    "WorkerError",
    "torchrun_main",
    "cpu_mesh",
    "device_mesh",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun scripts).

    Another process may take it before you bind it; ``launch`` avoids that
    race by letting its rendezvous server bind port 0 itself.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# launch: N processes, one result each, clear errors


class WorkerError(RuntimeError):
    """A rank raised or died; ``rank``, ``exitcode`` and ``worker_traceback`` say how."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None, worker_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.worker_traceback = worker_traceback


def launch(fn, world_size: int = 2, args=(), timeout: float | None = 120.0, backend: str | None = None,
           start_method: str | None = None, accelerator: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results in rank order.

    Each worker joins a process group (``backend``, default
    ``llmsys.core.device.dist_backend(world_size, accelerator)``), runs ``fn``, leaves the group
    and sends back the return value. It must be picklable; tensors come back
    on the CPU. Spawned workers use ``cpu_count // world_size`` threads each,
    so four ranks on two cores do not fight over them; forked workers use one
    thread, because OpenMP cannot start a new thread pool in a child forked
    from a parent that already ran one (the first parallel op would hang).

    Start method. On Linux with gloo the workers are *forked*: a function
    defined in a notebook cell or a ``python -c`` script lives only in the
    parent's ``__main__`` and cannot be pickled by name for a spawned child,
    and fork also skips re-importing torch in every child. Fork suits gloo
    workers, which compute on the CPU (had the parent used CUDA, a forked
    child that tries to gets a clear error from torch). NCCL workers need
    CUDA, and CUDA does not survive a fork once the
    parent has touched the driver (choosing the backend already does), so NCCL
    and non-Linux platforms use *spawn*: then ``fn`` must be importable from a
    ``.py`` file (or use ``torchrun_main`` in a script). ``start_method``
    overrides the choice.

    Backend. NCCL moves only CUDA tensors, so the caller says what its workers
    build: ``accelerator=False`` (default) for CPU tensors, which get gloo even
    on an 8-GPU server; ``accelerator=True`` for workers that put their tensors
    on their GPU (``torch.cuda.current_device()``, set to the rank here) when
    the group is NCCL, and on the CPU otherwise (as ``llmsys.zero`` does by
    asking ``dist.get_backend()``): NCCL when every rank can own a GPU, else gloo.

    Errors. An exception in a rank raises ``WorkerError`` naming that rank,
    with its traceback; a rank that dies without a result (``os._exit``, a
    signal, out of memory) raises ``WorkerError`` with its exit code; a run
    that has not finished after ``timeout`` seconds (usually a deadlock: one
    rank waits in a collective that another never calls) raises
    ``TimeoutError`` naming the unfinished ranks. In every case the other
    ranks are stopped and no child process is left behind.
    """
    _check_world_size(world_size)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    backend = backend or _device.dist_backend(world_size, accelerator)
    start_method = start_method or _default_start_method(backend)
    _check_can_start(fn, start_method)
    context = multiprocessing.get_context(start_method)

    # The rendezvous server lives in this process and binds port 0 itself, so
    # two launches (or two test runs on a shared machine) never race for a port.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    # The group's own timeout outlasts ours, so a deadlock is reported here,
    # with the ranks named, rather than as a gloo timeout inside one worker.
    group_timeout = (timeout or 1800.0) + 30.0
    threads = 1 if start_method == "fork" else max(1, _cpu_count() // world_size)
    # No rank connects before every rank exists: a fork taken while the store's
    # server thread holds glibc's resolver lock (serving an earlier rank) would
    # leave that lock held forever in the child.
    all_started = context.Event()
    processes, pipes = [], []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            config = (rank, world_size, backend, store.port, group_timeout, threads)
            process = context.Process(target=_worker, args=(fn, tuple(args), config, sender, all_started),
                                      name=f"llmsys-rank{rank}")  # not daemonic: fn may start a DataLoader
            process.start()
            sender.close()  # the child holds the only writing end now
            processes.append(process)
            pipes.append(receiver)
        all_started.set()
        return _collect_results(processes, pipes, timeout)
    finally:
        _stop(processes)
        for pipe in pipes:
            pipe.close()
        del store  # stops the rendezvous server now rather than at garbage collection


def _check_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (number of ranks), got {world_size!r}")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours container and taskset limits
    except AttributeError:
        return os.cpu_count() or 1


def _default_start_method(backend: str) -> str:
    if backend == "nccl" or sys.platform != "linux":
        return "spawn"
    return "fork"


def _check_can_start(fn, start_method: str) -> None:
    if start_method == "fork":
        return
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise ValueError(
            f"{getattr(fn, '__name__', fn)!r} is defined in an interactive session, which a "
            f"'{start_method}' worker cannot import. Put the function in a .py file and import it, "
            "or run a script with torchrun_main; on Linux, start_method='fork' works if this "
            "process has not used CUDA."
        )
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise ValueError(
            f"a '{start_method}' worker receives fn by pickling, and {fn!r} cannot be pickled "
            f"({error}); use a function defined at the top level of a module (not a lambda or closure)."
        ) from None


def _worker(fn, args, config, sender, all_started) -> None:
    """One rank: join the group, run fn, leave the group, send back ("ok", result) or ("error", ...)."""
    rank, world_size, backend, port, group_timeout, threads = config
    all_started.wait()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=group_timeout)
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        # gloo connects its pairs lazily; without this a rank whose fn never communicates
        # can leave and close its sockets while a peer is still connecting.
        dist.barrier()
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        message = pickle.dumps(("ok", _to_cpu(result)))
    except BaseException as error:  # KeyboardInterrupt and SystemExit in fn are failures too
        message = pickle.dumps(("error", f"{type(error).__name__}: {error}", traceback.format_exc(),
                                _lost_a_peer(error)))
    sender.send_bytes(message)
    sender.close()


def _lost_a_peer(error: BaseException) -> bool:
    """Did this rank fail only because another rank went away? (gloo raises a plain RuntimeError.)"""
    text = str(error)
    return isinstance(error, dist.DistError) or "closed by peer" in text or "reset by peer" in text


def _to_cpu(value):
    """Move tensors to the CPU so the parent never initialises CUDA by unpickling a result."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _collect_results(processes, pipes, timeout) -> list:
    """Wait for every rank's message; raise on the first failure or at the deadline."""
    results = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(results) < len(processes):
        waiting = [r for r in range(len(processes)) if r not in results]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait([pipes[r] for r in waiting] + [processes[r].sentinel for r in waiting], timeout=left)
        if not ready:
            raise TimeoutError(_timeout_message(waiting, sorted(results), timeout))
        failures = []
        for rank in waiting:
            alive = processes[rank].is_alive()  # before poll: a rank that sent and exited is not lost
            if pipes[rank].poll():
                try:
                    status, *payload = pickle.loads(pipes[rank].recv_bytes())
                except (EOFError, OSError):  # died while writing
                    failures.append(_exit_failure(rank, processes[rank]))
                    continue
                if status == "ok":
                    results[rank] = payload[0]
                else:
                    failures.append(_raised_failure(rank, *payload))
            elif not alive:
                failures.append(_exit_failure(rank, processes[rank]))
        if failures:
            # When one rank fails, its peers fail next with "connection closed".
            # Report the cause: a rank's own exception, else a rank that died,
            # else a rank that only lost its peer. A peer's message can arrive
            # before the dead rank is reaped, so give the others a moment first.
            if min(f[0] for f in failures) == 2:
                failed = {f[1].rank for f in failures}
                failures += [f for r in waiting if r not in failed and r not in results
                             for f in [_exit_failure(r, processes[r], grace=2.0)] if f is not None]
            raise min(failures, key=lambda f: f[0])[1]
    return [results[r] for r in range(len(processes))]


def _raised_failure(rank, summary, worker_traceback, lost_a_peer):
    message = f"rank {rank} raised {summary}"
    if lost_a_peer:
        message += (f"\n(rank {rank} lost a peer: another rank crashed, or returned while this one "
                    "still expected it in a collective or recv)")
    message += f"\n\n--- traceback from rank {rank} ---\n{worker_traceback}"
    return (2 if lost_a_peer else 0), WorkerError(message, rank, worker_traceback=worker_traceback)


def _exit_failure(rank, process, grace: float | None = None):
    """The failure of a rank that exited without a result; with ``grace``, None if it is still running then."""
    process.join(timeout=grace or 5.0)
    if grace is not None and process.is_alive():
        return None
    code = process.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        how = f"signal {signal.Signals(-code).name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    message = f"rank {rank} died with {how} before returning a result"
    return 1, WorkerError(message, rank, exitcode=code)


def _timeout_message(unfinished, finished, timeout) -> str:
    return (
        f"ranks {unfinished} had not finished after {timeout:g} s (finished: {finished or 'none'}); "
        "all ranks were stopped. This is usually a deadlock: check that every rank calls the same "
        "collectives in the same order with matching shapes, that every send has a matching recv "
        "on the peer, and that no rank returns early. If the work is only slow, raise timeout=."
    )


def _stop(processes) -> None:
    """Terminate what is still running, then kill what ignores SIGTERM; reap everything."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=3.0)
        if process.is_alive():
            process.kill()
            process.join()


# -----------------------------------------------------------------------------
# torchrun scripts


def torchrun_main(fn, accelerator: bool = False):
    """Entry point of a script that runs as ``torchrun --nproc-per-node=N script.py`` or ``python script.py``.

    Under torchrun (RANK and WORLD_SIZE in the environment) this process joins
    the group and returns ``fn(rank, world_size)``: on NCCL with GPU
    ``LOCAL_RANK`` when ``accelerator`` is true and there is one GPU per local
    rank, else on gloo (as in ``launch``). Without torchrun it runs
    ``launch(fn, world_size=$LLMSYS_WORLD_SIZE or 2, accelerator=accelerator)``
    and returns the list of results, so the same script works on a laptop.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return launch(fn, world_size=int(os.environ.get("LLMSYS_WORLD_SIZE", 2)), accelerator=accelerator)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = _device.dist_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), accelerator)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)  # MASTER_ADDR/PORT from torchrun
    try:
        return fn(rank, world_size)
    finally:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# device meshes


def cpu_mesh(shape, names):
    """A DeviceMesh over the CPU; on gloo always pass one explicitly (pytorch#132471)."""
    return _mesh("cpu", shape, names)


def device_mesh(shape, names):
    """A DeviceMesh on CUDA when the group runs NCCL, else on the CPU."""
    if not dist.is_initialized():
        raise RuntimeError("device_mesh needs a process group: call it inside a launch()ed function")
    return _mesh("cuda" if dist.get_backend() == "nccl" else "cpu", shape, names)


def _mesh(device_type, shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    names = (names,) if isinstance(names, str) else tuple(names)
    if not dist.is_initialized():
        raise RuntimeError("a device mesh needs a process group: call it inside a launch()ed function")
    if len(names) != len(shape):
        raise ValueError(f"mesh shape {shape} has {len(shape)} dims but {len(names)} names {names}: give one name per dim")
    world_size = dist.get_world_size()
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh shape {shape} holds {math.prod(shape)} ranks but the world has {world_size}: "
            f"choose a shape whose product is {world_size}, or launch with world_size={math.prod(shape)}"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
