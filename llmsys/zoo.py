"""The course's embedded models: built here from text that ships with Python.

Nothing is downloaded. The corpus is ``pydoc_data.topics`` (about 465 KB of
English help text); the zoo trains a byte-level BPE tokenizer on it, then a few
small Llama-architecture models (``SPECS``): a *target* of a few million
parameters, a much smaller *draft* for speculative decoding, and a *tiny* one
for tests.

Every entry lives in ``cache_dir()/zoo/<name>/`` with a ``manifest.json`` that
records the hash of the spec that built it and the sha256 of every file. An
entry is written to a temporary folder and renamed into place only when
complete; a corrupted, partial or stale (spec changed) entry is detected on
load, reported with a warning and rebuilt, never half-loaded. Building takes a
file lock, so two processes asking for the same entry train it once.

    from llmsys import zoo
    model = zoo.load("target")          # builds on first use (a few minutes on a CPU)
    tok = zoo.tokenizer()
    print(zoo.report())
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import io
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmsys import device as _device
from llmsys.cache import atomic_write_bytes, atomic_write_json, cache_dir, file_lock, sha256_file
from llmsys.model import ModelConfig, Transformer
from llmsys.tokenizer import SPLIT_PATTERN, BPETokenizer

VOCAB_SIZE = 1024
VAL_EVERY = 10  # every 10th block of the tokenized corpus is held out: a 90/10 split
SPLIT_BLOCK = 1024  # tokens per block; interleaving blocks keeps the val split representative
TOKENIZER = "tokenizer"
# Bump to invalidate every cached entry when the way entries are built changes.
FORMAT_VERSION = 1


class ZooCacheWarning(UserWarning):
    """A cached entry was corrupted, partial or stale and is being rebuilt."""


class _InvalidEntry(Exception):
    pass


@dataclass
class ZooSpec:
    """A model of the zoo: its architecture and how it is trained."""

    config: ModelConfig
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    seed: int = 0
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio
    grad_clip: float = 1.0
    description: str = ""

    def __post_init__(self):
        if self.config.vocab_size != VOCAB_SIZE:
            raise ValueError(f"zoo models share the zoo tokenizer: set vocab_size={VOCAB_SIZE}, not {self.config.vocab_size}")
        if not 1 <= self.seq_len <= self.config.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} must be in 1..max_seq_len={self.config.max_seq_len}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in 0..steps-1 (steps={self.steps})")
        if self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"batch_size and lr must be positive, got {self.batch_size} and {self.lr}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        return d


def _config(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB_SIZE, tie_embeddings=True, **kw)


SPECS: dict[str, ZooSpec] = {
    "target": ZooSpec(
        _config(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256),
        steps=240, batch_size=8, seq_len=256, lr=3e-3, warmup_steps=20,
        description="the model chapters study, fine-tune and serve",
    ),
    "draft": ZooSpec(
        _config(dim=96, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256),
        steps=400, batch_size=8, seq_len=256, lr=5e-3, warmup_steps=20,
        description="a small drafter for speculative decoding, same tokenizer",
    ),
    "tiny": ZooSpec(
        _config(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64),
        steps=30, batch_size=8, seq_len=64, lr=1e-2, warmup_steps=5,
        description="for tests: builds in a second or two",
    ),
}
# The real pretrained model (llmsys.pretrained) is fetched, not trained; it is cached like the rest.
PRETRAINED = "smollm2"
# Entries a chapter builds from the models above, by the module that knows how (imported only
# when asked for): each module has entry(force, progress) and entry_hash().
DERIVED = {"smollm2-eagle": "llmsys.specdec.chat", "smollm2-student": "llmsys.distill_chat"}
DEFAULT_BUILD = ("target", "draft", PRETRAINED, *DERIVED)


def names() -> list[str]:
    """Every entry ``build`` accepts."""
    return [*SPECS, PRETRAINED, *DERIVED]


# ---------------------------------------------------------------- corpus, tokenizer, data


@functools.cache
def corpus() -> str:
    """The English help text that ships with Python, topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def tokenizer(name: str = TOKENIZER):
    """The zoo's byte-level BPE tokenizer (1024 tokens), trained once and cached; with
    ``name="smollm2"``, the real model's tokenizer (transformers', with its chat template)."""
    if name == PRETRAINED:
        return _pretrained_entry()[0][1]
    if name != TOKENIZER:
        raise ValueError(f"no zoo tokenizer named {name!r}; choose {TOKENIZER!r} or {PRETRAINED!r}")
    return _tokenizer_entry()[0]


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """(train_ids, val_ids): the tokenized corpus as LongTensors, split 90/10.

    The corpus is cut into blocks of ``SPLIT_BLOCK`` tokens and every
    ``VAL_EVERY``-th block is held out, so both splits cover every topic.
    """
    return split(_tokenizer_entry()[1])


def split(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = ids.split(SPLIT_BLOCK)
    val = [b for i, b in enumerate(blocks) if i % VAL_EVERY == VAL_EVERY - 1]
    train = [b for i, b in enumerate(blocks) if i % VAL_EVERY != VAL_EVERY - 1]
    return torch.cat(train), torch.cat(val)


def batch(ids: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None = None):
    """Random windows of ``ids``: inputs x (B, T) and next-token targets y (B, T)."""
    if len(ids) <= seq_len:
        raise ValueError(f"need more than seq_len={seq_len} tokens to cut a window, got {len(ids)}")
    starts = torch.randint(len(ids) - seq_len, (batch_size,), generator=generator)
    x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
    y = torch.stack([ids[s + 1 : s + 1 + seq_len] for s in starts.tolist()])
    return x, y


def _tokenizer_hash() -> str:
    text_sha = hashlib.sha256(corpus().encode()).hexdigest()
    return _hash({"format": FORMAT_VERSION, "vocab_size": VOCAB_SIZE, "pattern": SPLIT_PATTERN, "corpus": text_sha})


def _tokenizer_entry():
    """(tokenizer, all corpus ids, manifest), building the entry if needed."""
    return _ensure(TOKENIZER, _tokenizer_hash(), _build_tokenizer, _parse_tokenizer)


def _build_tokenizer(folder: Path, progress: bool) -> dict:
    start = time.perf_counter()
    text = corpus()
    tok = BPETokenizer.train(text, VOCAB_SIZE, progress=progress)
    ids = torch.tensor(tok.encode(text), dtype=torch.int16)  # 1024 ids fit in int16
    tok.save(folder / "tokenizer.json")
    atomic_write_bytes(folder / "tokens.pt", _tensor_bytes(ids))
    metrics = {
        "vocab_size": tok.vocab_size,
        "corpus_bytes": len(text.encode()),
        "corpus_tokens": len(ids),
        "bytes_per_token": len(text.encode()) / len(ids),
        "build_seconds": time.perf_counter() - start,
    }
    return {"metrics": metrics}


def _parse_tokenizer(folder: Path, manifest: dict, files: dict[str, bytes]):
    tok = BPETokenizer.from_dict(json.loads(files["tokenizer.json"]))
    ids = torch.load(io.BytesIO(files["tokens.pt"]), weights_only=True).long()
    if tok.vocab_size != VOCAB_SIZE or len(ids) != manifest["metrics"]["corpus_tokens"]:
        raise _InvalidEntry("tokenizer or tokens do not match the manifest")
    return tok, ids, manifest


# ---------------------------------------------------------------- models


def load(name: str = "target", device=None, max_seq_len: int | None = None) -> Transformer:
    """The zoo model ``name`` in eval mode on ``device`` (default: the course device).

    Trained and cached on first use; later calls load the verified cache. ``max_seq_len``
    gives a copy with another context limit: RoPE runs at any position, but past the length
    the model was trained on (its spec's seq_len) its text degrades. Serving measurements
    (throughput, memory, equality with decoding alone) do not depend on that.
    ``name="smollm2"`` is the real pretrained chat model (``llmsys.pretrained``), in fp32."""
    model = _pretrained_entry()[0][0] if name == PRETRAINED else _model_entry(name)[0]
    if max_seq_len is not None and max_seq_len != model.cfg.max_seq_len:
        resized = Transformer(dataclasses.replace(model.cfg, max_seq_len=max_seq_len))
        resized.load_state_dict(model.state_dict())
        model = resized
    return model.to(device if device is not None else _device.device()).eval()


def build(names=None, force: bool = False, progress: bool = True) -> list[dict]:
    """Build (train) the named entries, by default the tokenizer, target and draft.

    Entries already cached and valid are kept unless ``force``. Returns ``status()`` rows."""
    names = list(DEFAULT_BUILD if names is None else [names] if isinstance(names, str) else names)
    for name in names:
        if name != PRETRAINED and name not in DERIVED:
            _spec(name)
    _ensure(TOKENIZER, _tokenizer_hash(), _build_tokenizer, _parse_tokenizer, progress=progress)
    for name in names:
        if name == PRETRAINED:
            _pretrained_entry(force=force, progress=progress)
        elif name in DERIVED:
            importlib.import_module(DERIVED[name]).entry(force=force, progress=progress)
        else:
            _model_entry(name, force=force, progress=progress)
    return [row for row in status() if row["name"] in names]


def status() -> list[dict]:
    """One row per spec: name, cached (a valid entry exists), params and, when cached,
    held-out loss, bits per byte and build seconds. Builds nothing."""
    tok_sha = _valid_tokenizer_sha()
    rows = []
    for name, spec in SPECS.items():
        manifest = None
        if tok_sha is not None:
            with contextlib.suppress(FileNotFoundError, _InvalidEntry):
                manifest = _read_entry(name, _spec_hash(spec, tok_sha), _parse_model(spec))[1]
        metrics = manifest["metrics"] if manifest else {}
        rows.append({
            "name": name,
            "cached": manifest is not None,
            "params": spec.config.n_params(),
            "val_loss": metrics.get("val_loss"),
            "bits_per_byte": metrics.get("bits_per_byte"),
            "build_seconds": metrics.get("build_seconds"),
        })
    manifest = None
    with contextlib.suppress(FileNotFoundError, _InvalidEntry):
        manifest = _read_entry(PRETRAINED, _pretrained_hash(), lambda folder, m, files: (None, m))[1]
    metrics = manifest["metrics"] if manifest else {}
    rows.append({"name": PRETRAINED, "cached": manifest is not None, "params": metrics.get("params"),
                 "val_loss": None, "bits_per_byte": None, "build_seconds": metrics.get("build_seconds")})
    for name, module in DERIVED.items():
        manifest = None
        with contextlib.suppress(FileNotFoundError, _InvalidEntry):
            expected = importlib.import_module(module).entry_hash()
            manifest = _read_entry(name, expected, lambda folder, m, files: (None, m))[1]
        metrics = manifest["metrics"] if manifest else {}
        rows.append({"name": name, "cached": manifest is not None, "params": metrics.get("params"),
                     "val_loss": None, "bits_per_byte": None, "build_seconds": metrics.get("build_seconds")})
    return rows


def report() -> str:
    """A plain-text table of the zoo: the tokenizer and every model."""
    lines = [f"llmsys zoo in {cache_dir() / 'zoo'}"]
    if _valid_tokenizer_sha() is None:
        lines.append("tokenizer: not built")
    else:
        m = _tokenizer_entry()[2]["metrics"]
        lines.append(
            f"tokenizer: byte-level BPE, {m['vocab_size']} tokens, {m['bytes_per_token']:.2f} bytes/token "
            f"on {m['corpus_bytes']:,} bytes of pydoc_data.topics ({m['corpus_tokens']:,} tokens), "
            f"built in {m['build_seconds']:.1f} s"
        )
    lines.append(f"{'name':<13} {'cached':<7} {'params':>10} {'val loss':>9} {'bits/byte':>10} {'build s':>8}")

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    for row in status():
        lines.append(
            f"{row['name']:<13} {'yes' if row['cached'] else 'no':<7} {fmt(row['params'], ','):>10} "
            f"{fmt(row['val_loss'], '.3f'):>9} {fmt(row['bits_per_byte'], '.3f'):>10} {fmt(row['build_seconds'], '.1f'):>8}"
        )
    return "\n".join(lines)


def _spec(name: str) -> ZooSpec:
    if name not in SPECS:
        raise ValueError(f"no zoo model named {name!r}; choose one of {sorted(SPECS)}")
    return SPECS[name]


def _spec_hash(spec: ZooSpec, tokenizer_sha: str) -> str:
    return _hash({"format": FORMAT_VERSION, "spec": spec.to_dict(), "tokenizer": tokenizer_sha})


def _valid_tokenizer_sha() -> str | None:
    try:
        manifest = _read_entry(TOKENIZER, _tokenizer_hash(), _parse_tokenizer)[2]
    except (FileNotFoundError, _InvalidEntry):
        return None
    return manifest["files"]["tokenizer.json"]


def _model_entry(name: str, force: bool = False, progress: bool = True):
    spec = _spec(name)
    tok, ids, tok_manifest = _tokenizer_entry()
    spec_hash = _spec_hash(spec, tok_manifest["files"]["tokenizer.json"])
    return _ensure(name, spec_hash, functools.partial(_build_model, name, spec, tok, split(ids)), _parse_model(spec),
                   force=force, progress=progress)


def _pretrained_hash() -> str:
    from llmsys import pretrained

    return _hash({"format": FORMAT_VERSION, "gguf": pretrained.GGUF_SHA256})


def _pretrained_entry(force: bool = False, progress: bool = True):
    """((model, tokenizer), manifest) of the real pretrained model, fetched once."""
    from llmsys import pretrained

    return _ensure(PRETRAINED, _pretrained_hash(), pretrained.build_entry, pretrained.parse_entry,
                   force=force, progress=progress)


def _parse_model(spec: ZooSpec):
    def parse(folder: Path, manifest: dict, files: dict[str, bytes]):
        if manifest["config"] != spec.config.to_dict():
            raise _InvalidEntry("config in the manifest differs from the spec")
        state = torch.load(io.BytesIO(files["model.pt"]), weights_only=True)
        with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep it off the caller's RNG
            model = Transformer(spec.config)
        model.load_state_dict(state)
        return model, manifest

    return parse


def _build_model(name: str, spec: ZooSpec, tok: BPETokenizer, data, folder: Path, progress: bool) -> dict:
    start = time.perf_counter()
    model, train_loss = train(spec, data[0], progress=progress, desc=f"zoo {name}")
    metrics = evaluate(model, data[1], spec.seq_len, tok)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    atomic_write_bytes(folder / "model.pt", _tensor_bytes(state))
    metrics.update(train_loss=train_loss, params=spec.config.n_params(), tokens_seen=spec.steps * spec.batch_size * spec.seq_len,
                   build_seconds=time.perf_counter() - start, device=str(next(model.parameters()).device))
    return {"config": spec.config.to_dict(), "spec": spec.to_dict(), "metrics": metrics}


# ---------------------------------------------------------------- training and evaluation


def lr_at(step: int, spec: ZooSpec) -> float:
    """The learning rate of 0-indexed ``step``: a linear warm-up that reaches ``spec.lr`` at step
    ``warmup_steps`` (lr·(step + 1)/(warmup_steps + 1) before it, so step 0 already learns), then
    a cosine decay to ``spec.lr * min_lr_ratio`` at the last step, held there after it."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / (spec.warmup_steps + 1)
    progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.steps - 1 - spec.warmup_steps))
    min_lr = spec.lr * spec.min_lr_ratio
    return min_lr + 0.5 * (spec.lr - min_lr) * (1 + math.cos(math.pi * progress))


def train(spec: ZooSpec, train_ids: torch.Tensor, progress: bool = True, desc: str = "train", device=None):
    """Train a fresh model from ``spec`` on ``train_ids``; returns (model, final smoothed loss).

    Deterministic for ``spec.seed`` on a given machine: the seed fixes the
    initial weights and a private generator draws the batches."""
    from tqdm.auto import tqdm

    dev = torch.device(device) if device is not None else _device.device()
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
        torch.manual_seed(spec.seed)
        model = Transformer(spec.config)
    model.to(dev).train()
    generator = torch.Generator().manual_seed(spec.seed)
    # Weight decay on matrices only: decaying norm gains toward 0 fights the normalisation.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    smoothed = None
    bar = tqdm(range(spec.steps), desc=desc, disable=not progress, leave=False)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        x, y = batch(train_ids, spec.batch_size, spec.seq_len, generator)
        x, y = x.to(dev), y.to(dev)
        logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        bar.set_postfix(loss=f"{smoothed:.3f}", refresh=False)
    return model.eval(), smoothed


@torch.no_grad()
def evaluate(model: Transformer, val_ids: torch.Tensor, seq_len: int, tok: BPETokenizer, batch_size: int = 16) -> dict:
    """Held-out loss over every full window of ``val_ids``, and bits per byte.

    bits/byte = (total nats over predicted tokens) / ln 2 / (UTF-8 bytes of
    those tokens): unlike loss per token it compares models with different
    tokenizers, and a uniform guess over bytes scores 8."""
    n_windows = (len(val_ids) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"val split of {len(val_ids)} tokens is shorter than one window of {seq_len + 1}")
    dev = next(model.parameters()).device
    x = val_ids[: n_windows * seq_len].view(n_windows, seq_len)
    y = val_ids[1 : n_windows * seq_len + 1].view(n_windows, seq_len)
    total_nats = 0.0
    for i in range(0, n_windows, batch_size):
        logits = model(x[i : i + batch_size].to(dev))
        targets = y[i : i + batch_size].to(dev)
        total_nats += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
    n_tokens = y.numel()
    n_bytes = len(tok.decode_bytes(y.flatten()))
    return {
        "val_loss": total_nats / n_tokens,
        "val_tokens": n_tokens,
        "val_bytes": n_bytes,
        "bits_per_byte": total_nats / math.log(2) / n_bytes,
    }


# ---------------------------------------------------------------- the cache


def cached(name: str, spec_hash: str, build_fn, parse_fn, force: bool = False, progress: bool = True):
    """Train once and cache: the entry ``name`` parsed by ``parse_fn``, built first when it is
    missing, stale (its manifest holds another ``spec_hash``) or damaged.

    ``build_fn(folder, progress) -> dict`` writes the entry's files into ``folder`` (a temporary
    folder renamed into place only when complete) and returns extra manifest fields;
    ``parse_fn(folder, manifest, files) -> value`` turns the verified files (name -> bytes)
    into what the caller wants. Building holds a file lock, so concurrent processes build an
    entry once; a damaged entry is reported with a ``ZooCacheWarning`` and rebuilt."""
    return _ensure(name, spec_hash, build_fn, parse_fn, force=force, progress=progress)


def entry_dir(name: str) -> Path:
    """The folder of the cache entry ``name`` (it may not exist yet)."""
    return _zoo_dir() / name


def spec_hash(spec) -> str:
    """A stable hash of a JSON-able description of how an entry is built."""
    return _hash(spec)


def _ensure(name: str, expected_hash: str, build_fn, parse_fn, force: bool = False, progress: bool = True):
    """The parsed entry ``name``: loaded if valid, else built under a lock and loaded."""
    if not force:
        with contextlib.suppress(FileNotFoundError, _InvalidEntry):
            return _read_entry(name, expected_hash, parse_fn)
    with _build_lock(name):
        problem = None
        if not force:  # someone may have built it while we waited for the lock
            try:
                return _read_entry(name, expected_hash, parse_fn)
            except FileNotFoundError:
                pass
            except _InvalidEntry as e:
                problem = str(e)
        if problem:
            warnings.warn(f"llmsys zoo: cached {name!r} {problem}; rebuilding it", ZooCacheWarning, stacklevel=3)
        _build_entry(name, expected_hash, build_fn, progress)
        return _read_entry(name, expected_hash, parse_fn)


def _read_entry(name: str, expected_hash: str, parse_fn):
    """Verify manifest, spec hash and every file's sha256, then parse.

    Raises FileNotFoundError if there is no entry, _InvalidEntry if there is a broken one."""
    folder = _zoo_dir() / name
    if not folder.is_dir():
        raise FileNotFoundError(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest.get("format") != FORMAT_VERSION:
            raise _InvalidEntry("was written by another version of llmsys")
        if manifest.get("spec_hash") != expected_hash:
            raise _InvalidEntry("is stale (its spec or tokenizer changed)")
        files = {}
        for file_name, sha in manifest["files"].items():
            files[file_name] = (folder / file_name).read_bytes()
            if hashlib.sha256(files[file_name]).hexdigest() != sha:
                raise _InvalidEntry(f"is corrupted ({file_name} does not match its sha256)")
        return parse_fn(folder, manifest, files)
    except _InvalidEntry:
        raise
    except Exception as e:  # missing or unreadable manifest/files, bad JSON, bad tensors
        raise _InvalidEntry(f"is corrupted or partial ({type(e).__name__}: {e})") from e


def _build_entry(name: str, expected_hash: str, build_fn, progress: bool) -> None:
    """Build into a temporary folder and rename it into place only when complete."""
    zoo = _zoo_dir()
    for leftover in zoo.glob(f".{name}.*"):  # debris of an interrupted build (we hold the lock)
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=zoo, prefix=f".{name}.tmp-"))
    try:
        extra = build_fn(tmp, progress)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if not p.name.startswith(".")}
        manifest = {"name": name, "format": FORMAT_VERSION, "spec_hash": expected_hash, "files": files,
                    "torch_version": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
        atomic_write_json(tmp / "manifest.json", manifest)
        final = zoo / name
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=zoo, prefix=f".{name}.old-"))
            os.replace(final, old / name)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_lock(name: str):
    """Concurrent processes (pytest-xdist workers, chapters side by side) build an entry once."""
    return file_lock(_zoo_dir() / f".{name}.lock")


def _zoo_dir() -> Path:
    path = cache_dir() / "zoo"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _tensor_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
