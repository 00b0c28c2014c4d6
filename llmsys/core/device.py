"""The one place that decides device, dtype, distributed backend and Triton mode.

Every notebook, lab and test asks here instead of probing torch itself, so a
laptop without a GPU and a classroom GPU server run the same cells:

- device: ``cuda`` when present, else ``cpu``;
- dtype: bf16 on GPUs that support it, fp32 on the CPU;
- distributed backend: gloo for workers that compute on CPU tensors (the
  default, even on a GPU machine); NCCL, one GPU per rank, for workers that
  say they use accelerator tensors, when every rank can own a GPU;
- random generators: on the device of the tensors they sample (``generator``);
- Triton: compiled on CUDA, ``TRITON_INTERPRET=1`` on the CPU. The interpreter
  flag is read when a kernel is *defined*, so ``configure_triton()`` runs
  before ``llmsys.kernels`` defines anything (the kernels package calls it).

This module imports only the standard library and torch, so anything may
import it.
"""

from __future__ import annotations

import os
import platform

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device a chapter runs on: the first GPU if there is one, else the CPU."""
    return torch.device("cuda" if has_cuda() else "cpu")


def dtype(dev: torch.device | str | None = None) -> torch.dtype:
    """bf16 where the GPU supports it, else fp32 (fp16 training needs loss scaling)."""
    dev = torch.device(dev) if dev is not None else device()
    if dev.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


# The dtype names a command line or a config may use; code passes torch.dtype objects.
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a torch.dtype: a torch.dtype as it is, or one of ``DTYPE_NAMES``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be a torch.dtype or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return DTYPE_NAMES[dtype]


def dist_backend(world_size: int = 1, accelerator: bool = False) -> str:
    """The process-group backend for ``world_size`` workers.

    NCCL only moves CUDA tensors, one GPU per rank: it is chosen when the
    workers use accelerator tensors (``accelerator=True``) and every rank can own
    a GPU. Workers that build CPU tensors get gloo, whatever GPUs the machine has.
    """
    if accelerator and has_cuda() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def backend_note() -> str:
    """Which backend launched workers get here, for each kind of worker."""
    gpus = torch.cuda.device_count() if has_cuda() else 0
    if not gpus:
        return "gloo (no GPU)"
    return f"gloo for CPU-tensor workers; nccl for accelerator workers, up to {gpus} rank(s)"


def generator(seed: int, like) -> torch.Generator:
    """A ``torch.Generator`` seeded with ``seed`` on the device of ``like``.

    ``like`` is what the generator will sample with (a tensor, a module, or a
    device): ``torch.multinomial`` and ``torch.rand`` refuse a generator on
    another device (a CPU generator cannot draw on CUDA). Seeds give the same
    draws again on the same device, not across devices.
    """
    dev = _device_of(like)
    if dev.type == "cuda" and not has_cuda():
        raise ValueError(f"a generator on {dev} was asked for, but this machine has no CUDA device; "
                         "make it on the device of the tensors it samples (e.g. generator(seed, logits))")
    return torch.Generator(device=dev).manual_seed(seed)


def _device_of(like) -> torch.device:
    if isinstance(like, torch.Tensor):
        return like.device
    if isinstance(like, torch.nn.Module):
        tensor = next(iter(like.parameters()), None)
        tensor = tensor if tensor is not None else next(iter(like.buffers()), None)
        if tensor is None:
            raise ValueError(f"{type(like).__name__} has no parameters or buffers to take a device from; "
                             "pass a tensor or a device instead")
        return tensor.device
    if isinstance(like, (torch.device, str)):
        return torch.device(like)
    raise ValueError(f"like must be a tensor, a module or a device, got {type(like).__name__}")


def configure_triton() -> str:
    """Choose compiled Triton on CUDA, the interpreter elsewhere; return the mode.

    An explicit ``TRITON_INTERPRET`` set by the user is respected (handy for
    stepping through a kernel on a GPU machine).
    """
    if "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "0" if has_cuda() else "1"
    return triton_mode()


def triton_mode() -> str:
    """'compiled', 'interpreter', or 'unavailable' (triton not installed)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "unavailable"
    return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"


def kernel_dtype(dev: torch.device | str | None = None) -> torch.dtype:
    """Dtype for Triton kernels: fp32 under the interpreter, which silently
    gives wrong bf16 results; the training dtype when compiled."""
    return torch.float32 if triton_mode() == "interpreter" else dtype(dev)


def summary() -> dict[str, str]:
    """What this machine has and how the course will run here."""
    gpus = torch.cuda.device_count() if has_cuda() else 0
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "device": str(device()),
        "gpus": str(gpus),
        "dtype": str(dtype()).replace("torch.", ""),
        "distributed backend": backend_note(),
        "triton": configure_triton(),
    }
    if gpus:
        info["gpu 0"] = torch.cuda.get_device_name(0)
    try:
        import triton

        info["triton version"] = triton.__version__
    except ImportError:
        pass
    return info


def gpu_cells_note() -> str:
    """One line per kind of GPU cell: how it runs on this machine."""
    if has_cuda():
        n = torch.cuda.device_count()
        return (
            f"GPU cells run natively: Triton compiled, {dtype()} compute, "
            f"accelerator workers use NCCL on up to {n} GPU(s) (launch(..., accelerator=True) "
            "or torchrun); CPU-tensor demos stay on gloo."
        )
    return (
        "No GPU: Triton kernels run under the interpreter (fp32), distributed "
        "cells use gloo with 2-4 CPU processes, and GPU-only measurements "
        "(bandwidth, TFLOP/s) print what they would measure instead."
    )
