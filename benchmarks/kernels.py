"""Benchmarks for llmsys.kernels: ratios measured side by side in one run.

    python benchmarks/kernels.py [--json PATH]

On a GPU (Triton compiled):
  * each kernel's error and time against its torch counterpart;
  * achieved bandwidth of the fused softmax and RMSNorm as a fraction of the
    GPU's HBM peak, next to torch's;
  * FlashAttention TFLOP/s against F.scaled_dot_product_attention, forward
    and forward+backward, at a few sequence lengths;
  * peak memory of naive attention (N x N scores) against the flash kernel.
On a CPU the Triton interpreter runs the same code at small sizes: errors and
memory are real measurements, times are not (the interpreter executes one
program at a time in Python), so those ratios are printed as such.

Peak memory is "bytes of tensors live at once during one forward, inputs
excluded": the CUDA caching allocator's peak on a GPU, and on a CPU a torch
dispatch mode that adds up every tensor torch allocates and subtracts it when
it is freed (see llmsys.kernels.flash_triton.LiveTensorBytes). A compiled
kernel's registers and shared memory are not tensors, so they are not counted:
that is the point of tiling.
"""

import argparse
import json

import torch
import torch.nn.functional as F

import llmsys.kernels as K
from llmsys.foundations import roofline
from llmsys.core.device import dtype as training_dtype
from llmsys.kernels.common import INTERPRETED
from llmsys.core.timing import median_seconds

DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPE = torch.float32 if INTERPRETED else training_dtype(DEVICE)
TIME_NOTE = "interpreter: time ratio is not a speed measurement" if INTERPRETED else "compiled"


def peak_bandwidth() -> float | None:
    """The GPU's HBM bandwidth from its datasheet (``llmsys.foundations.roofline.datasheet_roof``), None if not listed."""
    if INTERPRETED:
        return None
    roof = roofline.datasheet_roof(torch.cuda.get_device_name())
    return roof.bytes_per_s if roof else None


def bench_ms(fn, reps: int = 3) -> float:
    """Median milliseconds per call: triton's do_bench on a GPU (warm-up, CUDA events), else warm wall-clock calls."""
    if not INTERPRETED:
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    return 1e3 * median_seconds(fn, reps, device="cpu")


def randn(*shape, requires_grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE, requires_grad=requires_grad)


def max_error(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def print_table(title, header, rows) -> dict:
    """Print a table; return it as {"title", "rows": [{column: value}]} for --json."""
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print("  " + "  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    return {"title": title, "rows": [dict(zip(header, row)) for row in rows]}


def correctness_and_time():
    """Every kernel against torch: max error, then time(kernel) / time(torch)."""
    small = INTERPRETED
    n = 1 << 16 if small else 1 << 26
    rows, cols = (256, 1000) if small else (8192, 4096)
    m = 128 if small else 4096
    x, y = randn(n), randn(n)
    s = randn(rows, cols)
    w = randn(cols)
    a, b = randn(m, m), randn(m, m)
    heads, seq, d = (2, 128, 32) if small else (16, 2048, 64)
    q, k, v = (randn(1, heads, seq, d) for _ in range(3))
    cases = [
        ("add", f"{n}", lambda: K.add(x, y), lambda: x + y),
        ("softmax", f"{rows}x{cols}", lambda: K.softmax(s), lambda: torch.softmax(s, -1)),
        ("rmsnorm", f"{rows}x{cols}", lambda: K.rmsnorm(s, w), lambda: F.rms_norm(s, (cols,), w, 1e-6)),
        ("matmul", f"{m}x{m}x{m}", lambda: K.matmul(a, b), lambda: a @ b),
        ("flash attention", f"1x{heads}x{seq}x{d} causal", lambda: K.flash_attention(q, k, v, causal=True),
         lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    ]
    table = []
    for name, shape, ours, theirs in cases:
        with torch.no_grad():
            error = max_error(ours(), theirs())
            ours_ms, theirs_ms = bench_ms(ours), bench_ms(theirs)
        table.append((name, shape, f"{error:.1e}", f"{ours_ms:.3f}", f"{theirs_ms:.3f}", f"{ours_ms / theirs_ms:.1f}"))
    return print_table(f"Kernels vs torch ({DTYPE}, {TIME_NOTE})",
                ("kernel", "shape", "max |err|", "triton ms", "torch ms", "time ratio"), table)


def bandwidth():
    """Bytes a fused row kernel must move / time, as a fraction of HBM peak."""
    rows, cols = (256, 1000) if INTERPRETED else (16384, 4096)
    x, w = randn(rows, cols), randn(cols)
    size = x.element_size()
    read_write = 2 * x.numel() * size  # read x once, write y once
    cases = [
        ("softmax (triton)", lambda: K.softmax(x), read_write),
        ("softmax (torch)", lambda: torch.softmax(x, -1), read_write),
        ("rmsnorm (triton)", lambda: K.rmsnorm(x, w), read_write + cols * size + rows * 4),  # + weight, rstd
        ("rmsnorm (torch)", lambda: F.rms_norm(x, (cols,), w, 1e-6), read_write + cols * size),
    ]
    peak = peak_bandwidth()
    table = []
    for name, fn, nbytes in cases:
        with torch.no_grad():
            ms = bench_ms(fn)
        achieved = nbytes / (ms * 1e-3)
        fraction = f"{achieved / peak:.2f}" if peak else "n/a"
        table.append((name, f"{rows}x{cols}", f"{nbytes / 1e6:.1f}", f"{achieved / 1e9:.3g}", fraction))
    if INTERPRETED:
        where = "CPU interpreter: not a bandwidth figure; on a GPU this is achieved / HBM peak"
    elif peak:
        where = f"{torch.cuda.get_device_name()}, HBM peak {peak / 1e12:.2f} TB/s"
    else:
        where = f"{torch.cuda.get_device_name()}: peak bandwidth not in the table"
    return print_table(f"Fused row kernels: achieved bandwidth ({where})",
                ("kernel", "shape", "MB moved", "GB/s", "of peak"), table)


def attention_flops(batch, heads, seq, d, causal, backward):
    forward = 4 * batch * heads * seq * seq * d  # QKᵀ and PV, 2 FLOPs per multiply-add
    if causal:
        forward //= 2
    return forward * 3.5 if backward else forward  # backward: 5 matmuls to the forward's 2


def flash_attention_throughput():
    """TFLOP/s of the flash kernel and of torch SDPA at a few sequence lengths."""
    batch, heads, d = (1, 2, 32) if INTERPRETED else (4, 16, 64)
    lengths = (64, 128) if INTERPRETED else (1024, 2048, 4096, 8192)
    table = []
    for seq in lengths:
        q, k, v = (randn(batch, heads, seq, d, requires_grad=True) for _ in range(3))
        grad_out = randn(batch, heads, seq, d)
        for causal in (False, True):
            for backward in (False, True):
                def run(attention):
                    def step():
                        out = attention(q, k, v, causal)
                        if backward:
                            torch.autograd.grad(out, (q, k, v), grad_out)
                    return step

                ours = bench_ms(run(lambda q, k, v, c: K.flash_attention(q, k, v, causal=c)))
                theirs = bench_ms(run(lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)))
                flops = attention_flops(batch, heads, seq, d, causal, backward)
                table.append((seq, "causal" if causal else "full", "fwd+bwd" if backward else "fwd",
                              f"{flops / ours / 1e9:.3g}", f"{flops / theirs / 1e9:.3g}", f"{theirs / ours:.2f}"))
    return print_table(f"FlashAttention vs F.scaled_dot_product_attention (B={batch}, H={heads}, d={d}, {DTYPE}, {TIME_NOTE})",
                ("N", "mask", "pass", "triton TFLOP/s", "sdpa TFLOP/s", "triton/sdpa"), table)


def attention_memory():
    """Peak bytes of one attention forward: naive grows as N², flash as N."""
    d = 64
    lengths = (128, 256, 512, 1024) if INTERPRETED else (1024, 4096, 16384)
    table = []
    for seq in lengths:
        naive = K.attention_peak_bytes(seq, d, "naive")
        flash = K.attention_peak_bytes(seq, d, "flash")
        table.append((seq, f"{naive / 2**20:.3f}", f"{flash / 2**20:.3f}", f"{naive / flash:.1f}"))
    how = "CUDA allocator peak" if not INTERPRETED else "live torch tensor bytes (LiveTensorBytes)"
    return print_table(f"Attention peak memory, one head, d={d}, inputs excluded ({how})",
                ("N", "naive MiB", "flash MiB", "naive/flash"), table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write every table to this JSON file")
    args = parser.parse_args(argv)
    print(f"device {DEVICE}, Triton {K.TRITON_MODE}, dtype {DTYPE}")
    if not K.interpreter_ok():
        print("The copy canary failed: Triton returns wrong numbers here, so nothing below means anything.")
        return 1
    torch.manual_seed(0)
    tables = [correctness_and_time(), bandwidth(), flash_attention_throughput(), attention_memory()]
    if args.json:
        device_name = torch.cuda.get_device_name() if not INTERPRETED else "cpu (interpreter)"
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "dtype": str(DTYPE), "triton": K.TRITON_MODE, "tables": tables}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
