"""Chapter 5's claim on a real model: SmolLM2-135M-Instruct's 6-layer student, healed by sequence-level KD,
continued with on-policy distillation or with more sequence-level KD at equal FLOPs (the teacher's
generation and scoring counted), over seeds (``llmsys.distill.continuation``).

    python benchmarks/distill_smollm2.py --seeds 0 --lrs 1e-4 3e-4 1e-3 3e-3 \\
        --json benchmarks/results/distill_smollm2_tuning.json   # tuning only
    python benchmarks/distill_smollm2.py --seeds 5 --tuning-from benchmarks/results/distill_smollm2_tuning.json \\
        --json benchmarks/results/distill_smollm2.json
    python benchmarks/distill_smollm2.py --seeds 2 --budget-steps 1 --batch-size 2 --answer-tokens 4 \\
        --eval-prompts 2 --eval-samples 1 --points 1 --lrs 1e-4 --json /tmp/q.json   # the tiny size CI runs

Each method's learning rate is first tuned on a seed of its own (``--lrs``, or read from a tuning-only
run with ``--tuning-from``; chosen by reverse KL, see ``continuation.choose``); then every seed continues
the same healed student with each method on the same prompts; per run the curve of the task measure
(the teacher's log-prob per token of the student's own answers to held-out chat prompts) and the
reverse KL on those answers along the budget. The JSON (command, machine, date, tuning runs, setup,
per-seed runs, per-method mean curves, the summary with 95% intervals) is rewritten after every run,
so an interrupted sweep keeps what it did. Prints a table; asserts nothing. One thread, about
40 minutes on a CPU at the default size.
"""

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from llmsys.core import ledger
from llmsys.core.cache import atomic_write_json
from llmsys.distill import continuation

TUNING_SEED = 1000  # apart from the reported seeds 0, 1, ...


def main(argv=None) -> int:
    defaults = continuation.Setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per method (default 5)")
    for name in ("budget_steps", "batch_size", "answer_tokens", "points", "eval_prompts", "eval_samples"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                            help=f"default {getattr(defaults, name)} (see continuation.Setup)")
    parser.add_argument("--lrs", type=float, nargs="*", default=[1e-4, 3e-4, 1e-3],
                        help="learning rates each method is tuned over on a seed of its own (none: the defaults)")
    parser.add_argument("--tuning-from", metavar="PATH",
                        help="choose the rates from the tuning rows stored in PATH (a run of this script at the same "
                             "sizes, --seeds 0: tuning only) instead of running them again")
    parser.add_argument("--json", required=True, help="where to write the runs (rewritten after each run)")
    args = parser.parse_args(argv)
    if args.seeds == 1 or args.seeds < 0:
        parser.error("need --seeds >= 2 (an interval needs two), or 0 to tune only")
    sizes = {name: getattr(args, name) for name in ("budget_steps", "batch_size", "answer_tokens", "points",
                                                     "eval_prompts", "eval_samples")}
    try:
        setup = continuation.Setup(**sizes)
    except ValueError as error:
        parser.error(str(error))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the stored run's budget: one thread of a CPU
    began = time.perf_counter()
    header = {"command": "python benchmarks/distill_smollm2.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "when": datetime.datetime.now().isoformat(timespec="seconds"), **ledger.origin()}
    models = continuation.load(setup)
    if args.tuning_from:
        stored = json.loads(Path(args.tuning_from).read_text())
        if {k: stored["setup"][k] for k in sizes} != sizes:
            parser.error(f"{args.tuning_from} was tuned at other sizes ({stored['setup']}): tune at these")
        setup, header["tuning"] = continuation.choose(setup, stored["tuning"])
    elif args.lrs:  # a tuned baseline: each method gets its best rate, chosen on a seed no reported run uses
        setup, header["tuning"] = continuation.tune(setup, args.lrs, seed=TUNING_SEED, models=models)
    if "tuning" in header:
        print("learning rates chosen on the tuning seed: " + ", ".join(f"{m} {lr:g}" for m, lr in setup.lr.items()))
        edges = sorted({r["method"] for r in header["tuning"] if r["edge"]})
        if edges:
            print(f"the best rate for {', '.join(edges)} is at the edge of --lrs: a wider sweep may do better")

    def save(result):
        done = len(result["runs"]) == args.seeds * len(setup.methods)
        atomic_write_json(path, {**header, "complete": done, "seconds": time.perf_counter() - began, **result,
                                 "curves": continuation.curves(result), "summary": continuation.summary(result)})

    if args.seeds == 0:  # tuning only: the rows, for --tuning-from
        atomic_write_json(path, {**header, "complete": True, "setup": dataclasses.asdict(setup), "runs": []})
        return 0
    result = continuation.run_seeds(setup, range(args.seeds), models=models, on_run=save)
    summary = continuation.summary(result)
    print(f"teacher's own answers: {continuation.TASK} {result['teacher'][continuation.TASK]:.3f}; "
          f"healed student: {result['start'][continuation.TASK]:.3f}, reverse KL {result['start']['reverse_kl']:.3f}")
    print(f"{'method':<28} {'steps':>5} {'teacher log-prob/token (95% CI)':>34} {'reverse KL (95% CI)':>26}")
    for method in list(setup.methods) + ["on_policy - seq_kd"]:
        steps = [r["steps"] for r in result["runs"] if r["method"] == method]
        task, kl = summary[continuation.TASK].get(method), summary["reverse_kl"].get(method)
        if task is None:
            continue
        print(f"{continuation.LABELS.get(method, method):<28} {(str(round(sum(steps) / len(steps))) if steps else ''):>5} "
              f"{task[0]:>10.3f} [{task[1]:.3f}, {task[2]:.3f}] {kl[0]:>10.3f} [{kl[1]:.3f}, {kl[2]:.3f}]")
    print(f"wall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
