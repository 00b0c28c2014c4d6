"""Memory-bound vs fused: counting the bytes an operation moves.

Softmax and RMSNorm do a handful of FLOPs per element, so their speed is the
speed of memory: what matters is how many bytes cross between HBM and the
chip. Written as a chain of torch ops, every intermediate makes a round trip
to memory; a fused kernel reads its input once and writes its output once.
FlashAttention applies the same idea to attention, where the intermediate is
the N x N score matrix.

Two counters and the formulas they check:

- ``TorchTraffic``: a dispatch mode that charges every eager torch op for
  reading its tensor inputs and writing its outputs (views move nothing);
- ``kernel_traffic``: runs a Triton kernel under the interpreter and adds up
  the bytes its ``tl.load`` and ``tl.store`` touch (masked-off lanes excluded);
- ``softmax_bytes`` / ``rmsnorm_bytes`` (fused and unfused) and
  ``attention_peak_bytes_estimate`` (naive and flash).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that create storage without moving data through it.
_ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TorchTraffic(TorchDispatchMode):
    """Bytes read and written by eager torch ops run inside the mode.

    The model of an unfused chain: each op reads every tensor it is given from
    memory and writes every tensor it returns. ``ops`` lists (op, read, written).
    """

    def __init__(self):
        super().__init__()
        self.read = 0
        self.written = 0
        self.ops: list[tuple[str, int, int]] = []

    @property
    def total(self) -> int:
        return self.read + self.written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket.__name__ in _ALLOCATIONS:
            return out
        inputs = {id(t): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        read = sum(_tensor_bytes(t) for t in inputs.values())
        written = sum(_tensor_bytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.read += read
        self.written += written
        self.ops.append((str(func.overloadpacket), read, written))
        return out


def kernel_traffic(kernel, grid, *args, **meta) -> tuple[int, int]:
    """(bytes loaded, bytes stored) by one launch of a ``@triton.jit`` kernel.

    The kernel runs under the Triton interpreter on the given CPU tensors
    (a compiled kernel is re-run interpreted), and every ``tl.load`` and
    ``tl.store`` adds the bytes of its unmasked lanes. ``grid`` and ``meta``
    are what ``kernel[grid](*args, **meta)`` would take.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.device.type != "cpu":
            raise ValueError(f"argument {i} is on {arg.device}; kernel_traffic interprets the kernel on the CPU, "
                             "so pass CPU tensors (.cpu())")
    if isinstance(kernel, interpreter.InterpretedFunction):
        interpreted = kernel
    elif isinstance(kernel, JITFunction):
        interpreted = interpreter.InterpretedFunction(kernel.fn)
    else:
        raise ValueError(f"kernel must be a @triton.jit function, got {type(kernel).__name__}")

    builder = interpreter.interpreter_builder
    counts = {"load": 0, "store": 0}
    load, store = builder.create_masked_load, builder.create_masked_store

    def lane_bytes(ptrs, mask) -> int:
        return int(mask.data.sum()) * max(1, ptrs.get_element_ty().primitive_bitwidth // 8)

    def counting_load(ptrs, mask, other, *rest):
        counts["load"] += lane_bytes(ptrs, mask)
        return load(ptrs, mask, other, *rest)

    def counting_store(ptrs, value, mask, *rest):
        counts["store"] += lane_bytes(ptrs, mask)
        return store(ptrs, value, mask, *rest)

    # Helpers the kernel calls (tl.max, tl.sum, ...) are themselves @triton.jit
    # functions; when triton was imported in compiled mode they refuse to be
    # called from Python, so for this launch they are interpreted too.
    interpreted_helpers: dict = {}

    def interpret_helper(jit_function, *call_args, **call_kwargs):
        if jit_function.fn not in interpreted_helpers:
            interpreted_helpers[jit_function.fn] = interpreter.InterpretedFunction(jit_function.fn)
        return interpreted_helpers[jit_function.fn](*call_args, **call_kwargs)

    device_call = JITFunction.__call__
    builder.create_masked_load, builder.create_masked_store = counting_load, counting_store
    JITFunction.__call__ = interpret_helper
    try:
        with _triton_language_restored():
            interpreted[grid](*args, **meta)
    finally:
        JITFunction.__call__ = device_call
        del builder.create_masked_load, builder.create_masked_store  # the class's own methods again
    return counts["load"], counts["store"]


@contextlib.contextmanager
def _triton_language_restored():
    """Put back every attribute the interpreter patches in ``triton.language``.

    A kernel launch restores what it patched, but each interpreted helper call
    (``tl.max`` -> ``tl.reduce``, ...) patches ``triton.language.core`` and never
    restores it (Triton 3.6-3.8). Left patched, its builtins are plain lambdas,
    and every kernel compiled afterwards that uses ``tl.zeros`` or ``tl.max`` fails.
    """
    import triton.language as tl

    core = tl.core
    patched = [tl, core, tl.math, core.tensor, core.dtype]
    patched += [core.tensor_descriptor_base] if hasattr(core, "tensor_descriptor_base") else []
    saved = [(obj, dict(vars(obj))) for obj in patched]
    try:
        yield
    finally:
        for obj, before in saved:
            for name, value in list(vars(obj).items()):
                if name not in before and not inspect.ismodule(value):  # submodules imported meanwhile stay
                    delattr(obj, name)
                elif name in before and value is not before[name]:
                    setattr(obj, name, before[name])


# ---------------------------------------------------------------------------
# The unfused chains, written op by op


def softmax_unfused(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension as five separate ops, each a round trip to memory."""
    row_max = x.amax(dim=-1, keepdim=True)  # read N, write R
    shifted = x - row_max  # read N + R, write N
    numerator = shifted.exp()  # read N, write N
    total = numerator.sum(dim=-1, keepdim=True)  # read N, write R
    return numerator / total  # read N + R, write N


def softmax_bytes(rows: int, cols: int, bytes_per_element: float = 4, fused: bool = True) -> float:
    """Bytes moved by a row softmax of (rows, cols): fused reads x and writes y once;
    ``softmax_unfused`` reads 5 and writes 3 full tensors, plus four row vectors."""
    n, r, b = rows * cols, rows, bytes_per_element
    if fused:
        return 2 * n * b
    return (8 * n + 4 * r) * b


def rmsnorm_bytes(rows: int, cols: int, bytes_per_element: float = 4, fused: bool = True) -> float:
    """Bytes moved by RMSNorm of (rows, cols) with a gain of ``cols``.

    fused (``llmsys.kernels.rmsnorm``): read x and the gain, write y and one fp32
    1/rms per row (kept for backward). Unfused (``llmsys.core.model.RMSNorm`` in fp32):
    pow, mean, add eps, rsqrt, multiply, multiply by the gain: 4 reads and 3
    writes of the full tensor, plus row vectors and the gain.
    """
    n, r, c, b = rows * cols, rows, cols, bytes_per_element
    if fused:
        return (2 * n + c) * b + 4 * r
    return (7 * n + 6 * r + c) * b


def fused_softmax_traffic(x: torch.Tensor) -> tuple[int, int]:
    """(loaded, stored) bytes of ``llmsys.kernels.softmax`` on x, launched as its wrapper does."""
    import triton

    from llmsys.kernels.fused_softmax import launch_config, softmax_kernel

    x = x.detach().cpu().contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    block_rows, block_cols, _ = launch_config(n_rows, n_cols)
    y = torch.empty_like(x)
    return kernel_traffic(softmax_kernel, (triton.cdiv(n_rows, block_rows),), x, y, n_rows, n_cols,
                          BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)


def fused_rmsnorm_traffic(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple[int, int]:
    """(loaded, stored) bytes of the ``llmsys.kernels.rmsnorm`` forward on x, launched as its wrapper does."""
    import triton

    from llmsys.kernels.fused_rmsnorm import rmsnorm_fwd_kernel
    from llmsys.kernels.fused_softmax import launch_config

    x = x.detach().cpu().contiguous()
    weight = weight.detach().cpu().contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    block_rows, block_cols, _ = launch_config(n_rows, n_cols)
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, dtype=torch.float32)
    return kernel_traffic(rmsnorm_fwd_kernel, (triton.cdiv(n_rows, block_rows),), x, weight, y, rstd,
                          n_rows, n_cols, eps, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)


# ---------------------------------------------------------------------------
# Attention memory


def attention_peak_bytes_estimate(n: int, d: int = 64, impl: str = "flash", causal: bool = False,
                                  bytes_per_element: float = 4, batch: int = 1, heads: int = 1) -> float:
    """Peak bytes of new tensors during one attention forward, inputs excluded
    (what ``llmsys.kernels.attention_peak_bytes`` measures).

    naive: the scaled scores and the probabilities, N x N each, live together,
    then the output (plus a shared N x N boolean mask when causal):
    2N²b + Ndb per head. flash: only the output and one fp32 log-sum-exp per
    row, Ndb + 4N per head: O(N) instead of O(N²).
    """
    if impl not in ("naive", "flash"):
        raise ValueError(f"impl must be 'naive' or 'flash', got {impl!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    b, per_head = bytes_per_element, batch * heads
    if impl == "flash":
        return per_head * (n * d * b + 4 * n)
    return per_head * (2 * n * n * b + n * d * b) + (n * n if causal else 0)
