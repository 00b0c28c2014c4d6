"""What the EAGLE head needs: acceptance against training tokens, on SmolLM2-135M-Instruct.

    python benchmarks/eagle_data.py --json benchmarks/results/eagle_data.json   # 4 sizes, ~25 min of one core
    python benchmarks/eagle_data.py --sizes 3072 13632 27264 54528 --json PATH  # answer tokens per size
    python benchmarks/eagle_data.py --tiny --json /tmp/eagle_data.json          # seconds: checks the pipeline

The target answers the largest size's prompts once, through the continuous-batching engine
(``llmsys.specdec.eagle_data``); each size trains a head on a prefix of those answers (larger
sizes hold the smaller ones), with the zoo's recipe and steps in proportion to the data (every
size makes the same passes over its data: ``chat.eagle_spec``). Every head drafts chains of γ
tokens for the target in fp32, so drafting is lossless (checked: the tokens equal plain greedy
decoding), on held-out chat prompts (``chat.EVAL_PROMPTS``) and on the agentic workload
(``specdec.agentic``, whose functions and questions no training prompt uses). Per size:
acceptance α, tokens per target call, and the teacher-forced top-1 agreement on held-out answers.

Before that, the engine's speed is measured against the static batched ``generate`` the zoo used
before (``chat.self_distilled``) on the same prompts, side by side.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from llmsys import specdec
from llmsys.core import pretrained, zoo
from llmsys.specdec import agentic, chat, eagle_data

DEFAULT_SIZES = (3072, 6816, 13632, 27264)  # answer tokens: 32, 71, 142 (the zoo's default) and 284 answers
GAMMA = 5


def speed(target, tok, n_prompts: int, answer_tokens: int) -> dict:
    """Answer tokens per second of the engine (plus its teacher-forced pass) and of batched generate
    (features recorded while decoding), on the pool's first ``n_prompts`` prompts."""
    prompts = eagle_data.training_prompts(tok)[:n_prompts]
    start = time.perf_counter()
    answers = eagle_data.engine_answers(target, prompts, answer_tokens, chat.GENERATE_BATCH)
    engine = time.perf_counter() - start
    eagle_data.teacher_forced(target, answers, answer_tokens + chat.ANSWER_CONTEXT)
    forced = time.perf_counter() - start - engine
    start = time.perf_counter()
    chat.self_distilled(target, pretrained.left_padded(tok, prompts), answer_tokens, chat.GENERATE_BATCH,
                        progress=False)
    generate = time.perf_counter() - start
    tokens = n_prompts * answer_tokens
    return {"prompts": n_prompts, "answer_tokens": tokens, "batch": chat.GENERATE_BATCH,
            "engine_tok_s": tokens / engine, "engine_with_features_tok_s": tokens / (engine + forced),
            "generate_tok_s": tokens / generate, "ratio": generate / engine,
            "ratio_with_features": generate / (engine + forced)}


def acceptance(target, head, prompts: list, references: list, new_tokens: int) -> dict:
    method = {"eagle": lambda p, n, t, g: specdec.speculative_decode(target, specdec.EagleDrafter(head, target),
                                                                       p, n, GAMMA, t, generator=g)}
    row = specdec.measure_methods(method, prompts, new_tokens, 0.0, references, warmup=False)[0]
    return {"alpha": row["acceptance"], "tokens_per_call": row["tokens_per_call"], "lossless": row["exact"]}


def reading(curve: list[dict]) -> str:
    first, last = curve[0], curve[-1]
    before = curve[-2]
    gain = {w: last[w]["tokens_per_call"] - before[w]["tokens_per_call"] for w in ("chat", "agentic")}
    return (f"from {first['answer_tokens']:,} to {last['answer_tokens']:,} answer tokens, α rose "
            f"{first['chat']['alpha']:.2f} -> {last['chat']['alpha']:.2f} on chat and "
            f"{first['agentic']['alpha']:.2f} -> {last['agentic']['alpha']:.2f} on agentic; going from "
            f"{before['answer_tokens']:,} to {last['answer_tokens']:,} tokens changed tokens per target call by "
            f"{gain['chat']:+.2f} (chat) and {gain['agentic']:+.2f} (agentic)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="training answer tokens per size (rounded to whole answers of "
                             f"{chat.ANSWER_TOKENS} tokens), at least 4 sizes")
    parser.add_argument("--chat-prompts", type=int, default=8, help=f"held-out chat prompts (up to "
                                                                     f"{len(chat.EVAL_PROMPTS)})")
    parser.add_argument("--sessions", type=int, default=2, help="agentic sessions (3 turns each)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt when measuring")
    parser.add_argument("--compare", type=int, default=64, help="prompts for the engine vs generate speed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="a pipeline check in seconds: sizes 1-4 answers of 8 "
                                                            "tokens, one prompt per workload")
    parser.add_argument("--json", help="write the curve here")
    args = parser.parse_args(argv)
    answer_tokens, held_out = chat.ANSWER_TOKENS, chat.HELD_OUT
    if args.tiny:
        answer_tokens, held_out = 8, 2
        args.sizes, args.chat_prompts, args.sessions, args.new_tokens, args.compare = [8, 16, 24, 32], 1, 1, 8, 2
    sequences = sorted({max(1, round(n / answer_tokens)) for n in args.sizes})
    if len(sequences) < 4:
        sys.exit(f"--sizes must give at least 4 distinct sizes of whole {answer_tokens}-token answers, got {sequences}")
    if min(args.chat_prompts, args.sessions, args.new_tokens, args.compare, args.threads) < 1:
        sys.exit("--chat-prompts, --sessions, --new-tokens, --compare and --threads must be positive")
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    target, tok = zoo.load(zoo.PRETRAINED, device="cpu"), zoo.tokenizer(zoo.PRETRAINED)  # fp32: lossless drafting
    pool = len(eagle_data.training_prompts(tok)) - held_out
    if sequences[-1] > pool:
        sys.exit(f"the largest size needs {sequences[-1]} answers; the prompt pool holds {pool} (and {held_out} "
                 f"held out): give smaller --sizes")
    rate = speed(target, tok, args.compare, answer_tokens)
    print(f"engine (batch {rate['batch']}) {rate['engine_tok_s']:.0f} answer tok/s, with its teacher-forced pass "
          f"{rate['engine_with_features_tok_s']:.0f}; batched generate {rate['generate_tok_s']:.0f}: "
          f"{rate['ratio']:.2f}x ({rate['ratio_with_features']:.2f}x with features) on {args.compare} prompts")
    data = chat.distilled_data(target, tok, sequences[-1], progress=False, held_out=held_out,
                               answer_tokens=answer_tokens)
    if args.tiny:  # the first turn of the first session, without playing the session
        played = [pretrained.chat_ids(tok, eagle_data.first_turn(agentic.sessions(1)[0]))]
    else:
        played = agentic.played_prompts(target, tok, args.sessions, args.new_tokens)
    workloads = {"chat": chat.eval_prompts(tok)[:args.chat_prompts], "agentic": played}
    references = {w: [specdec.autoregressive_decode(target, p, args.new_tokens)[0] for p in prompts]
                  for w, prompts in workloads.items()}
    curve = []
    for n in sequences:
        start = time.perf_counter()
        tokens, features = (t[:n] for t in data["train"])
        head = chat.train_eagle(target, tok, tokens, features, progress=False)
        point = {"sequences": n, "answer_tokens": n * answer_tokens, "steps": chat.eagle_spec(n).steps,
                 "train_seconds": time.perf_counter() - start,
                 **chat.held_out_scores(head, target, *data["held_out"]),
                 **{w: acceptance(target, head, workloads[w], references[w], args.new_tokens) for w in workloads}}
        curve.append(point)
        print(f"{point['answer_tokens']:>7,} answer tokens ({n} answers, {point['steps']} steps): held-out top-1 "
              f"{point['held_out_top1']:.2f}; chat α {point['chat']['alpha']:.2f}, "
              f"{point['chat']['tokens_per_call']:.2f} tok/call; agentic α {point['agentic']['alpha']:.2f}, "
              f"{point['agentic']['tokens_per_call']:.2f} tok/call", flush=True)
    if not all(p[w]["lossless"] for p in curve for w in workloads):
        sys.exit("an fp32 EAGLE chain changed the target's greedy tokens: drafting must be lossless")
    line = reading(curve)
    print(line)
    if args.json:
        result = {"command": "python benchmarks/eagle_data.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "threads": args.threads, "dtype": "float32",
                  "gamma": GAMMA, "new_tokens": args.new_tokens, "answer_tokens_per_answer": answer_tokens,
                  "held_out_answers": held_out, "chat_prompts": args.chat_prompts,
                  "agentic_prompts": len(workloads["agentic"]),
                  "policy": "steps in proportion to the training tokens (the same passes over the data at every "
                            f"size: {chat.SPEC.steps} steps of {chat.SPEC.batch_size} answers at "
                            f"{chat.DEFAULT_SEQUENCES} answers)",
                  "speed": rate, "generate_seconds": data["generate_seconds"],
                  "features_seconds": data["features_seconds"], "curve": curve, "reading": line,
                  "wall_seconds": time.perf_counter() - wall}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
