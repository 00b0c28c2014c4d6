"""Chapter 5's claim over seeds: on-policy distillation vs sequence-level KD at equal compute on
multi-digit addition (``llmsys.distill.equal_compute``), from the cached addition teacher.

    python benchmarks/distill_seeds.py --seeds 5 --json benchmarks/results/distill_seeds.json
    python benchmarks/distill_seeds.py --seeds 2 --budget-steps 2 --digits 3 --teacher-steps 20 --lrs --json /tmp/q.json

Each method's learning rate is first tuned on a seed of its own (``--lrs``); then every seed
trains the same starting student with each method until it has spent the same FLOPs (the
teacher's generation and scoring counted); per run the curve of greedy exact match, accuracy
by answer position and reverse KL on the student's own samples along the budget. The JSON
(command, machine, date, tuning runs, setup, per-seed runs, per-method mean curves) is rewritten after
every run, so an interrupted sweep keeps what it did. Prints a table; asserts nothing.
"""

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

import torch

from llmsys.core import ledger, stats
from llmsys.core.cache import atomic_write_json
from llmsys.distill import equal_compute

TUNING_SEED = 1000  # apart from the reported seeds 0, 1, ...


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="student seeds per method (default 5)")
    parser.add_argument("--budget-steps", type=int, default=equal_compute.Setup.budget_steps,
                        help="the FLOP budget, in sequence-level KD steps' worth (default %(default)s)")
    parser.add_argument("--digits", type=int, default=equal_compute.TeacherSpec.digits,
                        help="digits per operand (default %(default)s; another value trains its own teacher)")
    parser.add_argument("--teacher-steps", type=int, default=equal_compute.TeacherSpec.steps,
                        help="the teacher's training steps (default %(default)s; another value trains its own teacher)")
    parser.add_argument("--lrs", type=float, nargs="*", default=[3e-4, 1e-3, 3e-3],
                        help="learning rates each method is tuned over on a seed of its own (none: the defaults)")
    parser.add_argument("--json", required=True, help="where to write the runs (rewritten after each run)")
    args = parser.parse_args(argv)
    if args.seeds < 2 or args.budget_steps < 1 or args.digits < 1 or args.teacher_steps < 1:
        parser.error("need --seeds >= 2 (an interval needs two), and --budget-steps, --digits, --teacher-steps >= 1")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # models this small: one thread is as fast, and runs do not disturb each other
    teacher = equal_compute.TeacherSpec(digits=args.digits, steps=args.teacher_steps)
    setup = dataclasses.replace(equal_compute.Setup(), teacher=teacher, budget_steps=args.budget_steps)
    header = {"command": "python benchmarks/distill_seeds.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "when": datetime.datetime.now().isoformat(timespec="seconds"), **ledger.origin()}
    if args.lrs:  # a tuned baseline: every method gets its best rate, chosen on a seed no reported run uses
        setup, header["tuning"] = equal_compute.tune(setup, args.lrs, seed=TUNING_SEED)
        print("learning rates chosen on the tuning seed: " + ", ".join(f"{m} {lr:g}" for m, lr in setup.lr.items()))

    def save(result):
        done = len(result["runs"]) == args.seeds * len(setup.methods)
        atomic_write_json(path, {**header, "complete": done, **result, "curves": equal_compute.curves(result)})

    result = equal_compute.run_seeds(setup, range(args.seeds), progress=True, on_run=save)
    print(f"teacher: exact match {result['teacher']['exact']:.3f} on {setup.eval_problems} held-out sums")
    print(f"{'method':<36} {'steps':>5} {'exact match (95% CI)':>26} {'reverse KL (95% CI)':>24}")
    for method in setup.methods:
        runs = [r for r in result["runs"] if r["method"] == method]
        exact = stats.mean_interval(equal_compute.finals(result, method, "exact"))
        kl = stats.mean_interval(equal_compute.finals(result, method, "reverse_kl"))
        print(f"{equal_compute.LABELS[method]:<36} {runs[0]['steps']:>5} "
              f"{exact[0]:>8.3f} [{exact[1]:.3f}, {exact[2]:.3f}] {kl[0]:>8.3f} [{kl[1]:.3f}, {kl[2]:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
