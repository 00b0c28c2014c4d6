"""Putting it together: device meshes, Llama 3 405B's layouts, and a layout planner.

Every GPU belongs to one group per dimension. A layout (TP, CP, PP, DP) with
TP·CP·PP·DP = GPUs is a 4-D device mesh; ``named_mesh`` builds it with the
innermost (fastest-varying) dimension TP, so a TP group is consecutive GPUs of
one node, where NVLink is.

The planner follows the three-step cheat sheet:

1. fit in memory: model states (ZeRO/FSDP over the data-parallel ranks) plus
   activations (Korthikanti's per-layer formula, times the layers a 1F1B stage
   holds in flight) must fit each GPU; TP, CP and recomputation shrink them;
2. reach the global batch: DP · microbatches · sequence = batch tokens, with
   every DP rank getting whole sequences;
3. maximise throughput: among what fits, the shortest estimated step time
   (compute, pipeline bubble, exposed TP/CP/PP/DP communication).

The estimates are a model, printed with their parts so they can be argued with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmsys.core.accounting import GPUS, activation_bytes_per_layer, zero_bytes_per_device
from llmsys.core.model import ModelConfig
from llmsys.parallel.context import kv_gather_bytes

DIMS = ("dp", "pp", "cp", "tp")  # mesh order, outermost first

LLAMA3_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                        max_seq_len=131072, rope_theta=500000.0)
LLAMA3_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                         max_seq_len=131072, rope_theta=500000.0)
LLAMA3_405B = ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                          max_seq_len=131072, rope_theta=500000.0)
MODELS = {"Llama 3 8B": LLAMA3_8B, "Llama 3 70B": LLAMA3_70B, "Llama 3 405B": LLAMA3_405B}

LLAMA3_BATCH_TOKENS = 16 * 2**20  # "16M tokens per batch"

# Llama 3 paper (arXiv 2407.21783), Table 4: layouts of the 405B pre-training.
LLAMA3_405B_LAYOUTS = [
    {"gpus": 8192, "tp": 8, "cp": 1, "pp": 16, "dp": 64, "seq_len": 8192, "tflops_per_gpu": 430, "mfu": 0.43},
    {"gpus": 16384, "tp": 8, "cp": 1, "pp": 16, "dp": 128, "seq_len": 8192, "tflops_per_gpu": 400, "mfu": 0.41},
    {"gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": 8, "seq_len": 131072, "tflops_per_gpu": 380, "mfu": 0.38},
]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.upper()} must be a positive int, got {value!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def check(self, gpus: int) -> None:
        if self.gpus != gpus:
            raise ValueError(f"TP·CP·PP·DP = {self.tp}·{self.cp}·{self.pp}·{self.dp} = {self.gpus} must equal "
                             f"the number of GPUs {gpus}; change a degree so the product is {gpus}")

    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp, self.pp, self.cp, self.tp)

    def __str__(self):
        return f"TP{self.tp}·CP{self.cp}·PP{self.pp}·DP{self.dp}"


def named_mesh(layout: Layout, device_type: str = "cpu"):
    """A 4-D DeviceMesh named dp, pp, cp, tp (call inside a launched worker)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("named_mesh needs a process group: call it inside a launch()ed function")
    layout.check(dist.get_world_size())
    return init_device_mesh(device_type, layout.mesh_shape(), mesh_dim_names=DIMS)


def mesh_groups(rank: int, world_size: int, layout: Layout) -> dict[str, list[int]]:
    """Worker: the ranks in each of this rank's groups, read from a real named mesh."""
    import torch.distributed as dist

    mesh = named_mesh(layout)
    return {dim: sorted(dist.get_process_group_ranks(mesh.get_group(dim))) for dim in DIMS}


def group_ranks(rank: int, layout: Layout) -> dict[str, list[int]]:
    """The same, computed: coordinates (dp, pp, cp, tp) with tp varying fastest."""
    shape = layout.mesh_shape()
    coords, rest = [], rank
    for size in reversed(shape):
        coords.insert(0, rest % size)
        rest //= size
    groups = {}
    for axis, dim in enumerate(DIMS):
        members = []
        for i in range(shape[axis]):
            c = list(coords)
            c[axis] = i
            members.append(sum(ci * math.prod(shape[a + 1:]) for a, ci in enumerate(c)))
        groups[dim] = members
    return groups


# -----------------------------------------------------------------------------
# the cost model


@dataclass(frozen=True)
class Cluster:
    gpu: str = "H100 SXM"
    gpus_per_node: int = 8
    nvlink_bytes_per_s: float = 450e9  # per GPU, one direction (H100 NVLink 4: 900 GB/s both ways)
    network_bytes_per_s: float = 50e9  # per GPU, one 400 Gb/s InfiniBand NIC each
    usable_memory: float = 0.9  # the rest goes to the framework, buffers and fragmentation
    matmul_efficiency: float = 0.6  # of peak, for the model's matmuls when nothing waits
    # measured α–β fits by collective (``alpha_beta.fit_all``): when given, every link is priced
    # α per call + β per byte sent instead of bytes / the datasheet bandwidth (the ring model)
    fits: dict | None = None

    @property
    def memory_bytes(self) -> float:
        return GPUS[self.gpu]["hbm_gb"] * 1e9 * self.usable_memory

    @property
    def peak_flops(self) -> float:
        return GPUS[self.gpu]["bf16_flops"]


RECOMPUTE = {"selective": 1.0, "full": 4 / 3}  # compute multiplier: full recompute redoes the forward
# the collectives each dimension runs, for pricing it with measured fits (pp's send is priced as a broadcast)
LINK_COLLECTIVES = {"tp": ("all_gather", "reduce_scatter"), "cp": ("all_gather",), "pp": ("broadcast",),
                    "dp": ("all_reduce",)}


def link_time(cluster: Cluster, dim: str, sent_bytes: float, calls: int, bandwidth: float) -> float:
    """Seconds one GPU spends on a dimension's transfers per step.

    Ring model (no fits): the bytes it sends / the link's bandwidth, latency ignored. With measured
    fits: calls·α + β·bytes, averaged over the dimension's collectives (TP's bytes are half
    all-gather, half reduce-scatter)."""
    if cluster.fits is None:
        return sent_bytes / bandwidth
    ops = LINK_COLLECTIVES[dim]
    missing = [op for op in ops if op not in cluster.fits]
    if missing:
        raise ValueError(f"Cluster.fits has no fit for {missing} (needed for {dim}); fit them with alpha_beta.fit_all")
    return sum(calls * cluster.fits[op].alpha_s + sent_bytes * cluster.fits[op].beta_s_per_byte for op in ops) / len(ops)


@dataclass
class Estimate:
    layout: Layout
    recompute: str
    microbatches: int
    chunks: int  # pipeline chunks per GPU (interleaved 1F1B when > 1)
    state_bytes: float
    activation_bytes: float
    comm_bytes: dict = field(default_factory=dict)  # per GPU per step, by dimension
    comm_calls: dict = field(default_factory=dict)  # collective calls per GPU per step, by dimension
    times: dict = field(default_factory=dict)  # seconds per step: compute, bubble, tp, cp, pp, dp
    fits: bool = True
    reason: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def step_time(self) -> float:
        return sum(self.times.values())

    def mfu(self, flops_per_step: float, gpus: int, peak: float) -> float:
        return flops_per_step / (gpus * peak * self.step_time)

    def row(self) -> str:
        gb = 1e9
        return (f"{str(self.layout):<24}{self.recompute:>10}{self.microbatches:>6}{self.chunks:>4}"
                f"{self.state_bytes / gb:>9.1f}{self.activation_bytes / gb:>9.1f}{self.memory_bytes / gb:>9.1f}"
                f"{self.times.get('bubble', 0) / self.step_time:>9.1%}{self.step_time:>9.2f}")


HEADER = f"{'layout':<24}{'recompute':>10}{'m':>6}{'v':>4}{'states':>9}{'acts':>9}{'GB/GPU':>9}{'bubble':>9}{'step s':>9}"


def _stage_params(cfg: ModelConfig, pp: int) -> float:
    """Parameters of the heaviest pipeline stage: ceil(L/pp) layers plus the embedding or the head."""
    per_layer = cfg._layer_matmul_params() + 2 * cfg.dim
    embedding = cfg.vocab_size * cfg.dim
    return math.ceil(cfg.n_layers / pp) * per_layer + embedding * (2 if pp == 1 else 1)


def estimate(cfg: ModelConfig, layout: Layout, seq_len: int, global_batch_tokens: int, cluster: Cluster = Cluster(),
             recompute: str = "selective", zero_stage: int = 2, chunks: int = 1) -> Estimate:
    """Per-GPU memory, communication and step time of one layout (the planner's cost model).

    Memory: bf16 weights and grads + fp32 master and Adam states (16 bytes per
    parameter) sharded by ZeRO ``zero_stage`` over the DP·CP ranks that hold the
    same stage; activations from ``accounting.activation_bytes_per_layer`` with
    TP + SP on seq_len/CP tokens, for the L layers' worth a 1F1B pipeline keeps
    in flight on its first stage (p microbatches × L/p layers), times
    1 + (p-1)/(p·v) when interleaved with v chunks (Megatron).
    Time: 6·N·tokens FLOPs at ``matmul_efficiency`` of peak (×4/3 with full
    recompute), plus TP, CP and PP transfers (not overlapped), the bubble
    (p-1)/(v·m) of all that, and whatever DP traffic outlasts the backward pass;
    each transfer priced by ``link_time`` (the ring model, or measured α–β fits).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {sorted(RECOMPUTE)}, got {recompute!r}")
    if chunks < 1 or (chunks > 1 and layout.pp == 1):
        raise ValueError(f"chunks (interleaving) must be 1 without pipeline parallelism, got {chunks}")
    tp, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    h, L, bf16 = cfg.dim, cfg.n_layers, 2
    sequences = global_batch_tokens // seq_len
    m = max(1, sequences // dp)  # microbatches of one sequence per pipeline
    s = seq_len // cp  # tokens per CP rank

    # 1. memory
    params = _stage_params(cfg, pp) / tp
    state = zero_bytes_per_device(params, dp * cp, zero_stage)
    per_layer = activation_bytes_per_layer(s, 1, h, cfg.n_heads, tp, sequence_parallel=True, recompute=recompute)
    layers_in_flight = min(pp, m) * math.ceil(L / pp)
    if chunks > 1:
        layers_in_flight *= 1 + (pp - 1) / (pp * chunks)
    activations = per_layer * layers_in_flight

    # 2. communication per GPU per step (bytes sent), and its time
    node_links = lambda group_span: cluster.nvlink_bytes_per_s if group_span <= cluster.gpus_per_node else cluster.network_bytes_per_s  # noqa: E731
    layers_here = math.ceil(L / pp)
    passes = 3 if recompute == "full" else 2  # TP collectives run in forward, backward (and the recomputed forward)
    tp_bytes = 0.0 if tp == 1 else m * layers_here * passes * 2 * (2 * (tp - 1) / tp) * s * h * bf16
    cp_bytes = 0.0 if cp == 1 else m * layers_here * passes * kv_gather_bytes(s * cp, max(1, cfg.n_kv_heads // tp), cfg.head_dim, cp)
    pp_bytes = 0.0 if pp == 1 else m * 2 * s * h * bf16 / tp
    dp_bytes = 0.0 if dp * cp == 1 else 2 * params * bf16 * (dp * cp - 1) / (dp * cp)
    comm = {"tp": tp_bytes, "cp": cp_bytes, "pp": pp_bytes, "dp": dp_bytes}
    calls = {"tp": 0 if tp == 1 else m * layers_here * passes * 4,  # all-gather + reduce-scatter around attention and MLP
             "cp": 0 if cp == 1 else m * layers_here * passes,  # one KV all-gather per layer
             "pp": 0 if pp == 1 else m * 2,  # activations forward, gradients back
             "dp": 0 if dp * cp == 1 else 1}  # one all-reduce of the gradients (buckets would add α each)

    flops = 6 * cfg.n_params() * global_batch_tokens * RECOMPUTE[recompute]
    compute = flops / (layout.gpus * cluster.peak_flops * cluster.matmul_efficiency)
    times = {
        "compute": compute,
        "tp": link_time(cluster, "tp", tp_bytes, calls["tp"], node_links(tp)),
        "cp": link_time(cluster, "cp", cp_bytes, calls["cp"], node_links(tp * cp)),
        "pp": link_time(cluster, "pp", pp_bytes, calls["pp"], cluster.network_bytes_per_s),
    }
    busy = sum(times.values())
    times["bubble"] = busy * (pp - 1) / (chunks * m)  # 1F1B: (p-1)/m of the ideal time; interleaving ÷ v
    dp_time = link_time(cluster, "dp", dp_bytes, calls["dp"], cluster.network_bytes_per_s)
    times["dp"] = max(0.0, dp_time - compute * 2 / 3)  # overlapped with backward
    est = Estimate(layout, recompute, m, chunks, state, activations, comm, calls, times)
    if est.memory_bytes > cluster.memory_bytes:
        est.fits = False
        est.reason = (f"needs {est.memory_bytes / 1e9:.1f} GB per GPU (states {state / 1e9:.1f} + activations "
                      f"{activations / 1e9:.1f}) > {cluster.memory_bytes / 1e9:.1f} GB usable")
    return est


class DoesNotFit(ValueError):
    """No layout fits: the message says what the smallest footprint is and what to change."""


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [d for d in (2**i for i in range(int(math.log2(max(1, limit))) + 1)) if n % d == 0 and d <= limit]


MIN_CP_TOKENS = 4096  # context parallelism is for long sequences: keep at least this many tokens per rank


def candidate_layouts(cfg: ModelConfig, gpus: int, seq_len: int, global_batch_tokens: int,
                      cluster: Cluster = Cluster()) -> list[Layout]:
    """Every layout the hard rules allow.

    TP within a node (NVLink) and dividing the heads, KV heads and FFN width;
    CP only for long sequences, each rank keeping at least MIN_CP_TOKENS tokens
    in 2·CP equal chunks; PP at most the layer count; DP dividing the batch's
    sequences, so every data-parallel rank gets whole sequences (step 2 of the
    cheat sheet: the global batch is reached exactly).
    """
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    if global_batch_tokens % seq_len:
        raise ValueError(f"the global batch ({global_batch_tokens} tokens) must be a whole number of "
                         f"sequences of {seq_len} tokens")
    sequences = global_batch_tokens // seq_len
    layouts = []
    tp_limit = min(cluster.gpus_per_node, gpus)
    tps = [t for t in _powers_of_two_dividing(math.gcd(cfg.n_heads, cfg.n_kv_heads, cfg.hidden), tp_limit)
           if gpus % t == 0]
    for tp in tps:
        cps = [c for c in _powers_of_two_dividing(seq_len // 2, gpus // tp)
               if (gpus // tp) % c == 0 and (c == 1 or seq_len // c >= MIN_CP_TOKENS)]
        for cp in cps:
            for pp in range(1, min(cfg.n_layers, gpus // (tp * cp)) + 1):
                if (gpus // (tp * cp)) % pp == 0 and sequences % (gpus // (tp * cp * pp)) == 0:
                    layouts.append(Layout(tp, cp, pp, gpus // (tp * cp * pp)))
    if not layouts:
        raise DoesNotFit(f"no layout of {gpus} GPUs splits a batch of {sequences} sequences of {seq_len} tokens "
                         f"into whole sequences per data-parallel rank; change the GPU count or the batch")
    return layouts


def _chunk_options(cfg: ModelConfig, layout: Layout, microbatches: int) -> list[int]:
    """Interleaving degrees v to try: whole layers per chunk, and microbatches in groups of p (Megatron)."""
    if layout.pp == 1:
        return [1]
    per_stage = math.ceil(cfg.n_layers / layout.pp)
    return [1] + [v for v in (2, 4, 8) if per_stage % v == 0 and microbatches % layout.pp == 0]


def plan(cfg: ModelConfig, gpus: int, seq_len: int, global_batch_tokens: int, cluster: Cluster = Cluster(),
         top: int = 5, zero_stage: int = 2) -> list[Estimate]:
    """The three-step cheat sheet: keep the layouts that fit in memory (step 1) and split the global
    batch into whole sequences per DP rank (step 2), then rank them by estimated step time (step 3).

    Returns the ``top`` fastest, best first; raises DoesNotFit, with the smallest
    footprint found and what to change, when nothing fits.
    """
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
    estimates = []
    for layout in candidate_layouts(cfg, gpus, seq_len, global_batch_tokens, cluster):
        microbatches = max(1, global_batch_tokens // seq_len // layout.dp)
        for recompute in RECOMPUTE:
            for chunks in _chunk_options(cfg, layout, microbatches):
                estimates.append(estimate(cfg, layout, seq_len, global_batch_tokens, cluster, recompute, zero_stage,
                                          chunks))
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_time)
    if not fitting:
        smallest = min(estimates, key=lambda e: e.memory_bytes)
        raise DoesNotFit(
            f"{cfg.n_params() / 1e9:.1f}B parameters at {seq_len} tokens do not fit on {gpus} × {cluster.gpu}: "
            f"the smallest footprint, {smallest.layout} with {smallest.recompute} recompute, {smallest.reason}. "
            f"Use more GPUs, GPUs with more memory, or shorter sequences.")
    return fitting[:top]


def flops_per_step(cfg: ModelConfig, global_batch_tokens: int) -> float:
    return 6 * cfg.n_params() * global_batch_tokens


def show_plan(cfg: ModelConfig, gpus: int, seq_len: int, global_batch_tokens: int, cluster: Cluster = Cluster(),
              top: int = 5) -> str:
    """The planner's proposals as a table (or the reason nothing fits)."""
    try:
        best = plan(cfg, gpus, seq_len, global_batch_tokens, cluster, top)
    except DoesNotFit as reason:
        return f"does not fit: {reason}"
    flops = flops_per_step(cfg, global_batch_tokens)
    lines = [HEADER + f"{'MFU':>7}"]
    lines += [e.row() + f"{e.mfu(flops, gpus, cluster.peak_flops):>7.0%}" for e in best]
    return "\n".join(lines)
