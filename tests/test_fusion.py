"""Counting bytes moved: the counters against the formulas, and the formulas against the kernels."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import llmsys.kernels as K  # first: sets the Triton mode before anything imports triton
from llmsys.foundations import fusion
from llmsys.kernels.canary import copy_kernel
from llmsys.kernels.common import INTERPRETED
from llmsys.core.model import RMSNorm

REPO_ROOT = Path(__file__).resolve().parents[1]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows, cols", [(3, 17), (64, 1000)])
def test_unfused_softmax_traffic_equals_the_formula(rows, cols):
    x = randn(rows, cols)
    with fusion.TorchTraffic() as traffic:
        y = fusion.softmax_unfused(x)
    torch.testing.assert_close(y, torch.softmax(x, dim=-1))
    assert traffic.total == fusion.softmax_bytes(rows, cols, 4, fused=False)
    assert [op for op, _, _ in traffic.ops] == ["aten.amax", "aten.sub", "aten.exp", "aten.sum", "aten.div"]


def test_unfused_rmsnorm_traffic_is_the_models_rmsnorm():
    rows, cols = 5, 96
    x = randn(rows, cols)
    norm = RMSNorm(cols, 1e-5)
    with torch.no_grad(), fusion.TorchTraffic() as traffic:
        norm(x)
    assert traffic.total == fusion.rmsnorm_bytes(rows, cols, 4, fused=False)


def test_views_and_allocations_move_nothing():
    x = randn(8, 8)
    with fusion.TorchTraffic() as traffic:
        x.view(64)
        x.t()
        torch.empty_like(x)
    assert traffic.total == 0 and traffic.ops == []


def test_kernel_traffic_counts_only_unmasked_lanes():
    n = 1000  # four blocks of 256, the last one ragged
    src, dst = torch.arange(1.0, n + 1), torch.zeros(n)
    loaded, stored = fusion.kernel_traffic(copy_kernel, (4,), src, dst, n, BLOCK_SIZE=256)
    assert (loaded, stored) == (4 * n, 4 * n)
    assert torch.equal(src, dst)


@pytest.mark.parametrize("rows, cols", [(64, 1000), (8, 33)])
def test_fused_kernels_move_the_compulsory_bytes(rows, cols):
    # Whole tiles (rows fit one program): exactly one read of the input, one write of the output.
    x, w = randn(rows, cols), randn(cols, seed=1)
    assert sum(fusion.fused_softmax_traffic(x)) == fusion.softmax_bytes(rows, cols, 4)
    assert sum(fusion.fused_rmsnorm_traffic(x, w)) == fusion.rmsnorm_bytes(rows, cols, 4)


def test_fusion_cuts_softmax_traffic_by_four():
    rows, cols = 16, 4096
    unfused = fusion.softmax_bytes(rows, cols, 4, fused=False)
    assert sum(fusion.fused_softmax_traffic(randn(rows, cols))) / unfused == pytest.approx(0.25, rel=1e-3)


def test_ragged_rows_cost_at_most_a_padded_tile_more():
    from llmsys.kernels.fused_softmax import launch_config

    rows, cols = 100, 1000
    block_rows = launch_config(rows, cols)[0]
    padded_rows = -(-rows // block_rows) * block_rows
    loaded, stored = fusion.fused_softmax_traffic(randn(rows, cols))
    assert stored == rows * cols * 4  # stores are masked by row
    assert rows * cols * 4 <= loaded <= padded_rows * cols * 4  # padding rows re-read the last row


def test_kernel_traffic_interprets_a_compiled_kernel_and_restores_triton():
    # A GPU machine imports the kernels compiled (TRITON_INTERPRET=0); counting must still work there,
    # and leave triton.language as it found it, or every later compile that uses tl.zeros / tl.max fails.
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import inspect
        import torch
        import triton.language as tl
        from triton.runtime.jit import JITFunction
        from llmsys.foundations import fusion
        from llmsys.kernels.fused_softmax import softmax_kernel
        assert isinstance(softmax_kernel, JITFunction)
        # what the interpreter patches: the language modules and the classes they share
        patched = (tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype)
        before = [dict(vars(obj)) for obj in patched]
        x = torch.randn(8, 33)
        print(sum(fusion.fused_softmax_traffic(x)) == fusion.softmax_bytes(8, 33, 4))
        # later compiles need the originals back (tl.max's helper call patches tl.core)
        changed = [f"{getattr(obj, '__name__', obj)}.{name}" for obj, old in zip(patched, before)
                   for name in set(old) | set(vars(obj))
                   if vars(obj).get(name) is not old.get(name) and not inspect.ismodule(vars(obj).get(name))]
        print(changed or True)
        try:
            softmax_kernel(x)
        except RuntimeError as err:
            print("outside of the scope of a kernel" in str(err))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT / "tests", env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True", "True"]


def test_kernel_traffic_refuses_what_it_cannot_count():
    with pytest.raises(ValueError, match="@triton.jit"):
        fusion.kernel_traffic(lambda: None, (1,))
    with pytest.raises(ValueError, match="impl"):
        fusion.attention_peak_bytes_estimate(64, impl="sparse")


@pytest.mark.skipif(not INTERPRETED, reason="exact only for the CPU counter; the CUDA allocator rounds up")
@pytest.mark.parametrize("impl", ["naive", "flash"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_peak_estimate_equals_the_measurement(impl, causal):
    n, d = 96, 32
    measured = K.attention_peak_bytes(n, d, impl, causal=causal)
    assert measured == fusion.attention_peak_bytes_estimate(n, d, impl, causal=causal)


def test_attention_memory_is_quadratic_naive_and_linear_flash():
    est = fusion.attention_peak_bytes_estimate
    assert est(8192, impl="naive") / est(4096, impl="naive") == pytest.approx(4, rel=0.01)
    assert est(8192, impl="flash") / est(4096, impl="flash") == pytest.approx(2)
    assert est(4096, impl="flash", batch=2, heads=3) == 6 * est(4096, impl="flash")
