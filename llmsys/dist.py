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
  own a GPU, as ``llmsys.device.dist_backend`` decides), returns each
  rank's result in rank order, and turns every way a run can go wrong (an
  exception, a crashed rank, a deadlock) into an error that says which rank
  and what to check, with every child process cleaned up.
- ``torchrun_main`` is the same entry point for scripts started by torchrun,
  falling back to ``launch`` when run as plain ``python script.py``.
- ``cpu_mesh`` / ``device_mesh`` build a named DeviceMesh with a checked shape.
- ``CommCounter`` counts, per rank, how many bytes each collective is given and
  how many a ring algorithm would send (``llmsys.accounting.collective_bytes``,
  the cost model).

Launching, the collectives named across torch releases and the counter stay in one
module because every distributed cell of the course imports exactly these together.
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
from collections import defaultdict
from multiprocessing.connection import wait

import torch
import torch._dynamo  # noqa: F401  every gloo collective imports it on first use (seconds); forked ranks inherit it
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from llmsys import device as _device
from llmsys.accounting import collective_bytes

__all__ = [
    "free_port",
    "launch",
    "WorkerError",
    "torchrun_main",
    "cpu_mesh",
    "device_mesh",
    "CommCounter",
    "all_gather_single",
    "reduce_scatter_single",
    "collective_names",
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
    ``llmsys.device.dist_backend(world_size, accelerator)``), runs ``fn``, leaves the group
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


# -----------------------------------------------------------------------------
# one-tensor collectives under the name this torch has

# Newest name first: torch 2.13 added the *_single names and deprecated the
# *_tensor ones (torch >= 1.13); the underscored ones are older still.
_RENAMED = {
    "all_gather_single": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
    "reduce_scatter_single": ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
}


def _renamed(name: str):
    for found in _RENAMED[name]:
        if hasattr(dist, found):
            return getattr(dist, found)
    raise RuntimeError(f"this torch ({torch.__version__}) has none of torch.distributed.{_RENAMED[name]}; "
                       "install torch >= 2.6")


def collective_names() -> dict[str, str]:
    """Which torch.distributed function each helper below calls with this torch."""
    return {name: _renamed(name).__name__ for name in _RENAMED}


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``input`` into ``output`` (world_size x input, concatenated along dim 0)."""
    return _renamed("all_gather_single")(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce ``input`` (world_size x output) over ranks; this rank keeps its slice in ``output``."""
    return _renamed("reduce_scatter_single")(output, input, op=op, group=group, async_op=async_op)


# -----------------------------------------------------------------------------
# the collective counter


def _nbytes(value) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(value):
    """The ProcessGroup behind a c10d op's group argument (boxed object or name)."""
    if isinstance(value, str):
        return dist.distributed_c10d._resolve_process_group(value)
    if isinstance(value, torch.ScriptObject):
        return dist.ProcessGroup.unbox(value)
    return value


# Every collective reaches the dispatcher as one of these ops: torch.distributed's
# eager functions as c10d ops, FSDP2 / DTensor / functional collectives as
# _c10d_functional ops. Each entry: (collective, argument holding the payload,
# how the payload relates to the "full" size: "full" as is, "shard" × group size).
_OPS = {
    "c10d::allreduce_": ("all_reduce", "tensors", "full"),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors", "full"),
    "c10d::broadcast_": ("broadcast", "tensors", "full"),
    "c10d::reduce_": ("reduce", "tensors", "full"),
    "c10d::allgather_": ("all_gather", "output_tensors", "full"),
    "c10d::allgather_coalesced_": ("all_gather", "output_lists", "full"),
    "c10d::_allgather_base_": ("all_gather", "output_tensor", "full"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "outputs", "full"),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors", "full"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor", "full"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", "full"),
    "c10d::alltoall_": ("all_to_all", "input_tensors", "full"),
    "c10d::alltoall_base_": ("all_to_all", "input", "full"),
    "c10d::send": ("send", "tensors", "full"),
    "c10d::recv_": ("recv", "tensors", "full"),
    "c10d::recv_any_source_": ("recv", "tensors", "full"),
    "_c10d_functional::all_reduce": ("all_reduce", "input", "full"),
    "_c10d_functional::all_reduce_": ("all_reduce", "input", "full"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs", "full"),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs", "full"),
    "_c10d_functional::broadcast": ("broadcast", "input", "full"),
    "_c10d_functional::broadcast_": ("broadcast", "input", "full"),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input", "shard"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input", "shard"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs", "shard"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input", "full"),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input", "full"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", "full"),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input", "full"),
    "_c10d_functional::isend": ("send", "tensor", "full"),
    "_c10d_functional::irecv": ("recv", "tensor", "full"),
}


class CommCounter(TorchDispatchMode):
    """Count the collectives this rank runs, and their bytes, inside a ``with`` block.

    ::

        with CommCounter() as comm:
            dist.all_reduce(grad)
        comm.calls["all_reduce"], comm.bytes["all_reduce"], comm.ring_bytes["all_reduce"]

    Keys are collectives (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
    ``"all_to_all"``, ``"broadcast"``, ``"reduce"``, ``"send"``, ``"recv"``),
    whichever function issued them. Two numbers per call:

    - ``bytes``: the payload, the tensor size the call was given: the input
      of all_reduce / broadcast / send / recv / all_to_all, the *full* output of
      an all-gather, the *full* input of a reduce-scatter;
    - ``ring_bytes``: what a ring algorithm sends per rank (``llmsys.accounting.collective_bytes``);
      all_to_all counts exactly the input bytes that leave this rank, so
      uneven splits are exact.

    How: a TorchDispatchMode sees every op on this thread. Eager
    ``torch.distributed`` calls reach the dispatcher as ``torch.ops.c10d.*``
    and FSDP2 / DTensor / functional collectives as ``torch.ops._c10d_functional.*``,
    so one mechanism counts both, whatever name the caller imported. gather,
    scatter and barrier are not counted.

    Why bytes and not time: gloo's own algorithms differ from the ring (it
    implements reduce-scatter via all-reduce), so wall-clock timing of gloo
    collectives does not reflect a collective's algorithmic volume.
    """

    def __init__(self):
        super().__init__()
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.ring_bytes = defaultdict(float)
        self.records = []  # (collective, payload bytes, ring bytes, group size), in call order

    def total_ring_bytes(self) -> float:
        return sum(self.ring_bytes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        name = func._schema.name
        if name != "_c10d_functional::batch_p2p_ops" and name not in _OPS:
            return
        group = _group(named.get("process_group", named.get("group_name")))
        n = group.size()
        if name == "_c10d_functional::batch_p2p_ops":
            for op, tensor in zip(named["op_list"], named["tensors"]):
                self._add("send" if op == "isend" else "recv", _nbytes(tensor), n)
            return
        kind, argument, relation = _OPS[name]
        payload = _nbytes(named[argument]) * (n if relation == "shard" else 1)
        if kind == "all_to_all":
            sent = float(payload - _bytes_kept_home(named, argument, group.rank(), n))
        else:
            sent = collective_bytes(kind, payload, n)
        self._add(kind, payload, n, sent)

    def _add(self, kind, payload, n, sent=None) -> None:
        sent = collective_bytes(kind, payload, n) if sent is None else sent
        self.calls[kind] += 1
        self.bytes[kind] += payload
        self.ring_bytes[kind] += sent
        self.records.append((kind, payload, sent, n))

    def __str__(self) -> str:
        lines = [f"{'collective':<15}{'calls':>7}{'payload B':>14}{'ring B':>14}"]
        for kind in self.calls:
            lines.append(f"{kind:<15}{self.calls[kind]:>7}{self.bytes[kind]:>14,}{self.ring_bytes[kind]:>14,.0f}")
        return "\n".join(lines)


def _bytes_kept_home(named, argument, rank, n) -> float:
    """The part of an all_to_all input that this rank sends to itself."""
    if argument == "input_tensors":  # one tensor per destination rank
        return _nbytes(named[argument][rank])
    tensor = named[argument]
    splits = list(named.get("input_split_sizes") or [])
    if not splits or tensor.shape[0] == 0:
        return _nbytes(tensor) / n  # even split along dim 0
    row_bytes = _nbytes(tensor) // tensor.shape[0]
    return splits[rank] * row_bytes
