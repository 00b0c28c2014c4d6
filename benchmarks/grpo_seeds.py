"""Chapter 6's length and std biases over seeds: GRPO vs Dr. GRPO, and each of Dr. GRPO's two
changes alone, from the chapter's cached SFT policy on Countdown (the notebook's setup).

    python benchmarks/grpo_seeds.py --json benchmarks/results/grpo_seeds.json
    python benchmarks/grpo_seeds.py --seeds 2 --variant-seeds 1 --steps 20 --json /tmp/quick.json

Per run: the expected length of an answerless ramble (exact, ``rl.ramble_stats``) at the start,
after 10 steps and at the end, the probability of starting one at the end, the mean length of
wrong and of correct completions in the first and last 10 training batches, and the held-out
pass rate. The JSON is rewritten after every run, so an interrupted sweep keeps what it did.
Prints a table; asserts nothing.
"""

import argparse
import copy
import datetime
import sys
import time
from pathlib import Path

import torch

from llmsys.core import ledger
from llmsys import rl
from llmsys.core.cache import atomic_write_json

# name: (loss normalizer, advantage scale); the last two change one thing each
VARIANTS = {"GRPO": ("grpo", "group"), "Dr. GRPO": ("dr_grpo", "none"),
            "1/|o|, no std": ("grpo", "none"), "constant, std": ("dr_grpo", "group")}
WINDOW = 10  # steps: the ramble probe's period and the width of the first/last averages


def window_mean(values):
    t = torch.tensor(values, dtype=torch.float64)
    return torch.nanmean(t).item()


def one_run(policy, tok, task, variant: str, seed: int, steps: int) -> dict:
    loss_type, scale = VARIANTS[variant]
    model = copy.deepcopy(policy)

    def probe(step, m):
        if (step + 1) % WINDOW == 0:
            stats = rl.ramble_stats(m, tok, task, task.test)
            return {"ramble_length": stats["length"], "ramble_start": stats["start"]}

    start = time.perf_counter()
    cfg = rl.GRPOConfig(steps=steps, seed=seed, loss_type=loss_type, scale_rewards=scale)
    hist = rl.train_grpo(model, tok, task, cfg, progress=False, callback=probe)
    after = rl.evaluate(model, tok, task, task.test, samples_per_problem=8)
    return {
        "variant": variant, "seed": seed, "steps": steps, "seconds": time.perf_counter() - start,
        "pass_rate": after["pass_rate"],
        "ramble_length_step10": hist["ramble_length"][0], "ramble_length_end": hist["ramble_length"][-1],
        "ramble_start_end": hist["ramble_start"][-1],
        **{f"{key}_{part}": window_mean(hist[key][:WINDOW] if part == "first10" else hist[key][-WINDOW:])
           for key in ("wrong_length", "correct_length", "length") for part in ("first10", "last10")},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=6, help="seeds for GRPO and Dr. GRPO (default 6)")
    parser.add_argument("--variant-seeds", type=int, default=3, help="seeds for each one-change variant (default 3)")
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps per run (default 60, as in the notebook)")
    parser.add_argument("--json", required=True, help="where to write the runs (rewritten after each run)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.variant_seeds < 0 or args.steps < WINDOW:
        parser.error(f"need --seeds >= 1, --variant-seeds >= 0 and --steps >= {WINDOW}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # a 100k-parameter policy: one thread is as fast, and runs do not disturb each other
    policy, tok, task = rl.load_policy(progress=False)
    start_rambles = rl.ramble_stats(policy, tok, task, task.test)
    seeds = {v: args.seeds if v in ("GRPO", "Dr. GRPO") else args.variant_seeds for v in VARIANTS}
    # seed by seed, so an interrupted sweep has compared every variant on the same seeds
    plan = [(v, s) for s in range(max(seeds.values())) for v in VARIANTS if s < seeds[v]]
    result = {"command": "python benchmarks/grpo_seeds.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "when": datetime.datetime.now().isoformat(timespec="seconds"), **ledger.origin(),
              "start": {"ramble_length": start_rambles["length"], "ramble_start": start_rambles["start"]},
              "complete": False, "runs": []}
    print(f"{'variant':<14} {'seed':>4} {'pass':>6} {'ramble@10':>9} {'ramble@end':>10} {'P(ramble)':>9} "
          f"{'wrong last10':>12} {'correct first10':>15} {'correct last10':>14} {'s':>5}")
    for variant, seed in plan:
        run = one_run(policy, tok, task, variant, seed, args.steps)
        result["runs"].append(run)
        result["complete"] = len(result["runs"]) == len(plan)
        atomic_write_json(path, result)
        print(f"{variant:<14} {seed:>4} {run['pass_rate']:>6.3f} {run['ramble_length_step10']:>9.2f} "
              f"{run['ramble_length_end']:>10.2f} {run['ramble_start_end']:>9.4f} {run['wrong_length_last10']:>12.2f} "
              f"{run['correct_length_first10']:>15.3f} {run['correct_length_last10']:>14.3f} {run['seconds']:>5.0f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
