"""Resource accounting: the memory, FLOP and communication formulas of the course.

Chapters, widgets and tests all call these same functions, so a figure printed
in a notebook is the figure the tests check against published worked examples
(ZeRO's 7.5B model on 64 GPUs, Llama-3-style 70B on 15T tokens, ...).

Units: bytes and FLOPs as plain numbers; ``GB`` is 1e9 bytes (as in the
papers), ``GiB`` 2**30.
"""

from __future__ import annotations

import math

GB = 1e9
GiB = 2**30

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "nf4": 0.5, "int4": 0.5}

# Optimizer state bytes per parameter, on top of weights and gradients.
# Mixed-precision Adam keeps an fp32 master copy plus m and v: K = 12 (ZeRO paper).
OPTIMIZER_STATE_BYTES = {
    "sgd": 0,
    "momentum": 4,
    "adam": 8,
    "adamw": 8,
    "adam8bit": 2,
    "muon": 4,  # one momentum buffer
}


def _check(minimum: float = 0, **values) -> None:
    """Each value must be a finite number >= minimum (a count, a length, a size)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
            raise ValueError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")


def _check_stage(stage) -> None:
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")


def bytes_per_element(precision: str) -> float:
    try:
        return BYTES_PER_ELEMENT[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; use one of {sorted(BYTES_PER_ELEMENT)}") from None


# ---------------------------------------------------------------------------
# Parameters and FLOPs


def llama_params(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden: int,
                 vocab_size: int, tie_embeddings: bool = False) -> int:
    """Parameters of a Llama-architecture decoder (no biases, RMSNorm gains included)."""
    _check(1, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_hidden=ffn_hidden,
           vocab_size=vocab_size)
    head_dim = dim // n_heads
    attention = dim * n_heads * head_dim * 2 + dim * n_kv_heads * head_dim * 2  # wq, wo, wk, wv
    mlp = 3 * dim * ffn_hidden  # w1, w2, w3 of SwiGLU
    norms = 2 * dim
    embeddings = vocab_size * dim * (1 if tie_embeddings else 2)
    return n_layers * (attention + mlp + norms) + dim + embeddings


def training_flops(n_params: float, n_tokens: float) -> float:
    """6ND: forward 2ND plus backward 4ND (Kaplan et al., Chinchilla)."""
    _check(n_params=n_params, n_tokens=n_tokens)
    return 6 * n_params * n_tokens


def training_days(n_params: float, n_tokens: float, n_gpus: int, peak_flops: float, mfu: float) -> float:
    """Wall-clock days to train at a model-FLOPs utilisation ``mfu``."""
    _check(1, n_gpus=n_gpus)
    if not (isinstance(peak_flops, (int, float)) and peak_flops > 0 and 0 < mfu <= 1):
        raise ValueError(f"peak_flops must be > 0 and mfu in (0, 1], got {peak_flops!r} and {mfu!r}")
    seconds = training_flops(n_params, n_tokens) / (n_gpus * peak_flops * mfu)
    return seconds / 86400


# Dense tensor-core peaks and HBM bandwidth from the vendor datasheets (A100 has no fp8).
GPUS = {
    "A100 80GB": {"bf16_flops": 312e12, "fp8_flops": None, "hbm_bytes_per_s": 2.04e12, "hbm_gb": 80},
    "H100 SXM": {"bf16_flops": 989e12, "fp8_flops": 1979e12, "hbm_bytes_per_s": 3.35e12, "hbm_gb": 80},
    "H200": {"bf16_flops": 989e12, "fp8_flops": 1979e12, "hbm_bytes_per_s": 4.8e12, "hbm_gb": 141},
}
# Pieces of torch.cuda.get_device_name() that identify the cards above. Other variants (PCIe
# cards, the 40 GB A100) have other figures, so they match none rather than a wrong one.
_TORCH_NAMES = {"A100-SXM4-80GB": "A100 80GB", "H100 80GB HBM3": "H100 SXM", "H200": "H200"}


def gpu_named(device_name: str) -> str | None:
    """The ``GPUS`` key of a GPU as torch names it, or None when its datasheet is not in the table."""
    return next((key for piece, key in _TORCH_NAMES.items() if piece in device_name), None)


def ridge_point(peak_flops: float, bytes_per_s: float) -> float:
    """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
    _check(1e-30, peak_flops=peak_flops, bytes_per_s=bytes_per_s)
    return peak_flops / bytes_per_s


def roofline(intensity: float, peak_flops: float, bytes_per_s: float) -> float:
    """Attainable FLOP/s at a given arithmetic intensity."""
    _check(intensity=intensity, peak_flops=peak_flops, bytes_per_s=bytes_per_s)
    return min(peak_flops, intensity * bytes_per_s)


# ---------------------------------------------------------------------------
# Training memory


def training_bytes_per_param(precision: str = "bf16", optimizer: str = "adam", master_weights: bool = True) -> float:
    """Weights + gradients (+ fp32 master) + optimizer state, per parameter.

    Mixed-precision Adam: 2 + 2 + 4 + 8 = 16 bytes, the ZeRO paper's (2 + 2 + K)Ψ.
    """
    p = bytes_per_element(precision)
    master = 4 if master_weights and p < 4 else 0
    try:
        state = OPTIMIZER_STATE_BYTES[optimizer]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE_BYTES)}") from None
    return 2 * p + master + state


def zero_bytes_per_device(n_params: float, world_size: int, stage: int, k: float = 12,
                          param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per device under ZeRO stage 0 (plain DP) to 3 (ZeRO paper, Fig. 1).

    stage 0: (2 + 2 + K)Ψ; 1: shards optimizer state; 2: + gradients; 3: + parameters.
    """
    _check_stage(stage)
    _check(1, world_size=world_size)
    _check(n_params=n_params, k=k, param_bytes=param_bytes, grad_bytes=grad_bytes)
    n = world_size
    params = param_bytes * n_params / (n if stage >= 3 else 1)
    grads = grad_bytes * n_params / (n if stage >= 2 else 1)
    optim = k * n_params / (n if stage >= 1 else 1)
    return params + grads + optim


def zero_comm_bytes_per_rank(n_params: float, stage: int, bytes_per_param: float = 2) -> float:
    """Per-step communication volume per rank in units of the model size.

    DP and ZeRO-1/2: one all-reduce of gradients = reduce-scatter + all-gather = 2Ψ.
    ZeRO-3 all-gathers parameters again in backward: 3Ψ, 1.5x DP.
    """
    _check_stage(stage)
    _check(n_params=n_params, bytes_per_param=bytes_per_param)
    factor = 3 if stage == 3 else 2
    return factor * n_params * bytes_per_param


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes of one transformer layer (Korthikanti et al., arXiv 2205.05198, fp16).

    sbh(34 + 5as/h) with no parallelism; tensor parallelism divides all but the
    10sbh kept by norms/dropout unless sequence parallelism splits those too;
    selective recompute drops the 5as/h attention term.
    """
    _check(1, seq=seq, batch=batch, hidden=hidden, heads=heads, tp=tp)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    attention_scores = 0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    if sequence_parallel:
        return s * b * h * (34 + attention_scores) / t
    return s * b * h * (10 + (24 + attention_scores) / t)


def llama_activation_bytes_per_layer(seq: int, batch: int, dim: int, n_heads: int, n_kv_heads: int,
                                     ffn_hidden: int, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one Llama block keeps for backward in bf16, counted tensor by tensor.

    Korthikanti et al.'s sbh(34 + 5as/h) counts a GPT block (LayerNorm, dropout masks,
    a 4h GELU MLP, materialised attention scores). A Llama block (``llmsys.core.model.Block``)
    has RMSNorm, no dropout, SwiGLU with its own width f, grouped KV heads (g of a) and
    fused attention (no s × s scores), and keeps:

    - each of its two RMSNorms, computed in fp32: its fp32 input (4sbh), that input cast
      back to bf16 (2sbh), the normalised output the next matmul needs (2sbh), 1/rms (4sb);
    - attention: the queries after RoPE and the output (2sbh each), keys and values
      (2 · 2sbh · g/a), the fp32 log-sum-exp of the fused kernel (4abs);
    - SwiGLU: the gate, its SiLU, the up projection and their product (2sbf each).

    Tensor parallelism divides everything but the norms by t; sequence parallelism the
    norms too. ``tests/test_accounting.py`` checks the count against autograd's saved
    tensors, byte for byte.
    """
    s, b, h, a, g, f, t = seq, batch, dim, n_heads, n_kv_heads, ffn_hidden, tp
    norms = 2 * (8 * s * b * h + 4 * s * b)
    attention = 4 * s * b * h + 4 * s * b * h * g / a + 4 * a * b * s
    mlp = 8 * s * b * f
    return norms / (t if sequence_parallel else 1) + (attention + mlp) / t


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int = 1, bytes_per_elem: float = 2) -> float:
    """Keys and values for ``tokens`` positions: 2 · layers · kv_heads · head_dim · bytes each."""
    _check(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, tokens=tokens, bytes_per_elem=bytes_per_elem)
    return 2 * n_layers * n_kv_heads * head_dim * bytes_per_elem * tokens


# ---------------------------------------------------------------------------
# Collectives (ring algorithms; bytes sent per rank)


def collective_bytes(op: str, size_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) when ``op`` runs as a ring over ``world_size`` ranks.

    ``size_bytes`` is the tensor given to all_reduce, broadcast, reduce, send,
    recv and all_to_all, and the *full* (gathered) tensor for all_gather and
    reduce_scatter. Each rank's share is size/N (Patarasuk & Yuan 2009,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations"):

    - all_reduce: 2(N-1)/N · size (a reduce-scatter, then an all-gather)
    - all_gather, reduce_scatter: (N-1)/N · size
    - all_to_all: (N-1)/N · size (everything but the block that stays home)
    - broadcast, reduce: size (pipelined in chunks along the ring), 0 alone
    - send, recv: size (point to point: N is ignored)
    """
    _check(1, world_size=world_size)
    _check(size_bytes=size_bytes)
    n = world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0 if n > 1 else 0.0,
        "reduce": 1.0 if n > 1 else 0.0,
        "send": 1.0,
        "recv": 1.0,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; use one of {sorted(factors)}")
    return factors[op] * size_bytes


def pipeline_bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of a GPipe/1F1B schedule, (p-1)/(m+p-1); interleaving divides the bubble by v."""
    _check(1, stages=stages, microbatches=microbatches, chunks=chunks)
    p, m, v = stages, microbatches, chunks
    bubble = (p - 1) / v
    return bubble / (m + bubble)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    _check(n=n)
    if n < 1024:
        return f"{n:.0f} B"
    exponent = min(int(math.log(n, 1024)), 5)
    return f"{n / 1024**exponent:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'][exponent]}"
