"""The running ledger: for every technique, what memory it saves, what
communication it adds and what it trades off, with evidence measured here.

The row texts live in ``ROWS`` below. Chapter runs call ``record(...)`` with
an analytic estimate and the value they measured; measurements persist in
``<cache>/ledger.json`` so the table keeps growing as the reader works through
the course. ``show(upto=chapter)`` renders every row up to that chapter: HTML
in a notebook, plain text in a terminal.
"""

from __future__ import annotations

import datetime
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

from llmsys.cache import atomic_write_json, cache_dir


@dataclass(frozen=True)
class Row:
    technique: str
    chapter: int
    saves: str
    adds: str
    trades: str
    evidence: str  # what the measured number is


ROWS: list[Row] = [
    # 0. Foundations
    Row("Kernel fusion", 0, "intermediate tensors in HBM", "none", "a custom kernel to write and maintain",
        "bytes moved: fused / unfused"),
    Row("FlashAttention", 0, "the N×N score matrix: O(N²) → O(N) activations", "none",
        "recomputes scores in backward", "peak attention bytes: flash / naive"),
    Row("Scoring k tokens per call", 0, "weight reads: k tokens share one read of every weight", "none",
        "k× the FLOPs: nearly free only while memory-bound", "call time: 8 tokens / 1 (bf16)"),
    # 1. ZeRO and FSDP
    Row("Mixed precision", 1, "half the bytes of weights, grads, activations", "half the bytes per collective",
        "fp32 master copy (16 B/param total with Adam); bf16 range, fp16 loss scaling", "model-state bytes / param"),
    Row("DDP", 1, "nothing: every rank holds everything (16Ψ)", "all-reduce of grads, 2Ψ per step",
        "simplest; memory does not scale with ranks", "comm bytes per rank / Ψ"),
    Row("ZeRO-1", 1, "optimizer state ÷ N", "same as DDP (2Ψ)", "all-gather of updated params",
        "per-rank bytes measured / formula"),
    Row("ZeRO-2", 1, "+ gradients ÷ N", "same as DDP (2Ψ)", "reduce-scatter instead of all-reduce",
        "per-rank bytes measured / formula"),
    Row("ZeRO-3 / FSDP", 1, "+ parameters ÷ N: (4+K)Ψ/N", "3Ψ, 1.5× DDP", "gathers every layer twice per step",
        "comm bytes: ZeRO-3 / DDP"),
    Row("Activation checkpointing", 1, "activations of recomputed blocks: each keeps only its input", "none",
        "the blocks' forward again in backward (up to +33% compute)",
        "compute: checkpointed / plain (memory kept in the note)"),
    # 2. Parallelism
    Row("Tensor parallel", 2, "weights and most activations ÷ t", "2 all-reduces fwd + 2 bwd per layer",
        "needs fast links (NVLink); within a node", "all-reduces counted per layer"),
    Row("Sequence parallel", 2, "norm/dropout activations ÷ t", "none extra: all-reduce → RS + AG",
        "more, smaller collectives", "activation bytes / formula"),
    Row("Context parallel", 2, "activations ÷ CP along the sequence", "K/V exchange (ring or all-gather)",
        "load balance for causal masks", "max |ring - full attention|"),
    Row("Pipeline parallel", 2, "layers ÷ p per stage", "point-to-point activations between stages",
        "bubble (p-1)/(m+p-1); in-flight activations", "bubble fraction: simulated / formula"),
    Row("Expert parallel", 2, "experts ÷ EP", "two all-to-alls per MoE layer", "load imbalance, token drops",
        "tokens received / (tokens·k − drops)"),
    # 3. LoRA
    Row("LoRA", 3, "grads and optimizer state of frozen weights", "none (adapters are tiny)",
        "rank limits what can be learned", "trainable params / full"),
    Row("LoRA+", 3, "same as LoRA", "none", "one more hyperparameter (lr ratio)", "loss at equal steps / LoRA"),
    Row("QLoRA", 3, "frozen weights in 4 bits (NF4)", "none", "dequantize on every forward", "backbone bytes: NF4 / bf16"),
    Row("VeRA", 3, "adapters down to vectors (r + out per layer)", "none", "less capacity per parameter",
        "trainable params / LoRA"),
    Row("DoRA", 3, "same as LoRA + a magnitude vector", "none", "extra norm per step", "loss at equal steps / LoRA"),
    Row("8-bit / paged optimizers", 3, "optimizer state 8 → 2 bytes/param", "none", "quantization error in m, v",
        "optimizer bytes: 8-bit / fp32"),
    # 4. Speculative decoding
    Row("Speculative decoding", 4, "target forward passes per token", "none",
        "draft model + its KV cache; compute on rejected tokens", "tokens per target call / formula"),
    Row("Medusa / MTP heads", 4, "a separate draft model", "none", "extra heads to train; tree verification",
        "tokens per target call / from head accuracy"),
    Row("EAGLE-style drafting", 4, "draft quality at small cost", "none",
        "a feature-level head (+ its KV cache) to train", "tokens per target call / from head accuracy"),
    # 5. Distillation
    Row("Sequence-level KD", 5, "labels: the teacher writes them", "none", "off-policy: exposure bias",
        "student reverse KL after training"),
    Row("On-policy distillation", 5, "compute vs RL: dense per-token signal", "teacher forward on student samples",
        "teacher memory at training time", "reverse KL: on-policy / off-policy at equal compute"),
    # 6. RL
    Row("PPO", 6, "nothing: a critic as large as the policy", "none", "value model memory and training",
        "training-state bytes: PPO / GRPO"),
    Row("GRPO", 6, "the critic (group baseline instead)", "none", "G samples per prompt", "pass rate after / before"),
    Row("Dr. GRPO", 6, "same as GRPO", "none", "removes length and std bias", "wrong-answer length: Dr. GRPO / GRPO"),
    # 7-8. Optimizers
    Row("AdamW", 7, "nothing: 8 bytes/param of state (m, v)", "none", "decoupled decay: wd independent of lr schedule",
        "state bytes / param"),
    Row("Muon", 8, "one state instead of two (4 bytes/param)", "whole matrices under FSDP: a gather",
        "Newton–Schulz matmuls per step", "tokens to AdamW's loss: Muon / AdamW"),
    Row("QK-clip", 8, "nothing", "none", "rescales W_q, W_k when logits exceed τ", "max logit after clip / τ"),
    # 9. Serving
    Row("KV cache", 9, "recomputation: O(T²) → O(T) decode work", "none", "memory per token per sequence",
        "KV bytes/token measured / formula"),
    Row("Paged attention", 9, "reserved-but-unused KV memory", "none", "a block table lookup per access",
        "KV waste, paged (reserve-max in the note)"),
    Row("Continuous batching", 9, "idle slots of finished requests", "none", "scheduling every iteration",
        "throughput: continuous / static"),
    Row("Chunked prefill", 9, "decode stalls behind long prompts", "none", "prefill spread over steps",
        "p99 inter-token latency: chunked / unchunked"),
    Row("Prefix caching", 9, "recomputing shared prefixes", "none", "hash bookkeeping, eviction",
        "prefill tokens: cached / uncached"),
    Row("KV quantization", 9, "KV bytes ÷ 16/bits", "none", "perplexity loss", "KV bytes: int8 / bf16"),
]

_BY_NAME = {row.technique: row for row in ROWS}


class LedgerError(RuntimeError):
    """The ledger file cannot be read; it is left untouched."""


def ledger_path() -> Path:
    return cache_dir() / "ledger.json"


def load_measurements(path: Path | None = None) -> dict[str, dict]:
    """Measurements recorded so far, by technique. A missing file is an empty ledger;
    an unreadable one raises LedgerError and is never overwritten."""
    path = Path(path or ledger_path())
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        measurements = data["measurements"]
        if not isinstance(measurements, dict):
            raise TypeError("'measurements' is not an object")
    except (ValueError, KeyError, TypeError) as err:
        raise LedgerError(
            f"The ledger file {path} is not a valid ledger ({err}). It was left as it is: "
            f"move it away (or delete it) to start a fresh ledger, or fix the JSON by hand."
        ) from err
    return measurements


def record(technique: str, estimate: float | None, measured: float, unit: str = "", note: str = "",
           path: Path | None = None) -> dict:
    """Write one measurement for a row of ``ROWS`` and return it.

    ``estimate`` is the analytic figure (None where there is none), ``measured``
    what this run saw; the ratio measured/estimate is derived.
    """
    if technique not in _BY_NAME:
        raise KeyError(f"no ledger row named {technique!r}; known rows: {', '.join(_BY_NAME)}")
    if not math.isfinite(float(measured)):
        raise ValueError(f"measured value for {technique!r} is not finite: {measured}")
    path = Path(path or ledger_path())
    measurements = load_measurements(path)
    entry = {
        "estimate": None if estimate is None else float(estimate),
        "measured": float(measured),
        "unit": unit,
        "note": note,
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    measurements[technique] = entry
    atomic_write_json(path, {"version": 1, "measurements": measurements})
    return entry


def ratio(entry: dict) -> float | None:
    estimate = entry.get("estimate")
    if not estimate:
        return None
    return entry["measured"] / estimate


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


COLUMNS = ["ch", "technique", "saves (memory)", "adds (communication)", "trades off", "evidence",
           "estimate", "measured", "ratio"]


def rows(upto: int | None = None, path: Path | None = None) -> list[list[str]]:
    """The table as lists of strings, rows up to chapter ``upto`` (all if None)."""
    measurements = load_measurements(path)
    table = []
    for row in ROWS:
        if upto is not None and row.chapter > upto:
            continue
        m = measurements.get(row.technique)
        evidence = row.evidence + (f" [{m['unit']}]" if m and m.get("unit") else "")
        numbers = [_fmt(m["estimate"]), _fmt(m["measured"]), _fmt(ratio(m))] if m else ["", "not run yet", ""]
        table.append([str(row.chapter), row.technique, row.saves, row.adds, row.trades, evidence, *numbers])
    return table


class Table:
    """What ``show`` displays: HTML in a notebook, text in a terminal."""

    def __init__(self, upto: int | None = None, path: Path | None = None):
        self.upto = upto
        self.body = rows(upto, path)

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in r) + "</tr>"
            for r in self.body
        )
        caption = "Running ledger" + (f" up to chapter {self.upto}" if self.upto is not None else "")
        return f"<table class='llmsys-ledger'><caption>{caption}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __str__(self) -> str:
        # Terminal: the short columns only, so a row fits on one line.
        keep = [0, 1, 5, 6, 7, 8]
        table = [[COLUMNS[i] for i in keep]] + [[r[i] for i in keep] for r in self.body]
        widths = [max(len(r[i]) for r in table) for i in range(len(keep))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    __repr__ = __str__


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


def show(upto: int | None = None, path: Path | None = None) -> None:
    """Display the running table up to chapter ``upto`` (use ``Table`` to keep it)."""
    table = Table(upto, path)
    if _in_notebook():
        from IPython.display import display

        display(table)
    else:
        print(table)
