"""A small Countdown policy, briefly supervised (SFT) and cached in the zoo."""

from __future__ import annotations

import io
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmsys.core import cache
from llmsys.core.model import ModelConfig, Transformer, masked_mean
from llmsys.rl.task import Countdown
from llmsys.rl.tokenizers import CharTokenizer


@dataclass
class PolicySpec:
    """A small policy for Countdown and how it is briefly supervised (SFT) before RL: long
    enough to learn the answer format and some arithmetic, short enough that it solves only
    some held-out problems (about a quarter of the samples), which leaves RL room to act."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_seq_len: int = 32  # prompt + max_new_tokens
    sizes: tuple[int, ...] = (2,)  # the task: two-number problems; (2, 3) adds three-number ones
    sft_steps: int = 150
    batch_size: int = 64
    lr: float = 3e-3
    ramble_rate: float = 0.1  # share of answerless demonstrations
    max_ramble: int = 12
    seed: int = 0

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, max_seq_len=self.max_seq_len, tie_embeddings=True)


FORMAT_VERSION = 1  # bump when the way a cached policy is built changes


def sft(policy: Transformer, tokenizer, task: Countdown, steps: int, batch_size: int = 64, lr: float = 3e-3,
        ramble_rate: float = 0.0, max_ramble: int = 12, seed: int = 0, progress: bool = True) -> list[float]:
    """Supervised fine-tuning on demonstrations: cross-entropy on the completion tokens only
    (prompt tokens are given, not learned). Returns the loss per step."""
    from tqdm.auto import tqdm

    device = policy.tok_embeddings.weight.device
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    policy.train()
    losses = []
    for step in tqdm(range(steps), desc="SFT", disable=not progress):
        for group in optimizer.param_groups:  # linear warm-up over 10% of the steps, cosine decay to 10%
            warm = min(1.0, (step + 1) / max(1, steps // 10))
            group["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        rows, masks = [], []
        for problem in task.sample(batch_size, rng):
            prompt = tokenizer.encode(task.prompt(problem))
            completion = tokenizer.encode(task.demonstration(problem, rng, ramble_rate, max_ramble)) + [tokenizer.eos_id]
            rows.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.eos_id] * (width - len(r)) for r in rows], device=device)
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], device=device, dtype=torch.float)
        logits = policy(ids[:, :-1])
        token_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1), reduction="none")
        loss = masked_mean(token_loss, mask[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    policy.eval()
    return losses


def _spec_hash(spec: PolicySpec, tokenizer: CharTokenizer) -> str:
    return cache.spec_hash({"spec": asdict(spec), "tokens": tokenizer.tokens, "version": FORMAT_VERSION})


def _entry_name(spec: PolicySpec) -> str:
    return f"rl-countdown-{_spec_hash(spec, CharTokenizer())[:12]}"


def policy_path(spec: PolicySpec | None = None) -> Path:
    """Where the cached weights of ``spec``'s policy live (in the zoo's cache)."""
    return cache.entry_dir(_entry_name(spec or PolicySpec())) / "model.pt"


def load_policy(spec: PolicySpec | None = None, device=None, progress: bool = True, force: bool = False):
    """(policy, tokenizer, task): the Countdown policy after its brief SFT, trained on first
    use (seconds on a CPU; on ``device`` if given) and cached by ``cache.entry`` (locked,
    verified, written atomically; a damaged entry is rebuilt with a warning). The policy
    comes back in eval mode."""
    spec = spec or PolicySpec()
    tokenizer, task = CharTokenizer(), Countdown(sizes=spec.sizes)
    config = spec.model_config(tokenizer.vocab_size)

    def build(folder: Path, show_progress: bool) -> dict:
        with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
            torch.manual_seed(spec.seed)
            policy = Transformer(config)
        policy.to(device or "cpu")
        losses = sft(policy, tokenizer, task, spec.sft_steps, spec.batch_size, spec.lr, spec.ramble_rate,
                     spec.max_ramble, spec.seed, show_progress)
        torch.save({k: v.cpu() for k, v in policy.state_dict().items()}, folder / "model.pt")
        return {"spec": asdict(spec), "metrics": {"final_sft_loss": losses[-1]}}

    def parse(folder: Path, manifest: dict, files: dict[str, bytes]) -> Transformer:
        with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep it off the caller's RNG
            policy = Transformer(config)
        policy.load_state_dict(torch.load(io.BytesIO(files["model.pt"]), weights_only=True))
        return policy

    policy = cache.entry(_entry_name(spec), _spec_hash(spec, tokenizer), build, parse, force=force, progress=progress)
    return policy.to(device or "cpu").eval(), tokenizer, task
