"""``python -m llmsys doctor``: the self-check to run on a new machine (a GPU server) before class.

It prints what it found (versions, devices), then runs each step in its own
subprocess with a timeout, and prints one line per step: ``ok``, ``FAILED``
(with the last line of its log) or ``skipped`` (with why). A failure never
stops the steps after it. Each step's output goes to ``<out>/<step>.log``,
and the lines to ``<out>/summary.txt``.

On a GPU the steps compile every Triton kernel into a fresh cache (so nothing
hides behind one compiled earlier), benchmark them, run FSDP2 on NCCL in bf16
under torchrun, run the GPU cells of chapters 0 and 4, and grade one lab:
about 10 minutes on one GPU. On a CPU the steps that only measure or run GPU
code are skipped, and each says why; ``--gpu`` makes a missing GPU a failure.

``found()`` and ``chapter_readiness()`` are also what ``python -m llmsys info`` prints.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmsys.course.runner import CHAPTERS, REPO

MIN_TORCH = (2, 6)  # the oldest torch whose APIs llmsys uses (collectives via llmsys.core.dist's helpers)


# -----------------------------------------------------------------------------
# what this machine has


def _version(package: str) -> str | None:
    """An installed distribution's version without importing it (bitsandbytes prints warnings on import)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def found() -> dict:
    """Versions and devices: torch and its CUDA, GPUs, Triton, bitsandbytes, the notebook runner."""
    import torch
    import torch.distributed as dist

    from llmsys.core import device
    from llmsys.core.comm import collective_names

    gpus = torch.cuda.device_count() if device.has_cuda() else 0
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch supported": release >= MIN_TORCH,
        "cuda": torch.version.cuda,  # None: a CPU build of torch
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "triton": _version("triton"),
        "triton mode": ("compiled" if gpus else "interpreter") if _version("triton") else "unavailable",
        "bitsandbytes": _version("bitsandbytes"),
        "transformers": _version("transformers"),
        "notebooks": all(importlib.util.find_spec(m) for m in ("nbclient", "nbformat", "ipykernel")),
        "pytest": importlib.util.find_spec("pytest") is not None and importlib.util.find_spec("nbval") is not None,
        "collectives": collective_names(),
    }


def describe(facts: dict) -> list[str]:
    """The facts as lines to print."""
    gpus = facts["gpus"]
    lines = [
        f"torch {facts['torch']}" + (f" (CUDA {facts['cuda']})" if facts["cuda"] else " (CPU build)")
        + ("" if facts["torch supported"] else f"  <- older than {'.'.join(map(str, MIN_TORCH))}: not supported"),
        f"GPUs: {len(gpus)}" + (f" ({', '.join(sorted(set(gpus)))})" if gpus else "")
        + (f", NCCL {'available' if facts['nccl'] else 'missing'}" if gpus else ""),
        f"Triton {facts['triton'] or 'not installed'} ({facts['triton mode']})",
        f"bitsandbytes {facts['bitsandbytes'] or 'not installed: chapter 3 and its lab need it'}",
        f"transformers {facts['transformers'] or 'not installed'}",
        "notebook runner (nbclient, ipykernel): " + ("found" if facts["notebooks"] else "missing"),
        "collectives: " + ", ".join(f"{ours} -> torch.distributed.{theirs}"
                                    for ours, theirs in facts["collectives"].items()),
    ]
    return lines


# What each chapter's GPU cells need beyond a CUDA torch (None: the chapter has none).
_CHAPTER_NEEDS = {0: ("triton",), 1: ("nccl",), 2: ("nccl",), 3: ("bitsandbytes",), 7: None, 8: ("triton",),
                  9: ("triton",), "09b_kv_distributed.ipynb": ("nccl",)}  # a chapter's second notebook: its own


def chapter_readiness(facts: dict) -> list[tuple[int, str, str, str]]:
    """(chapter, title, its GPU cells, how they run here) for every chapter."""
    rows = []
    for chapter in CHAPTERS:
        needs = _CHAPTER_NEEDS.get(chapter.notebook, _CHAPTER_NEEDS.get(chapter.number, ()))
        if needs is None:
            how = "no GPU cells"
        elif "bitsandbytes" in needs and not facts["bitsandbytes"]:  # the chapter compares against it throughout
            how = "cannot run, nor the rest of the chapter: needs bitsandbytes (pip install bitsandbytes)"
        elif not facts["gpus"]:
            how = "no GPU: they run reduced on the CPU, or print what they would measure"
        else:
            missing = [n for n in needs if not (facts[n] if n != "triton" else facts["triton mode"] == "compiled")]
            how = f"cannot run: needs {', '.join(missing)}" if missing else "run on this GPU"
        rows.append((chapter.number, chapter.title, chapter.gpu_cells, how))
    return rows


# -----------------------------------------------------------------------------
# steps


@dataclass(frozen=True)
class Step:
    """One check: what it checks, its command (argv, or why it is skipped here), its time limit, and
    what its log must show."""

    name: str
    what: str
    command: Callable[["Context"], list[str] | str]  # a string: the reason it is skipped
    timeout: int
    expect: Callable[["Context", str], str | None] = lambda context, log: None  # a problem, or None


@dataclass
class Context:
    facts: dict
    out: Path
    python: str = sys.executable

    @property
    def gpu(self) -> bool:
        return bool(self.facts["gpus"])


def _script(code: str) -> Callable[[Context], list[str]]:
    return lambda context: [context.python, "-c", code]


def _needs_gpu(why: str, command: Callable[[Context], list[str] | str]) -> Callable[[Context], list[str] | str]:
    return lambda context: command(context) if context.gpu else f"no CUDA device: {why}"


def _kernel_tests(context: Context):
    if not (REPO / "tests").is_dir():
        return "no tests/ folder here: run the doctor from a source checkout"
    if not context.facts["pytest"]:
        return "pytest and nbval are not installed (pip install pytest nbval)"
    return [context.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={context.out}/kernel-tests.xml",
            "tests/test_fusion.py", "tests/test_kernels.py",  # byte counting first, as in chapter 0
            "tests/test_optim.py::test_ns_matmul_kernel_equals_torch",
            "tests/test_optim.py::test_newton_schulz_kernel_equals_library",
            "tests/test_serving.py::test_triton_paged_kernel_equals_contiguous_attention"]


# Byte counting re-runs kernels under the interpreter; a kernel compiled afterwards must still
# compile (Triton's interpreter patches triton.language.core; llmsys.foundations.fusion puts it back).
_TRITON_AFTER_BYTE_COUNT = """
import torch
import llmsys.kernels as K
import triton.language as tl
from llmsys.foundations import fusion
before = dict(vars(tl.core))
print("fused softmax bytes (loaded, stored):", fusion.fused_softmax_traffic(torch.randn(8, 33)))
changed = [n for n, v in vars(tl.core).items() if n in before and v is not before[n]]
assert not changed, f"byte counting left triton.language.core patched: {changed[:5]}"
if K.TRITON_MODE == "compiled":
    q = torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    x = torch.randn(50, 3000, device="cuda")
    print("compiled after byte counting: flash max|err|", (K.flash_attention(q, q, q, causal=True) - ref).abs().max().item(),
          "softmax max|err|", (K.softmax(x) - torch.softmax(x, -1)).abs().max().item())
print("triton.language is intact")
"""

# Sampling where the model lives: the generator from llmsys.core.device.generator, through the decoders.
_SAMPLING = """
import torch
from llmsys.core import device
from llmsys import specdec
from llmsys.core.model import ModelConfig, Transformer
dev = device.device()
m = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64)).to(dev).eval()
prompt = torch.zeros(1, 4, dtype=torch.long, device=dev)
tokens, _ = specdec.autoregressive_decode(m, prompt, 8, 1.0, generator=device.generator(0, m))
print("sampled on", dev, tokens.tolist())
tokens, _ = specdec.speculative_decode(m, m, prompt, 8, 3, 1.0, generator=device.generator(0, m))
print("speculative sampling on", dev, tokens.tolist())
rows = specdec.measure_methods({"target only": lambda p, n, t, g: specdec.autoregressive_decode(m, p, n, t, generator=g)},
                               [prompt], 4, 1.0)
print("measure_methods at T=1:", rows[0]["method"], "ok")
"""


def _fsdp2(context: Context):
    size = ["--steps", "20"] if context.gpu else ["--model", "tiny", "--steps", "2"]
    return [context.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            "-m", "llmsys.zero", "--data", "random", *size]


def _expect_backend(context: Context, log: str) -> str | None:
    backend = "nccl" if context.gpu else "gloo"
    return None if f"on {backend}," in log else f"FSDP2 did not run on {backend} (see the log's first line)"


def _notebook_cells(context: Context):
    if not context.facts["notebooks"]:
        return "nbclient, nbformat or ipykernel is not installed (pip install nbclient nbformat ipykernel)"
    return [context.python, "-m", "llmsys.course.doctor", "--notebook-gpu-cells", str(context.out)]


def _graded_lab(context: Context):
    if not (context.facts["notebooks"] and context.facts["pytest"]):
        return "grading needs nbclient, ipykernel, pytest and nbval (pip install nbclient ipykernel pytest nbval)"
    return [context.python, "-m", "llmsys", "grade", str(REPO / "solutions" / "lab00_warmup.ipynb"),
            "--json", str(context.out / "graded-lab.json")]


def _full_score(context: Context, log: str) -> str | None:
    report = json.loads((context.out / "graded-lab.json").read_text())["submissions"][0]
    gpu_skipped = [c["id"] for c in report["checks"] if c["gpu"] and c["status"] != "passed"]
    if report["score"] != report["max_score"]:
        return f"the solution scored {report['score']} / {report['max_score']}"
    if context.gpu and gpu_skipped:
        return f"GPU checks did not pass on this GPU: {gpu_skipped}"
    return None


STEPS = [
    Step("info", "versions, devices, and how each chapter's GPU cells run here",
         lambda c: [c.python, "-m", "llmsys", "info"], 120),
    Step("kernel-tests", "the Triton kernel tests (compiled on a GPU, interpreted on a CPU)", _kernel_tests, 420),
    Step("triton-after-byte-count", "byte counting leaves triton.language intact; new kernels still compile",
         _script(_TRITON_AFTER_BYTE_COUNT), 180),
    Step("sampling", "seeded sampling on the model's device through the decoders", _script(_SAMPLING), 120),
    Step("kernel-bench", "HBM bandwidth share of the row kernels, FlashAttention vs SDPA TFLOP/s",
         _needs_gpu("the interpreter's times measure neither bandwidth nor TFLOP/s",
                    lambda c: [c.python, str(REPO / "benchmarks" / "kernels.py"), "--json", str(c.out / "kernels.json")]),
         300),
    Step("fsdp2-torchrun", "FSDP2 under torchrun, one process (NCCL and bf16 on a GPU, gloo on a CPU)", _fsdp2, 240,
         _expect_backend),
    Step("notebook-gpu-cells", "chapters 0 and 4 up to their last GPU cell, in a fresh kernel",
         _needs_gpu("on a CPU the GPU cells only print what they would measure", _notebook_cells), 480),
    Step("graded-lab", "grade lab00_warmup's solution: full marks, GPU check included on a GPU", _graded_lab, 300,
         _full_score),
]


# -----------------------------------------------------------------------------
# running


@dataclass
class Outcome:
    step: str
    status: str  # "ok", "FAILED" or "skipped"
    seconds: float
    detail: str = ""

    def line(self) -> str:
        detail = f"  {self.detail}" if self.detail else ""
        return f"{self.step:<26} {self.status:<8} {self.seconds:6.1f} s{detail}"


def run_step(step: Step, context: Context, require_gpu: bool = False) -> Outcome:
    """Run one step in its own process group; never raises for what the step does."""
    command = step.command(context)
    if isinstance(command, str):
        gpu_missing = command.startswith("no CUDA device")
        return Outcome(step.name, "FAILED" if require_gpu and gpu_missing else "skipped", 0.0, command)
    log_path = context.out / f"{step.name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    if context.gpu:  # compile every kernel here, into a cache of this run's own
        env.pop("TRITON_INTERPRET", None)
        env["TRITON_CACHE_DIR"] = str(context.out / "triton-cache" / step.name)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"# {step.what}\n$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its own group: a timeout stops its children too
        try:
            code = process.wait(timeout=step.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    if code is None:
        return Outcome(step.name, "FAILED", seconds, f"timed out after {step.timeout} s (log: {log_path})")
    if code != 0:
        last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
        return Outcome(step.name, "FAILED", seconds, f"exit code {code}: {last[:160]} (log: {log_path})")
    try:
        problem = step.expect(context, text)
    except Exception as error:  # a missing or malformed result file is the step's failure, not the doctor's
        problem = f"{type(error).__name__}: {error}"
    if problem:
        return Outcome(step.name, "FAILED", seconds, f"{problem} (log: {log_path})")
    return Outcome(step.name, "ok", seconds)


def run(out: Path, require_gpu: bool = False, only: list[str] | None = None, steps: list[Step] | None = None,
        say=print) -> list[Outcome]:
    """Print what was found, run the steps (all, or those named in ``only``), write ``summary.txt``."""
    steps = STEPS if steps is None else steps
    names = [s.name for s in steps]
    unknown = [name for name in only or [] if name not in names]
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; steps are {names}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    context = Context(found(), out)
    lines = describe(context.facts)
    if require_gpu and not context.gpu:
        lines.append("--gpu: no CUDA device found, so every GPU step counts as FAILED")
    for line in lines:
        say(line)
    say("")
    outcomes = []
    for step in steps:
        if only and step.name not in only:
            continue
        outcome = run_step(step, context, require_gpu)
        say(outcome.line())
        outcomes.append(outcome)
    counts = {status: sum(o.status == status for o in outcomes) for status in ("ok", "FAILED", "skipped")}
    tail = f"{counts['ok']} ok, {counts['FAILED']} FAILED, {counts['skipped']} skipped; logs in {out}"
    say(tail)
    (out / "summary.txt").write_text("\n".join(lines + [""] + [o.line() for o in outcomes] + [tail]) + "\n")
    return outcomes


# -----------------------------------------------------------------------------
# the notebook step's own process


def _last_gpu_cell(cells) -> int:
    """Index of the last code cell that branches on having a GPU."""
    marks = ("device.has_cuda()", "torch.cuda.is_available()")
    hits = [i for i, c in enumerate(cells) if c.cell_type == "code" and any(m in c.source for m in marks)]
    if not hits:
        raise ValueError("no GPU cell (one that tests device.has_cuda()) in this notebook")
    return hits[-1]


def run_notebook_gpu_cells(out: Path, chapters=(0, 4)) -> int:
    """Run each chapter's notebook from its first cell through its last GPU cell; 0 when all ran."""
    import nbformat

    from llmsys.course.runner import NOTEBOOKS, run_notebook

    failed = 0
    for number in chapters:
        chapter = next(c for c in CHAPTERS if c.number == number)
        nb = nbformat.read(NOTEBOOKS / chapter.notebook, as_version=4)
        nb.cells = nb.cells[: _last_gpu_cell(nb.cells) + 1]
        part = out / "notebooks" / chapter.notebook
        part.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, part)
        result = run_notebook(part, out / "notebooks" / "executed", cell_timeout=300)
        print(f"ch{number} {chapter.notebook} through cell {len(nb.cells)}: {result.seconds:.0f} s, "
              f"{'ok' if result.error is None else 'FAILED'}", flush=True)
        if result.error:
            print(result.error, flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":  # python -m llmsys.course.doctor --notebook-gpu-cells OUT (the notebook step)
    if sys.argv[1:2] != ["--notebook-gpu-cells"] or len(sys.argv) != 3:
        sys.exit("usage: python -m llmsys.course.doctor --notebook-gpu-cells OUT (run by `python -m llmsys doctor`)")
    sys.exit(run_notebook_gpu_cells(Path(sys.argv[2])))
