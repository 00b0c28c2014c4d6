"""Quality filtering: heuristic rules and perplexity under a reference model.

Heuristic rules of Gopher (Rae et al. 2021, arXiv 2112.11446, appendix A.1.1, "MassiveText
quality filters"): keep a document with 50 to 100,000 words, mean word length 3 to 10
characters, a symbol-to-word ratio below 0.1 for "#" and "...", at most 90% of lines
starting with a bullet, at most 30% ending in an ellipsis, at least 80% of words with an
alphabetic character and at least 2 of the stop words {the, be, to, of, and, that, have,
with}; plus Gopher's repetition rule on duplicate lines (at most 30% of lines).

Perplexity filtering (CCNet, Wenzek et al. 2019, arXiv 1911.00359): score each document by
its perplexity under a reference language model and keep the most fluent ones.
"""

from __future__ import annotations

import math

import torch

STOP_WORDS = {"the", "be", "to", "of", "and", "that", "have", "with"}
BULLETS = ("•", "-", "*", "●", "▪")


def gopher_failures(text: str) -> list[str]:
    """The Gopher rules this document breaks (empty: it passes)."""
    words = text.split()
    lines = [line for line in text.splitlines() if line.strip()] or [""]
    n = max(len(words), 1)
    failed = []
    if not 50 <= len(words) <= 100_000:
        failed.append("word count")
    if not 3 <= sum(len(w) for w in words) / n <= 10:
        failed.append("mean word length")
    if (text.count("#") + text.count("...") + text.count("…")) / n >= 0.1:
        failed.append("symbol ratio")
    if sum(line.lstrip().startswith(BULLETS) for line in lines) / len(lines) > 0.9:
        failed.append("bullet lines")
    if sum(line.rstrip().endswith(("...", "…")) for line in lines) / len(lines) > 0.3:
        failed.append("ellipsis lines")
    if sum(any(c.isalpha() for c in w) for w in words) / n < 0.8:
        failed.append("alphabetic words")
    if len({w.lower().strip(".,;:!?\"'()") for w in words} & STOP_WORDS) < 2:
        failed.append("stop words")
    if 1 - len(set(lines)) / len(lines) > 0.3:
        failed.append("duplicate lines")
    return failed


@torch.no_grad()
def perplexities(model, encode, texts: list[str], n_tokens: int = 64) -> list[float]:
    """Perplexity of each text's first ``n_tokens`` tokens (shorter texts: all their tokens),
    exp of the mean negative log-likelihood per predicted token."""
    from llmsys.core.model import token_logprobs

    out = []
    for text in texts:
        ids = encode(text)[:n_tokens]
        if len(ids) < 2:
            out.append(math.inf)  # nothing to predict: never the most fluent
            continue
        out.append(math.exp(-token_logprobs(model, torch.tensor([ids])).mean().item()))
    return out
