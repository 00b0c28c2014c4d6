"""Number formats and loss scaling (chapter 1): why bf16 trains as it is and fp16 needs help.

A floating-point format is sign, exponent and mantissa bits. The exponent sets the
range, the mantissa the precision: fp32 1-8-23, tf32 1-8-10 (a tensor-core input
format), bf16 1-8-7 (fp32's range, about 3 significant digits), fp16 1-5-10 (max
65,504; small gradients underflow), fp8 E4M3 and E5M2 (Micikevicius et al. 2022,
"FP8 Formats for Deep Learning"). Mixed-precision training (Micikevicius et al. 2018,
"Mixed Precision Training") keeps fp32 master weights, computes in half precision and,
for fp16, multiplies the loss by a scale so gradients stay representable: the dynamic
loss scaler below follows torch.amp.GradScaler (start at 2**16, halve and skip the step
on inf/NaN, double after 2,000 clean steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    finite_only: bool = False  # E4M3 (fn): no infinities, only the all-ones pattern is NaN
    dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max(self) -> float:
        if self.finite_only:  # the top exponent is an ordinary one; only mantissa all-ones there is NaN
            return (2 - 2 * 2.0 ** -self.mantissa_bits) * 2.0 ** (2 ** self.exponent_bits - 1 - self.bias)
        return (2 - 2.0 ** -self.mantissa_bits) * 2.0 ** self.bias

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """The gap between 1 and the next number: the relative precision."""
        return 2.0 ** -self.mantissa_bits

    @property
    def decimal_digits(self) -> float:
        return (self.mantissa_bits + 1) * math.log10(2)


FORMATS = [
    Format("fp32", 8, 23, dtype=torch.float32),
    Format("tf32", 8, 10),
    Format("bf16", 8, 7, dtype=torch.bfloat16),
    Format("fp16", 5, 10, dtype=torch.float16),
    Format("fp8 E4M3", 4, 3, finite_only=True, dtype=torch.float8_e4m3fn),
    Format("fp8 E5M2", 5, 2, dtype=torch.float8_e5m2),
]


def format_table() -> list[dict]:
    """One row per format: bits, range and precision, from the bit layout."""
    return [{"format": f.name, "sign-exp-mantissa": f"1-{f.exponent_bits}-{f.mantissa_bits}", "max": f.max,
             "smallest normal": f.smallest_normal, "smallest subnormal": f.smallest_subnormal, "eps": f.eps,
             "digits": f.decimal_digits} for f in FORMATS]


def underflow_share(values: torch.Tensor, dtype: torch.dtype) -> float:
    """Share of non-zero values that become zero when cast to ``dtype``."""
    nonzero = values[values != 0]
    return (nonzero.to(dtype) == 0).float().mean().item() if nonzero.numel() else 0.0


class DynamicLossScaler:
    """Loss scaling for fp16 gradients, with GradScaler's defaults and rules.

    Multiply the loss by ``scale`` before backward; ``unscale_`` divides the gradients
    back and reports an inf/NaN; ``update`` halves the scale after an overflow (the
    step is skipped) and doubles it after ``growth_interval`` clean steps in a row.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale, in place; True if any is inf or NaN."""
        found_inf = False
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale)
                found_inf |= not torch.isfinite(p.grad).all().item()
        return found_inf

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def step(self, optimizer: torch.optim.Optimizer, params) -> bool:
        """Unscale, step unless a gradient overflowed, update the scale; True if the step ran."""
        params = list(params)
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf
