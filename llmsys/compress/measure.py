"""What compression costs and buys on the real model: held-out perplexity, weight bytes, decode speed.

Text: Python's own help topics (``zoo.corpus()``), tokenized with SmolLM2's tokenizer and split
the way the zoo splits its data (every 10th block held out): calibration windows come from the
training part, evaluation windows from the held-out part, both fixed.
"""

from __future__ import annotations

import copy
import functools
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core import timing, zoo
from llmsys.core.cache import atomic_write_json, cache_dir
from llmsys.compress import awq, calibrate, formats, gptq, prune, smoothquant

SEQ_LEN = 256


@functools.cache
def _corpus_ids(source: str) -> torch.Tensor:
    tok = zoo.tokenizer(source)
    return torch.tensor(tok(zoo.corpus())["input_ids"], dtype=torch.long)


def windows(split: str, n: int, seq_len: int = SEQ_LEN, source: str = "smollm2") -> torch.Tensor:
    """n fixed windows (n, seq_len + 1) of the "calibration" (train) or "heldout" part of the corpus,
    in the tokens of ``source`` (SmolLM2, or a checkpoint ``zoo.tokenizer`` takes)."""
    if split not in ("calibration", "heldout"):
        raise ValueError(f"split must be 'calibration' or 'heldout', got {split!r}")
    train, held = zoo.split(_corpus_ids(source))
    ids = train if split == "calibration" else held
    available = (len(ids) - 1) // (seq_len + 1)
    if n > available:
        raise ValueError(f"the {split} text holds {available} windows of {seq_len + 1} tokens, {n} requested")
    stride = available // n  # spread over the whole text, every topic
    return torch.stack([ids[i * stride * (seq_len + 1):][: seq_len + 1] for i in range(n)])


@torch.no_grad()
def perplexity(model: nn.Module, windows_: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token loss) over windows (n, T + 1), teacher forcing, one forward per batch."""
    dev = model.tok_embeddings.weight.device
    total, count = 0.0, 0
    for i in range(0, windows_.size(0), batch):
        w = windows_[i:i + batch].to(dev)
        logits = model(w[:, :-1])
        total += float(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    return float(torch.tensor(total / count).exp())


def quantized_copy(model: nn.Module, method: str, bits: int, granularity=64, symmetric: bool = True,
                   calib: torch.Tensor | None = None, progress: bool = False, n_blocks: int | None = None,
                   act_order: bool = False) -> nn.Module:
    """A copy of ``model`` with every decoder linear quantized (dequantized back to the model's dtype):
    method "rtn", "gptq", "awq" or "awq+gptq" (AWQ's scales folded, then GPTQ); the LM head / embedding
    stays as it is (GPTQ and AWQ leave it too).
    GPTQ and AWQ need calibration windows ``calib`` (n, T). ``n_blocks`` quantizes only the first n blocks;
    ``act_order``: GPTQ's column order by decreasing Hessian diagonal."""
    q = copy.deepcopy(model)
    if method == "rtn":
        for block in q.layers[:n_blocks]:
            for linear in calibrate.block_linears(block).values():
                linear.weight.data = formats.fake_quantize(linear.weight.data, bits, granularity, symmetric)
        return q
    if calib is None:
        raise ValueError(f"{method} needs calibration windows (calib=...)")
    if method in ("gptq", "awq+gptq"):
        def compress(index, block, stats):
            # AWQ's scales first (the AWQ paper combines the two): inputs shrink by s, so H -> H / (s sᵀ)
            scales = awq.fold_scales(block, stats, bits, granularity, symmetric)[1] if method == "awq+gptq" else {}
            for shared, names in calibrate.SHARED_INPUTS.items():
                H = stats[names[0]].hessian.value
                if shared in scales:
                    H = H / (scales[shared][:, None] * scales[shared][None, :]).to(H.dtype)
                for group in ([names] if granularity != "tensor" else [[n] for n in names]):
                    # the rows of linears sharing an input are independent under one Hessian: one GPTQ pass
                    linears = [block.get_submodule(name) for name in group]
                    stacked = gptq.gptq_quantize(torch.cat([lin.weight.data for lin in linears]), H, bits,
                                                 granularity, symmetric, act_order=act_order)
                    for linear, rows in zip(linears, stacked.split([lin.out_features for lin in linears])):
                        linear.weight.data = rows.contiguous()
    elif method == "awq":
        def compress(index, block, stats):
            return awq.awq_block(block, stats, bits, granularity, symmetric)
    else:
        raise ValueError(f"unknown method {method!r}; choose rtn, gptq, awq or awq+gptq")
    calibrate.sequential(q, calib, compress, progress, desc=f"{method} {bits}-bit", n_blocks=n_blocks)
    return q


def pruned_copy(model: nn.Module, method: str, sparsity: float, calib: torch.Tensor, progress: bool = False):
    """(copy of ``model`` with every decoder linear pruned, the share of their weights zeroed)."""
    q = copy.deepcopy(model)
    shares = calibrate.sequential(q, calib, lambda i, block, stats: prune.prune_block(block, stats, method, sparsity),
                                  progress, desc=f"prune {method}")
    return q, sum(shares) / len(shares)


def smoothed_w8a8_copy(model: nn.Module, calib: torch.Tensor | None, alpha: float | None = 0.5,
                       outlier_threshold: float | None = None, progress: bool = False) -> nn.Module:
    """W8A8 copy: SmoothQuant's scales folded in first (``alpha``; None skips smoothing), or LLM.int8()'s
    outlier split (``outlier_threshold``)."""
    q = copy.deepcopy(model)
    if alpha is not None:
        calibrate.sequential(q, calib, lambda i, block, stats: smoothquant.smooth_block(block, stats, alpha),
                             progress, desc="smooth")
    for block in q.layers:
        smoothquant.w8a8_linears(block, outlier_threshold, skip=())
    return q


def linear_weight_count(model: nn.Module) -> tuple[int, int]:
    """(weights in the decoder blocks' linears, weights in the LM head)."""
    blocks = sum(lin.weight.numel() for b in model.layers for lin in calibrate.block_linears(b).values())
    return blocks, model.output.weight.numel()


def linear_bits(model: nn.Module, bits: int, granularity, symmetric: bool = True) -> float:
    """Storage bits per weight of the decoder linears at this grid: codes plus scales (and offsets),
    each linear's shape counted (a group size that does not divide a row leaves a shorter group)."""
    linears = [lin for b in model.layers for lin in calibrate.block_linears(b).values()]
    total = sum(formats.bits_per_weight(bits, granularity, symmetric, tuple(lin.weight.shape)) * lin.weight.numel()
                for lin in linears)
    return total / sum(lin.weight.numel() for lin in linears)


def weight_bytes(model: nn.Module, bits_per_weight: float, head_bits: float = 16) -> float:
    """Bytes a decode step reads: the decoder linears at ``bits_per_weight``, the LM head at ``head_bits``
    (with tied embeddings the table is read once, as the head), norms in bf16."""
    blocks, head = linear_weight_count(model)
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    return (blocks * bits_per_weight + head * head_bits + norms * 16) / 8


@torch.no_grad()
def decode_tokens_per_s(model: nn.Module, prompt_len: int = 32, new_tokens: int = 32, repeats: int = 3) -> float:
    """Greedy decode tokens/s of batch 1 (median of ``repeats``, GPU work synchronised), through the
    model's own generate loop (the short prompt's prefill included)."""
    dev = model.tok_embeddings.weight.device
    prompt = torch.arange(1, prompt_len + 1)[None].to(dev)
    model.generate(prompt, 2)  # warm-up: first-call allocations and kernel selection
    seconds = timing.median_seconds(lambda: model.generate(prompt, new_tokens), reps=repeats, warmup=0, device=dev)
    return new_tokens / seconds


def results_path():
    """Where ``benchmarks/quant.py`` leaves its results for the notebook."""
    return cache_dir() / "compress" / "quant.json"


def load_results() -> dict | None:
    """The benchmark's last results, or None when it has not run on this machine."""
    path = results_path()
    return json.loads(path.read_text()) if path.is_file() else None


def save_results(results: dict) -> None:
    """Update the cached results with these keys (runs of other parts keep theirs)."""
    merged = load_results() or {}
    merged.update(results)
    atomic_write_json(results_path(), merged)
