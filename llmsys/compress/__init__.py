"""Chapter 10: quantization and compression.

formats (integer grids, fp8, NF4, GGUF blocks) · gptq · awq · smoothquant (W8A8, LLM.int8()) ·
prune (magnitude, Wanda, 2:4) · qat (straight-through estimator) · kvcache (KIVI-style) ·
weightonly (torch's CPU int8/int4 kernels) · calibrate (layer-by-layer statistics) · measure
(perplexity, bytes, decode speed on SmolLM2).
"""
