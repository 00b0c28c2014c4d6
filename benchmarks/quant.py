"""Quantization and compression of SmolLM2-135M-Instruct on this machine: one table each for
number formats, perplexity / weight bytes of every method, decode speed against the roofline,
KV-cache quantization, pruning and QAT, measured side by side in one run.

    python benchmarks/quant.py --json quant.json            # everything: about an hour of one core (see below)
    python benchmarks/quant.py --parts speed kv --json x.json
    python benchmarks/quant.py --quick                      # fewer windows and methods
    python benchmarks/quant.py --parts perplexity --only "GPTQ 3-bit"   # some rows, merged into the cached table
    python benchmarks/quant.py --source DIR|HUB_ID --parts perplexity --json benchmarks/results/quant_source.json

--source runs the tables on an unquantized Llama-architecture checkpoint in transformers' format (a
local directory or a hub id): SmolLM2's offline weights are Q4_1 already, so only such a checkpoint
has a full-precision reference for "GPTQ / AWQ at 4 bits stay within 5% of bf16 perplexity". Its
converted weights are cached as their own entry (``pretrained.checkpoint_entry``), its tokenizer cuts
the same windows of text, and its results go only to --json (chapter 10 reads SmolLM2's).

Cost: a GPTQ, AWQ or AWQ+GPTQ row is one calibration pass through the 30 blocks (one to two
minutes of a quiet core; the "32 windows" row 4×), an RTN row a few seconds, each row's held-out
perplexity and chat answer about 15 s; the perplexity table has 23 such rows. Every row records its
quantization seconds in the JSON.

Perplexity: fixed held-out windows of Python's help text (``measure.windows``), every quantized
model evaluated in bf16 (the dtype the weight-only kernels compute in); calibration: fixed
windows of the training part. Weights are quantized in fp32, layer by layer (GPTQ, AWQ, Wanda
see the output of the blocks already compressed). The embedding / LM head stays bf16 except in
the weight-only kernel rows, where the head is quantized too.

The results also go to the course cache (``measure.results_path()``), where chapter 10's notebook
reads them.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

from llmsys.core import accounting, pretrained, timing, zoo
from llmsys.foundations import roofline
from llmsys.core.cache import atomic_write_json
from llmsys.compress import calibrate, formats, kvcache, measure, qat, weightonly

CHAT_PROMPT = "What is the capital of France?"
GROUP = 64  # the formats table's group size


def formats_table(model) -> list[dict]:
    """Relative error ‖W - Ŵ‖ / ‖W‖ over every decoder linear, and bits per weight, per format."""
    linears = [lin.weight.detach() for b in model.layers for lin in calibrate.block_linears(b).values()]
    rows = []

    def add(name, bits, fn):
        err = sum(float((fn(w) - w).pow(2).sum()) for w in linears) / sum(float(w.pow(2).sum()) for w in linears)
        rows.append({"format": name, "bits/weight": bits, "relative error": err ** 0.5})

    add("bf16", 16, lambda w: w.to(torch.bfloat16).float())
    add("fp8 E4M3 (per channel)", 8 + 16 / 576, formats.fp8_fake_quantize)
    add("fp8 E5M2 (per channel)", 8 + 16 / 576, lambda w: formats.fp8_fake_quantize(w, torch.float8_e5m2))
    add("int8 sym (per channel)", 8 + 16 / 576, lambda w: formats.fake_quantize(w, 8, "channel"))
    add("Q8_0 (int8 sym, g32)", formats.gguf_bits_per_weight("Q8_0"), lambda w: formats.fake_quantize(w, 8, 32))
    add("NF4 (g64, fp32 absmax)", 4.5, formats.nf4_fake_quantize)
    add("int4 sym per tensor", 4, lambda w: formats.fake_quantize(w, 4, "tensor"))
    add("int4 sym per channel", 4 + 16 / 576, lambda w: formats.fake_quantize(w, 4, "channel"))
    add(f"int4 sym g{GROUP}", formats.bits_per_weight(4, GROUP), lambda w: formats.fake_quantize(w, 4, GROUP))
    add("Q4_1 (int4 asym, g32)", formats.gguf_bits_per_weight("Q4_1"), lambda w: formats.fake_quantize(w, 4, 32, False))
    add(f"int3 sym g{GROUP}", formats.bits_per_weight(3, GROUP), lambda w: formats.fake_quantize(w, 3, GROUP))
    add(f"int2 asym g{GROUP}", formats.bits_per_weight(2, GROUP, False), lambda w: formats.fake_quantize(w, 2, GROUP, False))
    return rows


# (bits, granularity, symmetric): the grids GPTQ and AWQ run on. The model's linears ship as GGUF
# Q4_1 (asymmetric 4-bit, blocks of 32), so 4-bit g32 asym is *their own grid*; every other grid
# rounds them a second time. 128 does not divide 576: those rows end in a group of 64.
GRIDS = [(4, 32, False), (4, 64, False), (4, 128, False), (4, "channel", False),
         (3, 32, False), (3, 64, False), (3, 128, False), (3, "channel", False)]
CALIB_WINDOWS = 8  # of 256 tokens; one GPTQ row uses 4× as many


def grid_name(bits, granularity, symmetric) -> str:
    group = "per channel" if granularity == "channel" else f"g{granularity}"
    return f"{bits}-bit {group}{'' if symmetric else ' asym'}"


def methods(quick: bool):
    """(name, method, bits, granularity, symmetric, options of quantized_copy / calibration windows)."""
    rows = [("int8 RTN per channel", "rtn", 8, "channel", True, {}),
            ("int4 RTN g64", "rtn", 4, 64, True, {}),
            ("int3 RTN g64", "rtn", 3, 64, True, {})]
    if quick:
        return rows + [("GPTQ 4-bit g64 asym", "gptq", 4, 64, False, {}), ("AWQ 4-bit g64 asym", "awq", 4, 64, False, {}),
                       ("GPTQ 3-bit g64 asym", "gptq", 3, 64, False, {})]
    rows += [("int4 RTN g32", "rtn", 4, 32, True, {})]  # symmetric: misaligned with Q4_1 at the same group
    rows += [(f"int{b} RTN {grid_name(b, g, s)[6:]}", "rtn", b, g, s, {}) for b, g, s in GRIDS]
    rows += [(f"GPTQ {grid_name(*grid)}", "gptq", *grid, {}) for grid in GRIDS]
    rows += [(f"AWQ {grid_name(*grid)}", "awq", *grid, {}) for grid in GRIDS if grid != (4, 32, False)]
    rows += [(f"AWQ+GPTQ {grid_name(*grid)}", "awq+gptq", *grid, {}) for grid in GRIDS if grid[0] == 4 and grid[1] != 32]
    rows += [("GPTQ 4-bit g64 asym act-order", "gptq", 4, 64, False, {"act_order": True}),
             (f"GPTQ 4-bit g64 asym {4 * CALIB_WINDOWS} windows", "gptq", 4, 64, False, {"calib_windows": 4 * CALIB_WINDOWS}),
             ("GPTQ 4-bit g64", "gptq", 4, 64, True, {}), ("AWQ 4-bit g64", "awq", 4, 64, True, {}),
             ("GPTQ 3-bit g64", "gptq", 3, 64, True, {})]
    return rows


W8A8 = [("W8A8 per token / per channel", None, None), ("W8A8 + SmoothQuant α=0.5", 0.5, None),
        ("W8A8 LLM.int8() split |x|≥6", None, 6.0)]


def perplexity_table(model, tok, held, calib, quick: bool, only: list[str] | None = None,
                     source: str = "smollm2") -> list[dict]:
    """Rows for every method (``only``: just the methods whose names contain one of these strings)."""
    rows = []

    def wanted(name):
        return only is None or any(part in name for part in only)

    def add(name, q, bits, seconds=0.0):
        q = q.to(torch.bfloat16) if name != "fp32" else q
        ppl = measure.perplexity(q, held)
        rows.append({"method": name, "bits/weight": bits, "weight MB": measure.weight_bytes(model, bits) / 1e6,
                     "perplexity": ppl, "quantize s": seconds,
                     # a base checkpoint has no chat template: no chat answer
                     "chat": pretrained.chat(q, tok, CHAT_PROMPT, 24) if tok.chat_template else None})
        print(f"{name:<34} {bits:5.2f} bits  ppl {ppl:8.3f}  ({seconds:.0f} s)  {rows[-1]['chat']!r}", flush=True)

    for name, q in (("fp32", model), ("bf16", copy.deepcopy(model))):
        if wanted(name):
            add(name, q, 32 if name == "fp32" else 16)
    for name, method, bits, granularity, symmetric, options in methods(quick):
        if wanted(name):
            options = dict(options)
            windows = calib if "calib_windows" not in options else \
                measure.windows("calibration", options.pop("calib_windows"), source=source)[:, :-1]
            start = time.perf_counter()
            q = measure.quantized_copy(model, method, bits, granularity, symmetric, windows, progress=True, **options)
            add(name, q, measure.linear_bits(model, bits, granularity, symmetric), time.perf_counter() - start)
    for name, alpha, threshold in W8A8[: 1 if quick else 3]:
        if wanted(name):
            start = time.perf_counter()
            add(name, measure.smoothed_w8a8_copy(model, calib, alpha, threshold), 8 + 16 / 576, time.perf_counter() - start)
    return rows


def merge_rows(old: list[dict], new: list[dict], key) -> list[dict]:
    """``old`` with the rows of ``new`` replacing those of the same ``key(row)`` (new ones appended)."""
    fresh = {key(r): r for r in new}
    return [fresh.pop(key(r), r) for r in old] + list(fresh.values())


def speed_table(model, repeats: int) -> dict:
    """Decode tokens/s (batch 1) of fp32, bf16 and the int8 / int4 weight-only kernels, round-robin,
    with the memory roofline: measured copy bandwidth / bytes read per token."""
    variants = {"fp32": (copy.deepcopy(model), 32), "bf16": (copy.deepcopy(model).to(torch.bfloat16), 16)}
    if weightonly.has_cpu_kernels():
        for bits in (8, 4):
            q = copy.deepcopy(model).to(torch.bfloat16)
            weightonly.to_weight_only(q, bits, group=32)
            variants[f"int{bits} weight-only"] = (q, 8 + 16 / 576 if bits == 8 else 5.0)
    bandwidth = roofline.measure_copy_bandwidth(256 * roofline.MiB, reps=5, device="cpu")
    best = {name: 0.0 for name in variants}
    for _ in range(repeats):  # round-robin: a busy machine slows every variant alike
        for name, (m, _) in variants.items():
            best[name] = max(best[name], measure.decode_tokens_per_s(m, prompt_len=8, new_tokens=24, repeats=1))
    rows = []
    for name, (m, bits) in variants.items():
        per_token = measure.weight_bytes(model, bits, head_bits=bits)
        rows.append({"weights": name, "MB read per token": per_token / 1e6, "tokens/s": best[name],
                     "× bf16": best[name] / best["bf16"], "roofline tokens/s": bandwidth / per_token,
                     "share of roofline": best[name] / (bandwidth / per_token)})
    return {"copy bandwidth GB/s": bandwidth / 1e9, "rows": rows}


def kv_table(model, n_windows: int, seq_len: int, budget_bytes: float, source: str = "smollm2") -> list[dict]:
    cfg = model.cfg
    long = measure.windows("heldout", n_windows, seq_len, source=source)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    rows = []
    for bits in (None, 8, 4, 2):
        per_token = kvcache.bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, bits)
        ppl = kvcache.perplexity(bf16, long, bits, group=32)
        rows.append({"KV": "bf16" if bits is None else f"int{bits} (K per channel, V per token)",
                     "bytes/token": per_token, "perplexity": ppl,
                     "tokens in budget": int(budget_bytes // per_token)})
        print(rows[-1], flush=True)
    return rows


def prune_table(model, held, calib, sparsities, with_2_4: bool = True) -> list[dict]:
    rows = []
    for method in ("magnitude", "wanda"):
        for sparsity in sparsities:
            q, share = measure.pruned_copy(model, method, sparsity, calib)
            rows.append({"method": method, "sparsity": share, "perplexity": measure.perplexity(q.to(torch.bfloat16), held)})
            print(rows[-1], flush=True)
    for method in ("2:4", "wanda 2:4") if with_2_4 else ():
        q, share = measure.pruned_copy(model, method, 0.5, calib)
        rows.append({"method": method, "sparsity": share, "perplexity": measure.perplexity(q.to(torch.bfloat16), held)})
        print(rows[-1], flush=True)
    return rows


def sparse_speed() -> dict:
    """A 2:4-pruned (50% zeros) SwiGLU down projection, batch 1, bf16 on the CPU: the dense kernel
    does the same work, and torch's semi-structured sparse matmul needs a CUDA GPU."""
    w = torch.randn(576, 1536).to(torch.bfloat16)
    from llmsys.compress.prune import n_m_mask

    sparse_w = w * n_m_mask(w.float().abs())
    x = torch.randn(1, 1536).to(torch.bfloat16)
    dense = timing.median_seconds(lambda: x @ w.T, reps=50, device="cpu")
    pruned = timing.median_seconds(lambda: x @ sparse_w.T, reps=50, device="cpu")
    csr = sparse_w.float().to_sparse_csr()
    xf = x.float()
    csr_s = timing.median_seconds(lambda: (csr @ xf.T), reps=50, device="cpu")
    return {"dense µs": dense * 1e6, "2:4 zeros, dense kernel µs": pruned * 1e6, "2:4 as CSR (fp32) µs": csr_s * 1e6}


PARTS = ["formats", "perplexity", "speed", "kv", "prune", "qat"]


def load_source(source: str | None):
    """(model, tokenizer) of SmolLM2 or of the checkpoint ``source`` (converted once, its own cache entry)."""
    if source is None:
        return zoo.load("smollm2", device="cpu"), zoo.tokenizer("smollm2")
    if not pretrained.is_checkpoint(source):
        raise SystemExit(f"--source {source!r} is neither a directory nor a hub id (org/name): give a checkpoint "
                         "in transformers' format")
    (model, tok), _ = pretrained.checkpoint_entry(source)
    return model.eval(), tok


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the results here (they also go to the course cache)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, help="default: all (all but qat with --source)")
    parser.add_argument("--quick", action="store_true", help="fewer windows, methods and sparsities")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="perplexity: only the methods whose names contain TEXT, merged into the cached table")
    parser.add_argument("--sparsities", type=float, nargs="+",
                        help="pruning: only these shares of weights to zero (magnitude, Wanda), merged into the cached curve")
    parser.add_argument("--kv-windows", type=int, default=None, help="KV: held-out windows of 1024 tokens (default 4, quick 2)")
    parser.add_argument("--qat-steps", type=int, default=None, help="QAT: training steps each (default 80, quick 30)")
    parser.add_argument("--windows", type=int, default=None, help="held-out windows of 256 tokens (default 8, quick 4)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: a shared machine)")
    parser.add_argument("--source", metavar="DIR|HUB_ID",
                        help="an unquantized Llama-architecture checkpoint instead of SmolLM2 (needs --json)")
    args = parser.parse_args(argv)
    if args.source and not args.json:
        parser.error("--source needs --json PATH: its results stay out of the course cache chapter 10 reads")
    args.parts = args.parts or [p for p in PARTS if not (args.source and p == "qat")]
    if args.source and "qat" in args.parts:
        parser.error("QAT trains the zoo's target model, not a checkpoint: leave qat out of --parts with --source")
    torch.set_num_threads(args.threads)
    n_held = args.windows or (4 if args.quick else 8)
    if n_held < 1:
        parser.error("--windows must be at least 1")
    model, tok = load_source(args.source)
    source = args.source or "smollm2"
    held = measure.windows("heldout", n_held, source=source)
    calib = measure.windows("calibration", CALIB_WINDOWS, source=source)[:, :-1]
    # only the parts run now, merged into the earlier ones (SmolLM2's course cache, or --source's --json)
    earlier = measure.load_results() if not args.source else (
        json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else None)
    if earlier and earlier.get("source", "smollm2") != source:
        earlier = None  # another checkpoint's rows are no baseline for this one
    command = " ".join(["python benchmarks/quant.py", *(sys.argv[1:] if argv is None else argv)])
    results = {"source": source, "command": command}
    results["machine"] = {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads,
                          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results["heldout"] = {"windows": n_held, "tokens per window": measure.SEQ_LEN}
    if "formats" in args.parts:
        results["formats"] = formats_table(model)
        for r in results["formats"]:
            print(f"{r['format']:<26} {r['bits/weight']:5.2f} bits  relative error {r['relative error']:.4f}")
    if "perplexity" in args.parts:
        rows = perplexity_table(model, tok, held, calib, args.quick, args.only, source)
        cached = (earlier or {}).get("perplexity", [])
        results["perplexity"] = merge_rows(cached, rows, lambda r: r["method"]) if args.only else rows
    if "speed" in args.parts:
        results["speed"] = speed_table(model, repeats=2 if args.quick else 4)
        print(json.dumps(results["speed"], indent=1))
        results["sparse speed"] = sparse_speed()
        print(results["sparse speed"])
    if "kv" in args.parts:
        budget = 256 * 2**20
        results["kv"] = {"budget bytes": budget, "window tokens": 1024,
                         "rows": kv_table(model, args.kv_windows or (2 if args.quick else 4), 1024, budget, source)}
    if "prune" in args.parts:
        rows = prune_table(model, held, calib, args.sparsities or ((0.2, 0.5) if args.quick else (0.2, 0.4, 0.5, 0.6)),
                           with_2_4=not args.sparsities)
        cached = (earlier or {}).get("prune", [])
        results["prune"] = merge_rows(cached, rows, lambda r: (r["method"], round(r["sparsity"], 2))) if args.sparsities else rows
    if "qat" in args.parts:
        target = zoo.load("target", device="cpu")
        results["qat"] = {f"{bits}-bit": qat.qat_vs_ptq(target, bits, steps=args.qat_steps or (30 if args.quick else 80)) for bits in (4, 3)}
        print(results["qat"])
    if args.source:
        atomic_write_json(Path(args.json), {**(earlier or {}), **results})
    else:
        measure.save_results(results)
        if args.json:
            atomic_write_json(Path(args.json), results)
    cfg = model.cfg
    print(f"bf16 KV cache {accounting.kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):,.0f} B/token; "
          f"results in {args.json if args.source else measure.results_path()}")
    return results


if __name__ == "__main__":
    main()
