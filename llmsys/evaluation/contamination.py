"""Benchmark contamination: was this test item in the training text?

* n-gram overlap (GPT-3, Brown et al. 2020, arXiv 2005.14165, appendix C): an item is
  flagged when any of its 13-grams of lower-cased words (punctuation stripped) occurs in
  the training data. Needs the training data.
* Min-K% Prob (Shi et al. 2023, arXiv 2310.16789): the mean log-probability of the k% least
  likely tokens of the text under the model; text the model was trained on has fewer
  surprising tokens. Needs only the model.
"""

from __future__ import annotations

import re

import torch

from llmsys.core.model import token_logprobs

NGRAM = 13


def words(text: str) -> list[str]:
    """Lower-cased words without punctuation, the unit of GPT-3's overlap analysis."""
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


class NgramIndex:
    """Every n-gram of a training text, to look test items up in."""

    def __init__(self, texts, n: int = NGRAM):
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        for text in texts:
            self.grams |= ngrams(text, n)

    def overlap(self, text: str) -> float:
        """Share of the text's n-grams found in the training text (0 for a text shorter than n words)."""
        grams = ngrams(text, self.n)
        return len(grams & self.grams) / len(grams) if grams else 0.0

    def flagged(self, text: str) -> bool:
        return self.overlap(text) > 0


@torch.no_grad()
def min_k_prob(token_lp: torch.Tensor, k: float = 0.2) -> torch.Tensor:
    """Mean of the lowest ``k`` fraction of each row's token log-probabilities (B, T) -> (B,);
    higher means more likely seen in training."""
    if not 0 < k <= 1:
        raise ValueError(f"k is a fraction in (0, 1], got {k}")
    n = max(1, int(token_lp.size(-1) * k))
    return token_lp.topk(n, dim=-1, largest=False).values.mean(-1)


def min_k_scores(model, encode, texts: list[str], n_tokens: int, k: float = 0.2, batch_size: int = 8) -> list[float]:
    """Min-K% Prob of each text's first ``n_tokens`` tokens (equal lengths batch without padding;
    a text with fewer tokens is an error)."""
    rows = []
    for text in texts:
        ids = encode(text)
        if len(ids) < n_tokens:
            raise ValueError(f"a text has {len(ids)} tokens, fewer than n_tokens={n_tokens}: drop it or lower n_tokens")
        rows.append(ids[:n_tokens])
    ids = torch.tensor(rows)
    scores = [min_k_prob(token_logprobs(model, ids[i:i + batch_size]), k) for i in range(0, len(ids), batch_size)]
    return torch.cat(scores).tolist()
