"""The course map and the headless course runner (``python -m llmsys course``).

The runner first builds the zoo entries the chosen chapters need (and says which,
before a long build starts), then executes the chapter notebooks with nbclient one
cell at a time, so a failure names its chapter and cell. Chapters run side by side,
``jobs`` at a time with the cores split between them: most chapters compute on one
thread, so one chapter alone would leave a core idle. It writes executed copies and
HTML to an output folder and ends with the running ledger and each chapter's wall time.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


@dataclass(frozen=True)
class Chapter:
    """A lecture's notebook, what its GPU cells do, and its labs (README's chapter map has the techniques)."""

    number: int
    notebook: str
    title: str
    gpu_cells: str
    lab: str
    zoo: tuple[str, ...] = ()  # the zoo entries its cells load (the tokenizer comes with every build)


CHAPTERS = [
    Chapter(0, "00_foundations.ipynb", "Foundations", "compiled Triton kernels, HBM bandwidth, FlashAttention TFLOP/s",
            "lab00_warmup, lab00b_kernels, lab00c_estimates", ("target", "smollm2")),
    Chapter(1, "01_zero_fsdp.ipynb", "ZeRO and FSDP", "FSDP2 with NCCL and bf16 via torchrun", "lab01_zero", ("target",)),
    Chapter(2, "02_parallelism.ipynb", "5D parallelism", "tensor parallelism with NCCL via torchrun", "lab02_parallel"),
    Chapter(3, "03_lora.ipynb", "LoRA and its variants", "QLoRA in bf16 with bitsandbytes on CUDA", "lab03_lora", ("target",)),
    Chapter(4, "04_speculative_decoding.ipynb", "Speculative decoding", "decoding in bf16 on the GPU", "lab04_specdec",
            ("target", "draft", "smollm2", "smollm2-eagle")),
    Chapter(5, "05_distillation.ipynb", "On-policy distillation", "teacher and student in bf16", "lab05_distill",
            ("target", "draft", "smollm2", "smollm2-student", "addition-teacher")),
    Chapter(6, "06_grpo.ipynb", "GRPO", "a larger GRPO loop in bf16", "lab06_grpo"),
    Chapter(7, "07_adamw.ipynb", "AdamW", "none needed", "lab07_adamw"),
    Chapter(8, "08_muon.ipynb", "Muon and MuonClip", "a Triton Newton–Schulz kernel", "lab08_muon"),
    Chapter(9, "09_serving.ipynb", "LLM serving", "the engine with a Triton paged-attention kernel", "lab09_serving",
            ("target", "smollm2")),
    # a chapter too long for one notebook's time budget goes on in a second one with the same number
    Chapter(9, "09b_kv_distributed.ipynb", "LLM serving, part 2: the KV cache as a distributed store",
            "prefill to decode KV transfers over NCCL", "lab09_serving", ("target",)),
    Chapter(10, "10_quantization.ipynb", "Quantization and compression",
            "bitsandbytes int8/NF4 matmuls and fp8 on the GPU", "lab10_quant", ("target", "smollm2")),
    Chapter(11, "11_eval_data.ipynb", "Evaluation and data", "more items and samples in bf16", "lab11_eval", ("smollm2",)),
]


@dataclass
class RunResult:
    notebook: Path
    seconds: float
    error: str | None = None


def select(chapters: list[int] | None) -> list[Chapter]:
    """The chosen chapters (all when None), in the order given, each with all of its notebooks."""
    known = sorted({c.number for c in CHAPTERS})
    if chapters is None:
        return list(CHAPTERS)
    unknown = [c for c in chapters if c not in known]
    if unknown:
        raise ValueError(f"no chapter {unknown}; chapters are {known}")
    return [c for number in chapters for c in CHAPTERS if c.number == number]


def build_zoo_for(chapters: list[Chapter]) -> None:
    """Build the zoo entries these chapters need, saying first which are missing and for which
    chapters (a SmolLM2-derived entry takes minutes on a CPU), and after, what each took."""
    from llmsys.course import catalog

    needed = list(dict.fromkeys(name for chapter in chapters for name in chapter.zoo))
    missing = [row["name"] for row in catalog.status() if row["name"] in needed and not row["cached"]]
    if missing:
        users = {name: [str(c.number) for c in chapters if name in c.zoo] for name in missing}
        print("Building the zoo entries these chapters need, once (progress bars follow): "
              + "; ".join(f"{name} for chapter {', '.join(nums)}" for name, nums in users.items()), flush=True)
    catalog.build(needed or [], progress=True)
    if missing:
        print(catalog.report(), flush=True)


def run_notebook(path: Path, out_dir: Path | None = None, cell_timeout: int = 600, threads: int | None = None,
                 bar_position: int = 0) -> RunResult:
    """Execute one notebook top to bottom in a fresh kernel (cwd = its folder), its math
    libraries limited to ``threads`` (default: theirs).

    Writes ``<out_dir>/<name>.ipynb`` and ``.html`` even when a cell fails,
    so the failing output can be read.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from tqdm.auto import tqdm

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    error = None
    start = time.perf_counter()
    code_cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    env = dict(os.environ)
    if threads is not None:
        env.update({name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    with client.setup_kernel(env=env):
        cells = tqdm(code_cells, desc=path.stem, unit="cell", leave=False, position=bar_position)
        for number, (index, cell) in enumerate(cells, 1):
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as err:
                first_line = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
                error = (f"{path.name}: code cell {number} of {len(code_cells)} (`{first_line[:60]}`) failed:\n"
                         f"{_last_lines(str(err), 25)}")
                break
    seconds = time.perf_counter() - start
    if out_dir is not None:
        _write_outputs(nb, path.stem, Path(out_dir))
    return RunResult(path, seconds, error)


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _write_outputs(nb, stem: str, out_dir: Path) -> None:
    import nbformat
    from nbconvert import HTMLExporter

    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / f"{stem}.ipynb")
    body, _ = HTMLExporter().from_notebook_node(nb)
    (out_dir / f"{stem}.html").write_text(body, encoding="utf-8")


def default_jobs() -> int:
    """Chapters side by side: two where there are two cores or more."""
    return max(1, min(2, os.cpu_count() or 1))


def run_course(chapters: list[int] | None = None, out_dir: Path | str = "course_out",
               build_zoo: bool = True, stop_on_error: bool = False, jobs: int | None = None) -> list[RunResult]:
    """Build what the chosen chapters need, run them ``jobs`` at a time (each with its share
    of the cores), print the ledger and wall times. Results keep the chapters' order."""
    from llmsys.core import ledger

    chosen = select(chapters)
    if build_zoo:
        build_zoo_for(chosen)
    jobs = max(1, min(jobs or default_jobs(), len(chosen)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    paths = [NOTEBOOKS / c.notebook for c in chosen]
    results: dict[Path, RunResult] = {}
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        pending = {}
        for slot, path in enumerate(paths):
            pending[pool.submit(run_notebook, path, out_dir, threads=threads, bar_position=slot % jobs)] = path
        for future in concurrent.futures.as_completed(pending):
            if future.cancelled():
                continue
            result = future.result()
            results[result.notebook] = result
            print(f"{result.notebook.name:<32} {result.seconds:7.1f} s  {'ok' if result.error is None else 'FAILED'}",
                  flush=True)
            if result.error and stop_on_error:
                for other in pending:
                    other.cancel()
    wall = time.perf_counter() - start
    ordered = [results[p] for p in paths if p in results]
    print()
    ledger.show()
    print()
    print(format_times(ordered, wall, jobs))
    for r in ordered:
        if r.error:
            print("\n" + r.error)
    return ordered


def format_times(results: list[RunResult], wall: float | None = None, jobs: int = 1) -> str:
    lines = [f"{'chapter':<32} {'wall time':>10}  status"]
    for r in results:
        lines.append(f"{r.notebook.name:<32} {r.seconds:9.1f}s  {'ok' if r.error is None else 'failed'}")
    lines.append(f"{'sum of chapters':<32} {sum(r.seconds for r in results):9.1f}s")
    if wall is not None:
        lines.append(f"{f'total ({jobs} side by side)':<32} {wall:9.1f}s")
    return "\n".join(lines)
