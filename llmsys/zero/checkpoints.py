"""Distributed checkpoints written atomically, with torch.distributed.checkpoint.

Every rank writes its own shards; a checkpoint saved with one world size
resumes with another (each rank reads the slices it now owns). A save that
dies midway leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

COMPLETE = "COMPLETE"  # written last: a checkpoint folder without it is not a checkpoint


def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
    """Save model and optimizer state with torch.distributed.checkpoint; every rank calls this.

    Each rank writes its own shards into ``<path>.partial``; once all ranks are
    done, rank 0 marks it complete and renames it to ``path`` (replacing an older
    checkpoint there only then). A run that dies midway leaves ``path`` as it was.
    ``path`` must be on a filesystem every rank sees (one machine, or a shared disk).
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of a run that died
        partial.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=str(partial))
    dist.barrier()  # every rank has written its files
    if dist.get_rank() == 0:
        (partial / COMPLETE).write_text(f"step {step}, world size {dist.get_world_size()}\n")
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint written by ``save_checkpoint`` (any world size) into a sharded model; returns its step."""
    path = Path(path)
    if not (path / COMPLETE).exists():
        why = "does not exist" if not path.exists() else f"has no {COMPLETE} marker (an interrupted save?)"
        raise FileNotFoundError(f"no complete checkpoint at {path}: the folder {why}; "
                                "save one with save_checkpoint, or point resume_from at a finished one")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=True))
    return int(state["step"])

