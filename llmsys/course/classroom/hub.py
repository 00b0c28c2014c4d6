"""A JupyterHub for one GPU server: a JupyterLab per student, each with its own share of the GPUs.

``python -m llmsys classroom hub --users roster.csv [--gpus N | --mig UUID,...] --out hub/`` writes:

- ``hub/classroom.json``: the plan, one entry per student (folder, environment, limits); the
  config reads it, and the tests check it;
- ``hub/jupyterhub_config.py``: JupyterHub's own configuration (start with
  ``jupyterhub -f hub/jupyterhub_config.py``);
- ``hub/site/sitecustomize.py``: caps each student process's share of its GPU's memory
  (``torch.cuda.set_per_process_memory_fraction``) as soon as it imports torch;
- ``hub/grade_array.sbatch``: the Slurm array job that grades a large class in shards.

GPUs (or MIG slices, by UUID) are dealt round-robin through ``CUDA_VISIBLE_DEVICES``:
student i gets device i mod D, and the students on one device split its memory.
CPU and memory limits are enforced by systemd (jupyterhub-systemdspawner) with
``--spawner systemd``; ``--spawner local`` (JupyterHub's LocalProcessSpawner, for a
machine without systemd) only passes them on as ``CPU_LIMIT``/``MEM_LIMIT``. Idle
kernels are culled and idle servers stop, by Jupyter Server's own settings
(``MappingKernelManager.cull_idle_timeout``, ``ServerApp.shutdown_no_activity_timeout``).
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess
from pathlib import Path

from .roster import Person, students

AUTHENTICATORS = ("pam", "shared-password")  # JupyterHub's own short names
SPAWNERS = {"systemd": "systemdspawner.SystemdSpawner", "local": "jupyterhub.spawner.LocalProcessSpawner"}
MIG_UUID = re.compile(r"^MIG-[0-9a-fA-F-]{8,}$|^MIG-GPU-[0-9a-fA-F-]+/\d+/\d+$")
MEMORY = re.compile(r"^\d+(\.\d+)?[KMGT]$")
PASSWORD_VARIABLE = "LLMSYS_HUB_PASSWORD"  # read when the hub starts, never written to disk
HERE = Path(__file__).resolve().parent


class HubError(ValueError):
    """Options the hub cannot be set up with; the message says what to change."""


def gpus_on_this_machine() -> list[str]:
    """Indices of the GPUs ``nvidia-smi -L`` lists; none without the NVIDIA driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, _ in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def devices_from(gpus: int | None, mig: str | None) -> list[str]:
    if gpus is not None and mig:
        raise HubError("give either --gpus N or --mig UUID,..., not both")
    if mig:
        slices = [s.strip() for s in mig.split(",") if s.strip()]
        bad = [s for s in slices if not MIG_UUID.match(s)]
        if bad:
            raise HubError(f"--mig takes MIG device UUIDs as `nvidia-smi -L` lists them (MIG-...); got {', '.join(bad)}")
        return slices
    if gpus is None:
        return gpus_on_this_machine()
    if gpus < 0:
        raise HubError(f"--gpus must be 0 or more, got {gpus}")
    return [str(i) for i in range(gpus)]


def plan_hub(people: list[Person], devices: list[str], exchange: str | Path, course_env: str | Path,
             cpus: float = 2.0, memory: str = "16G", idle_minutes: int = 60, margin: float = 0.95,
             ip: str = "127.0.0.1", port: int = 8000, authenticator: str = "pam", spawner: str = "systemd") -> dict:
    """What every student gets; a pure function of its inputs (the GPU list can be made up)."""
    if authenticator not in AUTHENTICATORS:
        raise HubError(f"--auth must be one of {', '.join(AUTHENTICATORS)}, got {authenticator!r}")
    if spawner not in SPAWNERS:
        raise HubError(f"--spawner must be one of {', '.join(SPAWNERS)}, got {spawner!r}")
    if not cpus > 0:
        raise HubError(f"--cpus must be positive, got {cpus}")
    if not MEMORY.match(memory):
        raise HubError(f"--memory takes a size like 16G or 512M, got {memory!r}")
    if idle_minutes < 1:
        raise HubError(f"--idle-minutes must be 1 or more, got {idle_minutes}")
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise HubError(f"--ip takes an IP address such as 127.0.0.1 or 0.0.0.0, got {ip!r}") from None
    if not 1 <= port <= 65535:
        raise HubError(f"--port must be 1..65535, got {port}")
    if not 0 < margin <= 1:
        raise HubError(f"the GPU memory margin must be in (0, 1], got {margin}")
    course_env = Path(course_env)
    if not (course_env / "bin" / "python").exists():
        raise HubError(f"--course-env {course_env} has no bin/python; give the environment the course is installed in")
    class_list = students(people)
    sharing = [sum(1 for i in range(len(class_list)) if i % len(devices) == d) for d in range(len(devices))]
    users = {}
    for i, person in enumerate(class_list):
        environment = {"OMP_NUM_THREADS": str(max(1, int(cpus))), "PYTHONPATH": "{site}",
                       "CUDA_VISIBLE_DEVICES": ""}  # no GPU unless one is assigned: never all of them
        if devices:
            d = i % len(devices)
            environment["CUDA_VISIBLE_DEVICES"] = devices[d]
            environment["LLMSYS_GPU_MEMORY_FRACTION"] = f"{margin / sharing[d]:.4f}"
        users[person.username] = {"folder": str(Path(exchange) / person.username), "environment": environment}
    return {"ip": ip, "port": port, "authenticator": authenticator, "spawner": spawner,
            "spawner_class": SPAWNERS[spawner],
            "course_env": str(course_env), "exchange": str(exchange), "cpus": cpus, "memory": memory,
            "idle_seconds": idle_minutes * 60, "devices": devices, "users": users,
            "admins": [p.username for p in people if p.role == "instructor"]}


def write_hub(plan: dict, out: str | Path, shards: int = 4, force: bool = False) -> list[Path]:
    """The hub's folder: the plan, JupyterHub's config, the GPU-share hook, the Slurm grading script.
    Files of an earlier hub there (perhaps edited by hand) are kept unless ``force``."""
    out = Path(out)
    files = {
        out / "classroom.json": json.dumps(plan, indent=1) + "\n",
        out / "jupyterhub_config.py": (HERE / "hub_config_template.py").read_text(encoding="utf-8"),
        out / "site" / "sitecustomize.py": (HERE / "gpu_share.py").read_text(encoding="utf-8"),
        out / "grade_array.sbatch": slurm_array_script(shards, plan["course_env"]),
    }
    there = [str(path) for path in files if path.exists() or path.is_symlink()]
    if there and not force:
        raise HubError(f"{', '.join(there)} already exist(s); pass --force to overwrite, or choose another --out")
    (out / "site").mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)


def slurm_array_script(shards: int, course_env: str) -> str:
    """``sbatch --export=ALL,SUBMISSIONS=...,SEED=... grade_array.sbatch``: one shard per array task, then merge."""
    python = Path(course_env) / "bin" / "python"
    return f"""#!/bin/bash
# Grade a large class in {shards} shards, one Slurm array task each (same seed everywhere), then:
#   {python} -m llmsys grade merge shards/shard_*.json --csv grades.csv --json grades.json --feedback feedback
#SBATCH --job-name=llmsys-grade
#SBATCH --array=0-{shards - 1}
#SBATCH --cpus-per-task=2
#SBATCH --mem=8G
#SBATCH --time=02:00:00
#SBATCH --output=shards/shard_%a.log
set -euo pipefail
: "${{SUBMISSIONS:?set SUBMISSIONS to the collected folder, e.g. collected/lab00_warmup/submitted}}"
: "${{SEED:?set SEED to one number for every shard, e.g. SEED=$RANDOM}}"
mkdir -p shards
exec {python} -m llmsys grade "$SUBMISSIONS" --jobs 2 --seed "$SEED" \\
    --shard "$SLURM_ARRAY_TASK_ID/{shards}" --json "shards/shard_$SLURM_ARRAY_TASK_ID.json"
"""
