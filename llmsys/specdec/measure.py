"""Measuring decoding methods side by side: call costs, round-robin runs, tables."""

from __future__ import annotations

import time
from statistics import fmean

import torch

from llmsys.core.model import Transformer
from llmsys.specdec.decode import autoregressive_decode, dynamic_tree_decode, speculative_decode, tree_decode
from llmsys.specdec.drafters import ModelDrafter, PromptLookupDrafter
from llmsys.specdec.heads import make_drafter
from llmsys.specdec.planning import KS


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def call_seconds(model: Transformer, context: int, new_tokens: int, repeats: int = 30) -> float:
    """Median time of one forward over ``new_tokens`` tokens after ``context`` cached ones: CPU
    time of this process on a CPU (robust to other processes sharing the cores), wall time on a GPU."""
    dev = model.tok_embeddings.weight.device
    cache = model.new_cache(1)
    model(torch.zeros(1, context, dtype=torch.long, device=dev), cache)
    x = torch.zeros(1, new_tokens, dtype=torch.long, device=dev)
    clock = time.perf_counter if dev.type == "cuda" else time.process_time
    times = []
    for i in range(repeats + 5):  # the first few calls warm caches and allocators: not timed
        _sync()
        start = clock()
        model(x, cache)
        _sync()
        if i >= 5:
            times.append(clock() - start)
        cache.truncate(context)
    times.sort()
    return times[len(times) // 2]


def cost_curves(models: dict, context: int, ks=KS, repeats: int = 10) -> dict[str, dict[int, float]]:
    """{dtype: {k: seconds of one call scoring k tokens after ``context`` cached ones}}: what ``planning``
    plans from."""
    return {name: {k: call_seconds(model, context, k, repeats) for k in ks} for name, model in models.items()}


@torch.no_grad()
def sampled_ceiling(target: Transformer, prompts: list, new_tokens: int, top: int = 4, seed: int = 0) -> dict:
    """What any drafter of fixed tokens could get at temperature 1, along the target's own sampled answers.

    A draft token x is accepted with the target's probability p(x); a tree of candidates under one node with
    their summed probability. So at each position the target's largest probability bounds one draft's chance,
    and its ``top`` largest summed bound a ``top``-wide level. Returns their means over every answer token
    (``p_max``, ``p_top``) and ``chain_tokens``: the tokens per call of an oracle drafting the target's
    most likely token 5 deep, 1 + p1 + p1·p2 + ... with the answers' own largest probabilities, averaged
    over every position a round could start at (an estimate: the oracle's own path would differ)."""
    if not prompts or not 1 <= top <= target.cfg.vocab_size:
        raise ValueError(f"sampled_ceiling needs at least one prompt and 1 <= top <= {target.cfg.vocab_size} "
                         f"(the vocabulary), got {len(prompts)} prompt(s) and top={top!r}")
    gen = torch.Generator(device=prompts[0].device).manual_seed(seed)
    p_max, p_top, chain = [], [], []
    for prompt in prompts:
        out, _ = autoregressive_decode(target, prompt, new_tokens, 1.0, generator=gen)
        probs = torch.softmax(target(out[:, :-1])[0, prompt.size(1) - 1:].float(), -1)  # (new_tokens, V)
        best = probs.max(-1).values.tolist()
        p_max += best
        p_top += probs.topk(top, -1).values.sum(-1).tolist()
        for i in range(len(best)):
            run, total = 1.0, 1.0
            for p in best[i:i + 5]:
                run *= p
                total += run
            chain.append(total)
    return {"p_max": fmean(p_max), "top": top, "p_top": fmean(p_top), "chain_tokens": fmean(chain)}


def measure_methods(methods: dict, prompts: list, new_tokens: int, temperature: float = 0.0, reference=None,
                    warmup: bool = True, progress: bool = False) -> list[dict]:
    """Run every decoding method on every prompt, round-robin (so that a machine shared with
    other work slows them all alike), and total what they did.

    ``methods`` maps a name to fn(prompt, new_tokens, temperature, generator) -> (tokens, stats);
    ``reference`` (optional) holds the expected output per prompt, for the lossless check.
    Each row: wall and CPU seconds, tokens/s by both clocks, tokens per target call, acceptance,
    drafting time and calls, 'exact' (every output equal to the reference, or None) and 'matches'
    (how many were); ``progress``:
    a bar over the prompts."""
    from tqdm.auto import tqdm

    rows = {name: {"method": name, "wall": 0.0, "cpu": 0.0, "rounds": 0, "accepted": 0, "reached": 0, "drafted": 0,
                   "draft_seconds": 0.0, "draft_calls": 0, "exact": True if reference is not None else None,
                   "matches": 0}
            for name in methods}
    if warmup:
        for fn in methods.values():
            fn(prompts[0], min(8, new_tokens), temperature, torch.Generator(device=prompts[0].device).manual_seed(0))
    for i, prompt in enumerate(tqdm(prompts, desc=f"{len(methods)} methods, T={temperature}", disable=not progress,
                                    leave=False)):
        for name, fn in methods.items():
            row = rows[name]
            _sync()
            wall, cpu = time.perf_counter(), time.process_time()
            out, stats = fn(prompt, new_tokens, temperature, torch.Generator(device=prompt.device).manual_seed(i))
            _sync()
            row["wall"] += time.perf_counter() - wall
            row["cpu"] += time.process_time() - cpu
            row["rounds"] += stats.rounds
            row["accepted"] += sum(stats.accepted)
            row["reached"] += stats.reached
            row["drafted"] += sum(stats.drafted)
            row["draft_seconds"] += stats.draft_seconds
            row["draft_calls"] += stats.draft_calls
            if reference is not None:
                same = torch.equal(out.cpu(), reference[i].cpu())
                row["exact"] &= same
                row["matches"] += same
    tokens = new_tokens * len(prompts)
    for row in rows.values():
        row["tok_s_wall"], row["tok_s_cpu"] = tokens / row["wall"], tokens / row["cpu"]
        row["tokens_per_call"] = (row["accepted"] + row["rounds"]) / max(1, row["rounds"])
        row["acceptance"] = row["accepted"] / row["reached"] if row["reached"] else float("nan")
    return list(rows.values())


def format_table(rows: list[dict], title: str = "") -> str:
    """The rows of ``measure_methods`` as text, speedups relative to the first row."""
    base = rows[0]
    lines = [title] if title else []
    lines.append(f"{'method':<30} {'tok/s wall':>10} {'speedup':>8} {'tok/s cpu':>10} {'speedup':>8} "
                 f"{'tok/call':>9} {'accept':>7} {'lossless':>9}")
    for r in rows:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        accept = "-" if r["acceptance"] != r["acceptance"] else f"{r['acceptance']:.2f}"
        lines.append(f"{r['method']:<30} {r['tok_s_wall']:>10.1f} {r['tok_s_wall'] / base['tok_s_wall']:>7.2f}x "
                     f"{r['tok_s_cpu']:>10.1f} {r['tok_s_cpu'] / base['tok_s_cpu']:>7.2f}x "
                     f"{r['tokens_per_call']:>9.2f} {accept:>7} {exact:>9}")
    return "\n".join(lines)


def standard_methods(target: Transformer, draft: Transformer | None = None, heads: dict | None = None,
                     gamma: int = 4, widths=(3, 2, 1), lookup_ngram: int | None = None,
                     dynamic: tuple[int, int, int] | None = None) -> dict:
    """Target-only decoding plus a chain and a tree for every drafter given, with ``dynamic`` =
    (depth, expand, nodes) an EAGLE-2 dynamic tree for every drafter without a depth limit, and
    with ``lookup_ngram`` a chain of prompt-lookup drafts: name -> fn."""
    methods = {"target only": lambda p, n, t, g: autoregressive_decode(target, p, n, t, generator=g)}
    drafters = {}
    if draft is not None:
        drafters["draft model"] = lambda: ModelDrafter(draft)
    for kind, head in (heads or {}).items():
        drafters[{"medusa": "Medusa heads", "mtp": "MTP heads", "eagle": "EAGLE head"}.get(kind, kind)] = (
            lambda head=head: make_drafter(head, target))
    label = "x".join(map(str, widths))
    for name, make in drafters.items():
        g = min(gamma, make().max_depth or gamma)
        methods[f"{name}, chain γ={g}"] = (
            lambda p, n, t, gen, make=make, g=g: speculative_decode(target, make(), p, n, g, t, generator=gen))
        methods[f"{name}, tree {label}"] = (
            lambda p, n, t, gen, make=make: tree_decode(target, make(), p, n, widths, t, generator=gen))
        if dynamic is not None and make().max_depth is None:
            d, k, m = dynamic
            methods[f"{name}, dynamic tree {m} nodes"] = (
                lambda p, n, t, gen, make=make: dynamic_tree_decode(target, make(), p, n, d, k, m, t, generator=gen))
    if lookup_ngram is not None:
        methods[f"prompt lookup, chain γ={gamma}"] = lambda p, n, t, gen: speculative_decode(
            target, PromptLookupDrafter(target.cfg.vocab_size, lookup_ngram), p, n, gamma, t, generator=gen)
    return methods
