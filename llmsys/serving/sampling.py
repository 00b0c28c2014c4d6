"""How the engine picks each sequence's next token from its logits row: the response format's grammar mask
(``grammar``), OpenAI's presence and frequency penalties, then argmax at temperature 0 or a draw from the
request's own seeded generator; and the log-probabilities a request asks for."""

from __future__ import annotations

import torch

from llmsys.core.model import sample


def penalise(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: each token's logit minus ``frequency`` × its count in the
    output so far, minus ``presence`` if it appears at all (OpenAI's API reference, "Parameter details")."""
    if not (presence or frequency) or not output:
        return logits
    counts = torch.bincount(torch.tensor(output), minlength=logits.shape[-1]).to(logits.device, logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the model and the ``top`` likeliest tokens' (logits (V,)): the model's
    own distribution, before temperature, top-p and penalties, as vLLM reports by default."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(top)
    return float(logp[token]), list(zip(ids.tolist(), values.tolist()))


def needs_draw(seq) -> bool:
    """Whether ``seq``'s next token is anything but the argmax of its raw logits."""
    r = seq.request
    return r.temperature > 0 or bool(r.presence_penalty or r.frequency_penalty) or seq.matcher is not None


def draw(row: torch.Tensor, seq) -> int:
    """``seq``'s next token from its logits row (V,); its grammar, if any, takes the token. Raises on failure."""
    r, vocab = seq.request, row.shape[-1]
    if seq.matcher is not None:
        allowed = seq.matcher.allowed(vocab, row.device)
        if not allowed.any():
            raise ValueError("the response format's grammar allows no next token")
        row = row.masked_fill(~allowed, float("-inf"))
    row = penalise(row, seq.output, r.presence_penalty, r.frequency_penalty)
    token = (int(sample(row[None], r.temperature, generator=seq.generator, top_p=r.top_p)) if r.temperature > 0
             else int(row.argmax()))
    if not 0 <= token < vocab:
        raise ValueError(f"sampled token id {token} is outside the vocabulary")
    if seq.matcher is not None:
        seq.matcher.accept(token)
    return token
