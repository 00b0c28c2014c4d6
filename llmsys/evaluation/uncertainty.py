"""Uncertainty and hallucination detection for generated answers, scored by AUROC.

Detectors, each a score where higher means "more likely wrong":
* sequence probability: minus the mean log-probability of the greedy answer's tokens;
* token entropy: the mean entropy of the next-token distributions along that answer;
* self-consistency (SelfCheckGPT, Manakul et al. 2023, arXiv 2303.08896): the share of
  sampled answers that disagree with the greedy one;
* semantic entropy (Kuhn et al. 2023, arXiv 2302.09664; the discrete form of Farquhar et
  al. 2024): sampled answers are clustered by meaning, then the entropy of the cluster
  frequencies. Kuhn et al. decide "same meaning" by bidirectional entailment; our answers
  are module names, so two answers mean the same when they resolve to the same module
  (``os.path`` and ``posixpath``), checked by code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def auroc(scores, labels) -> float:
    """Area under the ROC curve = P(score of a positive > score of a negative), ties count 1/2
    (the Mann-Whitney U statistic over n_pos · n_neg pairs), from average ranks."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    labels = torch.as_tensor(labels).bool()
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if scores.shape != labels.shape or n_pos == 0 or n_neg == 0:
        raise ValueError(f"need equal-length scores and labels with both classes present, got {n_pos} positives "
                         f"and {n_neg} negatives")
    values, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based rank shared by tied scores
    rank_sum = average_rank[inverse][labels].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def clusters(answers: list[str], same) -> list[list[int]]:
    """Greedy clustering: each answer joins the first cluster whose first member means the same."""
    groups: list[list[int]] = []
    for i, answer in enumerate(answers):
        for group in groups:
            if same(answers[group[0]], answer):
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


def semantic_entropy(answers: list[str], same) -> float:
    """Entropy (nats) of the cluster frequencies of sampled answers: 0 when they all agree."""
    sizes = [len(g) for g in clusters(answers, same)]
    n = sum(sizes)
    return -sum(s / n * math.log(s / n) for s in sizes)


def disagreement(reference: str, samples: list[str], same) -> float:
    """Share of samples that do not mean the same as the reference answer (1 − self-consistency)."""
    return sum(not same(reference, s) for s in samples) / len(samples)


def _until_eos(row: torch.Tensor, eos_id: int) -> list[int]:
    stops = (row == eos_id).nonzero()
    return row[: stops[0, 0]].tolist() if len(stops) else row.tolist()


@torch.no_grad()
def answer_stats(model, prompt: torch.Tensor, answer_ids: list[int]) -> dict:
    """Mean log-probability and mean next-token entropy along ``answer_ids`` after ``prompt`` (1, T)."""
    if not answer_ids:
        return {"mean_logprob": -math.inf, "mean_entropy": math.inf}
    dev = prompt.device
    ids = torch.cat([prompt, torch.tensor([answer_ids], device=dev)], dim=1)
    logprobs = F.log_softmax(model(ids[:, :-1]).float()[0, prompt.size(1) - 1:], dim=-1)  # (n_answer, V)
    token_lp = logprobs.gather(-1, torch.tensor(answer_ids, device=dev)[:, None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return {"mean_logprob": token_lp.mean().item(), "mean_entropy": entropy.mean().item()}


@torch.no_grad()
def sample_answers(model, tok, prompt: torch.Tensor, n_samples: int, max_new_tokens: int, temperature: float,
                   generator: torch.Generator) -> tuple[list[int], list[str]]:
    """(greedy answer ids, sampled answers as text) for one prompt (1, T), each cut at end of turn,
    through the model's one decoding loop."""
    greedy = model.generate(prompt, max_new_tokens)[0, prompt.size(1):]
    batch = prompt.expand(n_samples, -1)
    sampled = model.generate(batch, max_new_tokens, temperature=temperature, generator=generator)[:, prompt.size(1):]
    texts = [tok.decode(_until_eos(row, tok.eos_token_id), skip_special_tokens=True).strip() for row in sampled]
    return _until_eos(greedy, tok.eos_token_id), texts


def detect(model, tok, questions: list[tuple[str, str]], same, n_samples: int = 4, max_new_tokens: int = 4,
           temperature: float = 1.0, seed: int = 0, progress: bool = True) -> list[dict]:
    """Per (question, start of the answer): the greedy answer and the four detector scores (higher =
    less trustworthy). The start of the answer opens the assistant's turn, so every answer is short."""
    from tqdm.auto import tqdm

    from llmsys.core.pretrained import chat_ids

    dev = next(model.parameters()).device
    generator = torch.Generator(device=dev).manual_seed(seed)
    rows = []
    for question, answer_start in tqdm(questions, desc="answering", disable=not progress, leave=False):
        opened = chat_ids(tok, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}])
        prompt = torch.cat([opened, torch.tensor([tok.encode(answer_start)])], dim=1).to(dev)
        greedy_ids, samples = sample_answers(model, tok, prompt, n_samples, max_new_tokens, temperature, generator)
        answer = tok.decode(greedy_ids, skip_special_tokens=True).strip()
        stats = answer_stats(model, prompt, greedy_ids)
        rows.append({"answer": answer, "samples": samples, "scores": {
            "sequence probability": -stats["mean_logprob"],
            "token entropy": stats["mean_entropy"],
            "self-consistency": disagreement(answer, samples, same),
            "semantic entropy": semantic_entropy(samples, same),
        }})
    return rows
