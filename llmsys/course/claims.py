"""The lectures' central claims, each with the experiment that tests it and a verdict.

A claim is the lecture's words with the paper behind them, the experiment that
measures it here (a chapter cell, whose figure lands in the running ledger, or a
benchmark whose run is stored in ``benchmarks/results/``), and a rule that says
what the measurement must show. The verdict is one of

- **shown**: the rule holds (for seeded runs: the whole confidence interval does);
- **not shown here**: the rule fails, or a caveat (one seed, an untuned baseline)
  keeps a good number from counting; the reason is printed;
- **not testable on this machine**: what the claim needs is not here (the reason);
- **not measured yet**: the chapter or benchmark has not run on this machine.

``python -m llmsys claims [--json PATH]`` prints the table; chapters print their
own verdicts with ``verdict_line(key)`` from the same records.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llmsys.core.stats import difference_interval

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

SHOWN, NOT_SHOWN, NOT_TESTABLE, NOT_MEASURED = ("shown", "not shown here", "not testable on this machine",
                                                "not measured yet")



@dataclass(frozen=True)
class Evidence:
    value: float
    unit: str
    where: str  # "ledger: <row>" or a stored result's path
    when: str = ""
    machine: str = ""
    estimate: float | None = None  # the formula's figure, where the claim is that the formula holds
    low: float | None = None  # a 95% confidence interval, for seeded runs
    high: float | None = None
    seeds: int = 1


@dataclass(frozen=True)
class Rule:
    """What the measurement must show, in words and as a test."""
    says: str
    holds: Callable[[Evidence], bool]


def at_most(limit: float) -> Rule:
    return Rule(f"≤ {limit:g}", lambda e: (e.high if e.high is not None else e.value) <= limit)


def at_least(limit: float) -> Rule:
    return Rule(f"≥ {limit:g}", lambda e: (e.low if e.low is not None else e.value) >= limit)


def near_estimate(relative: float) -> Rule:
    """The measurement agrees with the formula's figure within ``relative``."""
    return Rule(f"within {relative:.0%} of the formula",
                lambda e: e.estimate is not None and abs(e.value - e.estimate) <= relative * abs(e.estimate))


def near(target: float, tolerance: float) -> Rule:
    return Rule(f"{target:g} ± {tolerance:g}", lambda e: abs(e.value - target) <= tolerance)


def within(limit: float) -> Rule:
    """|value| ≤ limit over the whole 95% interval."""
    return Rule(f"within ±{limit:g} of 0", lambda e: max(abs(e.low if e.low is not None else e.value),
                                                      abs(e.high if e.high is not None else e.value)) <= limit)


@dataclass(frozen=True)
class Claim:
    key: str
    chapter: int
    says: str  # the lecture's claim, in its words
    source: str  # the paper or document behind it
    experiment: str  # where it is measured, with the command for a benchmark
    evidence: Callable[[], Evidence | None]
    rule: Rule | None  # None: not testable here
    caveat: str = ""  # what keeps a number without an interval from showing the claim (a seeded run lifts it)
    untestable: str = ""  # why it cannot be tested on this machine (with a rule: until a stored run exists)


@dataclass
class Verdict:
    claim: Claim
    verdict: str
    reason: str
    evidence: Evidence | None = field(default=None)

    def as_dict(self) -> dict:
        c, e = self.claim, self.evidence
        return {"key": c.key, "chapter": c.chapter, "claim": c.says, "source": c.source, "experiment": c.experiment,
                "rule": c.rule.says if c.rule else None, "verdict": self.verdict, "reason": self.reason,
                "evidence": None if e is None else e.__dict__}


def ledger_row(technique: str, ledger_path: Path | None = None) -> Callable[[], Evidence | None]:
    """Evidence from the running ledger: what the chapter measured on this machine."""
    def read() -> Evidence | None:
        from llmsys.core import ledger

        entry = ledger.load_measurements(ledger_path).get(technique)
        if entry is None:
            return None
        return Evidence(entry["measured"], entry.get("unit", ""), f"ledger: {technique}", entry.get("when", ""),
                        entry.get("machine", ""), estimate=entry.get("estimate"))
    read.technique = technique
    return read


def stored(name: str, extract: Callable[[dict], Evidence | None]) -> Callable[[], Evidence | None]:
    """Evidence from a benchmark's stored run in benchmarks/results/ (with its command, machine and date)."""
    def read() -> Evidence | None:
        path = RESULTS / name
        if not path.exists():
            return None
        return extract(json.loads(path.read_text()))
    return read


def nothing() -> Evidence | None:
    return None


def first_of(*sources: Callable[[], Evidence | None]) -> Callable[[], Evidence | None]:
    """The first source that has evidence: a stored benchmark run before a chapter's smaller one."""
    def read() -> Evidence | None:
        return next((e for e in (source() for source in sources) if e is not None), None)
    read.technique = next((getattr(s, "technique") for s in sources if hasattr(s, "technique")), None)
    return read


def ramble_growth(result: dict) -> Evidence | None:
    """GRPO − Dr. GRPO: expected length of an answerless ramble at the end of training, over seeds."""
    by = {v: [r["ramble_length_end"] for r in result["runs"] if r["variant"] == v] for v in ("GRPO", "Dr. GRPO")}
    if min(len(v) for v in by.values()) < 2:
        return None
    diff, low, high = difference_interval(by["GRPO"], by["Dr. GRPO"])
    return Evidence(diff, "tokens, GRPO − Dr. GRPO", "benchmarks/results/grpo_seeds.json", result.get("when", ""),
                    result.get("machine", ""), low=low, high=high, seeds=len(by["GRPO"]))


def on_policy_gain(result: dict) -> Evidence | None:
    """Full-vocabulary on-policy distillation (GKD β = 1) − sequence-level KD: greedy exact match on held-out
    sums at the end of an equal FLOP budget, over seeds (``llmsys.distill.equal_compute``)."""
    by = {m: sorted((r["seed"], r["curve"][-1]["exact"]) for r in result.get("runs", []) if r["method"] == m)
          for m in ("full_kl", "seq_kd")}
    if min(len(v) for v in by.values()) < 2:
        return None
    diff, low, high = difference_interval([v for _, v in by["full_kl"]], [v for _, v in by["seq_kd"]])
    return Evidence(diff, "exact match, on-policy − seq-KD", "benchmarks/results/distill_seeds.json",
                    result.get("when", ""), result.get("machine", ""), low=low, high=high, seeds=len(by["full_kl"]))


def on_policy_after_healing(result: dict) -> Evidence | None:
    """On-policy distillation − more sequence-level KD, continuing SmolLM2's healed 6-layer student at equal
    FLOPs: the teacher's log-prob per token of the student's own answers to held-out chat prompts at the
    end of the budget, paired by seed (``llmsys.distill.continuation``)."""
    from llmsys.distill import continuation

    paired = continuation.paired_difference(result, continuation.TASK)
    if paired is None:
        return None
    diff, low, high, seeds = paired
    return Evidence(diff, "nats/token of the teacher's log-prob of the student's own answers, on-policy − more "
                    "seq-KD (paired by seed)", "benchmarks/results/distill_smollm2.json", result.get("when", ""),
                    result.get("machine", ""), low=low, high=high, seeds=seeds)


def best_lossless_speedup(result: dict) -> Evidence | None:
    """The best wall-clock speedup among drafting methods whose output was checked lossless."""
    drafted = [m for m in result["methods"] if not m["name"].startswith("target only")]
    lossless = [m["speedup"] for m in drafted if m.get("lossless")]
    if not drafted:
        return None
    return Evidence(max(lossless, default=0.0), "× target-only decoding", "benchmarks/results/specdec_smollm2.json",
                    result.get("date", ""), result.get("machine", ""))


def decoupling_slope(result: dict) -> Evidence | None:
    from llmsys.optim.decoupling import PAPER

    s = result.get("summary", {}).get(PAPER)
    if not s:
        return None
    return Evidence(s["mean"], "decades of best λ per decade of learning rate (paper's form)",
                    "benchmarks/results/decoupling.json", result.get("when", ""), result.get("machine", ""),
                    low=s["low"], high=s["high"], seeds=len(s["slopes"]))


def muon_token_ratio(result: dict) -> Evidence | None:
    """Muon's share of AdamW's tokens at the largest size measured, both learning rates tuned."""
    sized = [(int(dim), entry) for dim, entry in result.get("sizes", {}).items() if entry.get("summary")]
    if not sized:
        return None
    dim, entry = max(sized, key=lambda pair: pair[0])
    s = entry["summary"]
    return Evidence(s["mean"], f"of AdamW's tokens (width {dim}, {entry['params']:,} parameters, lr tuned for both)",
                    "benchmarks/results/muon_seeds.json", result.get("when", ""), result.get("machine", ""),
                    low=s["low"], high=s["high"], seeds=len(s["ratios"]))


def quant_4bit_over_bf16(result: dict) -> Evidence | None:
    """The worst perplexity, relative to bf16, among the grouped 4-bit GPTQ and AWQ rows of a run of
    ``benchmarks/quant.py --source`` on an unquantized checkpoint (every grid measured must hold)."""
    ppl = {r["method"]: r["perplexity"] for r in result.get("perplexity", [])}
    four_bit = {m: p for m, p in ppl.items() if re.fullmatch(r"(GPTQ|AWQ) 4-bit g\d+.*", m)}
    if "bf16" not in ppl or {m.split()[0] for m in four_bit} != {"GPTQ", "AWQ"}:
        return None
    worst = max(four_bit, key=four_bit.get)
    machine = result.get("machine", {})
    return Evidence(four_bit[worst] / ppl["bf16"], f"× bf16 perplexity ({result.get('source')}: worst of "
                    f"{len(four_bit)} GPTQ/AWQ 4-bit rows, {worst})", "benchmarks/results/quant_source.json",
                    machine.get("date", ""), machine.get("processor") or machine.get("platform", ""))


def continuous_over_static(result: dict) -> Evidence | None:
    return Evidence(result["continuous_tok_s"] / result["static_tok_s"], "× throughput",
                    "benchmarks/results/serving.json", result.get("when", ""), result.get("machine", ""))


ONE_SEED = "one seed and one size, no interval: a difference this size can be noise"
CLAIMS: list[Claim] = [
    # 0. Foundations
    Claim("decode-memory-bound", 0, "Decode is memory-bound: scoring 8 tokens in one call costs about one step",
          "Leviathan et al. 2023 (arXiv 2211.17192) §1; the roofline", "chapter 0, roofline cell",
          ledger_row("Scoring k tokens per call"), at_most(1.5)),
    Claim("fusion-bytes", 0, "Fusing a chain of elementwise ops cuts the bytes moved through memory",
          "Triton tutorial 02 (fused softmax)", "chapter 0, kernel fusion cell", ledger_row("Kernel fusion"), at_most(0.6)),
    Claim("flash-memory", 0, "FlashAttention keeps O(N) memory instead of the N×N score matrix",
          "Dao et al. 2022 (arXiv 2205.14135)", "chapter 0, FlashAttention cell", ledger_row("FlashAttention"),
          at_most(0.5)),
    # 1. ZeRO and FSDP
    Claim("mixed-precision-16", 1, "Mixed-precision Adam keeps 16 bytes of model state per parameter",
          "Rajbhandari et al. 2020, ZeRO (arXiv 1910.02054) §3", "chapter 1, mixed-precision cell",
          ledger_row("Mixed precision"), near_estimate(0.05)),
    Claim("ddp-2psi", 1, "DDP's all-reduce sends 2(N−1)/N·Ψ per rank per step", "ZeRO §7",
          "chapter 1, counted collectives", ledger_row("DDP"), near_estimate(0.05)),
    Claim("zero1-bytes", 1, "ZeRO-1 holds 4Ψ + KΨ/N bytes per device", "ZeRO Fig. 1",
          "chapter 1, ZeRO stages on 2 gloo ranks", ledger_row("ZeRO-1"), near_estimate(0.10)),
    Claim("zero2-bytes", 1, "ZeRO-2 holds 2Ψ + (2+K)Ψ/N bytes per device", "ZeRO Fig. 1",
          "chapter 1, ZeRO stages on 2 gloo ranks", ledger_row("ZeRO-2"), near_estimate(0.10)),
    Claim("zero3-comm", 1, "ZeRO-3 communicates 1.5× what DDP does", "ZeRO §7.2",
          "chapter 1, counted collectives", ledger_row("ZeRO-3 / FSDP"), near_estimate(0.05)),
    Claim("checkpoint-compute", 1, "Activation checkpointing costs at most about a third more compute",
          "Chen et al. 2016 (arXiv 1604.06174)", "chapter 1, activation checkpointing cell",
          ledger_row("Activation checkpointing"), at_most(1.4)),
    # 2. Parallelism
    Claim("tp-all-reduces", 2, "Tensor parallelism needs 2 all-reduces forward and 2 backward per layer",
          "Shoeybi et al. 2019, Megatron-LM (arXiv 1909.08053) §3", "chapter 2, tensor-parallel block",
          ledger_row("Tensor parallel"), near(4, 0)),
    Claim("sp-activations", 2, "Sequence parallelism divides the remaining activations by t",
          "Korthikanti et al. 2022 (arXiv 2205.05198)", "chapter 2, sequence-parallel cell",
          ledger_row("Sequence parallel"), near_estimate(0.10)),
    Claim("cp-exact", 2, "Context parallelism's merged blocks equal full attention",
          "Liu et al. 2023, Ring Attention (arXiv 2310.01889)", "chapter 2, ring attention cell",
          ledger_row("Context parallel"), at_most(1e-4)),
    Claim("pp-bubble", 2, "1F1B idles (p−1)/(m+p−1) of the time", "Narayanan et al. 2021 (arXiv 2104.04473)",
          "chapter 2, 1F1B on 2 processes (wall clock)", ledger_row("Pipeline parallel"), near_estimate(0.35)),
    Claim("ep-tokens", 2, "Expert parallelism delivers tokens × top-k − drops to the experts",
          "Lepikhin et al. 2020, GShard (arXiv 2006.16668)", "chapter 2, all-to-all dispatch",
          ledger_row("Expert parallel"), near_estimate(0.0)),
    # 3. LoRA
    Claim("lora-share", 3, "LoRA trains r(in+out) parameters per adapted matrix, a small fraction",
          "Hu et al. 2021 (arXiv 2106.09685) §4", "chapter 3, parameter count", ledger_row("LoRA"),
          near_estimate(0.01)),
    Claim("lora-vs-full", 3, "LoRA at low rank matches full fine-tuning", "Hu et al. 2021, Table 2",
          "chapter 3 fine-tunes adapters only", nothing, None,
          untestable="no full fine-tuning baseline runs in chapter 3 within its 3-minute budget"),
    Claim("loraplus-faster", 3, "LoRA+ (B at a higher learning rate) converges faster than LoRA",
          "Hayou et al. 2024 (arXiv 2402.12354)", "chapter 3, equal-step comparison", ledger_row("LoRA+"),
          at_most(0.98), caveat=ONE_SEED),
    Claim("dora-better", 3, "DoRA learns better than LoRA at equal rank", "Liu et al. 2024 (arXiv 2402.09353)",
          "chapter 3, equal-step comparison", ledger_row("DoRA"), at_most(0.98), caveat=ONE_SEED),
    Claim("qlora-bytes", 3, "NF4 with double quantization stores weights in about 4.127 bits",
          "Dettmers et al. 2023, QLoRA (arXiv 2305.14314) §3", "chapter 3, NF4 bytes", ledger_row("QLoRA"),
          near_estimate(0.05)),
    Claim("adam8bit-bytes", 3, "8-bit Adam keeps 2 bytes of state per parameter instead of 8",
          "Dettmers et al. 2022 (arXiv 2110.02861)", "chapter 3, optimizer bytes",
          ledger_row("8-bit / paged optimizers"), near_estimate(0.10)),
    # 4. Speculative decoding
    Claim("specdec-tokens", 4, "Tokens per target call follow (1 − α^(γ+1))/(1 − α)", "Leviathan et al. 2023, Thm 3.8",
          "chapter 4, γ sweep with the draft model", ledger_row("Speculative decoding"), near_estimate(0.15)),
    Claim("specdec-speedup", 4, "Speculative decoding is 2-3× faster with identical outputs",
          "Leviathan et al. 2023 §5", "python benchmarks/specdec.py --model smollm2 --threads 1 --json ...",
          stored("specdec_smollm2.json", best_lossless_speedup), at_least(2.0)),
    Claim("medusa-tokens", 4, "Extra heads' accuracy predicts their tokens per call",
          "Cai et al. 2024, Medusa (arXiv 2401.10774)", "chapter 4, MTP heads", ledger_row("Medusa / MTP heads"),
          near_estimate(0.15)),
    Claim("eagle-tokens", 4, "A feature-level head drafts with the accuracy it was trained to",
          "Li et al. 2024, EAGLE (arXiv 2401.15077)", "chapter 4, EAGLE head on SmolLM2",
          ledger_row("EAGLE-style drafting"), near_estimate(0.15)),
    # 5. Distillation
    Claim("on-policy-beats-off", 5, "On-policy distillation beats sequence-level KD at equal compute",
          "Agarwal et al. 2024, GKD (arXiv 2306.13649); Lu et al. 2025, On-Policy Distillation",
          "python benchmarks/distill_seeds.py --seeds 5 --json benchmarks/results/distill_seeds.json "
          "(multi-digit addition, equal FLOPs; else chapter 5's one-seed run)",
          first_of(stored("distill_seeds.json", on_policy_gain), ledger_row("On-policy distillation")),
          Rule("exact match, on-policy − seq-KD, > 0 over its whole 95% CI (a one-seed chapter run: "
               "reverse KL ≤ 0.9× seq-KD's)", lambda e: e.low > 0 if e.low is not None else e.value <= 0.9),
          caveat="without the stored run, the chapter's one seed has no interval: a difference this size can be noise"),
    Claim("on-policy-after-healing", 5, "On-policy distillation improves a student that sequence-level KD has "
          "healed more than further sequence-level KD at the same compute",
          "Agarwal et al. 2024, GKD (arXiv 2306.13649) §4; Lu et al. 2025, On-Policy Distillation",
          "python benchmarks/distill_smollm2.py --seeds 5 --tuning-from benchmarks/results/distill_smollm2_tuning.json "
          "--json benchmarks/results/distill_smollm2.json (SmolLM2-135M-Instruct's 6-layer student healed by "
          "seq-KD, equal FLOPs counting the teacher's generation and scoring, rates tuned on another seed)",
          stored("distill_smollm2.json", on_policy_after_healing),
          Rule("teacher log-prob per token of the student's answers, on-policy − more seq-KD, > 0 over its whole "
               "95% CI", lambda e: e.low is not None and e.low > 0)),
    Claim("distilled-student", 5, "A distilled student keeps most of the teacher's quality at a fraction of its layers",
          "Sanh et al. 2019, DistilBERT (arXiv 1910.01108)", "chapter 5, SmolLM2's 6-layer student",
          ledger_row("Distillation as compression"), at_most(1.5)),
    Claim("on-policy-vs-rl-compute", 5, "On-policy distillation reaches RL's score with 9-30× less compute",
          "Lu et al. 2025, On-Policy Distillation (Thinking Machines)", "none in the course", nothing, None,
          untestable="it needs an RL run and a distillation run to the same score on one task; a CPU has "
                     "neither the teacher nor the hours"),
    # 6. GRPO
    Claim("grpo-pass-rate", 6, "GRPO raises the pass rate", "Shao et al. 2024, DeepSeekMath (arXiv 2402.03300)",
          "chapter 6, GRPO on Countdown", ledger_row("GRPO"), at_least(1.05), caveat=ONE_SEED),
    Claim("grpo-no-critic", 6, "Dropping PPO's critic saves its training state", "DeepSeekMath §4",
          "chapter 6, training-state bytes", ledger_row("PPO"), near_estimate(0.10)),
    Claim("dr-grpo-length", 6, "GRPO's 1/|o| lets answerless rambles grow; Dr. GRPO removes the drift",
          "Liu et al. 2025, Dr. GRPO (arXiv 2503.20783)",
          "python benchmarks/grpo_seeds.py --json benchmarks/results/grpo_seeds.json",
          stored("grpo_seeds.json", ramble_growth), at_least(0.0)),
    # 7. AdamW
    Claim("adamw-state", 7, "AdamW keeps 8 bytes of state per parameter (m and v)", "Loshchilov & Hutter 2019",
          "chapter 7, optimizer state", ledger_row("AdamW"), near_estimate(0.01)),
    Claim("adamw-decoupled", 7, "Under decoupled decay the best λ does not move with the learning rate",
          "Loshchilov & Hutter 2019 (arXiv 1711.05101) Fig. 2",
          "python benchmarks/decoupling.py --json benchmarks/results/decoupling.json",
          stored("decoupling.json", decoupling_slope), within(0.25)),
    # 8. Muon
    Claim("muon-tokens", 8, "Muon reaches AdamW's loss with about half the tokens",
          "Liu et al. 2025, Moonlight (arXiv 2502.16982); Wen et al. 2025 (arXiv 2509.02046) find ≈1.1-1.4×",
          "python benchmarks/muon_seeds.py --json benchmarks/results/muon_seeds.json (chapter 8: one seed)",
          first_of(stored("muon_seeds.json", muon_token_ratio), ledger_row("Muon")), at_most(0.75),
          caveat="one seed at one size, against an AdamW whose learning rate was not tuned for this budget"),
    Claim("qk-clip", 8, "QK-clip brings every head's max logit down to τ", "Kimi K2 (arXiv 2507.20534) §2",
          "chapter 8, QK-clip cell", ledger_row("QK-clip"), near(1.0, 1e-3)),
    # 9. Serving
    Claim("kv-bytes", 9, "The KV cache holds 2·layers·kv_heads·head_dim·bytes per token",
          "Kwon et al. 2023, vLLM (arXiv 2309.06180)", "chapter 9, SmolLM2's cache", ledger_row("KV cache"),
          near_estimate(0.01)),
    Claim("paged-waste", 9, "Paged attention wastes under 4% of KV memory", "vLLM §6 (96.3% used)",
          "chapter 9, chat trace on SmolLM2", ledger_row("Paged attention"), at_most(0.04)),
    Claim("continuous-batching", 9, "Continuous batching serves 2× or more the throughput of static batching",
          "Yu et al. 2022, Orca; vLLM §6",
          "python benchmarks/serving.py --model smollm2 --threads 1 2 --json benchmarks/results/serving.json "
          "(else chapter 9's smaller chat trace)",
          first_of(stored("serving.json", continuous_over_static), ledger_row("Continuous batching")), at_least(2.0)),
    Claim("chunked-prefill", 9, "Chunked prefill stops long prompts from stalling decodes",
          "Agrawal et al. 2024, Sarathi-Serve (arXiv 2403.02310)", "chapter 9, ITL p99 with and without chunks",
          ledger_row("Chunked prefill"), at_most(0.9)),
    Claim("prefix-caching", 9, "Prefix caching skips recomputing shared prefixes",
          "Zheng et al. 2024, SGLang (arXiv 2312.07104)", "chapter 9, chat trace on SmolLM2",
          ledger_row("Prefix caching"), at_most(0.9)),
    Claim("kv-int8", 9, "Quantizing the KV cache to int8 halves its bytes", "Hooper et al. 2024, KVQuant",
          "chapter 9, int8 KV bytes", ledger_row("KV quantization"), near_estimate(0.05)),
    Claim("kv-tiers", 9, "Reloading evicted KV from CPU RAM and disk spares long sessions their recomputation",
          "Cheng et al. 2025, LMCache (arXiv 2510.09665); Qin et al. 2025, Mooncake (arXiv 2407.00079)",
          "chapter 9 part 2, interleaved agent sessions: prompt tokens computed with tiers / without",
          ledger_row("KV tiers"), at_most(0.9)),
    Claim("prefix-routing", 9, "Routing each request to the replica caching its prefix raises the hit rate over "
          "round-robin", "Zheng et al. 2024, SGLang (arXiv 2312.07104), cache-aware load balancing",
          "chapter 9 part 2, chat sessions over 3 replicas: hit rate prefix-aware / round-robin",
          ledger_row("Prefix-aware routing"), at_least(1.2)),
    Claim("disagg-bytes", 9, "Disaggregated serving moves layers × 2 × KV heads × head dim × tokens × bytes per "
          "request", "Zhong et al. 2024, DistServe (arXiv 2401.09670)",
          "chapter 9 part 2, bytes the prefill process sent", ledger_row("Prefill/decode disaggregation"),
          near_estimate(0.01)),
    # 10. Quantization
    Claim("gptq-awq-4bit", 10, "GPTQ and AWQ at 4 bits stay within 5% of bf16 perplexity",
          "Frantar et al. 2023 (arXiv 2210.17323); Lin et al. 2024 (arXiv 2306.00978)",
          "python benchmarks/quant.py --source CHECKPOINT --parts perplexity --json "
          "benchmarks/results/quant_source.json (CHECKPOINT: an unquantized Llama-architecture checkpoint, "
          "a directory or a hub id)",
          # not chapter 10's ledger row: it quantizes weights that are Q4_1 already
          stored("quant_source.json", quant_4bit_over_bf16), at_most(1.05),
          untestable="the offline SmolLM2 weights are Q4_1 already, so there is no full-precision reference; "
                     "benchmarks/quant.py --source runs the table on an unquantized checkpoint"),
    Claim("int8-decode-speed", 10, "Weight-only int8 speeds up memory-bound decode (fewer bytes read)",
          "Dettmers et al. 2022, LLM.int8() (arXiv 2208.07339)", "chapter 10, decode tokens/s",
          ledger_row("Weight-only int8 kernels"), at_least(1.2)),
    Claim("smoothquant", 10, "SmoothQuant W8A8 keeps perplexity within a few percent of bf16",
          "Xiao et al. 2023 (arXiv 2211.10438)", "chapter 10, W8A8 perplexity", ledger_row("W8A8 (SmoothQuant)"),
          at_most(1.05)),
    Claim("kivi", 10, "KIVI's low-bit KV cache keeps perplexity close to bf16", "Liu et al. 2024 (arXiv 2402.02750)",
          "chapter 10, KV quantization perplexity", ledger_row("KV quantization int4 (KIVI)"), at_most(1.05)),
    Claim("qat-beats-ptq", 10, "Quantization-aware training beats post-training quantization at equal bits",
          "Jacob et al. 2018 (arXiv 1712.05877)", "chapter 10, QAT vs PTQ on the target model", ledger_row("QAT"),
          at_most(0.98), caveat=ONE_SEED),
    # 11. Evaluation and data
    Claim("temperature-scaling", 11, "Temperature scaling lowers calibration error",
          "Guo et al. 2017 (arXiv 1706.04599)", "chapter 11, ECE before and after", ledger_row("Temperature scaling"),
          at_most(0.8), caveat="one split of a few dozen test items, no interval"),
    Claim("self-consistency", 11, "Disagreement between sampled answers flags hallucinations",
          "Manakul et al. 2023, SelfCheckGPT (arXiv 2303.08896)", "chapter 11, made-up names",
          ledger_row("Hallucination detection (self-consistency)"), at_least(0.6),
          caveat="ten questions and no interval: an AUROC this near chance (0.5) can be noise"),
    Claim("min-k-prob", 11, "Min-K% Prob tells leaked items from unseen ones", "Shi et al. 2024 (arXiv 2310.16789)",
          "chapter 11, contamination cell", ledger_row("Contamination check (Min-K% Prob)"), at_least(0.6)),
    Claim("minhash-recall", 11, "MinHash + LSH finds near-duplicates at the rate the S-curve predicts",
          "Broder 1997; Lee et al. 2021 (arXiv 2107.06499)", "chapter 11, dedup cell", ledger_row("MinHash + LSH dedup"),
          Rule("≥ the S-curve's P[candidate] − 0.05",
               lambda e: e.estimate is not None and e.value >= e.estimate - 0.05)),
    Claim("perplexity-filter", 11, "A small model's perplexity separates junk from prose",
          "Wenzek et al. 2020, CCNet (arXiv 1911.00359)", "chapter 11, quality filters",
          ledger_row("Perplexity filtering"), at_least(0.8)),
]
BY_KEY = {claim.key: claim for claim in CLAIMS}


def judge(claim: Claim) -> Verdict:
    """The claim's verdict from its stored evidence."""
    evidence = claim.evidence()
    if claim.rule is None or (evidence is None and claim.untestable):  # untestable until a stored run exists
        return Verdict(claim, NOT_TESTABLE, claim.untestable, evidence)
    if evidence is None:
        run = claim.experiment if claim.experiment.startswith("python") else f"chapter {claim.chapter}"
        return Verdict(claim, NOT_MEASURED, f"no stored run on this machine: run {run}")
    measured = describe(evidence)
    if not claim.rule.holds(evidence):
        return Verdict(claim, NOT_SHOWN, f"measured {measured}; the claim needs {claim.rule.says}", evidence)
    if claim.caveat and evidence.low is None:
        return Verdict(claim, NOT_SHOWN, f"measured {measured}, but {claim.caveat}", evidence)
    return Verdict(claim, SHOWN, f"measured {measured} ({claim.rule.says})", evidence)


def describe(e: Evidence) -> str:
    text = f"{e.value:.4g} {e.unit}".strip()
    if e.low is not None:
        text += f", 95% CI [{e.low:.3g}, {e.high:.3g}] over {e.seeds} seeds"
    if e.estimate is not None:
        text += f" (formula {e.estimate:.4g})"
    return text


def table(chapter: int | None = None) -> list[Verdict]:
    return [judge(c) for c in CLAIMS if chapter is None or c.chapter == chapter]


def verdict_line(key: str) -> str:
    """One line for a chapter to print under its experiment."""
    v = judge(BY_KEY[key])
    return f"Claim — {v.claim.says} ({v.claim.source}): {v.verdict.upper()}: {v.reason}"


def format_table(verdicts: list[Verdict]) -> str:
    lines = []
    for v in verdicts:
        lines.append(f"ch{v.claim.chapter:<2} {v.verdict:<29} {v.claim.says}")
        lines.append(f"     {v.reason}")
        lines.append(f"     source: {v.claim.source}; experiment: {v.claim.experiment}")
    counts = {name: sum(v.verdict == name for v in verdicts) for name in (SHOWN, NOT_SHOWN, NOT_TESTABLE, NOT_MEASURED)}
    lines.append(", ".join(f"{n} {name}" for name, n in counts.items()))
    return "\n".join(lines)


def readme_table() -> str:
    """The README's list of claims: what each is tested by and the rule (verdicts come from your own runs)."""
    rows = ["| ch | claim | source | experiment | shown when |", "|---|---|---|---|---|"]
    for c in CLAIMS:
        rule = c.rule.says if c.rule else f"not testable here: {c.untestable}"
        if c.rule and c.untestable:
            rule += f" (without a stored run, not testable here: {c.untestable})"
        if c.caveat:
            rule += f" (caveat: {c.caveat})"
        rows.append(f"| {c.chapter} | {c.says} | {c.source} | {c.experiment} | {rule} |")
    return "\n".join(rows)
