"""Chapter 7's claim over seeds: does the best weight decay move with the learning rate?

    python benchmarks/decoupling.py --json benchmarks/results/decoupling.json
    python benchmarks/decoupling.py --seeds 2 --steps 100 --json /tmp/quick.json

For Adam + L2 and for AdamW in the paper's form (decay η_t·λ), a learning-rate × weight-decay
grid of held-out losses per seed (``llmsys.optim.decoupling``: a 3-layer MLP overfitting 200
noisy examples), the best λ per learning rate, and the slope of log10(best λ) against
log10(α): 0 means the best λ stays put, 1 means it moves with α. The slope read in torch's
units (decay α_t·λ) is the paper form's minus 1. The JSON is rewritten after every grid.
Prints a table; asserts nothing.
"""

import argparse
import datetime
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from llmsys import optim
from llmsys.core import ledger
from llmsys.core.cache import atomic_write_json
from llmsys.core.stats import mean_interval
from llmsys.optim import decoupling


def summary(runs: list[dict], convention: str) -> dict:
    slopes = [r["slope"] for r in runs if r["convention"] == convention]
    mean, low, high = mean_interval(slopes)
    return {"slopes": slopes, "mean": mean, "low": low, "high": high}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds (default 3)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    parser.add_argument("--json", required=True, help="where to write the grids (rewritten after each one)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 10:
        parser.error("need --seeds >= 1 and --steps >= 10")
    torch.set_num_threads(1)  # a 70k-parameter MLP: one thread is as fast
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    conventions = (decoupling.L2, decoupling.PAPER)
    result = {"command": "python benchmarks/decoupling.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "when": datetime.datetime.now().isoformat(timespec="seconds"), **ledger.origin(),
              "learning_rates": list(decoupling.LEARNING_RATES), "weight_decays": list(decoupling.WEIGHT_DECAYS),
              "steps": args.steps, "complete": False, "runs": []}
    plan = [(seed, c) for seed in range(args.seeds) for c in conventions]
    bar = tqdm(total=len(plan) * len(decoupling.LEARNING_RATES) * len(decoupling.WEIGHT_DECAYS), desc="runs")
    for seed, convention in plan:
        grid = decoupling.decoupling_grid(convention, steps=args.steps, seed=seed)
        bar.update(grid.numel())
        best = [decoupling.best_decay(row, decoupling.WEIGHT_DECAYS) for row in grid]
        slope = decoupling.argmin_slope(grid, decoupling.LEARNING_RATES, decoupling.WEIGHT_DECAYS)
        result["runs"].append({"convention": convention, "seed": seed, "losses": grid.tolist(), "best_decay": best,
                               "slope": slope, "best_loss": grid.min().item()})
        result["summary"] = {c: summary(result["runs"], c) for c in conventions
                             if any(r["convention"] == c for r in result["runs"])}
        result["complete"] = len(result["runs"]) == len(plan)
        atomic_write_json(path, result)
    bar.close()
    print(f"{'convention':<28} {'seed':>4} {'slope':>6} {'best loss':>9}  best λ per α {decoupling.LEARNING_RATES}")
    for r in result["runs"]:
        print(f"{r['convention']:<28} {r['seed']:>4} {r['slope']:>6.2f} {r['best_loss']:>9.3f}  "
              + " ".join(f"{b:.2g}" for b in r["best_decay"]))
    for c, s in result["summary"].items():
        print(f"{c}: slope {s['mean']:.2f}, 95% CI [{s['low']:.2f}, {s['high']:.2f}] over {len(s['slopes'])} seeds")
    paper = result["summary"][decoupling.PAPER]
    print(f"{optim.DECAY_CONVENTIONS[1]} (the same runs in torch's units): slope {paper['mean'] - 1:.2f}, "
          f"95% CI [{paper['low'] - 1:.2f}, {paper['high'] - 1:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
