"""Distillation with a real teacher: SmolLM2-135M-Instruct teaches a layer-dropped student.

The student has the teacher's tokenizer, its embedding (tied to the LM head, kept frozen), its
final norm and 6 of its 30 decoder layers: every sixth and the last (``KEEP``). Students
initialised from a subset of the teacher's layers are how DistilBERT (Sanh et al. 2019: every
other layer) and Minitron (Muralidharan et al. 2024: depth pruning, then distillation) start.
At a fifth of the depth the untrained student is broken (held-out perplexity above 10^5 on
Python's help text; evenly spaced layers did best of the subsets tried, keeping only the first layers
far worse); distillation heals it.

The zoo entry ``smollm2-student`` trains two copies of that initialisation on the same
training prompts (``specdec.chat.train_prompts``: Python's help topics) at equal compute
(FLOPs counted by ``distill.Compute``):

- **sequence-level KD** (Kim & Rush 2016): the teacher answers the prompts greedily, in batches
  (``specdec.chat.self_distilled``: one weight read serves the whole batch), and the student is
  trained on the answers with cross-entropy;
- **on-policy distillation** (GKD, Agarwal et al. 2024, with β = 1): the student samples, the
  teacher scores every position in one forward pass, and the student descends the exact reverse
  KL over the vocabulary (``distill.on_policy_step(signal="full")``).

``compare`` measures them on held-out chat prompts (``specdec.chat.EVAL_PROMPTS``) with the
teacher's own log-probs, and as drafters for the teacher (chapter 4's ``speculative_decode``).

    from llmsys.core import zoo
    from llmsys.distill import chat as distill_chat
    teacher = zoo.load("smollm2")
    students = distill_chat.load_students(teacher)   # built once by the zoo, then cached
"""

from __future__ import annotations

import dataclasses
import io
import time

import torch

from llmsys import distill
from llmsys.core import cache, pretrained, zoo
from llmsys.core.model import Rollout, Transformer, masked_mean

NAME = "smollm2-student"
FORMAT = 1  # bump when the way the entry is built changes
KEEP = (0, 6, 12, 18, 24, 29)  # teacher layers the student starts from
TRAIN_PROMPTS = 16  # training prompts, spread over the help topics
NEW_TOKENS = 32  # answer tokens per prompt
BATCH = 8
SEQ_KD_EPOCHS = 3  # passes of sequence-level KD over the teacher's answers; on-policy gets the same FLOPs
LR = 1e-3  # 3e-3 diverged after a few steps
SEED = 0
METHODS = ("seq_kd", "on_policy")
LABELS = {"layer_dropped": "layer-dropped, untrained", "seq_kd": "sequence-level KD", "on_policy": "on-policy (GKD β=1)"}


# ---------------------------------------------------------------- the student


def layer_dropped(teacher: Transformer, keep=KEEP) -> Transformer:
    """A student with the teacher's layers ``keep`` (in order), embedding, norm and head: same config
    but ``n_layers = len(keep)``. Keeping every layer gives the teacher back."""
    if not keep or any(not 0 <= i < teacher.cfg.n_layers for i in keep) or list(keep) != sorted(set(keep)):
        raise ValueError(f"keep must be increasing layer indices in 0..{teacher.cfg.n_layers - 1}, got {keep}")
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep it off the caller's RNG
        student = Transformer(dataclasses.replace(teacher.cfg, n_layers=len(keep)))
    state = {k: v for k, v in teacher.state_dict().items() if not k.startswith("layers.")}
    for new, old in enumerate(keep):
        prefix = f"layers.{old}."
        state.update({f"layers.{new}.{k[len(prefix):]}": v for k, v in teacher.state_dict().items() if k.startswith(prefix)})
    student.load_state_dict(state)
    return student.to(teacher.tok_embeddings.weight.device).eval()


def freeze_embedding(student: Transformer) -> list[torch.nn.Parameter]:
    """Freeze the (tied) embedding and LM head, shared with the teacher; return what trains."""
    student.tok_embeddings.weight.requires_grad_(False)
    return [p for p in student.parameters() if p.requires_grad]


def trained_state(student: Transformer) -> dict[str, torch.Tensor]:
    """What training changed: every tensor but the embedding (the teacher's, frozen, and the LM head when tied to it)."""
    frozen = {"tok_embeddings.weight", "output.weight"} if student.cfg.tie_embeddings else {"tok_embeddings.weight"}
    return {k: v.detach().cpu() for k, v in student.state_dict().items() if k not in frozen}


# ---------------------------------------------------------------- prompts and teacher answers


def chat_prompts(tok, split: str, n: int | None = None) -> torch.Tensor:
    """Chat prompts built by ``specdec.chat`` (train: help topics, every len/n-th; heldout: its
    held-out questions), left-padded: (n, P)."""
    from llmsys.core.pretrained import left_padded
    from llmsys.specdec import chat

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    prompts = chat.train_prompts(tok) if split == "train" else chat.eval_prompts(tok)
    n = len(prompts) if n is None else n
    if not 1 <= n <= len(prompts):
        raise ValueError(f"the {split} split has {len(prompts)} prompts, {n} requested")
    return left_padded(tok, prompts[:: len(prompts) // n][:n])


def teacher_answers(teacher: Transformer, prompts: torch.Tensor, new_tokens: int, stop_token: int,
                    compute: distill.Compute | None = None, progress: bool = False) -> Rollout:
    """The teacher's greedy answers to ``prompts`` (B, P), decoded in batches, as a Rollout whose
    mask covers each answer up to and including its first ``stop_token``."""
    from llmsys.specdec import chat

    tokens, _ = chat.self_distilled(teacher, prompts, new_tokens + 1, progress=progress, desc=f"{NAME}: teacher answers")
    B, P = prompts.shape  # self_distilled drops the last token (it has no feature yet): P + new_tokens remain
    answer = tokens[:, P:]
    stopped_before = (answer == stop_token).long().cumsum(1) - (answer == stop_token).long()  # stops before t
    mask = torch.cat([torch.zeros(B, P - 1), (stopped_before == 0).float()], dim=1)
    if compute is not None:
        compute.generate(teacher, B, P, new_tokens, teacher=True)
    return Rollout(tokens=tokens, mask=mask.to(tokens.device), logprobs=torch.zeros_like(mask), prompt_len=P)


# ---------------------------------------------------------------- training at equal compute


def train_seq_kd(student, teacher, prompts, stop_token: int, epochs: int = SEQ_KD_EPOCHS, batch_size: int = BATCH,
                 new_tokens: int = NEW_TOKENS, lr: float = LR, progress: bool = False):
    """Sequence-level KD: the teacher answers once, the student trains ``epochs`` passes on the
    answers. Returns (Compute, per-step losses)."""
    from tqdm.auto import tqdm

    compute = distill.Compute()
    data = teacher_answers(teacher, prompts, new_tokens, stop_token, compute, progress)
    optimizer = torch.optim.AdamW(freeze_embedding(student), lr=lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(SEED)
    losses = []
    for _ in tqdm(range(epochs), desc=f"{NAME}: sequence-level KD", disable=not progress, leave=False):
        for rows in torch.randperm(len(prompts), generator=order).split(batch_size):
            batch = Rollout(data.tokens[rows], data.mask[rows], data.logprobs[rows], data.prompt_len)
            losses.append(distill.sequence_kd_step(student, optimizer, batch, compute)["loss"])
    return compute, losses


def train_on_policy(student, teacher, prompts, stop_token: int, flops_budget: float, batch_size: int = BATCH,
                    new_tokens: int = NEW_TOKENS, lr: float = LR, progress: bool = False):
    """On-policy distillation (exact reverse KL on the student's samples) on the same prompts,
    until it has spent ``flops_budget``. Returns (Compute, per-step sampled reverse KL)."""
    from tqdm.auto import tqdm

    compute = distill.Compute()
    optimizer = torch.optim.AdamW(freeze_embedding(student), lr=lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(SEED)
    sampler = torch.Generator(device=prompts.device).manual_seed(SEED)
    kls = []
    bar = tqdm(total=round(flops_budget / 1e12, 2), desc=f"{NAME}: on-policy (TFLOP)", disable=not progress, leave=False)
    while compute.flops < flops_budget:
        rows = torch.randperm(len(prompts), generator=order)[:batch_size]
        before = compute.flops
        out = distill.on_policy_step(student, teacher, optimizer, prompts[rows], new_tokens, signal="full",
                                     stop_token=stop_token, generator=sampler, compute=compute)
        kls.append(out["sampled_reverse_kl"])
        bar.update(min(round((compute.flops - before) / 1e12, 2), bar.total - bar.n))  # the last step overshoots
    bar.close()
    return compute, kls


# ---------------------------------------------------------------- the zoo entry


def entry_hash() -> str:
    from llmsys.specdec import chat

    recipe = {"keep": KEEP, "prompts": TRAIN_PROMPTS, "new_tokens": NEW_TOKENS, "batch": BATCH, "epochs": SEQ_KD_EPOCHS,
              "lr": LR, "seed": SEED, "templates": chat.TRAIN_TEMPLATES}
    return cache.spec_hash({"format": cache.FORMAT_VERSION, "student": FORMAT, "gguf": pretrained.GGUF_SHA256, "recipe": recipe,
                          "topics": chat.help_topics()})


def _build(folder, progress: bool) -> dict:
    start = time.perf_counter()
    teacher, tok = zoo.load(zoo.PRETRAINED), zoo.tokenizer(zoo.PRETRAINED)
    prompts = chat_prompts(tok, "train", TRAIN_PROMPTS).to(teacher.tok_embeddings.weight.device)
    metrics = {"params": layer_dropped(teacher).cfg.n_params(), "keep": list(KEEP), "prompts": len(prompts)}
    budget = None
    for method in METHODS:
        begin = time.perf_counter()
        torch.manual_seed(SEED)
        student = layer_dropped(teacher)
        if method == "seq_kd":
            compute, curve = train_seq_kd(student, teacher, prompts, tok.eos_token_id, progress=progress)
            budget = compute.flops
        else:
            compute, curve = train_on_policy(student, teacher, prompts, tok.eos_token_id, budget, progress=progress)
        torch.save(trained_state(student), folder / f"{method}.pt")
        metrics[method] = {**dataclasses.asdict(compute), "curve": curve, "seconds": time.perf_counter() - begin}
    metrics["build_seconds"] = time.perf_counter() - start
    return {"metrics": metrics}


def _parse(folder, manifest: dict, files: dict[str, bytes]):
    states = {m: torch.load(io.BytesIO(files[f"{m}.pt"]), map_location="cpu", weights_only=True) for m in METHODS}
    return states, manifest


def entry(force: bool = False, progress: bool = True):
    """({method: trained state}, manifest) from the zoo, built on first use (minutes on a CPU)."""
    return cache.entry(NAME, entry_hash(), _build, _parse, force=force, progress=progress)


def load_students(teacher: Transformer, progress: bool = True) -> dict[str, Transformer]:
    """{"layer_dropped", "seq_kd", "on_policy"}: the untrained student and the two distilled ones,
    on the teacher's device and in its dtype."""
    states = entry(progress=progress)[0]
    w = teacher.tok_embeddings.weight
    students = {"layer_dropped": layer_dropped(teacher)}
    for method, state in states.items():
        student = layer_dropped(teacher)
        student.load_state_dict({**student.state_dict(), **state})
        students[method] = student.to(device=w.device, dtype=w.dtype).eval()
    return students


# ---------------------------------------------------------------- measuring on held-out prompts


@torch.no_grad()
def heldout_kls(teacher: Transformer, students: dict, prompts: torch.Tensor, new_tokens: int, stop_token: int,
                seed: int = 0) -> dict[str, dict]:
    """Per student, on held-out ``prompts`` (B, P), measured with the teacher's own log-probs:
    forward KL(π_T‖π_S) on the teacher's greedy answers (what sequence-level KD trains on), top-1
    agreement and α = Σ min(π_T, π_S) there (greedy / sampled acceptance of one draft token), and
    the reverse KL(π_S‖π_T) on the student's own samples (what on-policy distillation trains on)."""
    from llmsys.specdec import acceptance_rate

    answers = teacher_answers(teacher, prompts, new_tokens, stop_token)
    inputs = answers.tokens[:, :-1]
    t_logits = teacher(inputs).float()
    out = {}
    for name, student in students.items():
        s_logits = student(inputs).float()
        own = own_sample_scores(student, teacher, prompts, new_tokens, stop_token, seed)
        out[name] = {
            "forward_kl": masked_mean(distill.forward_kl(s_logits, t_logits), answers.mask).item(),
            "top1": masked_mean((s_logits.argmax(-1) == t_logits.argmax(-1)).float(), answers.mask).item(),
            "alpha": masked_mean(acceptance_rate(t_logits.softmax(-1), s_logits.softmax(-1)), answers.mask).item(),
            "reverse_kl": own["reverse_kl"],
        }
    return out


@torch.no_grad()
def own_sample_scores(student: Transformer, teacher: Transformer, prompts: torch.Tensor, new_tokens: int,
                      stop_token: int, seed: int = 0) -> dict:
    """The student answers ``prompts`` (B, P) by sampling (temperature 1, ``seed``), as it is used; on
    those answers: the reverse KL(π_S‖π_T) over the vocabulary per token (what on-policy distillation
    trains down), the teacher's log-prob per sampled token (how likely the teacher finds the student's
    text: it falls where the student has drifted onto prefixes the teacher would not write), and that
    log-prob by answer position, averaged over the rows still answering (later positions show whether
    errors compound), and the student's entropy per token (a student that collapses onto one answer
    the teacher finds likely raises the teacher's log-prob while its entropy falls to 0 and its reverse
    KL rises to minus that log-prob). Tokens after a row's stop token are left out."""
    import torch.nn.functional as F

    from llmsys.core.model import token_logprobs

    own = distill.sample_rollouts(student, prompts, new_tokens, stop_token=stop_token,
                                  generator=torch.Generator(device=prompts.device).manual_seed(seed))
    teacher_lp, t_logits = token_logprobs(teacher, own.tokens, return_logits=True)
    s_logits = student(own.tokens[:, :-1]).float()
    s_logp = F.log_softmax(s_logits, -1)
    mask = own.mask
    answer = slice(own.prompt_len - 1, None)  # the positions that predict answer tokens
    by_position = (teacher_lp * mask)[:, answer].sum(0) / mask[:, answer].sum(0).clamp_min(1)
    return {"reverse_kl": masked_mean(distill.reverse_kl(s_logits, t_logits), mask).item(),
            "teacher_logprob": masked_mean(teacher_lp, mask).item(), "teacher_logprob_by_position": by_position.tolist(),
            "entropy": masked_mean(-(s_logp.exp() * s_logp).sum(-1), mask).item()}


def drafting(teacher: Transformer, students: dict, prompts: list[torch.Tensor], new_tokens: int, gamma: int = 4) -> list[dict]:
    """Each student as a drafter for the teacher (chapter 4's ``speculative_decode``, greedy, a
    chain of ``gamma``): rows of ``specdec.measure_methods`` with acceptance and tokens per call."""
    from llmsys.specdec import ModelDrafter, measure_methods, speculative_decode

    methods = {name: (lambda p, n, t, g, s=s: speculative_decode(teacher, ModelDrafter(s), p, n, gamma, t, generator=g))
               for name, s in students.items()}
    return measure_methods(methods, prompts, new_tokens, temperature=0.0, warmup=False)
