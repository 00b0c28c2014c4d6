"""The script behind ``python -m llmsys.zero`` and ``torchrun --nproc-per-node=N -m llmsys.zero``:
train a zoo model with ZeRO by hand or FSDP2, then report the bytes held and sent against the formulas."""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

from llmsys.core import accounting
from llmsys.core.dist import torchrun_main
from llmsys.zero.estimates import comm_bytes_estimate, state_bytes_estimate
from llmsys.zero.fsdp2 import train_fsdp
from llmsys.zero.training import TrainConfig, train_zero


def run_from_command_line(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """What each rank runs for ``python -m llmsys.zero``: train, then report bytes against the formulas."""
    from llmsys.core import zoo  # only the script needs the corpus

    spec = zoo.SPECS[args.model]
    config = TrainConfig(model=spec.config, steps=args.steps, batch_size=args.batch_size * world_size,
                         seq_len=args.seq_len, lr=args.lr, weight_decay=0.1)
    tokens = zoo.dataset()[0] if args.data == "zoo" else None
    if rank == 0:
        print(f"{world_size} rank(s) on {dist.get_backend()}, model {args.model!r} "
              f"({config.model.n_params():,} parameters), stage {args.stage}, {args.steps} steps", flush=True)
    if args.stage == "fsdp":
        result = train_fsdp(rank, world_size, config, reshard_after_forward=not args.no_reshard, tokens=tokens,
                            verbose=True)
        result.pop("params")
        if rank == 0:
            psi = 4 * config.model.n_params()
            print(f"parameter shard on rank 0: {accounting.human_bytes(result['param_bytes'])} "
                  f"(model {accounting.human_bytes(psi)} fp32 / {world_size} ranks)")
    else:
        stage = int(args.stage)
        result = train_zero(rank, world_size, stage, config, tokens=tokens, verbose=True)
        result.pop("params")
        if rank == 0:
            estimate = state_bytes_estimate(result["n_params"], world_size, stage)
            for key, value in result["state_bytes"].items():
                print(f"{key:<10} held {accounting.human_bytes(value):>10}   formula "
                      f"{accounting.human_bytes(estimate[key]):>10}   ratio {value / estimate[key]:.4f}")
    if rank == 0:
        ring = sum(result["ring_bytes"].values())
        estimate = comm_bytes_estimate(config.model.n_params(), world_size, 3 if args.stage in ("3", "fsdp") else 0)
        print(f"sent per step (ring model): {accounting.human_bytes(ring)}   "
              f"formula {accounting.human_bytes(estimate)}   calls {result['calls']}", flush=True)
    return {"losses": result["losses"]}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m llmsys.zero",
        description="Sharded data-parallel training of a zoo model. Under torchrun: one process per GPU "
                    "(NCCL, bf16 for FSDP2). As plain python: $LLMSYS_WORLD_SIZE (default 2) gloo processes.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", choices=["0", "1", "2", "3", "fsdp"], default="fsdp",
                        help="0 = DDP, 1-3 = ZeRO by hand (fp32), fsdp = PyTorch FSDP2 (default)")
    parser.add_argument("--no-reshard", action="store_true", help="FSDP2 with reshard_after_forward=False")
    parser.add_argument("--model", choices=["tiny", "draft", "target"], default="target")
    parser.add_argument("--data", choices=["zoo", "random"], default="zoo",
                        help="windows of the zoo corpus, or random tokens (no tokenizer needed)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default: min(128, the model's max_seq_len)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    from llmsys.core.zoo import SPECS

    max_len = SPECS[args.model].config.max_seq_len
    args.seq_len = min(128, max_len) if args.seq_len is None else args.seq_len
    if args.steps < 1 or args.batch_size < 1 or not 1 <= args.seq_len <= max_len:
        parser.error(f"--steps and --batch-size must be >= 1, and --seq-len in 1..{max_len} for --model {args.model}")
    return torchrun_main(functools.partial(run_from_command_line, args=args), accelerator=torch.cuda.is_available())
