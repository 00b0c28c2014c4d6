"""Input checks and launch settings shared by the kernel wrappers."""

import math
import os

import torch

# ``llmsys.kernels`` sets TRITON_INTERPRET before importing any kernel module;
# read once, like the kernels' own decoration.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(t, name: str, *, ndim: int | None = None, min_ndim: int = 1,
                 contiguous: bool = True) -> None:
    """Raise ValueError saying what to change when ``t`` cannot go to a kernel."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; use float32, float16 or bfloat16")
    if INTERPRETED and t.dtype == torch.bfloat16:
        raise ValueError(
            f"{name} is bfloat16, which the Triton interpreter computes silently wrong; "
            "use float32 on the CPU (llmsys.core.device.kernel_dtype())"
        )
    if not INTERPRETED and t.device.type != "cuda":
        raise ValueError(f"{name} is on device {t.device}; compiled Triton kernels need CUDA tensors (use .cuda())")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")


def check_same(tensors: dict, what: str = "device and dtype") -> None:
    """All tensors on one device with one dtype."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; put them on one device")
        if t.dtype != first.dtype:
            raise ValueError(f"{name} is {t.dtype} but {first_name} is {first.dtype}; use one dtype")


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: full fp32 for fp32 inputs, as torch's matmul does by
    default (a GPU would otherwise round them to tf32); 16-bit inputs are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def softmax_scale(causal, sm_scale, head_dim: int) -> float:
    """Check the attention options shared by both FlashAttention versions; return the score scale."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive number or None (1/sqrt(head_dim)), got {sm_scale!r}")
    return float(sm_scale)
