"""Sampling G completions per problem with the library's KV-cached loop, scoring them, and
the per-token log-probabilities the GRPO loss needs."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmsys.core.model import Rollout, Transformer, sample_rollout


def completion_logprobs(model: Transformer, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """log π(o_t | prompt, o_<t) for every completion token, (B, L), in one forward pass."""
    P = prompt_ids.size(1)
    logits = model(torch.cat([prompt_ids, completion_ids], dim=1))[:, P - 1:-1]  # (B, L, V)
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, completion_ids[..., None]).squeeze(-1)


@dataclass
class RolloutBatch:
    """G completions for each of a batch of problems, sampled in chunks of one prompt length (a
    model without an attention mask cannot pad prompts), then right-padded into one (N, L) batch."""

    chunks: list[Rollout]  # one per prompt length, from llmsys.core.model.sample_rollout
    mask: torch.Tensor  # (N, L): 1 on completion tokens (EOS included)
    rewards: torch.Tensor  # (N,), each problem's G completions next to each other
    texts: list[str]
    group_size: int

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)

    @property
    def correct(self) -> torch.Tensor:
        return self.rewards >= 1.0


def rollout(policy: Transformer, tokenizer, task, problems, group_size: int, max_new_tokens: int,
            temperature: float = 1.0, generator: torch.Generator | None = None, prompt_fn=None) -> RolloutBatch:
    """Sample ``group_size`` completions per problem and score them with ``task.reward``."""
    if not problems:
        raise ValueError("no problems to sample completions for")
    prompt_fn = prompt_fn or task.prompt
    device = policy.tok_embeddings.weight.device
    by_length = defaultdict(list)
    for i, problem in enumerate(problems):
        by_length[len(tokenizer.encode(prompt_fn(problem)))].append(i)
    order, chunks, completions, masks = [], [], [], []
    for _, indices in sorted(by_length.items()):
        prompts = torch.tensor([tokenizer.encode(prompt_fn(problems[i])) for i in indices], device=device)
        prompts = prompts.repeat_interleave(group_size, dim=0)  # (n·G, P)
        sampled = sample_rollout(policy, prompts, max_new_tokens, temperature, stop_token=tokenizer.eos_id,
                                 generator=generator)
        ids, mask = sampled.completions, sampled.completion_mask  # (n·G, L_chunk)
        order += indices
        chunks.append(sampled)
        completions += [row[: int(m.sum())] for row, m in zip(ids.tolist(), mask)]
        masks.append(mask)
    width = max(m.size(1) for m in masks)
    mask = torch.cat([F.pad(m, (0, width - m.size(1))) for m in masks])
    texts = [tokenizer.decode([t for t in c if t != tokenizer.eos_id]) for c in completions]
    problems_in_order = [problems[i] for i in order for _ in range(group_size)]
    rewards = torch.tensor([task.reward(p, t) for p, t in zip(problems_in_order, texts)], device=device)
    return RolloutBatch(chunks, mask, rewards, texts, group_size)


def rollout_logprobs(model: Transformer, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of a rollout's completions under ``model``, (N, L), zero-padded."""
    width = batch.mask.size(1)
    parts = [completion_logprobs(model, r.tokens[:, :r.prompt_len], r.completions, temperature) for r in batch.chunks]
    return torch.cat([F.pad(p, (0, width - p.size(1))) for p in parts])


@torch.no_grad()
def evaluate(policy: Transformer, tokenizer, task, problems, samples_per_problem: int = 4, temperature: float = 1.0,
             max_new_tokens: int = 24, seed: int = 0, prompt_fn=None, batch_problems: int = 256) -> dict:
    """Pass rate (reward 1), format rate (an answer in tags), mean reward and lengths of sampled
    completions (temperature 0: greedy, one sample each)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    generator = torch.Generator(device=policy.tok_embeddings.weight.device).manual_seed(seed)
    samples = 1 if temperature == 0 else samples_per_problem
    was_training = policy.training
    policy.eval()
    rewards, lengths = [], []
    for start in range(0, len(problems), batch_problems):
        group = problems[start:start + batch_problems]
        batch = rollout(policy, tokenizer, task, group, samples, max_new_tokens, temperature, generator, prompt_fn)
        rewards.append(batch.rewards.cpu())
        lengths.append(batch.lengths.cpu())
    policy.train(was_training)
    rewards, lengths = torch.cat(rewards), torch.cat(lengths)
    correct = rewards >= 1.0
    return {
        "pass_rate": correct.float().mean().item(),
        "format_rate": (rewards > 0).float().mean().item(),
        "reward": rewards.mean().item(),
        "length": lengths.mean().item(),
        "wrong_length": lengths[~correct].mean().item() if (~correct).any() else float("nan"),
        "correct_length": lengths[correct].mean().item() if correct.any() else float("nan"),
    }


@torch.no_grad()
def ramble_stats(policy: Transformer, tokenizer, task, problems, max_len: int = 24, filler: str = ".") -> dict:
    """How likely the policy starts an answerless ramble, and how long it expects one to be,
    computed exactly from its probabilities rather than sampled.

    One forward pass over prompt + ``filler``·max_len per problem: P(start) = π(filler | prompt)
    and, once started, E[length] = Σ_k P(reach k fillers) for k = 1..max_len, with
    P(reach k) = Π_{j<k} π(filler | prompt, j fillers). Rambles are rare after RL, so sampling
    them would need many draws to see their length; this needs none."""
    device = policy.tok_embeddings.weight.device
    (filler_id,) = tokenizer.encode(filler)
    prompts = torch.tensor([tokenizer.encode(task.prompt(p)) for p in problems], device=device)
    rambles = torch.full((len(problems), max_len), filler_id, device=device)
    P = prompts.size(1)
    logits = policy(torch.cat([prompts, rambles], dim=1))[:, P - 1:P + max_len - 1]  # (N, max_len, V)
    p_filler = F.softmax(logits.float(), dim=-1)[..., filler_id]  # π(filler | prompt, j fillers), j = 0..max_len-1
    reach = torch.cumprod(p_filler[:, 1:], dim=1)  # P(reach k + 1 | started), k = 1..max_len-1
    expected_length = 1.0 + reach.sum(dim=1)
    return {"start": p_filler[:, 0].mean().item(), "length": expected_length.mean().item()}
