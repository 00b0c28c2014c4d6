"""The course map and the headless course runner (``python -m llmsys course``).

The runner executes chapter notebooks with nbclient one cell at a time, so a
failure names its chapter and cell; it writes executed copies and HTML to an
output folder and ends with the running ledger and each chapter's wall time.
"""

from __future__ import annotations

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


CHAPTERS = [
    Chapter(0, "00_foundations.ipynb", "Foundations", "compiled Triton kernels, HBM bandwidth, FlashAttention TFLOP/s",
            "lab00_warmup, lab00b_kernels"),
    Chapter(1, "01_zero_fsdp.ipynb", "ZeRO and FSDP", "FSDP2 with NCCL and bf16 via torchrun", "lab01_zero"),
    Chapter(2, "02_parallelism.ipynb", "5D parallelism", "tensor parallelism with NCCL via torchrun", "lab02_parallel"),
    Chapter(3, "03_lora.ipynb", "LoRA and its variants", "QLoRA in bf16 with bitsandbytes on CUDA", "lab03_lora"),
    Chapter(4, "04_speculative_decoding.ipynb", "Speculative decoding", "decoding in bf16 on the GPU", "lab04_specdec"),
    Chapter(5, "05_distillation.ipynb", "On-policy distillation", "teacher and student in bf16", "lab05_distill"),
    Chapter(6, "06_grpo.ipynb", "GRPO", "a larger GRPO loop in bf16", "lab06_grpo"),
    Chapter(7, "07_adamw.ipynb", "AdamW", "none needed", "lab07_adamw"),
    Chapter(8, "08_muon.ipynb", "Muon and MuonClip", "a Triton Newton–Schulz kernel", "lab08_muon"),
    Chapter(9, "09_serving.ipynb", "LLM serving", "the engine with a Triton paged-attention kernel", "lab09_serving"),
    Chapter(10, "10_quantization.ipynb", "Quantization and compression",
            "bitsandbytes int8/NF4 matmuls and fp8 on the GPU", "lab10_quant"),
    Chapter(11, "11_eval_data.ipynb", "Evaluation and data", "more items and samples in bf16", "lab11_eval"),
]


@dataclass
class RunResult:
    notebook: Path
    seconds: float
    error: str | None = None


def select(chapters: list[int] | None) -> list[Path]:
    """Notebook paths for the chosen chapter numbers (all when None)."""
    known = {c.number: NOTEBOOKS / c.notebook for c in CHAPTERS}
    if chapters is None:
        return list(known.values())
    unknown = [c for c in chapters if c not in known]
    if unknown:
        raise ValueError(f"no chapter {unknown}; chapters are {sorted(known)}")
    return [known[c] for c in chapters]


def run_notebook(path: Path, out_dir: Path | None = None, cell_timeout: int = 600) -> RunResult:
    """Execute one notebook top to bottom in a fresh kernel (cwd = its folder).

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
    with client.setup_kernel():
        for number, (index, cell) in enumerate(tqdm(code_cells, desc=path.stem, unit="cell", leave=False), 1):
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


def run_course(chapters: list[int] | None = None, out_dir: Path | str = "course_out",
               build_zoo: bool = True, stop_on_error: bool = False) -> list[RunResult]:
    """Build the zoo if needed, run the chosen chapters, print the ledger and wall times."""
    from llmsys import ledger

    paths = select(chapters)
    if build_zoo:
        from llmsys import zoo

        zoo.build()
    results = []
    for path in paths:
        result = run_notebook(path, out_dir)
        results.append(result)
        status = "ok" if result.error is None else "FAILED"
        print(f"{path.name:<32} {result.seconds:7.1f} s  {status}", flush=True)
        if result.error and stop_on_error:
            break
    print()
    ledger.show()
    print()
    print(format_times(results))
    failed = [r for r in results if r.error]
    for r in failed:
        print("\n" + r.error)
    return results


def format_times(results: list[RunResult]) -> str:
    lines = [f"{'chapter':<32} {'wall time':>10}  status"]
    for r in results:
        lines.append(f"{r.notebook.name:<32} {r.seconds:9.1f}s  {'ok' if r.error is None else 'failed'}")
    lines.append(f"{'total':<32} {sum(r.seconds for r in results):9.1f}s")
    return "\n".join(lines)
