"""Chapter 11 at benchmark size: calibration, hallucination detection and contamination of
SmolLM2 and the zoo's own models; deduplication, quality filtering, duplication and mixing on
tiny models.

    python benchmarks/eval.py --json eval.json          # every part (tens of minutes on a loaded CPU)
    python benchmarks/eval.py --parts dedup,mixing      # some parts

Prints each part's table and writes every number to --json; asserts nothing.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

PARTS = ("calibration", "hallucination", "contamination", "pretrained_min_k", "dedup", "quality", "duplication", "mixing")


def smollm2():
    from llmsys.core import device, zoo

    dtype = torch.bfloat16 if device.device().type == "cpu" or device.has_cuda() else None
    return zoo.load("smollm2").to(dtype=dtype), zoo.tokenizer("smollm2")


def run_part(name: str, args, real):
    from llmsys.data import experiments as data
    from llmsys.evaluation import experiments as ev

    if name == "calibration":
        return ev.calibration_experiment(*real(), n_dev=args.mc_items, n_test=args.mc_items)
    if name == "hallucination":
        return ev.hallucination_experiment(*real(), n_real=args.qa_items, n_fake=args.qa_items)
    if name == "contamination":
        return ev.contamination_experiment()
    if name == "pretrained_min_k":
        return ev.pretrained_min_k_experiment(*real(), n_texts=args.min_k_texts)
    if name == "dedup":
        return data.dedup_experiment(n_docs=args.dedup_docs, n_near=args.dedup_docs // 10, n_exact=args.dedup_docs // 40)
    if name == "quality":
        return data.quality_experiment(*real(), n_each=args.quality_docs)
    if name == "duplication":
        return data.duplication_experiment()
    return data.mixing_experiment()


def summary(name: str, r: dict) -> str:
    if name == "calibration":
        lines = [f"docstring task {r['sizes']}, test {r['test']}"]
        lines += [f"  {row['method']:<19} T={row['T']:.2f} acc={row['acc']:.3f} conf={row['confidence']:.3f} "
                  f"ECE={row['ece']:.3f} NLL={row['nll']:.3f}" for row in r["table"]]
        return "\n".join(lines)
    if name == "hallucination":
        lines = [f"accuracy on real names {r['accuracy_on_real']:.2f}"]
        lines += [f"  AUROC for {target}: " + ", ".join(f"{d} {v:.2f}" for d, v in aurocs.items())
                  for target, aurocs in r["auroc"].items()]
        return "\n".join(lines)
    if name == "contamination":
        return (f"acc contaminated {r['acc']['contaminated']:.3f} clean {r['acc']['clean']:.3f} (chance {r['chance']:.2f}), "
                f"inflation {r['inflation']:+.3f}; AUROC " + ", ".join(f"{k} {v:.2f}" for k, v in r["auroc"].items()))
    if name == "pretrained_min_k":
        return f"Min-20% Prob, Python docs vs new docstrings: {r['mean_min_k']}, AUROC {r['auroc']:.2f}"
    if name == "dedup":
        return (f"{r['documents']} docs, {r['planted']} planted, {r['true_pairs']} true pairs: precision {r['precision']:.3f} "
                f"recall {r['recall']:.3f} (planted {r['recall_planted']:.3f}); all pairs / LSH time "
                f"{r['seconds']['all pairs'] / r['seconds']['minhash+lsh']:.1f}x")
    if name == "quality":
        return (f"Gopher pass rate {json.dumps({k: round(v, 2) for k, v in r['gopher_pass'].items()})}\n"
                f"  median perplexity {json.dumps({k: round(v, 1) for k, v in r['median_perplexity'].items()})}\n"
                f"  AUROC perplexity junk vs prose {json.dumps({k: round(v, 2) for k, v in r['auroc_junk_vs_prose'].items()})}")
    if name == "duplication":
        return "; ".join(f"{k}: val loss {r[k]['val_loss']:.3f}, repeated passages reproduced: exactly {r[k]['memorized']['exact']:.2f}, "
                         f"tokens {r[k]['memorized']['tokens']:.2f}" for k in ("unique", "with repeats"))
    return (f"held-out code share {r['held_out_share']}: " + "; ".join(
        f"{d} predicted {r['predicted'][d]:.3f} measured {r['measured'][d]:.3f}" for d in ("prose", "code")))


def plain(x):
    """JSON-safe: NaN (an empty reliability bin) becomes null."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every result to this file")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    p.add_argument("--mc-items", type=int, default=100, help="docstring-task items per split (dev, test)")
    p.add_argument("--qa-items", type=int, default=30, help="real and made-up names each")
    p.add_argument("--min-k-texts", type=int, default=40)
    p.add_argument("--dedup-docs", type=int, default=800)
    p.add_argument("--quality-docs", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    if args.json and not args.json.parent.is_dir():
        p.error(f"--json: folder {args.json.parent} does not exist")
    if args.threads:
        torch.set_num_threads(args.threads)
    cached = {}

    def real():
        if "model" not in cached:
            cached["model"] = smollm2()
        return cached["model"]

    results = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    for name in parts:
        start = time.perf_counter()
        results[name] = run_part(name, args, real)
        results[name]["wall_s"] = time.perf_counter() - start
        print(f"[{name}, {results[name]['wall_s']:.0f} s] {summary(name, results[name])}", flush=True)
        if args.json:  # after every part, so a long run loses nothing
            args.json.write_text(json.dumps(plain(results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
