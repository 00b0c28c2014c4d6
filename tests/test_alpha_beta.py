"""The α–β fit of collective times: exact on a line, and fed by real gloo collectives."""

import pytest

from llmsys.core.accounting import collective_bytes
from llmsys.core.dist import launch
from llmsys.parallel import alpha_beta


def test_fit_recovers_a_known_line():
    alpha, beta = 50e-6, 1 / 2e9  # 50 µs per call, 2 GB/s
    sizes = [1e3, 1e5, 1e6, 4e6]
    fit = alpha_beta.fit_line(sizes, [alpha + beta * s for s in sizes], "all_reduce")
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.predict(1e6, 4) == pytest.approx(alpha + beta * collective_bytes("all_reduce", 1e6, 4))


def test_fit_refuses_what_cannot_define_a_line():
    with pytest.raises(ValueError, match="two different message sizes"):
        alpha_beta.fit_line([1e3, 1e3], [1.0, 2.0])


def test_real_collectives_are_timed_and_fitted_against_ring_bytes():
    sizes = (4096, 65536, 1 << 20)
    timings = launch(alpha_beta.time_collectives, 2, args=(("all_reduce", "all_gather"), sizes, 3))[0]
    assert set(timings) == {"all_reduce", "all_gather"}
    for rows in timings.values():
        assert [size for size, _ in rows] == list(sizes)
        assert all(t > 0 for _, t in rows)
    # the fit is taken against the bytes a ring sends, not the tensor size
    fit = alpha_beta.fit_all(timings, 2)["all_gather"]
    rows = timings["all_gather"]  # a ring all-gather on 2 ranks sends half the full tensor
    expected = alpha_beta.fit_line([size / 2 for size, _ in rows], [t for _, t in rows], "all_gather")
    # LAPACK may sum in another order from call to call: equal to rounding, not bitwise
    assert fit.op == expected.op
    assert (fit.alpha_s, fit.beta_s_per_byte, fit.r2) == pytest.approx(
        (expected.alpha_s, expected.beta_s_per_byte, expected.r2), rel=1e-9, abs=1e-15)
