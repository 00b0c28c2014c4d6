"""Multiple-choice scoring by log-likelihood, as EleutherAI's lm-evaluation-harness does it.

Each choice is a continuation of the prompt (``" " + choice``, the harness's default
``target_delimiter``); its score is the summed log-probability of the continuation's
tokens given the prompt. ``acc`` takes the argmax of the sums; ``acc_norm`` divides each
sum by the choice's length in characters first (the harness's ``acc_norm``: longer choices
collect more negative log-probability), ``acc_bytes`` by its UTF-8 length.

Tokenization follows the harness's ``_encode_pair``: trailing spaces of the context move
to the continuation, the whole string is encoded, and the continuation's tokens are the
ones after the context's own encoding, so a token merging across the boundary is scored
the way the harness scores it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"


def encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) for a causal model, like lm-evaluation-harness."""
    if not context:
        raise ValueError("context is empty: give every item a prompt")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, context_ids = encode(context + continuation), encode(context)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def loglikelihoods(model, requests: list[tuple[list[int], list[int]]], progress: bool = False) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), continuation is the greedy one) per request.

    Requests that share a context (the choices of one item) share its forward pass: the
    context runs once into a KV cache, the cache is repeated once per continuation, and the
    continuations run as one right-padded batch (causal attention never lets a position see
    the padding after it, so padding changes no score)."""
    from tqdm.auto import tqdm

    limit = model.cfg.max_seq_len
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ValueError("a context or continuation encodes to no tokens; every item needs a prompt and text per choice")
        if len(context) + len(continuation) - 1 > limit:
            raise ValueError(f"a request of {len(context) + len(continuation)} tokens exceeds the model's "
                             f"max_seq_len={limit}; shorten the prompt or use fewer few-shot examples")
        groups.setdefault(tuple(context), []).append(i)
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for context, members in tqdm(groups.items(), desc="scoring", disable=not progress, leave=False):
        continuations = [requests[i][1] for i in members]
        for i, out in zip(members, _score_continuations(model, list(context), continuations)):
            results[i] = out
    return results


def _score_continuations(model, context: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
    dev = next(model.parameters()).device
    width = max(len(c) for c in continuations)
    cache = model.new_cache(1, max_len=len(context) + width - 1)
    first = F.log_softmax(model(torch.tensor([context], device=dev), cache)[:, -1].float(), dim=-1)  # (1, V)
    logprobs = first.expand(len(continuations), 1, -1)  # (C, 1, V): every continuation's first token
    if width > 1:
        cache.k = [k.repeat(len(continuations), 1, 1, 1) for k in cache.k]
        cache.v = [v.repeat(len(continuations), 1, 1, 1) for v in cache.v]
        x = torch.zeros(len(continuations), width - 1, dtype=torch.long)
        for row, c in enumerate(continuations):
            x[row, :len(c) - 1] = torch.tensor(c[:-1])
        rest = F.log_softmax(model(x.to(dev), cache).float(), dim=-1)  # (C, width - 1, V)
        logprobs = torch.cat([logprobs, rest], dim=1)  # (C, width, V)
    out = []
    for row, c in enumerate(continuations):
        lp, target = logprobs[row, :len(c)], torch.tensor(c, device=dev)
        out.append((lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
    return out


def fewshot_prompt(item, examples=()) -> str:
    """The harness's context: each example's prompt + delimiter + its answer, then the item's prompt."""
    shots = [ex.prompt + TARGET_DELIMITER + ex.choices[ex.gold] for ex in examples]
    return FEWSHOT_DELIMITER.join([*shots, item.prompt])


@dataclass
class MCResult:
    """Per-item log-likelihoods of every choice, and the metrics derived from them."""

    loglik: list[list[float]]
    gold: list[int]
    choices: list[tuple[str, ...]]

    def predictions(self, norm: str | None = None) -> list[int]:
        out = []
        for lls, choices in zip(self.loglik, self.choices):
            lengths = {None: [1.0] * len(choices), "chars": [float(len(c)) for c in choices],
                       "bytes": [float(len(c.encode())) for c in choices]}[norm]
            scores = [ll / n for ll, n in zip(lls, lengths)]
            out.append(max(range(len(scores)), key=scores.__getitem__))  # first maximum, like np.argmax
        return out

    def metrics(self) -> dict[str, float]:
        n = len(self.gold)
        hits = {name: sum(p == g for p, g in zip(self.predictions(norm), self.gold)) / n
                for name, norm in (("acc", None), ("acc_norm", "chars"), ("acc_bytes", "bytes"))}
        return {**hits, "n": n}

    def logits(self) -> torch.Tensor:
        """Choice log-likelihoods (N, C) as logits: their softmax is the model's confidence over choices."""
        return torch.tensor(self.loglik, dtype=torch.float64)


def score_mc(model, encode, items, fewshot=(), progress: bool = False) -> MCResult:
    """Score every item's choices; ``fewshot`` items are prepended to every prompt (the harness's
    ``first_n`` sampler over the train split)."""
    requests, shape = [], []
    for item in items:
        context = fewshot_prompt(item, fewshot)
        shape.append(len(item.choices))
        requests += [encode_pair(encode, context, TARGET_DELIMITER + c) for c in item.choices]
    flat = [ll for ll, _ in loglikelihoods(model, requests, progress)]
    loglik, start = [], 0
    for n in shape:
        loglik.append(flat[start:start + n])
        start += n
    return MCResult(loglik, [item.gold for item in items], [item.choices for item in items])


def write_harness_task(items, folder: Path, name: str, num_fewshot: int = 0, fewshot_items=()) -> Path:
    """A local lm-evaluation-harness task (YAML + JSONL, no download) holding ``items``;
    returns the folder to pass to the harness's ``TaskManager(include_path=...)``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("test", items), ("train", fewshot_items)):
        with open(folder / f"{name}_{split}.jsonl", "w") as f:
            for item in rows:
                f.write(json.dumps({"prompt": item.prompt, "choices": list(item.choices), "gold": item.gold}) + "\n")
    fewshot = (f"fewshot_split: train\nfewshot_config:\n  sampler: first_n\nnum_fewshot: {num_fewshot}\n"
               if num_fewshot else "")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / f'{name}_test.jsonl'}\n    train: {folder / f'{name}_train.jsonl'}\n"
        f"test_split: test\n{fewshot}output_type: multiple_choice\n"
        "doc_to_text: \"{{prompt}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\n"
        f"target_delimiter: \"{TARGET_DELIMITER}\"\nfewshot_delimiter: \"\\n\\n\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return folder
