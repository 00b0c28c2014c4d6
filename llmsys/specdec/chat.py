"""Drafters for the real chat model, SmolLM2-135M-Instruct (``llmsys.core.pretrained``), built by the zoo.

The EAGLE head (``drafters.EagleHead``) learns from the target itself: the target answers chat
prompts about Python's help topics (``pydoc_data.topics`` ships with Python) and coding-agent
prompts over standard-library functions, served by the continuous-batching engine; one
teacher-forced pass gives its hidden states along the answers (``eagle_data``), and the head is
trained to predict the next hidden state and token from them, on the answers (self-distillation:
no other data, and exactly the text the target will be asked to reproduce). Its LM head keeps the most frequent tokens of the target's
answers and of the help text (frequency-ranked vocabulary truncation), so a draft step reads a
few MB.

    from llmsys.core import zoo
    from llmsys.specdec import chat, speculative_decode, EagleDrafter
    target = zoo.load("smollm2").to(torch.bfloat16)
    head = chat.load_eagle(target)               # built once by the zoo (minutes on a CPU), then cached
    head = chat.load_eagle(target, sequences=568)  # 4x the answers: its own zoo entry, ~4x the build time
    out, stats = speculative_decode(target, EagleDrafter(head, target), prompt, 128, gamma=5)
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict, replace

import torch

from llmsys.core import cache, pretrained, zoo
from llmsys.core.model import ModelConfig, Transformer
from llmsys.specdec import eagle_data
from llmsys.specdec.drafters import EagleHead
from llmsys.specdec.eagle_data import help_topics
from llmsys.specdec.heads import HEADS_FORMAT, HeadSpec, head_accuracy, train_head

NAME = "smollm2-eagle"
# the distilled student's prompts (``llmsys.distill.chat``): every help topic in the first two phrasings
TRAIN_TEMPLATES = eagle_data.CHAT_PHRASINGS[:2]
ANSWER_TOKENS = 96  # tokens of each answer recorded (the benchmark decodes 128: the head generalises)
# the head trains and is scored on the answers, with this many prompt tokens before each: the chat
# template is easy to predict, and would take its training and inflate its score
ANSWER_CONTEXT = 8
GENERATE_BATCH = eagle_data.GENERATE_BATCH  # prompts decoded together: one weight read serves them all
SPEC = HeadSpec("eagle", steps=160, batch_size=8, seq_len=ANSWER_TOKENS + ANSWER_CONTEXT, lr=3e-3, vocab=8192)
# answers the zoo's head trains on (about 13.6k answer tokens, within the zoo's two-minute budget);
# ``benchmarks/eagle_data.py`` measures what more buys, ``load_eagle(sequences=...)`` builds it
DEFAULT_SEQUENCES = 142
HELD_OUT = 16  # the pool's last prompts: no size trains on them, they score every head
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


def entry_name(sequences: int = DEFAULT_SEQUENCES) -> str:
    """The zoo's name for a head trained on ``sequences`` answers: the default keeps the plain name."""
    return NAME if sequences == DEFAULT_SEQUENCES else f"{NAME}-{sequences}"


def entry_hash(sequences: int = DEFAULT_SEQUENCES) -> str:
    """What the head depends on: the target's file, the prompts, how many answers, the recipe."""
    return cache.spec_hash({"format": cache.FORMAT_VERSION, "heads": HEADS_FORMAT, "gguf": pretrained.GGUF_SHA256,
                            "spec": asdict(eagle_spec(sequences)), "phrasings": eagle_data.CHAT_PHRASINGS,
                            "code_tasks": eagle_data.code_tasks(), "answers": "engine, teacher-forced features",
                            "sequences": sequences, "held_out": HELD_OUT, "answer_tokens": ANSWER_TOKENS,
                            "answer_context": ANSWER_CONTEXT, "topics": help_topics()})


def eagle_spec(sequences: int) -> HeadSpec:
    """The head's recipe for ``sequences`` training answers: the same passes over the data as the default
    (steps grow with the data), so sizes differ in what the head sees, not in how often."""
    return replace(SPEC, steps=max(1, round(SPEC.steps * sequences / DEFAULT_SEQUENCES)))


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
    second pass), ``batch_size`` rows at a time, with a bar labelled ``desc``: static batching with
    ``generate``, which the distilled student's teacher uses and the engine is measured against. Returns tokens (N, L)
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


def distilled_data(target: Transformer, tok, sequences: int, progress: bool = True, held_out: int = HELD_OUT,
                   answer_tokens: int = ANSWER_TOKENS) -> dict:
    """The target's answers to the first ``sequences`` prompts of the pool and to the ``held_out`` last ones,
    generated by the engine, with teacher-forced features: {"train": (tokens, features), "held_out": ...,
    "generate_seconds", "features_seconds"}; each row is the answer and the ``ANSWER_CONTEXT`` tokens before it."""
    prompts = eagle_data.training_prompts(tok)
    if not (1 <= sequences <= len(prompts) - held_out and held_out >= 1 and answer_tokens >= 2):
        raise ValueError(f"sequences={sequences}, held_out={held_out}, answer_tokens={answer_tokens}: need "
                         f"sequences >= 1, held_out >= 1, sequences + held_out <= {len(prompts)} (the pool) "
                         f"and answer_tokens >= 2")
    chosen = prompts[:sequences] + prompts[-held_out:]
    start = time.perf_counter()
    answers = eagle_data.engine_answers(target, chosen, answer_tokens, GENERATE_BATCH, progress=progress)
    generated = time.perf_counter()
    tokens, features = eagle_data.teacher_forced(target, answers, answer_tokens + ANSWER_CONTEXT)
    return {"train": (tokens[:sequences], features[:sequences]),
            "held_out": (tokens[sequences:], features[sequences:]),
            "generate_seconds": generated - start, "features_seconds": time.perf_counter() - generated}


def train_eagle(target: Transformer, tok, tokens: torch.Tensor, features: torch.Tensor,
                progress: bool = True) -> EagleHead:
    """An EAGLE head trained on rows of ``distilled_data`` with ``eagle_spec(len(tokens))``; its LM head keeps the
    tokens most frequent in the help text and the answers (the target's own words weigh more)."""
    answers = tokens[:, ANSWER_CONTEXT:].flatten().cpu()
    ranking = torch.cat([help_text_ids(tok), answers.repeat(4)])
    return train_head(eagle_spec(len(tokens)), target, ranking, progress=progress, data=(tokens, features))


def held_out_scores(head: EagleHead, target: Transformer, tokens: torch.Tensor, features: torch.Tensor) -> dict:
    """Teacher-forced top-1 agreement with the target at draft depths 1 and 2 on held-out rows, scored from
    the prompt's last token on (every guess is of an answer token), and the answers' share in the head's rows."""
    depth1, depth2 = head_accuracy(head, target, tokens[:, ANSWER_CONTEXT:], features[:, ANSWER_CONTEXT:])
    kept = torch.isin(tokens[:, ANSWER_CONTEXT:], head.vocab.to(tokens.device)).float().mean().item()
    return {"held_out_top1": depth1, "held_out_top1_depth2": depth2, "held_out_vocab_coverage": kept}


def _builder(sequences: int):
    def build(folder, progress: bool) -> dict:
        start, cpu = time.perf_counter(), time.process_time()
        target, tok = zoo.load(zoo.PRETRAINED), zoo.tokenizer(zoo.PRETRAINED)
        data = distilled_data(target, tok, sequences, progress)
        head = train_eagle(target, tok, *data["train"], progress=progress)
        torch.save({k: v.cpu() for k, v in head.state_dict().items()}, folder / "head.pt")
        metrics = {"params": sum(p.numel() for p in head.parameters()), "train_sequences": sequences,
                   "train_answer_tokens": sequences * ANSWER_TOKENS,
                   **held_out_scores(head, target, *data["held_out"]),
                   "generate_seconds": data["generate_seconds"], "features_seconds": data["features_seconds"],
                   "build_seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
                   "threads": torch.get_num_threads()}
        return {"spec": asdict(eagle_spec(sequences)), "config": target.cfg.to_dict(), "metrics": metrics}

    return build


def _parse(folder, manifest: dict, files: dict[str, bytes]):
    head = EagleHead(ModelConfig(**manifest["config"]), vocab=SPEC.vocab)
    head.load_state_dict(torch.load(io.BytesIO(files["head.pt"]), map_location="cpu", weights_only=True))
    return head.eval(), manifest


def entry(force: bool = False, progress: bool = True, sequences: int = DEFAULT_SEQUENCES):
    """(EAGLE head, manifest) from the zoo, built on first use from ``sequences`` answers (the default fits the
    zoo's budget; a larger head is its own entry, ``entry_name(sequences)``)."""
    return cache.entry(entry_name(sequences), entry_hash(sequences), _builder(sequences), _parse, force=force,
                       progress=progress)


def load_eagle(target: Transformer, progress: bool = True, sequences: int = DEFAULT_SEQUENCES) -> EagleHead:
    """The zoo's EAGLE head for SmolLM2 trained on ``sequences`` answers, on the target's device and in its dtype."""
    w = target.tok_embeddings.weight
    return entry(progress=progress, sequences=sequences)[0].to(device=w.device, dtype=w.dtype)
