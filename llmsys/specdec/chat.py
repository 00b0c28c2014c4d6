"""Drafters for the real chat model, SmolLM2-135M-Instruct (``llmsys.pretrained``), built by the zoo.

The EAGLE head (``drafters.EagleHead``) learns from the target itself: the target's greedy answers
to chat prompts about Python (``answers``: its own zoo entry, with the hidden states recorded
while it decoded), and the head is trained to predict the next hidden state and token from them
(self-distillation: no other data, and exactly the text the target will be asked to reproduce).
Its LM head keeps the most frequent tokens of the target's answers and of the help text
(frequency-ranked vocabulary truncation, FR-Spec, arXiv 2502.14856), so a draft step reads a few MB.

    from llmsys import zoo
    from llmsys.specdec import chat, dynamic_tree_decode, EagleDrafter
    target = zoo.load("smollm2").to(torch.bfloat16)
    head = chat.entry()[0]                       # built once by the zoo (minutes on a CPU), then cached; fp32
    out, stats = dynamic_tree_decode(target, EagleDrafter(head, target), prompt, 128)
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict

import torch

from llmsys.model import ModelConfig, Transformer
from llmsys.specdec import answers
from llmsys.specdec.drafters import EagleHead
from llmsys.specdec.heads import HEADS_FORMAT, HeadSpec, head_accuracy, train_head

NAME = "smollm2-eagle-head"
# 300 steps x 8 answers: about seven passes over the recorded answers, a few CPU minutes
SPEC = HeadSpec("eagle", steps=300, batch_size=8, seq_len=answers.ANSWER_TOKENS, lr=3e-3, vocab=8192)
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
    """What the head depends on: the recorded answers and the recipe."""
    from llmsys import zoo

    return zoo._hash({"format": zoo.FORMAT_VERSION, "heads": HEADS_FORMAT, "answers": answers.entry_hash(),
                      "spec": asdict(SPEC)})


def eval_prompts(tok) -> list[torch.Tensor]:
    from llmsys.pretrained import chat_ids

    return [chat_ids(tok, text) for text in EVAL_PROMPTS]


def help_text_ids(tok) -> torch.Tensor:
    """The help text in the target's tokenizer: it ranks the head's vocabulary with the answers."""
    from llmsys.zoo import corpus

    return torch.tensor(tok(corpus())["input_ids"], dtype=torch.long)


def _build(folder, progress: bool) -> dict:
    from llmsys import zoo

    start, cpu = time.perf_counter(), time.process_time()
    target, tok = zoo.load(zoo.PRETRAINED), zoo.tokenizer(zoo.PRETRAINED)
    tokens, features, _ = answers.entry(progress=progress)
    # the answers only (the last prompt token's state predicts the first answer token): what the
    # head drafts, and a training step costs what its length costs
    tokens, features = tokens[:, -SPEC.seq_len:], features[:, -SPEC.seq_len:].float()
    held_out = torch.arange(len(tokens)) % 10 == 0  # every tenth answer measures the head, the rest train it
    answer_ids = tokens[~held_out].flatten()
    ranking = torch.cat([help_text_ids(tok), answer_ids.repeat(4)])  # the target's own words weigh more
    head = train_head(SPEC, target, ranking, progress=progress, data=(tokens[~held_out], features[~held_out]))
    torch.save({k: v.cpu() for k, v in head.state_dict().items()}, folder / "head.pt")
    val_tokens, val_features = tokens[held_out][:16], features[held_out][:16]  # 16 x 96 positions: enough, and (16, 96, 49k) logits fit
    depth1, depth2 = head_accuracy(head, target, val_tokens, val_features)
    kept = torch.isin(val_tokens, head.vocab).float().mean().item()
    metrics = {"params": sum(p.numel() for p in head.parameters()), "train_sequences": int((~held_out).sum()),
               "held_out_top1": depth1, "held_out_top1_depth2": depth2, "held_out_vocab_coverage": kept,
               "threads": torch.get_num_threads(), "build_seconds": time.perf_counter() - start,
               "cpu_seconds": time.process_time() - cpu}
    return {"spec": asdict(SPEC), "config": target.cfg.to_dict(), "metrics": metrics}


def _parse(folder, manifest: dict, files: dict[str, bytes]):
    head = EagleHead(ModelConfig(**manifest["config"]), vocab=SPEC.vocab)
    head.load_state_dict(torch.load(io.BytesIO(files["head.pt"]), map_location="cpu", weights_only=True))
    return head.eval(), manifest


def entry(force: bool = False, progress: bool = True):
    """(EAGLE head, manifest) from the zoo, built on first use."""
    from llmsys import zoo

    return zoo._ensure(NAME, entry_hash(), _build, _parse, force=force, progress=progress)


def load_eagle(target: Transformer, progress: bool = True) -> EagleHead:
    """The zoo's EAGLE head for SmolLM2, on the target's device and in its dtype."""
    w = target.tok_embeddings.weight
    return entry(progress=progress)[0].to(device=w.device, dtype=w.dtype)
