"""Muon's extra compute, measured side by side: Newton–Schulz in torch vs the Triton kernel,
and one Muon step vs one AdamW step on a Llama-style layer's matrices.

    python benchmarks/muon.py            # on a GPU: timings and ratios
                                         # on a CPU: a small interpreter check, no timings

Prints ratios; asserts nothing about speed.
"""

from llmsys.core.device import configure_triton

configure_triton()  # before anything imports triton

import time  # noqa: E402

import torch  # noqa: E402

from llmsys import kernels, optim  # noqa: E402
from llmsys.core.timing import median_seconds  # noqa: E402

NS_SHAPES = [(1024, 1024), (1024, 4096), (2048, 2048), (2048, 8192), (4096, 4096)]
LAYER_DIM, LAYER_HIDDEN, KV_DIM = 2048, 5632, 512  # a 1B-class Llama layer


def bench_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() on the GPU (``llmsys.core.timing.median_seconds``: CUDA events)."""
    return 1e3 * median_seconds(fn, reps, warmup=3, device="cuda")


def newton_schulz_table():
    print("Newton–Schulz, 5 steps, bf16: torch (cuBLAS, = torch.optim.Muon) vs Triton (symmetric Gram tiles)")
    print(f"{'shape':>12s} {'torch ms':>9s} {'triton ms':>9s} {'torch/triton':>12s} "
          f"{'torch TFLOP/s':>13s} {'max |diff|':>10s}")
    for rows, cols in NS_SHAPES:
        G = torch.randn(rows, cols, device="cuda")
        t_torch = bench_ms(lambda: optim.newton_schulz(G))
        Gb = G.bfloat16()
        t_triton = bench_ms(lambda: kernels.newton_schulz_triton(Gb))
        diff = (optim.newton_schulz(G).float() - kernels.newton_schulz_triton(Gb).float()).abs().max().item()
        tflops = optim.newton_schulz_flops(rows, cols) / (t_torch * 1e-3) / 1e12
        print(f"{rows:>5d}x{cols:<6d} {t_torch:9.3f} {t_triton:9.3f} {t_torch / t_triton:12.2f} "
              f"{tflops:13.1f} {diff:10.3g}")


def gram_table():
    print("\nGram matrix X Xᵀ, bf16: torch matmul vs Triton computing only the upper tiles")
    print(f"{'shape':>12s} {'torch ms':>9s} {'triton ms':>9s} {'torch/triton':>12s}")
    for rows, cols in NS_SHAPES:
        m, n = min(rows, cols), max(rows, cols)
        X = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        t_torch = bench_ms(lambda: X @ X.mT)
        t_triton = bench_ms(lambda: kernels.ns_matmul(X, X.mT, symmetric=True))
        print(f"{m:>5d}x{n:<6d} {t_torch:9.3f} {t_triton:9.3f} {t_torch / t_triton:12.2f}")


def optimizer_step_table():
    """One optimizer step over a layer's seven matrices: what Muon's orthogonalisation costs."""
    shapes = [(LAYER_DIM, LAYER_DIM), (KV_DIM, LAYER_DIM), (KV_DIM, LAYER_DIM), (LAYER_DIM, LAYER_DIM),
              (LAYER_HIDDEN, LAYER_DIM), (LAYER_HIDDEN, LAYER_DIM), (LAYER_DIM, LAYER_HIDDEN)]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    times = {}
    for name, opt in [("AdamW (torch, fused)", torch.optim.AdamW(params, lr=1e-3, fused=True)),
                      ("AdamW (llmsys loop)", optim.AdamW(params, lr=1e-3)),
                      ("Muon (torch.optim)", torch.optim.Muon(params, lr=1e-3)),
                      ("Muon (llmsys)", optim.Muon(params, lr=1e-3))]:
        times[name] = bench_ms(opt.step)
    ns_flops = sum(optim.newton_schulz_flops(*s) for s in shapes)
    tokens = 4 * 2**20  # a 4M-token batch
    print(f"\nOne optimizer step on a Llama layer's 7 matrices ({n / 1e6:.1f}M parameters)")
    base = times["AdamW (torch, fused)"]
    for name, t in times.items():
        print(f"  {name:22s} {t:8.3f} ms   {t / base:6.2f}x fused AdamW")
    print(f"  Newton–Schulz FLOPs / training FLOPs (6·N·tokens, {tokens / 2**20:.0f}M tokens): "
          f"{ns_flops / (6 * n * tokens):.2%}")


def cpu_check():
    print("No GPU: timings need compiled Triton. Checking the kernel under the interpreter instead.")
    G = torch.randn(48, 80)
    t = time.perf_counter()
    got = kernels.newton_schulz_triton(G)
    seconds = time.perf_counter() - t
    want = optim.newton_schulz(G, dtype=torch.float32)
    print(f"interpreter Newton–Schulz on 48x80 (fp32): max |diff| vs torch = {(got - want).abs().max():.2e} "
          f"({seconds:.1f} s: the interpreter runs one program at a time)")
    print("On a GPU this script prints: torch vs Triton Newton–Schulz times for "
          f"{', '.join(f'{r}x{c}' for r, c in NS_SHAPES)}, the Gram-matrix speedup from symmetric tiles, "
          "and one Muon step vs one AdamW step on a Llama layer.")


def main():
    if not torch.cuda.is_available():
        cpu_check()
        return
    print(torch.cuda.get_device_name(0))
    newton_schulz_table()
    gram_table()
    optimizer_step_table()


if __name__ == "__main__":
    main()
