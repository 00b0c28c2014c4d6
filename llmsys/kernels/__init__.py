"""The course's Triton kernels (chapters 0, 8 and 9), installed as ``llmsys.kernels``.

Each module follows the rhythm of Triton's own tutorials: a ``@triton.jit``
kernel, a Python wrapper that checks its inputs and launches it, and (in
``tests/test_kernels.py`` and ``benchmarks/kernels.py``) a test against torch
and a benchmark.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function, so the
mode (compiled on CUDA, interpreter on the CPU) is fixed here, before any
kernel module is imported.
"""

from llmsys.device import configure_triton

TRITON_MODE = configure_triton()

from .canary import copy_canary, interpreter_ok  # noqa: E402
from .flash_attention import (  # noqa: E402
    attention_peak_bytes,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    naive_attention,
)
from .matmul import matmul  # noqa: E402
from .newton_schulz import newton_schulz_triton, ns_matmul  # noqa: E402
from .paged_attention import paged_attention_decode  # noqa: E402
from .rmsnorm import rmsnorm, rmsnorm_reference  # noqa: E402
from .softmax import softmax  # noqa: E402
from .vector_add import add  # noqa: E402

__all__ = [
    "TRITON_MODE",
    "add",
    "attention_peak_bytes",
    "copy_canary",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "interpreter_ok",
    "matmul",
    "naive_attention",
    "newton_schulz_triton",
    "ns_matmul",
    "paged_attention_decode",
    "rmsnorm",
    "rmsnorm_reference",
    "softmax",
]
