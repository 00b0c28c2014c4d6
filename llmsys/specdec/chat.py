"""Drafters for the real chat model, SmolLM2-135M-Instruct (``llmsys.core.pretrained``), built by the zoo.

The EAGLE head (``drafters.EagleHead``) learns from the target itself: the target answers chat
prompts about Python's help topics (``pydoc_data.topics`` ships with Python), its hidden states
are recorded while it decodes, and the head is trained to predict the next hidden state and
token from them, on the answers (self-distillation: no other data, and exactly the text the
target will be asked to reproduce). Its LM head keeps the most frequent tokens of the target's
answers and of the help text (frequency-ranked vocabulary truncation), so a draft step reads a
few MB.

    from llmsys.core import zoo
    from llmsys.specdec import chat, speculative_decode, EagleDrafter
    target = zoo.load("smollm2").to(torch.bfloat16)
    head = chat.load_eagle(target)               # built once by the zoo (minutes on a CPU), then cached
    out, stats = speculative_decode(target, EagleDrafter(head, target), prompt, 128, gamma=5)
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict

import torch

from llmsys.core import cache, pretrained, zoo
from llmsys.core.model import ModelConfig, Transformer
from llmsys.specdec.drafters import EagleHead
from llmsys.specdec.heads import HEADS_FORMAT, HeadSpec, head_accuracy, train_head

NAME = "smollm2-eagle"
# chat prompts the head trains on: every help topic in two phrasings
TRAIN_TEMPLATES = (
    "Explain the Python topic '{}' briefly.",
    "Give a short example of '{}' in Python and explain it.",
)
ANSWER_TOKENS = 96  # tokens of each answer recorded (the benchmark decodes 128: the head generalises)
# the head trains and is scored on the answers, with this many prompt tokens before each: the chat
# template and the left padding are easy to predict, and would take its training and inflate its score
ANSWER_CONTEXT = 8
GENERATE_BATCH = 32  # prompts decoded together: one weight read serves them all
SPEC = HeadSpec("eagle", steps=160, batch_size=8, seq_len=ANSWER_TOKENS + ANSWER_CONTEXT, lr=3e-3, vocab=8192)
# held-out chat prompts (questions and explanations, none of them a help topic's phrasing above)
EVAL_PROMPTS = (
    "What is the difference between a list and a tuple in Python?",
    "How do I read a text file line by line in Python?",
    "Explain what a Python decorator does, with a small example.",
    "Why is my recursive function slow, and how can memoization help?",
    "What does the `if __name__ == '__main__':` line do?",
    "How do virtual environments work in Python?",
    "Explain list comprehensions to a beginner.",
    "What is the GIL and why does it matter?",
    "How can I sort a list of dictionaries by a key?",
    "What are *args and **kwargs used for?",
    "Explain the difference between == and is.",
    "How do I handle a missing key in a dictionary?",
    "What is a generator, and when should I use one?",
    "Give me three tips for writing readable Python code.",
    "How does exception chaining work in Python?",
    "What is the difference between a shallow copy and a deep copy?",
    "Explain how Python's garbage collection works.",
    "How do I measure how long a piece of Python code takes?",
)
# an editing task: the answer copies most of the prompt, where prompt-lookup drafting shines
EDIT_TEXT = ("The quick brown fox jumps over the lazy dog. Python is a programing language that lets you work "
             "quickly and integrate systems more effectivly. It is used for web development, data analysis, "
             "machine learning and automation, and it has a large comunity of developers.")
EDIT_PROMPT = f"Fix the spelling mistakes in this text and repeat it in full:\n\n{EDIT_TEXT}"


def entry_hash() -> str:
    """What the head depends on: the target's file, the prompts, the recipe."""
    return cache.spec_hash({"format": cache.FORMAT_VERSION, "heads": HEADS_FORMAT, "gguf": pretrained.GGUF_SHA256,
                      "spec": asdict(SPEC), "templates": TRAIN_TEMPLATES, "answer_tokens": ANSWER_TOKENS,
                      "answer_context": ANSWER_CONTEXT,
                      "topics": help_topics()})


def help_topics() -> list[str]:
    """The names of Python's help topics (``pydoc_data.topics``), sorted: the prompts' subjects."""
    from pydoc_data.topics import topics

    return sorted(topics)


def train_prompts(tok) -> list[torch.Tensor]:
    from llmsys.core.pretrained import chat_ids

    return [chat_ids(tok, template.format(topic)) for template in TRAIN_TEMPLATES for topic in help_topics()]


def eval_prompts(tok) -> list[torch.Tensor]:
    from llmsys.core.pretrained import chat_ids

    return [chat_ids(tok, text) for text in EVAL_PROMPTS]


@torch.no_grad()
def self_distilled(target: Transformer, prompts: torch.Tensor, new_tokens: int, batch_size: int = GENERATE_BATCH,
                   progress: bool = True, desc: str = f"{NAME}: target answers"):
    """The target's greedy answers to ``prompts`` (N, P), left-padded (``pretrained.left_padded``),
    and its final hidden states on them, recorded while it decodes (a hook on its final norm: no
    second pass), ``batch_size`` rows at a time, with a bar labelled ``desc``. Returns tokens (N, L)
    and features (N, L, dim), L = P + new_tokens - 1: the last token has no feature yet."""
    from tqdm.auto import tqdm

    recorded: list[torch.Tensor] = []
    hook = target.norm.register_forward_hook(lambda module, args, out: recorded.append(out.float()))
    tokens, features = [], []
    try:
        batches = prompts.to(target.tok_embeddings.weight.device).split(batch_size)
        for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
            recorded.clear()
            tokens.append(target.generate(batch, new_tokens)[:, :-1])  # (B, L)
            features.append(torch.cat(recorded, dim=1))  # (B, L, dim)
    finally:
        hook.remove()
    return torch.cat(tokens), torch.cat(features)


def help_text_ids(tok) -> torch.Tensor:
    """The help text in the target's tokenizer: it ranks the head's vocabulary with the answers."""
    from llmsys.core.zoo import corpus

    return torch.tensor(tok(corpus())["input_ids"], dtype=torch.long)


def _build(folder, progress: bool) -> dict:
    from llmsys.core.pretrained import left_padded

    start, cpu = time.perf_counter(), time.process_time()
    target, tok = zoo.load(zoo.PRETRAINED), zoo.tokenizer(zoo.PRETRAINED)
    prompts = train_prompts(tok)
    held_out = prompts[::10]  # every tenth prompt measures the head, the rest train it
    train = [p for i, p in enumerate(prompts) if i % 10]
    tokens, features = self_distilled(target, left_padded(tok, train), ANSWER_TOKENS, progress=progress)
    generated = time.perf_counter() - start
    answers = tokens[:, -ANSWER_TOKENS:].flatten().cpu()
    ranking = torch.cat([help_text_ids(tok), answers.repeat(4)])  # the target's own words weigh more
    keep = ANSWER_TOKENS + ANSWER_CONTEXT  # the last prompt tokens, then the answer
    head = train_head(SPEC, target, ranking, progress=progress, data=(tokens[:, -keep:], features[:, -keep:]))
    torch.save({k: v.cpu() for k, v in head.state_dict().items()}, folder / "head.pt")
    val_tokens, val_features = self_distilled(target, left_padded(tok, held_out), ANSWER_TOKENS,
                                             progress=progress)
    # scored from the prompt's last token on: every guess is of an answer token
    depth1, depth2 = head_accuracy(head, target, val_tokens[:, -ANSWER_TOKENS:], val_features[:, -ANSWER_TOKENS:])
    kept = torch.isin(val_tokens[:, -ANSWER_TOKENS:], head.vocab).float().mean().item()
    metrics = {"params": sum(p.numel() for p in head.parameters()), "train_sequences": len(tokens),
               "held_out_top1": depth1, "held_out_top1_depth2": depth2, "held_out_vocab_coverage": kept,
               "generate_seconds": generated, "build_seconds": time.perf_counter() - start,
               "cpu_seconds": time.process_time() - cpu, "threads": torch.get_num_threads()}
    return {"spec": asdict(SPEC), "config": target.cfg.to_dict(), "metrics": metrics}


def _parse(folder, manifest: dict, files: dict[str, bytes]):
    head = EagleHead(ModelConfig(**manifest["config"]), vocab=SPEC.vocab)
    head.load_state_dict(torch.load(io.BytesIO(files["head.pt"]), map_location="cpu", weights_only=True))
    return head.eval(), manifest


def entry(force: bool = False, progress: bool = True):
    """(EAGLE head, manifest) from the zoo, built on first use."""
    return cache.entry(NAME, entry_hash(), _build, _parse, force=force, progress=progress)


def load_eagle(target: Transformer, progress: bool = True) -> EagleHead:
    """The zoo's EAGLE head for SmolLM2, on the target's device and in its dtype."""
    w = target.tok_embeddings.weight
    return entry(progress=progress)[0].to(device=w.device, dtype=w.dtype)
