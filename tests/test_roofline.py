"""The roofline: intensity formulas, roofs from the datasheets, this machine's measurement."""

import math

import matplotlib
import pytest

from llmsys.core import accounting, timing
from llmsys.foundations import roofline

matplotlib.use("Agg")


def test_matmul_intensity_is_flops_over_bytes():
    m, n, k = 64, 48, 80
    op = roofline.matmul(m, n, k, bytes_per_element=2)
    assert op.flops == 2 * m * n * k
    assert op.bytes == 2 * (m * k + k * n + m * n)
    assert op.intensity == pytest.approx(2 * m * n * k / (2 * (m * k + k * n + m * n)))
    # square n: 2n³ / (3n² b) = 2n / (3b), so it grows with n: big matmuls are compute-bound
    assert roofline.matmul(4096, 4096, 4096, 2).intensity == pytest.approx(2 * 4096 / 6)


@pytest.mark.parametrize("batch", [1, 2, 8, 64])
def test_decode_linear_intensity_is_about_the_batch_in_bf16(batch):
    # the roofline of a decode matmul: 2BN FLOPs over 2N bf16 weight bytes (N = d²); the B·d inputs and
    # outputs add a little: intensity = B / (1 + 2B/d).
    d = 4096
    op = roofline.decode_linear(batch, d, d, bytes_per_element=2)
    assert op.flops == 2 * batch * d * d
    assert op.intensity == pytest.approx(batch / (1 + 2 * batch / d))
    assert op.intensity == pytest.approx(batch, rel=0.04)
    # fp32 moves twice the bytes for the same FLOPs
    assert roofline.decode_linear(batch, 4096, 4096, 4).intensity == pytest.approx(op.intensity / 2)


def test_row_ops_and_attention_intensity():
    assert roofline.softmax(100, 1000, 2).intensity == pytest.approx(5 / 4)
    assert roofline.rmsnorm(4096, 4096, 2).intensity == pytest.approx(4 / 4, rel=1e-3)
    # attention: 4N²d FLOPs over 4Nd elements -> N / bytes per element; causal does half the work
    assert roofline.attention(2048, 128, 8, 2, bytes_per_element=2).intensity == pytest.approx(1024)
    assert roofline.attention(2048, 128, 8, 2, 2, causal=True).intensity == pytest.approx(512)


def test_roofs_from_datasheets_match_accounting():
    for name, spec in accounting.GPUS.items():
        roof = roofline.gpu(name)
        assert roof.ridge == pytest.approx(accounting.ridge_point(spec["bf16_flops"], spec["hbm_bytes_per_s"]))
    h100 = roofline.gpu("H100 SXM")
    assert round(h100.ridge) == 295
    assert h100.attainable(10) == pytest.approx(10 * 3.35e12)  # below the ridge: intensity x bandwidth
    assert h100.attainable(1e4) == h100.peak_flops  # above it: the peak
    assert roofline.gpu("H100 SXM", "fp8").ridge == pytest.approx(2 * h100.ridge, rel=0.01)
    assert roofline.datasheet_roof("NVIDIA H100 80GB HBM3") == h100
    assert roofline.datasheet_roof("NVIDIA H100 PCIe") is None  # different figures: none rather than wrong


def test_course_operations_fall_where_the_lecture_says_on_an_h100():
    roof = roofline.gpu("H100 SXM")
    bounds = {op.name: roof.bound(op.intensity) for op in roofline.course_operations(bytes_per_element=2)}
    assert bounds["matmul 4096x4096x4096"] == "compute-bound"
    assert bounds["attention N=4096, causal"] == "compute-bound"
    assert bounds["softmax 4096x4096"] == bounds["RMSNorm 4096x4096"] == "memory-bound"
    assert all(bound == "memory-bound" for name, bound in bounds.items() if name.startswith("decode"))
    # decoding becomes compute-bound once the batch passes the ridge (~295 in bf16)
    assert roof.bound(roofline.decode_linear(512).intensity) == "compute-bound"


def test_bad_inputs_say_what_to_change():
    with pytest.raises(ValueError, match="unknown GPU"):
        roofline.gpu("V100")
    with pytest.raises(ValueError, match="no fp8"):
        roofline.gpu("A100 80GB", "fp8")
    with pytest.raises(ValueError, match="m must be a positive"):
        roofline.matmul(0, 4, 4)
    with pytest.raises(ValueError, match="reps"):
        timing.median_seconds(lambda: None, reps=0)
    with pytest.raises(ValueError, match="warmup"):
        timing.median_seconds(lambda: None, warmup=-1)


def test_median_seconds_is_the_median_of_the_timed_calls_only(monkeypatch):
    calls, clock = [], iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # calls take 1, 3 and 2 seconds
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    assert timing.median_seconds(lambda: calls.append(1), reps=3, warmup=2, device="cpu") == 2.0
    assert len(calls) == 5  # two warm-up calls, untimed


def test_gpu_names_map_to_one_datasheet_table():
    assert accounting.gpu_named("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert accounting.gpu_named("NVIDIA H200") == "H200"
    assert accounting.gpu_named("NVIDIA A100-SXM4-40GB") is None
    assert all(accounting.gpu_named(piece) in accounting.GPUS for piece in accounting._TORCH_NAMES)


def test_measured_roof_is_positive_and_finite():
    roof = roofline.measure(matmul_size=128, copy_bytes=2**20, reps=2, device="cpu")
    for value in (roof.peak_flops, roof.bytes_per_s, roof.ridge):
        assert math.isfinite(value) and value > 0
    assert roof.attainable(roof.ridge) == pytest.approx(roof.peak_flops)


def test_plot_draws_each_roof_and_operation():
    roofs = [roofline.Roof("test", 1e11, 1e10), roofline.gpu("H200")]
    ops = roofline.course_operations(bytes_per_element=4, batches=(1, 4))
    ax = roofline.plot(roofs, ops)
    assert len(ax.lines) >= 2 + 1  # two roofs and the decode series
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert len(ax.collections) == len([op for op in ops if not op.group])
    matplotlib.pyplot.close(ax.figure)
