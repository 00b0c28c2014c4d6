"""Training drafting heads on a frozen target's hidden states (self-distillation), cached by the zoo."""

from __future__ import annotations

import hashlib
import io
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core.model import Transformer
from llmsys.specdec.drafters import Drafter, EagleDrafter, EagleHead, MedusaDrafter, MedusaHeads, MTPDrafter, MTPHeads


@dataclass(frozen=True)
class HeadSpec:
    """How a drafting head is built and trained on a frozen target."""

    kind: str  # "medusa", "mtp" or "eagle"
    depth: int = 4  # Medusa heads / MTP modules: how far ahead it can draft (EAGLE: unlimited)
    steps: int = 200
    batch_size: int = 8  # windows per step
    seq_len: int = 128
    lr: float = 3e-3
    n_windows: int = 96  # windows of training text whose target features are computed once
    seed: int = 0
    vocab: int | None = None  # EAGLE: LM-head rows kept, the most frequent training tokens (None: all)

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose one of {HEAD_KINDS}")
        for name in ("depth", "steps", "batch_size", "seq_len", "n_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"HeadSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab is not None and (self.kind != "eagle" or self.vocab < 1):
            raise ValueError(f"vocab={self.vocab}: a truncated LM head is an option of the 'eagle' head, "
                             f"with >= 1 rows")
        if self.depth + 2 > self.seq_len:
            raise ValueError(f"seq_len={self.seq_len} is too short to train depth {self.depth}: need depth + 2 tokens")


HEAD_KINDS = ("medusa", "mtp", "eagle")
HEADS_FORMAT = 4
# what the notebook and the benchmark train on the zoo target: about a minute of CPU in all, once
HEAD_SPECS = {
    "medusa": HeadSpec("medusa", depth=4, steps=120),
    "mtp": HeadSpec("mtp", depth=4, steps=120),
    "eagle": HeadSpec("eagle", steps=200),
}  # bump when the way heads are trained changes: cached heads are retrained


def new_head(spec: HeadSpec, target: Transformer) -> nn.Module:
    if spec.kind == "medusa":
        return MedusaHeads(target.cfg.dim, spec.depth)
    if spec.kind == "mtp":
        return MTPHeads(target.cfg, spec.depth)
    return EagleHead(target.cfg, vocab=spec.vocab)


def frequent_tokens(ids: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    """The k token ids seen most often in ``ids`` (ties to the lower id), ascending: a truncated
    drafting head covers most of what is said with a fraction of the vocabulary."""
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k={k} rows must be in 1..vocab_size={vocab_size}")
    counts = torch.bincount(ids.flatten().cpu(), minlength=vocab_size).double()
    ranked = (counts - torch.arange(vocab_size) / vocab_size).topk(k).indices  # count first, then lower id
    return ranked.sort().values


def make_drafter(head: nn.Module, target: Transformer) -> Drafter:
    """The Drafter that drafts with a trained head."""
    if isinstance(head, MedusaHeads):
        return MedusaDrafter(head, target)
    if isinstance(head, MTPHeads):
        return MTPDrafter(head, target)
    if isinstance(head, EagleHead):
        return EagleDrafter(head, target)
    raise ValueError(f"no drafter for a {type(head).__name__}; expected MedusaHeads, MTPHeads or EagleHead")


@torch.no_grad()
def target_features(target: Transformer, ids: torch.Tensor, n_windows: int, seq_len: int, seed: int = 0):
    """Random windows of ``ids`` (N, T) and the target's final hidden states on them (N, T, dim):
    the heads train on these, so the target runs once, not once per step."""
    if len(ids) <= seq_len:
        raise ValueError(f"need more than seq_len={seq_len} training tokens, got {len(ids)}")
    gen = torch.Generator(device=ids.device).manual_seed(seed)
    starts = torch.randint(len(ids) - seq_len, (n_windows,), generator=gen).tolist()
    dev = target.tok_embeddings.weight.device
    tokens = torch.stack([ids[s:s + seq_len] for s in starts]).long().to(dev)
    features = torch.cat([target(chunk, return_hidden=True)[1] for chunk in tokens.split(16)])
    return tokens, features


def _soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's own distribution (self-distillation): the heads learn
    to predict what the target would say, which is what verification accepts."""
    return -(F.softmax(target_logits.float(), -1) * F.log_softmax(logits.float(), -1)).sum(-1).mean()


def head_loss(head: nn.Module, target: Transformer, tokens: torch.Tensor, features: torch.Tensor,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Training loss on windows tokens (B, T) with target features (B, T, dim); ``generator``
    (on the features' device) draws the EAGLE head's input noise.

    The target's logits at position j, output(f_j), are its distribution for t_{j+1}."""
    if not isinstance(head, EagleHead):
        with torch.no_grad():
            target_logits = target.output(features)  # (B, T, V)
    if isinstance(head, MedusaHeads):  # head k at position i guesses t_{i+k+2}: the target's at i+k+1
        states = head(features)  # (B, T, K, dim)
        losses = [_soft_ce(target.output(states[:, :-(k + 1), k]), target_logits[:, k + 1:])
                  for k in range(head.n_heads)]
        return sum(losses) / len(losses)
    emb = target.tok_embeddings(tokens).detach()
    if isinstance(head, MTPHeads):  # module k at i sees t_{i+k+1}, guesses t_{i+k+2}
        h, losses = features, []
        for k in range(head.depth):
            h, out = head.step(k, h[:, :-1], emb[:, k + 1:])
            losses.append(_soft_ce(target.output(out), target_logits[:, k + 1:]))
        return sum(losses) / len(losses)
    # EAGLE: entry (f_i, t_{i+1}) predicts f_{i+1}; regression on features plus the token loss
    # (EAGLE-1's L_reg + 0.1 L_cls). The regression is measured in units of the features' RMS:
    # on raw features (entries of tens) a smooth-L1 sits in its linear part and hardly trains, and
    # a head whose predicted features are off cannot draft past its first token. Noise on the
    # input features, on the same scale, mimics the error of the head's own predictions.
    # The second draft step is trained too, from the head's own first guess as drafting feeds it
    # (EAGLE-3's training-time test): trained on true features only, a head drafts one good token.
    scale = features.float().pow(2).mean().sqrt().clamp(min=1e-6)
    noise = torch.rand(features[:, :-1].shape, generator=generator, device=features.device, dtype=features.dtype)
    noisy = features[:, :-1] + 0.1 * scale * (noise - 0.5)
    predicted = head(noisy, emb[:, 1:])
    again = head.second_step(noisy, emb[:, 1:], predicted)
    return _eagle_loss(head, target, predicted, features[:, 1:], scale) + \
        _eagle_loss(head, target, again, features[:, 2:], scale)


def _eagle_loss(head, target: Transformer, predicted: torch.Tensor, true: torch.Tensor, scale) -> torch.Tensor:
    """Feature regression in units of the features' RMS + 0.1 x cross-entropy against the target."""
    regression = F.smooth_l1_loss(predicted / scale, true / scale)
    with torch.no_grad():  # a truncated head learns the target's distribution renormalised over its rows
        target_logits = head.logits(true, target)
    return regression + 0.1 * _soft_ce(head.logits(predicted, target), target_logits)


def train_head(spec: HeadSpec, target: Transformer, train_ids: torch.Tensor, progress: bool = False,
               data: tuple[torch.Tensor, torch.Tensor] | None = None) -> nn.Module:
    """Train a drafting head on the frozen target's hidden states (AdamW, cosine schedule).

    The head trains on ``data`` = (tokens (N, T), the target's features on them (N, T, dim)) if
    given, else on random windows of ``train_ids``; a truncated EAGLE head keeps the tokens most
    frequent in ``train_ids``."""
    from tqdm.auto import tqdm

    if data is None:
        key = (_fingerprint(target, train_ids, None), spec.n_windows, spec.seq_len, spec.seed)
        if key not in _FEATURES:  # the heads of one target share its features: compute them once
            _FEATURES.clear()
            _FEATURES[key] = target_features(target, train_ids, spec.n_windows, spec.seq_len, spec.seed)
        data = _FEATURES[key]
    tokens, features = data
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        head = new_head(spec, target).to(features.device)
    if spec.vocab is not None:
        head.set_vocab(frequent_tokens(train_ids, spec.vocab, target.cfg.vocab_size), target)
    for p in target.parameters():
        p.requires_grad_(False)
    gen = torch.Generator(device=tokens.device).manual_seed(spec.seed + 1)
    optimizer = torch.optim.AdamW(head.parameters(), lr=spec.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, spec.steps, eta_min=spec.lr * 0.1)
    head.train()
    try:
        for _ in tqdm(range(spec.steps), desc=f"train {spec.kind}", disable=not progress, leave=False):
            rows = torch.randint(len(tokens), (spec.batch_size,), generator=gen, device=tokens.device)
            loss = head_loss(head, target, tokens[rows], features[rows], gen)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        for p in target.parameters():
            p.requires_grad_(True)
    return head.eval()


_FEATURES: dict = {}  # the last target_features computed for training, by fingerprint


def _fingerprint(target: Transformer, train_ids: torch.Tensor, spec: HeadSpec | None) -> str:
    """Hash of the target's weights, the training tokens and the spec: what a trained head depends on."""
    h = hashlib.sha256()
    for name, t in sorted(target.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    h.update(train_ids.cpu().numpy().tobytes())
    h.update(repr((HEADS_FORMAT, target.cfg.to_dict(), asdict(spec) if spec else None)).encode())
    return h.hexdigest()[:20]


def load_head(spec: HeadSpec, target: Transformer, train_ids: torch.Tensor, progress: bool = True) -> nn.Module:
    """A head for this target: a zoo entry named after the kind and a fingerprint of the target's
    weights, the data and the spec; trained on first use, then loaded (verified) from the cache."""
    from llmsys.core import cache

    fingerprint = _fingerprint(target, train_ids, spec)

    def build(folder, progress):
        head = train_head(spec, target, train_ids, progress=progress)
        torch.save({k: v.cpu() for k, v in head.state_dict().items()}, folder / "head.pt")
        return {"spec": asdict(spec)}

    def parse(folder, manifest, files):
        head = new_head(spec, target)
        head.load_state_dict(torch.load(io.BytesIO(files["head.pt"]), map_location="cpu", weights_only=True))
        return head

    head = cache.entry(f"{spec.kind}-head-{fingerprint[:12]}", fingerprint, build, parse, progress=progress)
    return head.to(target.tok_embeddings.weight.device).eval()


@torch.no_grad()
def head_accuracy(head: nn.Module, target: Transformer, tokens: torch.Tensor, features: torch.Tensor) -> list[float]:
    """Top-1 agreement with the target's argmax at each draft depth, on held-out windows
    (teacher-forced: depth k sees the true tokens before it)."""
    target_top = target.output(features).argmax(-1)  # (B, T)
    if isinstance(head, MedusaHeads):
        states = head(features)
        return [(target.output(states[:, :-(k + 1), k]).argmax(-1) == target_top[:, k + 1:]).float().mean().item()
                for k in range(head.n_heads)]
    emb = target.tok_embeddings(tokens)
    if isinstance(head, MTPHeads):
        h, out_acc = features, []
        for k in range(head.depth):
            h, out = head.step(k, h[:, :-1], emb[:, k + 1:])
            out_acc.append((target.output(out).argmax(-1) == target_top[:, k + 1:]).float().mean().item())
        return out_acc
    # depth 1 from the target's features; depth 2 from the head's own guess after true entries,
    # as drafting computes it
    predicted = head(features[:, :-1], emb[:, 1:])  # (B, T-1, dim): entry i guesses f_{i+1}
    again = head.second_step(features[:, :-1], emb[:, 1:], predicted)  # row i guesses f_{i+2}
    return [(head.draft_logits(p, target).argmax(-1) == target_top[:, k + 1:]).float().mean().item()
            for k, p in enumerate((predicted, again))]
