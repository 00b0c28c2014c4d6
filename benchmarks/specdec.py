"""Speculative decoding benchmark: tokens per second of target-only decoding against every
drafting method, measured side by side in one run, with acceptance, tokens per target call and
a lossless check (greedy outputs must equal the target's own greedy decoding, token for token).

    python benchmarks/specdec.py                  # greedy and sampled, the embedded zoo models
    python benchmarks/specdec.py --quick          # fewer prompts and tokens
    python benchmarks/specdec.py --threads 2      # intra-op threads (default 1, see below)
    python benchmarks/specdec.py --bf16           # on a GPU: models in bf16

Methods run round-robin (prompt 1 with every method, then prompt 2, ...), so a machine shared
with other work slows them all alike. Two clocks: wall time, and the CPU time of this process
(robust when other processes compete for the cores; on a GPU only wall time means anything).
One intra-op thread by default: batch-1 decoding of these small models is a chain of small
kernels, and a second thread mostly adds synchronisation.

The last lines give the ceiling this machine sets: tokens per round at the best measured
acceptance, over the measured cost of the verify call, i.e. the speedup if drafting were free.
Where scoring γ+1 tokens costs well over one step (fp32 on a CPU: small-batch matrix products
grow with the batch), that ceiling stays low whatever the drafter.
"""

from __future__ import annotations

import argparse

import torch

from llmsys import device, specdec, zoo


def prompts_from(val_ids: torch.Tensor, n: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(val_ids) - length, (n,), generator=gen).tolist()
    return [val_ids[s:s + length].long()[None] for s in starts]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=3, help="draft tokens per round (chains)")
    parser.add_argument("--widths", default="3,2,1", help="children per node at each depth (trees)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="models and heads in bf16 (GPU, or a CPU with bf16 matrix units)")
    parser.add_argument("--quick", action="store_true", help="3 prompts, 64 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.new_tokens = 3, 64
    torch.set_num_threads(args.threads)
    dev = device.device()
    target, draft = zoo.load("target", device=dev), zoo.load("draft", device=dev)
    train_ids, val_ids = zoo.dataset()
    heads = {kind: specdec.load_head(spec, target, train_ids) for kind, spec in specdec.HEAD_SPECS.items()}
    if args.bf16:
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
        heads = {k: h.to(torch.bfloat16) for k, h in heads.items()}
    prompts = [p.to(dev) for p in prompts_from(val_ids, args.prompts, args.prompt_len)]
    clock = "wall" if dev.type == "cuda" else "cpu"
    print(f"device {dev}, {torch.get_num_threads()} thread(s); target {target.cfg.n_params():,} params, "
          f"draft {draft.cfg.n_params():,}; {args.prompts} prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens each")
    one = specdec.call_seconds(target, args.prompt_len, 1)
    costs = ", ".join(f"{k}: {specdec.call_seconds(target, args.prompt_len, k) / one:.2f}x" for k in (2, 5, 8, 16, 32))
    print(f"target call, 1 token: {one * 1e3:.2f} ms ({clock} time); k tokens in one call cost {costs}")
    c = specdec.call_seconds(draft, args.prompt_len, 1) / one
    print(f"draft model call, 1 token: c = {c:.2f} of a target call")

    widths = tuple(int(w) for w in args.widths.split(","))
    methods = specdec.standard_methods(target, draft, heads, gamma=args.gamma, widths=widths)
    reference = [specdec.autoregressive_decode(target, p, args.new_tokens)[0] for p in prompts]
    results = {}
    for mode, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        rows = specdec.measure_methods(methods, prompts, args.new_tokens, temperature,
                                       reference if temperature == 0 else None)
        note = ("lossless = the same tokens as target-only greedy decoding" if temperature == 0
                else "lossless in distribution (tests/test_specdec.py)")
        print("\n" + specdec.format_table(rows, f"{mode} (temperature {temperature:g}); {note}"))
        results[mode] = rows
    key = f"tok_s_{clock}"
    best_mode, best = max(((m, r) for m, rows in results.items() for r in rows[1:]),
                          key=lambda mr: mr[1][key] / results[mr[0]][0][key])
    print(f"\nbest: {best['method']} ({best_mode}), {best[key] / results[best_mode][0][key]:.2f}x "
          f"target-only by {clock} time")
    # what no drafter could beat here: a round yields E(α, γ) tokens and costs at least its verify call
    for mode, rows in results.items():
        chain = max((r for r in rows if "chain" in r["method"]), key=lambda r: r["acceptance"])
        gamma = int(chain["method"].rsplit("γ=", 1)[1])
        verify = specdec.call_seconds(target, args.prompt_len, gamma + 1) / one
        tokens = specdec.expected_tokens(chain["acceptance"], gamma)
        print(f"ceiling ({mode}): α = {chain['acceptance']:.2f} ({chain['method']}) gives E = {tokens:.2f} tokens per "
              f"round; verifying {gamma + 1} tokens costs {verify:.2f} steps, so even free drafting gives at most "
              f"{tokens / verify:.2f}x")
    if all(r["exact"] for r in results["greedy"]):
        return
    if not args.bf16:
        raise SystemExit("a greedy method changed the output: speculative decoding must be lossless")
    # In bf16 the target's logits for a token depend on how many tokens share its forward call
    # (other kernels, other rounding), so near-ties can break differently. The target alone shows it:
    with torch.no_grad():
        full_pass = [target(ref[:, :-1]).argmax(-1)[0, args.prompt_len - 1:] for ref in reference]
    disagree = sum(not torch.equal(f, ref[0, args.prompt_len:]) for f, ref in zip(full_pass, reference))
    print(f"\nbf16: greedy outputs differ from target-only decoding. The target alone disagrees with itself "
          f"(one token per call vs one call over the whole sequence) on {disagree} of {len(reference)} prompts: "
          f"rounding, not the algorithm. Run without --bf16 for the exact check.")


if __name__ == "__main__":
    main()
