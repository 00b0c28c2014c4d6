"""Every technique of the course on common axes, at one reference scale.

A row says, in words, what a technique saves in memory, adds in communication and
trades off, and when to use it; and, in numbers from ``llmsys.core.accounting``, the
memory per GPU it saves and the communication per GPU per step it adds against a
named baseline, at one of two reference scales:

* ``TRAIN``: Llama-3-8B (Meta, "The Llama 3 Herd of Models", 2024) trained on 8 GPUs in
  bf16 with Adam (16 bytes per parameter), one sequence of 8,192 tokens per GPU;
* ``SERVE``: the same model served in bf16 on one GPU, 32 sequences of 8,192 tokens.

These numbers are *modelled* (formulas). What this machine measured for a row is
kept by ``llmsys.core.ledger`` beside them, with its kind of evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsys.core import accounting as acc


@dataclass(frozen=True)
class Scale:
    name: str
    n_params: float
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    seq: int
    batch: int
    gpus: int


LLAMA3_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256)
TRAIN = Scale("Llama-3-8B, 8 GPUs, bf16 + Adam, 1 × 8k tokens per GPU", acc.llama_params(**LLAMA3_8B),
              32, 4096, 32, 8, seq=8192, batch=1, gpus=8)
SERVE = Scale("Llama-3-8B served in bf16 on 1 GPU, 32 sequences × 8k tokens", acc.llama_params(**LLAMA3_8B),
              32, 4096, 32, 8, seq=8192, batch=32, gpus=1)


@dataclass(frozen=True)
class Row:
    technique: str
    chapter: int
    saves: str
    adds: str
    trades: str
    evidence: str  # what the measured number of a chapter is
    use_when: str = ""
    baseline: str = ""  # what the numbers below are relative to
    saves_bytes: float | None = None  # memory per GPU saved at the reference scale
    adds_bytes: float | None = None  # communication per GPU per step added at the reference scale
    scale: Scale | None = None


def _psi(scale=TRAIN):
    return scale.n_params


def _activations(scale=TRAIN, recompute=False, **kw):
    """Activation bytes of the whole model (the Llama block's count), or with every block
    recomputed, only the blocks' bf16 inputs."""
    if recompute:
        return scale.n_layers * scale.seq * scale.batch * scale.dim * 2
    return scale.n_layers * acc.llama_activation_bytes_per_layer(scale.seq, scale.batch, scale.dim, scale.n_heads,
                                                                 scale.n_kv_heads, LLAMA3_8B["ffn_hidden"], **kw)


def _ddp_bytes(scale=TRAIN, grad_bytes=2):
    return acc.collective_bytes("all_reduce", grad_bytes * _psi(scale), scale.gpus)


def _zero_saved(stage, scale=TRAIN):
    return acc.zero_bytes_per_device(_psi(scale), scale.gpus, 0) - acc.zero_bytes_per_device(_psi(scale), scale.gpus, stage)


def _kv(scale=SERVE, bytes_per_elem=2):
    head_dim = scale.dim // scale.n_heads
    return acc.kv_cache_bytes(scale.n_layers, scale.n_kv_heads, head_dim, scale.seq * scale.batch, bytes_per_elem)


def _weights(config, bytes_per_param=2):
    return acc.llama_params(**config) * bytes_per_param


def _linear_shapes(scale=TRAIN):
    """(in, out) of the seven linears of a block: wq wk wv wo w1 w3 w2."""
    d, kv, f = scale.dim, scale.dim * scale.n_kv_heads // scale.n_heads, LLAMA3_8B["ffn_hidden"]
    return [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]


def _lora_params(rank=16, scale=TRAIN):
    """LoRA's A and B on all seven linears of every block: rank · (in + out) each."""
    return scale.n_layers * sum(rank * (i + o) for i, o in _linear_shapes(scale))


def _vera_params(scale=TRAIN):
    """VeRA trains two vectors per linear, d (rank 256) and b (out); the random matrices are frozen and shared."""
    return scale.n_layers * sum(256 + o for _, o in _linear_shapes(scale))


# A separate draft model: Llama-3.2-1B's configuration (Meta, 2024), same tokenizer as the target.
LLAMA32_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                  tie_embeddings=True)
_S = SERVE
_draft = _weights(LLAMA32_1B) + acc.kv_cache_bytes(16, 8, 64, _S.seq * _S.batch)
# Medusa heads as built here: one d×d residual block per head (4 heads), sharing the target's LM head
_medusa = 4 * (_S.dim ** 2 + _S.dim) * 2
# EAGLE's head: one decoder layer, a 2d → d fusion layer, and one layer of KV cache
_eagle_layer = acc.llama_params(**{**LLAMA3_8B, "n_layers": 2}) - acc.llama_params(**{**LLAMA3_8B, "n_layers": 1})
_eagle = (_eagle_layer + 2 * _S.dim ** 2) * 2 + _kv() / _S.n_layers
# a student with 6 of the teacher's 32 blocks (chapter 5 keeps 6 of SmolLM2's 30)
_student = {**LLAMA3_8B, "n_layers": 6}


_T = TRAIN
# NF4 with double-quantized block constants: 4 + 0.127 bits per parameter (Dettmers et al. 2023, QLoRA, §3)
_NF4_BYTES = (4 + 0.127) / 8
_layer_io = _T.seq * _T.batch * _T.dim * 2  # one layer's bf16 input or output, bytes

ROWS: list[Row] = [
    # 0. Foundations
    Row("Kernel fusion", 0, "intermediate tensors in HBM", "none", "a custom kernel to write and maintain",
        "bytes moved: fused / unfused", "a chain of elementwise ops is memory-bound", "unfused kernels", 0, 0, _T),
    Row("FlashAttention", 0, "the N×N score matrix: O(N²) → O(N) activations", "none",
        "recomputes scores in backward", "peak attention bytes: flash / naive", "always, for training and prefill",
        "materialised attention", _T.n_layers * _T.n_heads * _T.seq ** 2 * 2 * _T.batch, 0, _T),
    Row("Scoring k tokens per call", 0, "weight reads: k tokens share one read of every weight", "none",
        "k× the FLOPs: nearly free only while memory-bound", "call time: 8 tokens / 1 (bf16)",
        "decode is memory-bound: speculative decoding and batching spend the spare FLOPs", "one token per call",
        0, 0, SERVE),
    # 1. ZeRO and FSDP
    Row("Mixed precision", 1, "activations and collectives in half precision; model state stays 16 B/param",
        "halves gradient all-reduce bytes vs fp32", "fp32 master copy; bf16 range, fp16 needs loss scaling",
        "model-state bytes / param", "always on GPUs with bf16 tensor cores", "fp32 training",
        _activations() , -_ddp_bytes(grad_bytes=2), _T),
    Row("DDP", 1, "nothing: every rank holds everything (16Ψ)", "all-reduce of grads, 2Ψ per step",
        "simplest; memory does not scale with ranks", "comm bytes per rank / Ψ",
        "the model and its optimizer fit one GPU", "one GPU", 0, _ddp_bytes(), _T),
    Row("ZeRO-1", 1, "optimizer state ÷ N", "same as DDP (2Ψ)", "all-gather of updated params",
        "per-rank bytes measured / formula", "DDP runs out of memory on optimizer state", "DDP",
        _zero_saved(1), 0, _T),
    Row("ZeRO-2", 1, "+ gradients ÷ N", "same as DDP (2Ψ)", "reduce-scatter instead of all-reduce",
        "per-rank bytes measured / formula", "ZeRO-1 is not enough; free over ZeRO-1", "DDP", _zero_saved(2), 0, _T),
    Row("ZeRO-3 / FSDP", 1, "+ parameters ÷ N: (4+K)Ψ/N", "3Ψ, 1.5× DDP", "gathers every layer twice per step",
        "comm bytes: ZeRO-3 / DDP", "the model's weights do not fit one GPU", "DDP", _zero_saved(3),
        acc.collective_bytes("all_gather", 2 * _psi(), _T.gpus), _T),
    Row("Activation checkpointing", 1, "activations of recomputed blocks: each keeps only its input", "none",
        "the blocks' forward again in backward (up to +33% compute)",
        "compute: checkpointed / plain (memory kept in the note)", "activations, not model state, hit the limit",
        "no recompute", _activations() - _activations(recompute=True), 0, _T),
    # 2. Parallelism
    Row("Tensor parallel", 2, "weights and most activations ÷ t", "2 all-reduces fwd + 2 bwd per layer",
        "needs fast links (NVLink); within a node", "all-reduces counted per layer",
        "one layer's matmuls are too big for a GPU; inside one NVLink node", "one GPU per replica (t = 8)",
        16 * _psi() * (1 - 1 / _T.gpus) + _activations() - _activations(tp=_T.gpus),
        4 * _T.n_layers * acc.collective_bytes("all_reduce", _layer_io, _T.gpus), _T),
    Row("Sequence parallel", 2, "norm/dropout activations ÷ t", "none extra: all-reduce → RS + AG",
        "more, smaller collectives", "activation bytes / formula", "always with tensor parallelism",
        "tensor parallel alone", _activations(tp=_T.gpus) - _activations(tp=_T.gpus, sequence_parallel=True), 0, _T),
    Row("Context parallel", 2, "activations ÷ CP along the sequence", "K/V exchange (ring or all-gather)",
        "load balance for causal masks", "max |ring - full attention|", "sequences of 100k+ tokens",
        "one GPU per sequence (CP = 8)", _activations() * (1 - 1 / _T.gpus),
        # K and V gathered in forward, gathered again and their gradients reduce-scattered in backward
        3 * _T.n_layers * acc.collective_bytes("all_gather", 2 * _layer_io * _T.n_kv_heads / _T.n_heads, _T.gpus), _T),
    Row("Pipeline parallel", 2, "layers ÷ p per stage", "point-to-point activations between stages",
        "bubble (p-1)/(m+p-1); in-flight activations", "bubble fraction: measured timeline / formula",
        "across nodes, when tensor parallelism would cross slow links", "one GPU per replica (p = 8)",
        16 * _psi() * (1 - 1 / _T.gpus), 2 * _layer_io, _T),
    Row("Expert parallel", 2, "experts ÷ EP", "two all-to-alls per MoE layer", "load imbalance, token drops",
        "tokens received / (tokens·k − drops)", "mixture-of-experts models (no numbers: the reference is dense)"),
    # 3. LoRA
    Row("LoRA", 3, "grads and optimizer state of frozen weights", "none (adapters are tiny)",
        "rank limits what can be learned", "trainable params / full", "adapting a model to a task on one GPU",
        "full fine-tuning on one GPU", 14 * _psi(), 0, _T),
    Row("LoRA+", 3, "same as LoRA", "none", "one more hyperparameter (lr ratio)", "loss at equal steps / LoRA",
        "LoRA converges slowly", "LoRA", 0, 0, _T),
    Row("QLoRA", 3, "frozen weights in 4 bits (NF4)", "none", "dequantize on every forward",
        "backbone bytes: NF4 / bf16", "the frozen base does not fit in bf16", "LoRA on a bf16 base",
        (2 - _NF4_BYTES) * _psi(), 0, _T),
    Row("VeRA", 3, "adapters down to vectors (r + out per layer)", "none", "less capacity per parameter",
        "trainable params / LoRA", "thousands of adapters must be stored or served", "LoRA at rank 16",
        16 * (_lora_params() - _vera_params()), 0, _T),
    Row("DoRA", 3, "same as LoRA + a magnitude vector", "none", "extra norm per step", "loss at equal steps / LoRA",
        "LoRA's quality falls short of full fine-tuning", "LoRA", 0, 0, _T),
    Row("8-bit / paged optimizers", 3, "optimizer state 8 → 2 bytes/param", "none", "quantization error in m, v",
        "optimizer bytes: 8-bit / fp32", "optimizer state dominates memory", "fp32 Adam state", 6 * _psi(), 0, _T),
    # 4. Speculative decoding
    Row("Speculative decoding", 4, "target forward passes per token", "none",
        "draft model + its KV cache; compute on rejected tokens", "tokens per target call / formula",
        "decode is memory-bound (small batches) and a cheap drafter agrees often",
        "plain decoding (draft: Llama-3.2-1B with its KV cache)", -_draft, 0, SERVE),
    Row("Medusa / MTP heads", 4, "a separate draft model", "none", "extra heads to train; tree verification",
        "tokens per target call / from head accuracy", "no good small drafter exists",
        "a separate draft model (Llama-3.2-1B)", _draft - _medusa, 0, SERVE),
    Row("EAGLE-style drafting", 4, "draft quality at small cost", "none",
        "a feature-level head (+ its KV cache) to train", "tokens per target call / from head accuracy",
        "the best speedup at batch 1 is worth training a head", "a separate draft model (Llama-3.2-1B)",
        _draft - _eagle, 0, SERVE),
    # 5. Distillation
    Row("Sequence-level KD", 5, "labels: the teacher writes them", "none", "off-policy: exposure bias",
        "student reverse KL after training", "teacher samples are cheap and plenty",
        "training on human data (the teacher's answers are written beforehand)", 0, 0, _T),
    Row("On-policy distillation", 5, "compute vs RL: dense per-token signal", "teacher forward on student samples",
        "teacher memory at training time", "reverse KL: on-policy / off-policy at equal compute",
        "a strong teacher exists and the student must recover from its own mistakes",
        "sequence-level KD (a bf16 teacher of the student's size held on every GPU)", -_weights(LLAMA3_8B), 0, _T),
    Row("Distillation as compression", 5, "weight bytes: a student with a fraction of the teacher's layers",
        "none", "perplexity; a training run with the teacher's forward passes",
        "student / teacher perplexity on held-out text, at student / teacher bytes",
        "a smaller model is needed and quantization alone cannot reach its size", "the teacher (student: 6 of 32 blocks)",
        _weights(LLAMA3_8B) - _weights(_student) + _kv() * (1 - 6 / 32), 0, SERVE),
    # 6. RL
    Row("PPO", 6, "nothing: a critic as large as the policy", "none", "value model memory and training",
        "training-state bytes: PPO / GRPO", "dense rewards, a good value model", "GRPO", -16 * _psi(), 0, _T),
    Row("GRPO", 6, "the critic (group baseline instead)", "none", "G samples per prompt", "pass rate after / before",
        "verifiable rewards (math, code)", "PPO with a critic of the policy's size", 16 * _psi(), 0, _T),
    Row("Dr. GRPO", 6, "same as GRPO", "none", "removes length and std bias", "wrong-answer length: Dr. GRPO / GRPO",
        "wrong answers grow long under GRPO", "GRPO", 0, 0, _T),
    # 7-8. Optimizers
    Row("AdamW", 7, "nothing: 8 bytes/param of state (m, v)", "none", "decoupled decay: wd independent of lr schedule",
        "state bytes / param", "the default for transformers", "Adam + L2", 0, 0, _T),
    Row("Muon", 8, "one state instead of two (4 bytes/param)", "whole matrices under FSDP: a gather",
        "Newton–Schulz matmuls per step", "tokens to AdamW's loss: Muon / AdamW",
        "hidden matrices of a transformer (AdamW for embeddings and norms)", "AdamW", 4 * _psi(), 0, _T),
    Row("QK-clip", 8, "nothing", "none", "rescales W_q, W_k when logits exceed τ", "max logit after clip / τ",
        "attention logits blow up in long Muon runs", "Muon alone", 0, 0, _T),
    # 9. Serving
    Row("KV cache", 9, "recomputing the prefix's projections and MLP every step (attention over it stays)", "none", "memory per token per sequence",
        "KV bytes/token measured / formula", "always for decoding", "recomputing the prefix", -_kv(), 0, SERVE),
    Row("Paged attention", 9, "reserved-but-unused KV memory", "none", "a block table lookup per access",
        "KV waste, paged (reserve-max in the note)", "serving many requests of unknown lengths",
        "reserving max length per request (requests use half of it on average)", _kv() / 2, 0, SERVE),
    Row("Continuous batching", 9, "idle slots of finished requests", "none", "scheduling every iteration",
        "throughput: continuous / static", "always in a server", "static batches", 0, 0, SERVE),
    Row("Chunked prefill", 9, "decode stalls behind long prompts", "none", "prefill spread over steps",
        "p99 inter-token latency: chunked / unchunked", "long prompts arrive while others decode",
        "whole-prompt prefill", 0, 0, SERVE),
    Row("Prefix caching", 9, "recomputing shared prefixes", "none", "hash bookkeeping, eviction",
        "prefill tokens: cached / uncached", "requests share system prompts or chat history", "no reuse",
        0, 0, SERVE),
    Row("KV quantization", 9, "KV bytes ÷ 16/bits", "none", "perplexity loss", "KV bytes: int8 / bf16",
        "KV memory limits batch size or context", "bf16 KV cache", _kv() / 2, 0, SERVE),
    # 9, part 2. The KV cache as a distributed store: one 8k-token sequence's KV is _kv() / batch
    Row("KV tiers", 9, "recomputing evicted prefixes: their KV waits in CPU RAM or on disk",
        "one sequence's KV over PCIe per reload", "RAM and disk space; a reload wins only past a crossover context",
        "prefill tokens computed: with tiers / without", "long sessions return after their KV was evicted",
        "recomputing an evicted 8k-token prefix", 0, _kv() / SERVE.batch, SERVE),
    Row("Prefix-aware routing", 9, "recomputing a session's history on a replica that never saw it", "none",
        "load balance: a hot prefix piles onto one replica until the loads differ enough",
        "prefix hit rate: prefix routing / round-robin", "several replicas serve multi-turn chats or agents",
        "round-robin over replicas", 0, 0, SERVE),
    Row("Prefill/decode disaggregation", 9, "decode steps stalled behind prefills; each pool sized for its bottleneck",
        "each request's KV sent once, prefill → decode", "a second pool of GPUs and a KV transfer per request",
        "KV bytes sent: measured / formula", "long prompts under tight time-per-output-token targets",
        "prefill and decode on the same GPUs", 0, _kv() / SERVE.batch, SERVE),
    # 10. Quantization and compression
    Row("Weight-only int4 (GPTQ / AWQ)", 10, "weight bytes ≈ 16/4.25 ≈ 3.8× (and decode time: it is memory-bound)",
        "none; dequantization inside the matmul", "perplexity; calibration data and minutes of compute",
        "perplexity: 4-bit / bf16", "serving at small batch, where decode reads every weight each token",
        "bf16 weights", (2 - 4.25 / 8) * _psi(SERVE), 0, SERVE),
    Row("Weight-only int8 kernels", 10, "weight bytes ÷ 2", "none", "a dequantizing kernel per matmul",
        "decode tokens/s: int8 / bf16", "almost always for inference: quality stays, bytes halve", "bf16 weights",
        (2 - 8.03 / 8) * _psi(SERVE), 0, SERVE),
    Row("W8A8 (SmoothQuant)", 10, "weight and activation bytes ÷ 2; int8 tensor-core matmuls", "none",
        "activation outliers: smoothing or a 16-bit split (LLM.int8())", "perplexity: W8A8 smoothed / bf16",
        "large batches, where matmuls are compute-bound and int8 tensor cores pay", "bf16 weights and activations",
        _psi(SERVE), 0, SERVE),
    Row("KV quantization int4 (KIVI)", 10, "KV bytes ≈ 16/4.5 ≈ 3.5×: longer contexts in the same memory", "none",
        "perplexity at long context", "perplexity at 1k context: int4 KV / bf16 KV",
        "long contexts or many sequences fill the KV memory", "bf16 KV cache", _kv() * (1 - 4.5 / 16), 0, SERVE),
    Row("Pruning (2:4, Wanda)", 10, "up to half the weights (2:4 kernels on NVIDIA GPUs)", "none",
        "perplexity; no speed without sparse hardware", "perplexity: 2:4 / dense",
        "a GPU with 2:4 sparse tensor cores, and a quality budget", "dense bf16 weights",
        # 2:4 on NVIDIA sparse tensor cores stores the kept half in bf16 plus 2 bits of position per kept value
        _psi(SERVE) * (2 - (1 + 0.125)), 0, SERVE),
    Row("QAT", 10, "same bytes as PTQ at equal bits", "none", "training through fake quantization (STE)",
        "held-out loss: QAT / PTQ", "3 bits or fewer, where post-training quantization loses too much",
        "PTQ at the same bits", 0, 0, SERVE),
    # 11. Evaluation and data
    Row("Temperature scaling", 11, "nothing: one scalar T", "none", "needs a dev split; fixes confidence, never accuracy",
        "test ECE: scaled / uncalibrated", "a model's probabilities drive decisions (abstain, route, rank)", "raw softmax", 0, 0, SERVE),
    Row("Hallucination detection (self-consistency)", 11, "nothing", "none", "k extra sampled answers per question",
        "AUROC for made-up names", "answers must be checked and k extra samples are affordable", "trusting one answer", 0, 0, SERVE),
    Row("Contamination check (Min-K% Prob)", 11, "the training data: needs only the model", "none",
        "weaker than n-gram overlap with the data", "AUROC contaminated vs clean",
        "the training data is not available", "13-gram overlap with the data", 0, 0, SERVE),
    Row("MinHash + LSH dedup", 11, "all-pairs comparison: O(n²) → O(n) band lookups", "none",
        "k hashes per document; misses pairs below the S-curve", "recall of true near-duplicate pairs",
        "any web-scale corpus before training", "exact all-pairs Jaccard", 0, 0, _T),
    Row("Perplexity filtering", 11, "training tokens spent on junk", "none",
        "a reference-model forward per document; favours text like the reference's", "AUROC word salad vs prose",
        "a good reference model of the target domain exists", "rule-based filters alone", 0, 0, _T),
]
