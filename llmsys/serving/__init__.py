"""Chapter 9: serving. A paged KV cache with reference counts, copy-on-write
and prefix caching (``blocks``), attention over it (``paged``), static and
continuous batching with chunked prefill, preemption and SLO ordering
(``scheduler``), an engine serving request traces (``engine``, ``trace``) with
per-request sampling (``sampling``; JSON response formats by constrained decoding, ``grammar``; n choices
of one prompt sharing its blocks) and speculative decoding (``speculative``), run reports (``report``),
long sessions under a KV
budget (``sessions``), int8 KV-cache
quantization (``kvquant``), and an OpenAI-compatible HTTP server (``api``,
``protocol``, ``responses``, ``loop``, ``served``; ``python -m llmsys serve``) with a load generator for any
such server (``load``), and a router in front of several servers sending each request to the one
holding its prompt's prefix (``routing``, ``router``, ``replica_health``; ``python -m llmsys serve-router``).
KV tiers below the block pool (``tiers``; reload against recompute, ``tier_costs``) and prefill/decode
disaggregation (``disagg``, its messages over ``kvlink``). The server modules import FastAPI and are not imported here."""

from llmsys.serving.blocks import (
    BlockAllocator,
    BlockManager,
    OutOfBlocks,
    block_hash,
    blocks_for,
    prefix_hashes,
)
from llmsys.serving.engine import Engine, linear_cost
from llmsys.serving.report import Report, Result, StepRecord, percentile, summary_table
from llmsys.serving.kvquant import (
    QuantizedKVCache,
    dequantize_keys,
    dequantize_values,
    kv_bytes_per_token_int8,
    perplexity,
    quantize_keys,
    quantize_values,
)
from llmsys.serving.paged import Chunk, PagedKVCache, paged_attention, paged_forward
from llmsys.serving.scheduler import Plan, Scheduler, SchedulerConfig, Sequence, scheduler_in_state
from llmsys.serving.speculative import Speculation, StepCosts, step_costs
from llmsys.serving.trace import SERVING_CONTEXT, Request, make_trace, next_turn, predicted_steps, serving_trace

__all__ = [
    "BlockAllocator", "BlockManager", "Chunk", "Engine", "OutOfBlocks", "PagedKVCache", "Plan",
    "QuantizedKVCache", "Report", "Request", "Result", "SERVING_CONTEXT", "Scheduler", "SchedulerConfig", "Sequence",
    "Speculation", "StepCosts", "StepRecord",
    "block_hash", "blocks_for", "scheduler_in_state", "dequantize_keys", "dequantize_values", "kv_bytes_per_token_int8", "linear_cost",
    "make_trace", "next_turn", "paged_attention", "paged_forward", "percentile", "perplexity", "predicted_steps",
    "prefix_hashes", "quantize_keys", "quantize_values", "serving_trace", "step_costs", "summary_table",
]
