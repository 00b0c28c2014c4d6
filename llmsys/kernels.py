"""The course's Triton kernels (chapters 0, 8 and 9), imported as ``llmsys.kernels``, and
FlashAttention-2 in plain PyTorch (``flash_torch``), the step before its Triton version.

Each module follows the rhythm of Triton's own tutorials: a ``@triton.jit``
kernel, a Python wrapper that checks its inputs and launches it, and (in
``tests/test_kernels.py`` and ``benchmarks/kernels.py``) a test against torch
and a benchmark.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function, so the
mode (compiled on CUDA, interpreter on the CPU) is fixed here, before any
kernel module is imported.

Where the modules live: the folder ``kernels/`` at the top of the repository
(an installed copy puts them in ``llmsys/kernels/``). That folder has no
``__init__.py`` on purpose: a PyPI package is called ``kernels`` and
transformers probes for it by importing it, so with the repository root on
``sys.path`` the folder must stay an empty namespace that runs nothing. This
module is the package's entry instead: setting ``__path__`` makes Python look
up ``llmsys.kernels.<name>`` in that folder.
"""

from pathlib import Path

from llmsys.core.device import configure_triton

TRITON_MODE = configure_triton()

_HERE = Path(__file__).resolve().parent
# installed (site-packages/llmsys/kernels/) first, then the checkout (<repo>/kernels/)
__path__ = [str(d) for d in (_HERE / "kernels", _HERE.parent / "kernels") if (d / "common.py").is_file()][:1]
if not __path__:
    raise ImportError(f"the kernel modules are missing: neither {_HERE / 'kernels'} nor {_HERE.parent / 'kernels'} "
                      "holds common.py; reinstall with `pip install -e .` from the repository root")

from llmsys.kernels.canary import copy_canary, interpreter_ok  # noqa: E402
from llmsys.kernels.flash_triton import (  # noqa: E402
    attention_peak_bytes,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    naive_attention,
)
from llmsys.kernels.flash_torch import flash_attention_torch  # noqa: E402
from llmsys.kernels.fused_rmsnorm import rmsnorm, rmsnorm_reference  # noqa: E402
from llmsys.kernels.fused_softmax import softmax  # noqa: E402
from llmsys.kernels.newton_schulz import newton_schulz_triton, ns_matmul  # noqa: E402
from llmsys.kernels.paged_attention import paged_attention_decode  # noqa: E402
from llmsys.kernels.tiled_matmul import matmul  # noqa: E402
from llmsys.kernels.vector_add import add  # noqa: E402

__all__ = [
    "TRITON_MODE",
    "add",
    "attention_peak_bytes",
    "copy_canary",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_attention_torch",
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
