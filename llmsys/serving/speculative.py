"""Speculative decoding inside the engine, with a prompt-lookup drafter.

A greedy request's decode step may carry up to γ drafted tokens after the token
sampled last step: the target scores all of them in the same flat batch (one
chunk of 1 + γ tokens), keeps the drafts while they equal its own argmax, and
adds its token at the first mismatch (``greedy_accept`` of chapter 4), so the
output is exactly greedy decoding's. Rejected drafts' keys and values sit past
the sequence's computed length and are overwritten later.

The drafter is prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's
n-gram speculator): find the latest earlier occurrence of the sequence's last n
tokens (n = 3, then 2, then 1) and propose the γ tokens that followed it. It
needs no model, which is why servers offer it for any model; it pays off when
answers copy from their prompt (quoting, editing code, summarising).

Why servers switch speculation off under load: a step of B decodes with γ
drafts each computes B·(1 + γ) tokens. While decoding is memory-bound that is
barely dearer than B tokens, but as B grows the step turns compute-bound and
the drafts cost about as much as they save.
"""

from __future__ import annotations


def prompt_lookup(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest matching suffix n-gram: the latest
    occurrence with k tokens after it, else the latest one (a match just before the end has few)."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix, found = tokens[-n:], None
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first, excluding the suffix itself
            if tokens[start:start + n] == suffix:
                found = found or tokens[start + n:start + n + k]
                if start + n + k <= len(tokens):
                    return tokens[start + n:start + n + k]
        if found:
            return found
    return []


def accept_greedy(drafts: list[int], target: list[int], stop_ids=()) -> tuple[int, list[int]]:
    """Drafts kept and the tokens a verified step adds: the drafts while they equal the target's argmax
    (``target``: its choice after each of the 1 + len(drafts) positions), then the target's own token;
    cut after a stop token. Returns (drafts accepted, new tokens)."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    new = drafts[:n] + [target[n]]
    for i, t in enumerate(new):
        if t in stop_ids:
            return min(n, i + 1), new[:i + 1]
    return n, new
