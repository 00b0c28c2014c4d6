"""The course's embedded models: built here from text that ships with Python.

Nothing is downloaded. The corpus is ``pydoc_data.topics`` (about 465 KB of
English help text); the zoo trains a byte-level BPE tokenizer on it, then a few
small Llama-architecture models (``SPECS``): a *target* of a few million
parameters, a much smaller *draft* for speculative decoding, and a *tiny* one
for tests.

Each model and the tokenizer is an entry of the course's store (``llmsys.core.cache``):
trained once, hash-checked, rebuilt when its spec changes. ``load`` is the one way to get
a model: a zoo model, the real chat model (``"smollm2"``, ``llmsys.core.pretrained``), or
a local/hub checkpoint in transformers' format, in the dtype asked for.

    from llmsys.core import zoo
    model = zoo.load("target")          # builds on first use (a few minutes on a CPU)
    tok = zoo.tokenizer()
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmsys.core import device as _device
from llmsys.core import cache, pretrained
from llmsys.core.cache import InvalidEntry, atomic_write_bytes, tensor_bytes
from llmsys.core.model import ModelConfig, Transformer
from llmsys.core.tokenizer import SPLIT_PATTERN, BPETokenizer

VOCAB_SIZE = 1024
VAL_EVERY = 10  # every 10th block of the tokenized corpus is held out: a 90/10 split
SPLIT_BLOCK = 1024  # tokens per block; interleaving blocks keeps the val split representative
TOKENIZER = "tokenizer"



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
# The real pretrained model (llmsys.core.pretrained) is fetched, not trained; it is cached like the rest.
PRETRAINED = pretrained.NAME


# ---------------------------------------------------------------- corpus, tokenizer, data


@functools.cache
def corpus() -> str:
    """The English help text that ships with Python, topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def tokenizer(name: str = TOKENIZER):
    """The zoo's byte-level BPE tokenizer (1024 tokens), trained once and cached; with
    ``name="smollm2"`` (or a checkpoint, as ``load`` takes), that model's tokenizer
    (transformers', with its chat template)."""
    if name == PRETRAINED:
        return pretrained.entry()[0][1]
    if name != TOKENIZER and pretrained.is_checkpoint(name):
        return pretrained.from_checkpoint(name)[1]
    if name != TOKENIZER:
        raise ValueError(f"no tokenizer named {name!r}; choose {TOKENIZER!r}, {PRETRAINED!r}, "
                         f"a local checkpoint directory or a hub id (org/name)")
    return tokenizer_entry()[0]


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """(train_ids, val_ids): the tokenized corpus as LongTensors, split 90/10.

    The corpus is cut into blocks of ``SPLIT_BLOCK`` tokens and every
    ``VAL_EVERY``-th block is held out, so both splits cover every topic.
    """
    return split(tokenizer_entry()[1])


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


def tokenizer_hash() -> str:
    text_sha = hashlib.sha256(corpus().encode()).hexdigest()
    return cache.spec_hash({"format": cache.FORMAT_VERSION, "vocab_size": VOCAB_SIZE, "pattern": SPLIT_PATTERN,
                            "corpus": text_sha})


def tokenizer_entry(force: bool = False, progress: bool = True):
    """(tokenizer, all corpus ids, manifest), building the entry if needed."""
    return cache.entry(TOKENIZER, tokenizer_hash(), _build_tokenizer, _parse_tokenizer, force=force, progress=progress)


def _build_tokenizer(folder: Path, progress: bool) -> dict:
    start = time.perf_counter()
    text = corpus()
    tok = BPETokenizer.train(text, VOCAB_SIZE, progress=progress)
    ids = torch.tensor(tok.encode(text), dtype=torch.int16)  # 1024 ids fit in int16
    tok.save(folder / "tokenizer.json")
    atomic_write_bytes(folder / "tokens.pt", tensor_bytes(ids))
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
        raise InvalidEntry("tokenizer or tokens do not match the manifest")
    return tok, ids, manifest


# ---------------------------------------------------------------- models


def load(name: str = "target", device=None, dtype=None, max_seq_len: int | None = None) -> Transformer:
    """The model ``name`` in eval mode on ``device`` (default: the course device), in ``dtype``
    (a torch.dtype or a name such as "bf16"; default fp32).

    ``name`` is a zoo model (trained and cached on first use; later calls load the verified
    cache), ``"smollm2"`` (the real pretrained chat model, ``llmsys.core.pretrained``), or a
    local directory / hub id of a Llama-architecture checkpoint in transformers' format.
    ``max_seq_len`` gives a copy with another context limit: RoPE runs at any position, but
    past the length the model was trained on (its spec's seq_len) its text degrades. Serving
    measurements (throughput, memory, equality with decoding alone) do not depend on that."""
    if name == PRETRAINED:
        model = pretrained.entry()[0][0]
    elif name in SPECS:
        model = model_entry(name)[0]
    elif pretrained.is_checkpoint(name):
        model = pretrained.from_checkpoint(name)[0]
    else:
        raise ValueError(f"no model named {name!r}: choose one of {sorted([*SPECS, PRETRAINED])}, "
                         f"a local checkpoint directory or a hub id (org/name)")
    if max_seq_len is not None and max_seq_len != model.cfg.max_seq_len:
        resized = Transformer(dataclasses.replace(model.cfg, max_seq_len=max_seq_len))
        resized.load_state_dict(model.state_dict())
        model = resized
    dev = device if device is not None else _device.device()
    return model.to(device=dev, dtype=_device.torch_dtype(dtype or torch.float32)).eval()


def _spec(name: str) -> ZooSpec:
    if name not in SPECS:
        raise ValueError(f"no zoo model named {name!r}; choose one of {sorted(SPECS)}")
    return SPECS[name]


def _spec_hash(spec: ZooSpec, tokenizer_sha: str) -> str:
    return cache.spec_hash({"format": cache.FORMAT_VERSION, "spec": spec.to_dict(), "tokenizer": tokenizer_sha})


def model_hash(name: str) -> str | None:
    """The hash a valid entry of zoo model ``name`` carries; None while the tokenizer is not built."""
    manifest = cache.read_manifest(TOKENIZER, tokenizer_hash())
    return None if manifest is None else _spec_hash(_spec(name), manifest["files"]["tokenizer.json"])


def model_entry(name: str, force: bool = False, progress: bool = True):
    """(model, manifest) of zoo model ``name``, trained first when missing or stale."""
    spec = _spec(name)
    tok, ids, tok_manifest = tokenizer_entry(progress=progress)
    spec_hash = _spec_hash(spec, tok_manifest["files"]["tokenizer.json"])
    return cache.entry(name, spec_hash, functools.partial(_build_model, name, spec, tok, split(ids)), _parse_model(spec),
                       force=force, progress=progress)


def _parse_model(spec: ZooSpec):
    def parse(folder: Path, manifest: dict, files: dict[str, bytes]):
        if manifest["config"] != spec.config.to_dict():
            raise InvalidEntry("config in the manifest differs from the spec")
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
    atomic_write_bytes(folder / "model.pt", tensor_bytes(state))
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


