"""The chat model's own answers, recorded once by the zoo: the data its drafting heads learn from.

SmolLM2-135M-Instruct answers chat prompts built from what ships with Python (every help topic
of ``pydoc_data.topics``, every public standard-library module name), greedily, in batches: a
decoding step reads every weight once whatever the batch, so 32 answers cost little more than
one. The target's final hidden states are recorded while it decodes (no second pass). Stored as
its own zoo entry, so that a head can be retrained without asking the target again.

    from llmsys.specdec import answers
    tokens, features, manifest = answers.entry()   # (N, L) ids, (N, L, dim) bf16 hidden states
"""

from __future__ import annotations

import io
import sys
import time

import torch
import torch.nn.functional as F

from llmsys.model import Transformer

NAME = "smollm2-answers"
TOPIC_TEMPLATES = (
    "Explain the Python topic '{}' briefly.",
    "Give a short example of '{}' in Python and explain it.",
)
MODULE_TEMPLATE = "What is the Python module '{}' used for? Show a short example."
ANSWER_TOKENS = 96  # tokens of each answer recorded (the benchmark decodes 128: the head generalises)
GENERATE_BATCH = 32  # prompts decoded together: one weight read serves them all
FORMAT = 1


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return sorted(topics)


def _modules() -> list[str]:
    return [name for name in sorted(sys.stdlib_module_names) if not name.startswith("_")]


def prompt_texts() -> list[str]:
    """Every training prompt, in a fixed order (held-out ones are every tenth)."""
    return ([t.format(topic) for t in TOPIC_TEMPLATES for topic in _topics()]
            + [MODULE_TEMPLATE.format(module) for module in _modules()])


def entry_hash() -> str:
    from llmsys import pretrained, zoo

    return zoo._hash({"format": zoo.FORMAT_VERSION, "answers": FORMAT, "gguf": pretrained.GGUF_SHA256,
                      "prompts": prompt_texts(), "answer_tokens": ANSWER_TOKENS})


def pad_id(tok) -> int:
    return tok("\n")["input_ids"][0]  # a blank line before the conversation


@torch.no_grad()
def self_distilled(target: Transformer, prompts: list[torch.Tensor], new_tokens: int, pad_id: int,
                   batch_size: int = GENERATE_BATCH, progress: bool = True):
    """The target's greedy answers to ``prompts`` (each (1, T_i)) and its final hidden states on
    them, recorded while it decodes (a hook on its final norm: no second pass). Prompts are
    left-padded with ``pad_id`` to the longest one, so that a batch decodes together (one weight
    read serves every row; the padding is part of the context the target answers). Returns
    tokens (N, L) and features (N, L, dim), L = longest prompt + new_tokens - 1: the last
    token has no feature yet."""
    from tqdm.auto import tqdm

    dev = target.tok_embeddings.weight.device
    longest = max(p.size(1) for p in prompts)
    padded = torch.cat([F.pad(p, (longest - p.size(1), 0), value=pad_id) for p in prompts]).to(dev)
    recorded: list[torch.Tensor] = []
    hook = target.norm.register_forward_hook(lambda module, args, out: recorded.append(out.float()))
    tokens, features = [], []
    try:
        for batch in tqdm(padded.split(batch_size), desc=f"{NAME}: target answers", disable=not progress, leave=False):
            recorded.clear()
            tokens.append(target.generate(batch, new_tokens)[:, :-1])  # (B, L)
            features.append(torch.cat(recorded, dim=1))  # (B, L, dim)
    finally:
        hook.remove()
    return torch.cat(tokens), torch.cat(features)


def _build(folder, progress: bool) -> dict:
    from llmsys import pretrained, zoo

    start, cpu = time.perf_counter(), time.process_time()
    target, tok = zoo.load(zoo.PRETRAINED), zoo.tokenizer(zoo.PRETRAINED)
    prompts = [pretrained.chat_ids(tok, text) for text in prompt_texts()]
    tokens, features = self_distilled(target, prompts, ANSWER_TOKENS, pad_id(tok), progress=progress)
    torch.save(tokens.cpu(), folder / "tokens.pt")
    torch.save(features.to(torch.bfloat16).cpu(), folder / "features.pt")  # half the bytes; heads add noise anyway
    return {"metrics": {"sequences": len(tokens), "length": tokens.size(1), "threads": torch.get_num_threads(),
                        "build_seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}}


def _parse(folder, manifest: dict, files: dict[str, bytes]):
    load = lambda name: torch.load(io.BytesIO(files[name]), map_location="cpu", weights_only=True)  # noqa: E731
    return load("tokens.pt"), load("features.pt"), manifest


def entry(force: bool = False, progress: bool = True):
    """(tokens (N, L), features (N, L, dim) in bf16, manifest) from the zoo, built on first use."""
    from llmsys import zoo

    return zoo._ensure(NAME, entry_hash(), _build, _parse, force=force, progress=progress)
