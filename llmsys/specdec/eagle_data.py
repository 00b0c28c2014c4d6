"""Self-distilled training data for the EAGLE head, at scale: the target answers many prompts
through the course's continuous-batching engine (``llmsys.serving.Engine``), then one
teacher-forced forward pass over each prompt + answer gives the hidden states the head learns
from.

Why two passes: the engine keeps no hidden states, and recording them while decoding would
tie the data to the engine's step layout. A causal model's hidden state at a position depends
only on the tokens up to it, so a forward pass over the finished sequence computes exactly what
decoding computed (up to float rounding; ``tests/test_specdec_data.py`` checks it). The pass
runs whole sequences as matrix products: on one CPU thread it costs about half of what decoding
them did (every token, prompt included, goes through the model once more).

The prompts: every Python help topic (``pydoc_data.topics``) in several phrasings, and the
first turn of coding-agent sessions (``agentic.coding_session``) over standard-library
functions other than the ones the agentic workload measures on, so the head sees code too.

    prompts = training_prompts(tok)                              # a fixed order: a size is a prefix
    answers = engine_answers(target, prompts[:272], 96)          # token lists, prompt + answer
    tokens, features = teacher_forced(target, answers, keep=104) # (N, 104), (N, 104, dim)
"""

from __future__ import annotations

import importlib
import inspect
import math

import torch

from llmsys.core.model import Transformer
from llmsys.specdec import agentic

CHAT_PHRASINGS = (
    "Explain the Python topic '{}' briefly.",
    "Give a short example of '{}' in Python and explain it.",
    "What is '{}' in Python used for?",
    "Write a small Python program that uses '{}', then explain each line.",
    "What mistakes do beginners make with '{}' in Python?",
    "Compare '{}' with a related Python feature.",
)
# modules whose small pure-Python functions become coding prompts (the agentic workload's own are left out)
CODE_MODULES = ("textwrap", "shlex", "statistics", "fnmatch", "html", "string", "posixpath", "glob", "colorsys",
                "calendar", "difflib", "base64", "quopri", "copy", "pprint", "keyword", "random", "functools",
                "heapq", "bisect", "json", "urllib.parse", "email.utils", "ipaddress", "fractions", "inspect",
                "locale", "gettext", "mimetypes", "tokenize", "typing", "dataclasses", "shutil", "tempfile")
MAX_SOURCE_CHARS = 900  # longer functions make long prompts: prefill would dominate the data's cost
GENERATE_BATCH = 32  # sequences the engine runs side by side


def help_topics() -> list[str]:
    """The names of Python's help topics (``pydoc_data.topics``), sorted."""
    from pydoc_data.topics import topics

    return sorted(topics)


def code_tasks() -> list[tuple[str, str, str, str]]:
    """(module, function, parameter, new name): small standard-library functions whose first
    parameter the agent renames, none of them in the agentic workload (``agentic.CODE_TASKS``)."""
    measured = {(m, f) for m, f, _, _ in agentic.CODE_TASKS}
    tasks = []
    for module_name in CODE_MODULES:
        module = importlib.import_module(module_name)
        for name, fn in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            params = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "cls")]
            if params and len(source) <= MAX_SOURCE_CHARS and (module_name, name) not in measured:
                tasks.append((module_name, name, params[0].name, f"{params[0].name}_in"))
    return tasks


def chat_messages() -> list[str]:
    return [phrasing.format(topic) for phrasing in CHAT_PHRASINGS for topic in help_topics()]


def first_turn(session: agentic.Session) -> list[dict]:
    """The messages of a session's first turn, as ``agentic.run`` sends them: the system prompt, then the
    tool output and the request (the first turn depends on no answer)."""
    return [{"role": "system", "content": agentic.SYSTEM}, {"role": "user", "content": session.steps[0]([])}]


def code_messages() -> list[list[dict]]:
    """The first turn of a coding session per task."""
    return [first_turn(agentic.coding_session(*task)) for task in code_tasks()]


def training_prompts(tok, seed: int = 0) -> list[torch.Tensor]:
    """Every chat and coding prompt (1, T_i), in one fixed shuffled order: a data size is a prefix of it,
    so larger sizes hold the smaller ones, and every prefix mixes chat and code in the same proportion."""
    from llmsys.core.pretrained import chat_ids

    prompts = [chat_ids(tok, m) for m in chat_messages()] + [chat_ids(tok, m) for m in code_messages()]
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    return [prompts[i] for i in order]


@torch.no_grad()
def engine_answers(target: Transformer, prompts: list[torch.Tensor], new_tokens: int,
                   batch_size: int = GENERATE_BATCH, progress: bool = False) -> list[list[int]]:
    """Each prompt (1, T_i) followed by the target's greedy answer of ``new_tokens`` tokens, served by the
    continuous-batching engine ``batch_size`` sequences at a time (no padding: each attends to its own
    paged cache). Answers run the full length (no stop token), as the head's training windows are."""
    from llmsys.serving import Engine, Request, SchedulerConfig

    if batch_size < 1 or new_tokens < 1:
        raise ValueError(f"batch_size and new_tokens must be >= 1, got {batch_size} and {new_tokens}")
    block_size = 16
    need = sorted((math.ceil((p.size(1) + new_tokens) / block_size) for p in prompts), reverse=True)
    engine = Engine(target, num_blocks=sum(need[:batch_size]), block_size=block_size,
                    config=SchedulerConfig(max_batch=batch_size))  # the longest batch fits: nothing preempted
    requests = [Request(i, p[0].tolist(), new_tokens) for i, p in enumerate(prompts)]
    report = engine.run(requests, progress=progress)
    failed = [r for r in report.results if r.status != "finished"]
    if failed:
        raise RuntimeError(f"the engine did not finish {len(failed)} prompt(s): {failed[0].reason}")
    outputs = {r.id: r.output for r in report.results}
    return [requests[i].prompt + outputs[i] for i in range(len(prompts))]


@torch.no_grad()
def teacher_forced(target: Transformer, sequences: list[list[int]], keep: int, batch_size: int = 8):
    """The last ``keep`` tokens of each sequence and the target's final hidden states there, from one forward
    pass over the whole sequence: tokens (N, keep), features (N, keep, dim) float32. The last token gets no
    feature (nothing has read it yet), so both windows end one token early, as decoding recorded them.

    Sequences run ``batch_size`` at a time, right-padded to the longest: causal attention keeps the
    padding out of every earlier position."""
    if keep < 1 or any(len(s) <= keep for s in sequences):
        raise ValueError(f"keep={keep} must be >= 1 and shorter than every sequence")
    dev = target.tok_embeddings.weight.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths share a batch
    tokens = torch.empty(len(sequences), keep, dtype=torch.long)
    features = torch.empty(len(sequences), keep, target.cfg.dim)
    for lo in range(0, len(order), batch_size):
        rows = order[lo:lo + batch_size]
        longest = max(len(sequences[i]) for i in rows)
        ids = torch.zeros(len(rows), longest - 1, dtype=torch.long)
        for j, i in enumerate(rows):
            ids[j, :len(sequences[i]) - 1] = torch.tensor(sequences[i][:-1])
        hidden = target(ids.to(dev), return_hidden=True)[1].float().cpu()
        for j, i in enumerate(rows):
            end = len(sequences[i]) - 1
            tokens[i] = ids[j, end - keep:end]
            features[i] = hidden[j, end - keep:end]
    return tokens, features
