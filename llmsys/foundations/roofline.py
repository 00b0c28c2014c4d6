"""The roofline: how fast an operation can run, from its arithmetic intensity.

A kernel that does F FLOPs while moving B bytes between memory and the chip
has arithmetic intensity I = F / B. On a machine with peak compute P (FLOP/s)
and memory bandwidth W (bytes/s) it runs at most min(P, I·W): below the ridge
point I = P / W it waits on memory (memory-bound), above it on arithmetic
(compute-bound). Large matmuls sit far right of the ridge; softmax, RMSNorm
and batch-1 decoding sit far left of it.

This module measures the roof of the machine it runs on (a large matmul for
P, a large copy for W), builds roofs from the GPU datasheets in
``llmsys.core.accounting.GPUS``, and places the course's operations on them.

    roof = measure()                     # this machine
    ops = course_operations(bytes_per_element=4)
    plot([roof, gpu("H100 SXM")], ops)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmsys.core import accounting
from llmsys.core import device as _device
from llmsys.core.timing import median_seconds

MiB = 2**20


# ---------------------------------------------------------------------------
# Operations and their arithmetic intensity


@dataclass(frozen=True)
class Operation:
    """An operation's FLOPs and the bytes it must move to and from memory."""

    name: str
    flops: float
    bytes: float
    group: str = ""  # operations of one group are drawn as a connected series

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes


def _check_positive(**sizes) -> None:
    for name, value in sizes.items():
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def matmul(m: int, n: int, k: int, bytes_per_element: float = 2, name: str | None = None,
           group: str = "") -> Operation:
    """(m, k) @ (k, n): 2mnk FLOPs; reads both inputs and writes the output once."""
    _check_positive(m=m, n=n, k=k, bytes_per_element=bytes_per_element)
    moved = (m * k + k * n + m * n) * bytes_per_element
    return Operation(name or f"matmul {m}x{n}x{k}", 2 * m * n * k, moved, group)


def decode_linear(batch: int, d_in: int = 4096, d_out: int = 4096, bytes_per_element: float = 2) -> Operation:
    """One linear layer while decoding: ``batch`` token vectors times a (d_in, d_out) weight.

    2·batch·d_in·d_out FLOPs over about d_in·d_out weight elements (the activations
    are tiny next to them), so in bf16 the intensity is about ``batch``
    (Williams et al. 2009, "Roofline"): decoding is memory-bound until the batch reaches the ridge.
    """
    return matmul(batch, d_out, d_in, bytes_per_element, name=f"decode linear, batch {batch}", group="decode linear")


def softmax(rows: int, cols: int, bytes_per_element: float = 2) -> Operation:
    """Fused row softmax: 5 FLOPs per element (max, subtract, exp, sum, divide), one read and one write."""
    _check_positive(rows=rows, cols=cols, bytes_per_element=bytes_per_element)
    elements = rows * cols
    return Operation(f"softmax {rows}x{cols}", 5 * elements, 2 * elements * bytes_per_element)


def rmsnorm(rows: int, cols: int, bytes_per_element: float = 2) -> Operation:
    """Fused RMSNorm: 4 FLOPs per element (square, sum, scale by 1/rms, scale by the gain);
    reads x and the gain, writes y."""
    _check_positive(rows=rows, cols=cols, bytes_per_element=bytes_per_element)
    elements = rows * cols
    return Operation(f"RMSNorm {rows}x{cols}", 4 * elements, (2 * elements + cols) * bytes_per_element)


def attention(seq_len: int, head_dim: int = 128, heads: int = 32, batch: int = 1,
              bytes_per_element: float = 2, causal: bool = False) -> Operation:
    """FlashAttention forward: QKᵀ and PV, 4·N²·d FLOPs per head (half with a causal mask),
    while reading Q, K, V and writing O once: 4·N·d elements per head."""
    _check_positive(seq_len=seq_len, head_dim=head_dim, heads=heads, batch=batch,
                    bytes_per_element=bytes_per_element)
    per_head = 4 * seq_len * seq_len * head_dim
    flops = batch * heads * per_head / (2 if causal else 1)
    moved = batch * heads * 4 * seq_len * head_dim * bytes_per_element
    mask = ", causal" if causal else ""
    return Operation(f"attention N={seq_len}{mask}", flops, moved)


def course_operations(bytes_per_element: float = 2, dim: int = 4096, tokens: int = 4096,
                      batches=(1, 2, 4, 8, 16, 32, 64)) -> list[Operation]:
    """The operations the course keeps meeting, sized like a 7B-class layer.

    ``tokens`` is the number of rows (batch × sequence) for training-time ops
    and the sequence length of attention (head_dim 128, dim // 128 heads).
    """
    heads = max(1, dim // 128)
    ops = [
        matmul(tokens, dim, dim, bytes_per_element, name=f"matmul {tokens}x{dim}x{dim}"),
        softmax(tokens, tokens, bytes_per_element),
        rmsnorm(tokens, dim, bytes_per_element),
        attention(tokens, 128, heads, 1, bytes_per_element, causal=True),
    ]
    ops += [decode_linear(b, dim, dim, bytes_per_element) for b in batches]
    return ops


# ---------------------------------------------------------------------------
# Roofs


@dataclass(frozen=True)
class Roof:
    """A machine as the roofline sees it: peak FLOP/s and memory bytes/s."""

    name: str
    peak_flops: float
    bytes_per_s: float

    def __post_init__(self):
        _check_positive(peak_flops=self.peak_flops, bytes_per_s=self.bytes_per_s)

    @property
    def ridge(self) -> float:
        """The intensity (FLOP/byte) where memory stops being the limit."""
        return accounting.ridge_point(self.peak_flops, self.bytes_per_s)

    def attainable(self, intensity: float) -> float:
        """FLOP/s an operation of this intensity can reach at best."""
        return accounting.roofline(intensity, self.peak_flops, self.bytes_per_s)

    def bound(self, intensity: float) -> str:
        return "compute-bound" if intensity >= self.ridge else "memory-bound"


def gpu(name: str, precision: str = "bf16") -> Roof:
    """A datasheet roof from ``accounting.GPUS``: dense tensor-core peak and HBM bandwidth."""
    if name not in accounting.GPUS:
        raise ValueError(f"unknown GPU {name!r}; use one of {sorted(accounting.GPUS)}")
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    spec = accounting.GPUS[name]
    peak = spec[f"{precision}_flops"]
    if peak is None:
        raise ValueError(f"{name} has no {precision} tensor cores; use precision='bf16'")
    return Roof(f"{name} ({precision})", peak, spec["hbm_bytes_per_s"])


def datasheet_roof(device_name: str, precision: str = "bf16") -> Roof | None:
    """The datasheet roof of a GPU named as torch names it, or None when it is not in the table."""
    name = accounting.gpu_named(device_name)
    return gpu(name, precision) if name is not None else None


# ---------------------------------------------------------------------------
# Measuring this machine


def measure_matmul_flops(n: int = 1024, reps: int = 5, dtype: torch.dtype | None = None,
                         device: torch.device | str | None = None) -> float:
    """FLOP/s of an (n, n) @ (n, n) matmul: 2n³ FLOPs over the median time."""
    _check_positive(n=n)
    dev = torch.device(device) if device is not None else _device.device()
    dtype = dtype or _device.dtype(dev)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    seconds = median_seconds(lambda: torch.mm(a, b, out=out), reps, device=dev)
    return 2 * n**3 / seconds


def measure_copy_bandwidth(n_bytes: int = 64 * MiB, reps: int = 5, device: torch.device | str | None = None) -> float:
    """Bytes/s of copying one buffer into another: each copy reads and writes n_bytes (the
    STREAM "copy" convention). Make n_bytes larger than the last-level cache."""
    _check_positive(n_bytes=n_bytes)
    dev = torch.device(device) if device is not None else _device.device()
    src = torch.ones(int(n_bytes) // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), reps, device=dev)
    return 2 * src.nbytes / seconds


def measure(matmul_size: int | None = None, copy_bytes: int | None = None, reps: int = 5,
            device: torch.device | str | None = None) -> Roof:
    """This machine's own roof: a large matmul for the peak, a large copy for the bandwidth.

    Defaults suit the device: a 1024² fp32 matmul and a 64 MiB copy on a CPU,
    8192² in the training dtype and 1 GiB on a GPU.
    """
    dev = torch.device(device) if device is not None else _device.device()
    on_gpu = dev.type == "cuda"
    matmul_size = matmul_size or (8192 if on_gpu else 1024)
    copy_bytes = copy_bytes or (1024 * MiB if on_gpu else 64 * MiB)
    dtype = _device.dtype(dev)
    flops = measure_matmul_flops(matmul_size, reps, dtype, dev)
    bandwidth = measure_copy_bandwidth(copy_bytes, reps, dev)
    what = torch.cuda.get_device_name(dev) if on_gpu else "this CPU"
    return Roof(f"{what}, measured ({str(dtype).replace('torch.', '')})", flops, bandwidth)


# ---------------------------------------------------------------------------
# The picture


def plot(roofs, operations=(), ax=None, title: str | None = None, intensity_range=(0.1, 1e4)):
    """Log-log roofline: one line per roof, the operations placed on the first roof.

    ``roofs`` is a Roof or a list of them. Returns the matplotlib axes.
    """
    import matplotlib.pyplot as plt

    roofs = [roofs] if isinstance(roofs, Roof) else list(roofs)
    if not roofs:
        raise ValueError("plot needs at least one Roof")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    top = max(r.peak_flops for r in roofs)
    unit, scale = ("TFLOP/s", 1e12) if top >= 1e13 else ("GFLOP/s", 1e9)
    lo, hi = intensity_range
    xs = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    for roof in roofs:
        line, = ax.plot(xs, [roof.attainable(x) / scale for x in xs], label=f"{roof.name}, ridge {roof.ridge:.3g} FLOP/B")
        ax.axvline(roof.ridge, color=line.get_color(), linestyle=":", linewidth=1)
    main = roofs[0]
    groups: dict[str, list[Operation]] = {}
    for op in operations:
        if op.group:
            groups.setdefault(op.group, []).append(op)
        else:
            ax.scatter([op.intensity], [main.attainable(op.intensity) / scale], zorder=3, label=op.name)
    for name, ops in groups.items():
        first, last = (op.name.split(",")[-1].strip() for op in (ops[0], ops[-1]))
        ax.plot([op.intensity for op in ops], [main.attainable(op.intensity) / scale for op in ops], "o-",
                markersize=4, zorder=3, label=f"{name} ({first} .. {last})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel(f"attainable {unit}")
    ax.set_title(title or f"Roofline; operations placed on {main.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def describe(roof: Roof, operations) -> list[tuple[str, float, float, str]]:
    """(name, intensity, attainable FLOP/s, bound) for each operation on ``roof``."""
    return [(op.name, op.intensity, roof.attainable(op.intensity), roof.bound(op.intensity)) for op in operations]
