"""Data mixing and duplication, measured on tiny models the zoo trains in seconds.

Mixing: train on prose/code mixtures at several code shares r, measure each domain's
held-out loss, fit the data-mixing law of Ye et al. 2024 (arXiv 2403.16952) per domain,
L_i(r) = c_i + k_i · exp(t_i · r_i) (r_i = domain i's own share; with two domains their
Σ_j t_ij r_j reduces to one exponent), and predict a ratio no run used. DoReMi (Xie et al.
2023, arXiv 2305.10429) learns such weights with a small proxy model instead.

Duplication (Lee et al. 2021, arXiv 2107.06499): the same token budget with a few passages
repeated many times; duplicated text is memorized and held-out loss suffers.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from llmsys.core import zoo
from llmsys.data import corpora
from llmsys.core.model import ModelConfig

# A tiny Llama for the experiments: trains in seconds on a CPU core.
TINY = zoo.ZooSpec(ModelConfig(vocab_size=zoo.VOCAB_SIZE, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                               tie_embeddings=True),
                   steps=150, batch_size=8, seq_len=128, lr=5e-3, warmup_steps=15,
                   description="data experiments: one run in seconds")
BLOCK = 128  # tokens per block when mixing: the unit drawn from either domain


@dataclasses.dataclass
class Domains:
    """Token ids of each domain, split into train and held-out (LongTensors)."""

    train: dict[str, torch.Tensor]
    val: dict[str, torch.Tensor]


def domains(code_docs: int = 400) -> Domains:
    """Prose = the zoo's own 90/10 split of the corpus; code = standard-library chunks, every 10th held out."""
    prose_train, prose_val = zoo.dataset()
    tok = zoo.tokenizer()
    chunks = corpora.code_documents(max_docs=code_docs)
    code = [torch.tensor(tok.encode(c + "\n")) for c in chunks]
    code_train = torch.cat([c for i, c in enumerate(code) if i % 10 != 9])
    code_val = torch.cat([c for i, c in enumerate(code) if i % 10 == 9])
    return Domains({"prose": prose_train, "code": code_train}, {"prose": prose_val, "code": code_val})


def mixture(train: dict[str, torch.Tensor], shares: dict[str, float], n_tokens: int, seed: int = 0) -> torch.Tensor:
    """A training stream of ``n_tokens`` whose blocks come from each domain in proportion ``shares``."""
    if abs(sum(shares.values()) - 1) > 1e-9 or any(s < 0 for s in shares.values()):
        raise ValueError(f"shares must be non-negative and sum to 1, got {shares}")
    rng = random.Random(seed)
    n_blocks = n_tokens // BLOCK
    blocks = []
    for name, share in shares.items():
        ids = train[name]
        count = round(share * n_blocks)
        if count * BLOCK > len(ids):
            raise ValueError(f"domain {name!r} has {len(ids)} tokens, fewer than the {count * BLOCK} requested")
        starts = rng.sample(range(0, len(ids) - BLOCK + 1, BLOCK), count)
        blocks += [ids[s:s + BLOCK] for s in starts]
    rng.shuffle(blocks)
    return torch.cat(blocks)


def train_and_measure(train_ids: torch.Tensor, val: dict[str, torch.Tensor], spec: zoo.ZooSpec = TINY,
                      desc: str = "train"):
    """(model, held-out loss per domain) of a fresh tiny model trained on ``train_ids``."""
    model, _ = zoo.train(spec, train_ids, progress=False, desc=desc)
    tok = zoo.tokenizer()
    return model, {name: zoo.evaluate(model, ids, spec.seq_len, tok)["val_loss"] for name, ids in val.items()}


def mixing_runs(data: Domains, code_shares, n_tokens: int = 60_000, spec: zoo.ZooSpec = TINY,
                progress: bool = True) -> list[dict]:
    """One run per code share: {"code_share", "prose", "code"} (held-out losses)."""
    from tqdm.auto import tqdm

    rows = []
    for r in tqdm(code_shares, desc="mixtures", disable=not progress, leave=False):
        stream = mixture(data.train, {"prose": 1 - r, "code": r}, n_tokens)
        _, losses = train_and_measure(stream, data.val, spec, desc=f"code {r:.2f}")
        rows.append({"code_share": r, **losses})
    return rows


def fit_mixing_law(shares, losses, exponents=None) -> dict[str, float]:
    """Least-squares fit of L(r) = c + k · exp(t · r): for each t on a grid, (c, k) is linear
    least squares; keep the t with the smallest squared error."""
    r = torch.as_tensor(shares, dtype=torch.float64)
    y = torch.as_tensor(losses, dtype=torch.float64)
    if len(r) < 3:
        raise ValueError(f"the law has 3 parameters: fit it on at least 3 ratios, got {len(r)}")
    exponents = torch.linspace(-10, 10, 2001, dtype=torch.float64) if exponents is None else exponents
    best = None
    for t in exponents.tolist():
        design = torch.stack([torch.ones_like(r), torch.exp(t * r)], dim=1)  # (n, 2)
        coef = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
        err = ((design @ coef - y) ** 2).sum().item()
        if best is None or err < best["sse"]:
            best = {"c": coef[0].item(), "k": coef[1].item(), "t": t, "sse": err}
    return best


def predict(law: dict[str, float], share: float) -> float:
    return law["c"] + law["k"] * math.exp(law["t"] * share)


# ---------------------------------------------------------------- duplication


def with_repeats(train: torch.Tensor, n_passages: int, passage_len: int, repeat_share: float,
                 seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A stream as long as ``train`` where ``repeat_share`` of the tokens are copies of
    ``n_passages`` passages (the rest unique blocks of ``train``); returns (stream, passages)."""
    rng = random.Random(seed)
    starts = rng.sample(range(0, len(train) - passage_len, passage_len), n_passages)
    passages = [train[s:s + passage_len] for s in starts]
    n_copies = int(repeat_share * len(train)) // (passage_len * n_passages)
    unique_blocks = len(train) // passage_len - n_copies * n_passages
    chosen = set(starts)
    others = [s for s in range(0, len(train) - passage_len + 1, passage_len) if s not in chosen]
    rest = [train[s:s + passage_len] for s in sorted(rng.sample(others, unique_blocks))]  # dropped text: from everywhere
    blocks = rest + passages * n_copies
    rng.shuffle(blocks)
    return torch.cat(blocks), passages


@torch.no_grad()
def memorized(model, passages: list[torch.Tensor], prefix: int = 32, suffix: int = 16) -> dict[str, float]:
    """Greedy decoding from each passage's first ``prefix`` tokens: the share of passages whose next
    ``suffix`` tokens come out exactly (Carlini et al.'s extractable memorization), and the share
    of those tokens reproduced."""
    dev = next(model.parameters()).device
    prompts = torch.stack([p[:prefix] for p in passages]).to(dev)
    out = model.generate(prompts, suffix)[:, prefix:]
    truth = torch.stack([p[prefix:prefix + suffix] for p in passages]).to(dev)
    return {"exact": (out == truth).all(dim=1).float().mean().item(), "tokens": (out == truth).float().mean().item()}
