"""Number formats from their bit layouts, and the loss scaler against torch's GradScaler."""

import pytest
import torch

from llmsys.zero import precision


@pytest.mark.parametrize("fmt", [f for f in precision.FORMATS if f.dtype is not None], ids=lambda f: f.name)
def test_format_figures_equal_torch_finfo(fmt):
    info = torch.finfo(fmt.dtype)
    assert fmt.bits == info.bits
    assert fmt.max == info.max
    assert fmt.smallest_normal == info.smallest_normal
    assert fmt.eps == info.eps
    # the smallest subnormal is representable and half of it rounds to zero
    tiny = torch.tensor(fmt.smallest_subnormal, dtype=torch.float64)
    assert tiny.to(fmt.dtype).double().item() == fmt.smallest_subnormal
    assert (tiny / 2.5).to(fmt.dtype).double().item() == 0.0


def test_published_figures():
    by_name = {f.name: f for f in precision.FORMATS}
    assert by_name["fp16"].max == 65504 and by_name["fp8 E4M3"].max == 448 and by_name["fp8 E5M2"].max == 57344
    assert by_name["tf32"].eps == by_name["fp16"].eps  # tf32 keeps fp16's 10 mantissa bits and fp32's range
    assert by_name["bf16"].max == pytest.approx(torch.finfo(torch.float32).max, rel=1e-2)


def test_underflow_share():
    grads = torch.tensor([1e-9, 1e-3, 0.0, 3e-8])
    assert precision.underflow_share(grads, torch.float16) == pytest.approx(1 / 3)  # 3e-8 rounds to 2**-24
    assert precision.underflow_share(grads * 2**16, torch.float16) == 0.0
    assert precision.underflow_share(grads, torch.bfloat16) == 0.0


def _run(scaler_step, overflow_at, steps):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([w], lr=0.1)
    scales, weights = [], []
    for step in range(steps):
        opt.zero_grad()
        factor = float("inf") if step in overflow_at else 1.0
        scales.append(scaler_step(opt, w, (w * torch.arange(4.0)).sum() * factor))
        weights.append(w.detach().clone())
    return scales, weights


def test_dynamic_loss_scaler_equals_grad_scaler():
    overflow_at, steps = {0, 1, 5, 6, 13}, 20

    ours = precision.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)

    def our_step(opt, w, loss):
        ours.scale_loss(loss).backward()
        ours.step(opt, [w])
        return ours.scale

    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)

    def their_step(opt, w, loss):
        theirs.scale(loss).backward()
        theirs.step(opt)
        theirs.update()
        return theirs.get_scale()

    our_scales, our_weights = _run(our_step, overflow_at, steps)
    their_scales, their_weights = _run(their_step, overflow_at, steps)
    assert our_scales == their_scales
    for a, b in zip(our_weights, their_weights):
        torch.testing.assert_close(a, b)


def test_bad_scaler_settings():
    with pytest.raises(ValueError, match="growth_factor > 1"):
        precision.DynamicLossScaler(growth_factor=1.0)
