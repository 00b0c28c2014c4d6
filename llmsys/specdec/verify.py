"""One verification step: speculative sampling (Leviathan et al., arXiv 2211.17192;
Chen et al., arXiv 2302.01318) and its greedy limit."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def probs(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None) -> torch.Tensor:
    """The distribution that ``llmsys.core.model.sample`` draws from: softmax(logits / T) over the
    top_k logits, and a one-hot argmax at temperature 0. Last dimension = vocabulary."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).float()
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.softmax(logits, dim=-1)


def accept_reject(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None = None):
    """One round of speculative sampling, batched over B independent rounds.

    p (B, γ+1, V): the target's distribution at each draft position and one past the last;
    q (B, γ, V): the drafter's distributions; draft (B, γ): tokens drawn from q.
    Draft i is accepted with probability min(1, p(x)/q(x)); at the first rejection the next
    token is drawn from norm(max(0, p - q)), and when all γ pass, a bonus token from p.
    Returns (n_accepted (B,), next_token (B,)): keep draft[:n], then append next_token.
    The output is distributed exactly as p, whatever q is."""
    B, gamma, V = q.shape
    if p.shape != (B, gamma + 1, V) or draft.shape != (B, gamma):
        raise ValueError(f"need p (B, γ+1, V), q (B, γ, V), draft (B, γ); got {tuple(p.shape)}, "
                         f"{tuple(q.shape)}, {tuple(draft.shape)}")
    p_x = p[:, :gamma].gather(-1, draft[..., None]).squeeze(-1)  # (B, γ)
    q_x = q.gather(-1, draft[..., None]).squeeze(-1)  # (B, γ), > 0: x was drawn from q
    u = torch.rand(B, gamma, generator=generator, device=p.device)
    accepted = u * q_x < p_x  # u < p/q, without dividing by zero
    n = accepted.long().cumprod(-1).sum(-1)  # (B,) length of the leading run of acceptances
    # where the run stopped: residual of p over q there, or p itself after the last draft (q = 0)
    q_padded = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # (B, γ+1, V)
    at_stop = n[:, None, None].expand(B, 1, V)
    p_n, q_n = p.gather(1, at_stop).squeeze(1), q_padded.gather(1, at_stop).squeeze(1)  # (B, V)
    residual = (p_n - q_n).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # a rejection where p == q has probability 0; rounding can still get there, so fall back to p
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    return n, next_token


def greedy_accept(target_tokens: torch.Tensor, draft: torch.Tensor):
    """Temperature 0: keep drafts while they equal the target's argmax, then append the target's
    token at the first mismatch (or the bonus). target_tokens (B, γ+1), draft (B, γ)."""
    n = (draft == target_tokens[:, :-1]).long().cumprod(-1).sum(-1)  # (B,)
    return n, target_tokens.gather(1, n[:, None]).squeeze(1)
