"""llmsys.parallel: each dimension checked against its one-process reference or its formula.

Distributed checks run on 2-4 gloo ranks with tiny shapes; each launched worker
checks several invariants at once and returns numbers for the asserts here.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core import accounting
from llmsys.core.comm import CommCounter
from llmsys.core.dist import cpu_mesh, launch
from llmsys.core.model import ModelConfig, Transformer, rope_tables
from llmsys.parallel import collectives, context, expert, pipeline, planner, sequence, tensor


TINY = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)


def tiny_block(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64)).layers[0]


def block_inputs(seq=8, batch=2, dim=32, head_dim=8):
    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(7))
    cos, sin = rope_tables(head_dim, torch.arange(seq), 10000.0)
    return x, cos, sin


# --- collectives --------------------------------------------------------------


def test_every_collective_gives_its_result_and_moves_the_ring_bytes():
    world, numel = 4, 1024
    reports = launch(collectives.primer, world, args=(numel,))
    model = collectives.ring_model(numel, world)
    for rank, report in enumerate(reports):
        for op in collectives.PRIMER_OPS:
            assert report[op]["ok"], f"rank {rank}: {op} returned the wrong tensor"
            assert report[op]["calls"] == 1
            assert report[op]["ring_bytes"] == pytest.approx(model[op]), op
    assert model["all_reduce"] == pytest.approx(2 * model["reduce_scatter"])  # AR = RS + AG


def test_ring_all_reduce_by_hand_equals_all_reduce_and_sends_2_n_minus_1_over_n():
    world, numel = 4, 1024
    for result in launch(collectives.ring_all_reduce_demo, world, args=(numel,)):
        assert result["max_error"] < 1e-5
        assert result["sends"] == 2 * (world - 1)
        assert result["sent_bytes"] == result["model_bytes"] == 2 * (world - 1) / world * numel * 4


# --- tensor parallelism --------------------------------------------------------


def _tp_worker(rank, world_size):
    block = tiny_block()
    x, cos, sin = block_inputs()
    full_x = x.clone().requires_grad_()
    block(full_x, cos, sin).square().sum().backward()

    tp_block = tensor.tensor_parallel_block(block)
    tp_x = x.clone().requires_grad_()
    with CommCounter() as fwd:
        y = tp_block(tp_x, cos, sin)
    with CommCounter() as bwd:
        y.square().sum().backward()
    grad_errors = {name: (p.grad - slicer(full.grad)).abs().max().item()
                   for name, p, full, slicer in tensor.sharded_pairs(tp_block, block)}

    # a lone column-parallel layer gathering its output
    torch.manual_seed(3)
    linear = nn.Linear(32, 16, bias=False)
    column = tensor.ColumnParallelLinear.from_linear(linear, gather_output=True)
    z = torch.randn(5, 32)
    lone = (column(z) - linear(z)).abs().max().item()
    return {
        "out": (y - block(x, cos, sin)).abs().max().item(),
        "x_grad": (tp_x.grad - full_x.grad).abs().max().item(),
        "grads": grad_errors,
        "fwd": dict(fwd.calls), "bwd": dict(bwd.calls),
        "fwd_bytes": fwd.bytes["all_reduce"],
        "lone": lone,
    }


def test_tensor_parallel_block_equals_one_process_with_two_all_reduces_each_way():
    for r in launch(_tp_worker, 2):
        assert r["out"] < 1e-5 and r["x_grad"] < 1e-5
        assert max(r["grads"].values()) < 1e-5, r["grads"]
        assert r["fwd"] == {"all_reduce": 2} and r["bwd"] == {"all_reduce": 2}
        assert r["fwd_bytes"] == 2 * 2 * 8 * 32 * 4  # two (B, T, D) fp32 outputs
        assert r["lone"] < 1e-6
        # every parameter of the block is there: 2 norms + 7 projections
        assert len(r["grads"]) == 9


def _row_parallel_worker(rank, world_size):
    torch.manual_seed(4)
    linear = nn.Linear(16, 12, bias=False)
    row = tensor.RowParallelLinear.from_linear(linear, input_is_parallel=False)
    z = torch.randn(3, 16, requires_grad=True)
    z_ref = z.detach().clone().requires_grad_()
    row(z).sum().backward()
    linear(z_ref).sum().backward()
    refused = []
    for make in (lambda: tensor.ColumnParallelLinear(16, 7), lambda: tensor.RowParallelLinear(7, 16)):
        try:
            make()
        except ValueError as e:
            refused.append(str(e))
    errors = ((row(z) - linear(z)).abs().max().item(), (z.grad - z_ref.grad).abs().max().item(),
              (row.weight.grad - row.shard_of(linear.weight.grad)).abs().max().item())
    return errors, refused


def test_row_parallel_linear_scatters_its_input_and_gathers_the_gradient():
    for errors, refused in launch(_row_parallel_worker, 2):
        assert max(errors) < 1e-5
        assert refused == ["out_features=7 must be divisible by the tensor-parallel degree 2",
                           "in_features=7 must be divisible by the tensor-parallel degree 2"]


def _dtensor_worker(rank, world_size):
    block = tiny_block()
    x, cos, sin = block_inputs()
    ref_x = x.clone().requires_grad_()
    want = block(ref_x, cos, sin)
    want.square().sum().backward()
    dt_block = tensor.dtensor_parallelize_block(block, cpu_mesh((world_size,), ("tp",)))
    dt_x = x.clone().requires_grad_()
    with CommCounter() as fwd:
        y = dt_block(dt_x, cos, sin)
    with CommCounter() as bwd:
        y.square().sum().backward()
    w1 = dt_block.feed_forward.w1.weight.grad.full_tensor()
    return {"out": (y - want).abs().max().item(), "x_grad": (dt_x.grad - ref_x.grad).abs().max().item(),
            "w1_grad": (w1 - block.feed_forward.w1.weight.grad).abs().max().item(),
            "fwd": dict(fwd.calls), "bwd": dict(bwd.calls)}


def test_dtensor_parallelize_module_matches_and_counts_the_same_collectives():
    for r in launch(_dtensor_worker, 2):
        assert max(r["out"], r["x_grad"], r["w1_grad"]) < 1e-5
        assert r["fwd"] == {"all_reduce": 2} and r["bwd"] == {"all_reduce": 2}


def test_tp_degree_must_divide_heads_and_hidden():
    with pytest.raises(ValueError, match="n_heads=4"):
        tensor.check_tp_degree(TINY, 3)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        tensor.check_tp_degree(TINY, 4)
    odd_hidden = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=66)
    with pytest.raises(ValueError, match="ffn hidden size=66"):
        tensor.check_tp_degree(odd_hidden, 4)
    tensor.check_tp_degree(TINY, 2)


# --- sequence parallelism ------------------------------------------------------


def _sp_worker(rank, world_size):
    block = tiny_block()
    x, cos, sin = block_inputs()
    full_x = x.clone().requires_grad_()
    want = block(full_x, cos, sin)
    want.square().sum().backward()
    rows = slice(rank * x.size(1) // world_size, (rank + 1) * x.size(1) // world_size)
    results = {}
    for keep in (False, True):
        sp_block = sequence.SequenceParallelBlock(block, keep_gathered=keep)
        shard = sequence.sequence_shard(x).requires_grad_()
        with CommCounter() as fwd:
            y = sp_block(shard, cos, sin)
        with CommCounter() as bwd:
            y.square().sum().backward()
        sequence.sync_sequence_parallel_grads(sp_block)
        grads = [(p.grad - slicer(full.grad)).abs().max().item()
                 for _, p, full, slicer in tensor.sharded_pairs(sp_block, block)]
        results[keep] = {"out": (y - want[:, rows]).abs().max().item(),
                         "x_grad": (shard.grad - full_x.grad[:, rows]).abs().max().item(), "grads": max(grads),
                         "fwd": dict(fwd.calls), "bwd": dict(bwd.calls),
                         "ring": fwd.total_ring_bytes() + bwd.total_ring_bytes()}
    tp_block = tensor.TensorParallelBlock(block)
    with CommCounter() as tp_comm:
        tp_block(x.clone().requires_grad_(), cos, sin).square().sum().backward()
    results["tp_ring"] = tp_comm.total_ring_bytes()
    return results


def test_sequence_parallel_block_equals_one_process_and_moves_tp_bytes():
    for r in launch(_sp_worker, 2):
        for keep in (False, True):
            assert r[keep]["out"] < 1e-5 and r[keep]["x_grad"] < 1e-5 and r[keep]["grads"] < 1e-5
            assert r[keep]["fwd"] == {"all_gather": 2, "reduce_scatter": 2}
        # keeping the gathered input: RS + AG per region each way = the bytes of TP's all-reduces
        assert r[True]["bwd"] == {"all_gather": 2, "reduce_scatter": 2}
        assert r[True]["ring"] == r["tp_ring"]
        # storing only the shard costs one more all-gather per region in backward
        assert r[False]["bwd"] == {"all_gather": 4, "reduce_scatter": 2}


def test_activation_bytes_per_rank_match_korthikanti():
    s, b, h, a = 64, 2, 128, 4
    results = launch(sequence.gpt_layer_activation_demo, 2, args=(s, b, h, a))
    formula = {
        "one_process": accounting.activation_bytes_per_layer(s, b, h, a),
        "tensor_parallel": accounting.activation_bytes_per_layer(s, b, h, a, tp=2),
        "sequence_parallel": accounting.activation_bytes_per_layer(s, b, h, a, tp=2, sequence_parallel=True),
    }
    for result in results:
        for key, estimate in formula.items():
            # the only extra: LayerNorm's mean and rstd, 2 numbers per token per norm
            assert estimate <= result[key] <= estimate * 1.01, (key, result[key], estimate)
        assert result["sequence_parallel"] < result["tensor_parallel"] < result["one_process"]


# --- context parallelism ------------------------------------------------------


def test_merge_of_blockwise_attention_is_full_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=gen) for _ in range(3))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = lse = None
    for block in torch.arange(12).chunk(3):
        out, lse = context.merge_attention(out, lse, *context.block_attention(q, k[:, :, block], v[:, :, block],
                                                                             mask[:, block]))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp((q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~mask, -math.inf), -1))


def test_load_balanced_layout_equalises_causal_work():
    for cp in (2, 4):
        seen = torch.cat([context.load_balanced_positions(32, cp, r) for r in range(cp)])
        assert sorted(seen.tolist()) == list(range(32))  # every token once
        assert len(set(context.causal_work(32, cp, balanced=True))) == 1
        assert sum(context.causal_work(32, cp, True)) == sum(context.causal_work(32, cp, False)) == 32 * 33 // 2
        contiguous = context.causal_work(32, cp, balanced=False)
        assert contiguous == sorted(contiguous) and contiguous[-1] > contiguous[0]
    assert context.load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="2·CP"):
        context.load_balanced_positions(30, 4, 0)


@pytest.mark.parametrize("world,balanced", [(2, False), (4, True)])
def test_ring_and_allgather_attention_equal_full_attention(world, balanced):
    kv_heads, head_dim, seq, batch = 2, 8, 32, 2
    for r in launch(context.context_parallel_demo, world, args=(seq, 4, kv_heads, head_dim, batch, balanced)):
        for name in ("ring", "allgather"):
            assert r[name]["max_error_out"] < 1e-5 and r[name]["max_error_grads"] < 1e-5, (name, r[name])
        local_kv = 2 * batch * kv_heads * seq // world * head_dim * 4
        # ring: CP-1 K/V hops forward; backward CP-1 hops of K/V plus CP hops of their gradients
        assert r["ring"]["sent_bytes"] == (world - 1) * local_kv + (world - 1) * local_kv + world * local_kv
        assert r["allgather"]["calls"] == {"all_gather": 2, "reduce_scatter": 2}


# --- pipeline parallelism ------------------------------------------------------


DURATIONS = [(1, 1, 1), (1, 2, 1), (2, 1, 0.5), (1, 1, 0.25)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_simulated_bubbles_equal_the_formulas(schedule):
    for p, m in [(2, 4), (4, 8), (4, 12), (8, 16)]:
        for F_, B_, W_ in DURATIONS:
            timeline = pipeline.simulate(schedule, p, m, chunks=2, f_time=F_, b_time=B_, w_time=W_)
            formula = pipeline.bubble_formula(schedule, p, F_, B_, W_, chunks=2)
            for device in range(p):
                assert timeline.bubble(device) == pytest.approx(formula), (schedule, p, m, device)
        if schedule != "zb-h1":  # share of the step, as in accounting (F = B = W)
            v = 2 if schedule == "interleaved" else 1
            assert pipeline.simulate(schedule, p, m, chunks=2).idle_fraction() == pytest.approx(
                accounting.pipeline_bubble_fraction(p, m, v))


def test_zb_h1_bubble_is_a_third_of_1f1b_when_f_b_w_are_equal():
    for p, m in [(4, 8), (8, 24)]:
        one_f_one_b = pipeline.simulate("1f1b", p, m).bubble(0)
        assert pipeline.simulate("zb-h1", p, m).bubble(0) == pytest.approx(one_f_one_b / 3)
        assert one_f_one_b == pytest.approx((p - 1) * 3)


def test_dualpipe_rows_of_deepseek_v3_table():
    # exact in this simulator when F = B and F + B <= F&B <= F + B + W (the overlap hides at most W)
    for F_, W_, FB in [(1, 1, 3), (1, 1, 2.5), (2, 1, 4), (1, 0.5, 2.2)]:
        for pp, m in [(4, 8), (8, 16), (8, 24)]:
            dual = pipeline.simulate("dualpipe", pp, m, f_time=F_, b_time=F_, w_time=W_, fb_time=FB)
            folded = pipeline.simulate("dualpipev", pp // 2, m, f_time=F_, b_time=F_, w_time=W_, fb_time=FB)
            formula = pipeline.bubble_formula("dualpipe", pp, F_, F_, W_, FB)
            assert max(dual.bubble(d) for d in range(pp)) == pytest.approx(formula)
            assert max(folded.bubble(d) for d in range(pp // 2)) == pytest.approx(formula)
            assert [dual.peak_in_flight(d) for d in range(pp)] == [pp + 1] * pp  # PP + 1 (of 2× params)
            assert max(folded.peak_in_flight(d) for d in range(pp // 2)) == pp + 1


def test_peak_in_flight_activations_gpipe_m_versus_1f1b_p():
    p, m = 4, 12
    assert pipeline.simulate("gpipe", p, m).peak_in_flight(0) == m
    assert [pipeline.simulate("1f1b", p, m).peak_in_flight(d) for d in range(p)] == [4, 3, 2, 1]
    assert max(pipeline.simulate("zb-h1", p, m).peak_in_flight(d) for d in range(p)) == p


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_every_op_runs_once_after_its_inputs(schedule):
    timeline = pipeline.simulate(schedule, 4, 8, f_time=1, b_time=1.5, w_time=0.5)
    ends = {}
    for slot in timeline.slots:
        for op in slot.ops:
            key = (op.kind, op.microbatch, op.stage, op.pipe)
            assert key not in ends, f"{key} ran twice"
            ends[key] = (slot.start, slot.end)
    stages = 8 if schedule in ("interleaved", "dualpipev") else 4
    pipes = 2 if schedule == "dualpipe" else 1
    microbatches = 4 if schedule == "dualpipe" else 8
    forwards = [k for k in ends if k[0] == "F"]
    assert len(forwards) == stages * pipes * microbatches
    for kind, mb, stage, pipe in ends:
        start = ends[(kind, mb, stage, pipe)][0]
        if kind == "F" and stage > 0:
            assert start >= ends[("F", mb, stage - 1, pipe)][1]
        if kind in ("B", "BW") and stage < stages - 1:
            upstream = ends.get(("B", mb, stage + 1, pipe)) or ends[("BW", mb, stage + 1, pipe)]
            assert start >= upstream[1]
        if kind == "W":
            assert start >= ends[("B", mb, stage, pipe)][1]
    for device in range(4 if schedule != "dualpipev" else 4):
        slots = sorted((s for s in timeline.slots if s.device == device), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(slots, slots[1:])), "a device ran two ops at once"


def _pipeline_batches():
    torch.manual_seed(0)
    model = Transformer(TINY)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        x = torch.randint(0, TINY.vocab_size, (8, 16), generator=gen)
        batches.append((x, (3 * x + 1) % TINY.vocab_size))
    return model, batches


@pytest.mark.parametrize("schedule,world", [("1f1b", 2), ("zb-h1", 4), ("gpipe", 2)])
def test_real_pipeline_losses_equal_one_process_training(schedule, world):
    model, batches = _pipeline_batches()
    reference = copy.deepcopy(model)
    want = pipeline.single_process_train(reference, batches, lr=0.5)
    results = launch(pipeline.pipeline_train, world, args=(model, batches, schedule, 4, 0.5))
    assert results[-1]["losses"] == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]  # it learns
    stages = pipeline.split_stages(reference, world)
    for stage, result in zip(stages, results):
        for name, param in stage.named_parameters():
            torch.testing.assert_close(result["params"][f"layer{stage.first_layer}+" + name], param.detach(),
                                       rtol=1e-4, atol=1e-5)
        # the log lists the same ops, in the same order, as the simulator's schedule for this device
        assert [(kind, mb) for kind, mb, *_ in result["log"]] == [
            (op.kind, op.microbatch) for op in pipeline.schedule_orders(schedule, world, 4)[stages.index(stage)]]


def test_real_pipeline_on_a_sub_group_sends_to_its_members():
    """Stages 0 and 1 on processes 1 and 2 of three: a stage's neighbour is a global rank of the
    group's members, not its own group rank ± 1."""
    model, batches = _pipeline_batches()
    want = pipeline.single_process_train(copy.deepcopy(model), batches, lr=0.5)
    results = launch(pipeline.pipeline_train, 3, args=(model, batches, "1f1b", 4, 0.5, [1, 2]), timeout=60)
    assert results[0] is None
    assert results[2]["losses"] == pytest.approx(want, rel=1e-5)


def test_pipeline_bad_input_names_the_constraint():
    model, _ = _pipeline_batches()
    with pytest.raises(ValueError, match="at least 5 layers.*n_layers=4"):
        pipeline.split_stages(model, 5)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        pipeline.simulate("interleaved", 4, 6)
    with pytest.raises(ValueError, match="even number"):
        pipeline.simulate("dualpipe", 3, 12)
    with pytest.raises(ValueError, match="unknown schedule"):
        pipeline.simulate("2f2b", 4, 8)
    assert len(pipeline.split_stages(model, 4)) == 4


def test_timeline_text_and_plot():
    timeline = pipeline.simulate("1f1b", 2, 3)
    lines = timeline.text().splitlines()
    assert lines[0].split()[2:] == ["F0", "F1", ".", ".", "BW0", "~", "F2", "BW1", "~", ".", "BW2", "~"]
    assert lines[1].split()[2:] == [".", "F0", "BW0", "~", "F1", "BW1", "~", "F2", "BW2", "~", ".", "."]
    assert "F0.1" in pipeline.simulate("interleaved", 2, 2, chunks=2).text()
    import matplotlib

    matplotlib.use("Agg")
    ax = pipeline.plot_timeline(pipeline.simulate("dualpipev", 2, 4))
    assert len(ax.patches) + len(ax.collections) > 0


# --- expert parallelism ----------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process_moe(world):
    torch.manual_seed(0)
    moe = expert.MoE(16, 32, 8, top_k=2, capacity_factor=1.0)
    results = launch(expert.expert_parallel_demo, world, args=(moe, 32))
    for r in results:
        assert r["max_error"] < 1e-6 and r["max_grad_error"] < 1e-6
        assert r["all_to_all_calls"] == 4  # counts, dispatch, combine; the combine's backward
    torch.testing.assert_close(sum(r["router_grad"] for r in results), results[0]["reference_router_grad"])
    received = sum(r["received"] for r in results)
    assert received == sum(r["assigned"] - r["drops"] for r in results)  # tokens·k - drops
    assert sum(r["drops"] for r in results) > 0  # capacity 1.0 drops some


def test_router_capacity_and_drops():
    logits = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    logits[:, 0] += 3.0  # everyone's favourite
    routing = expert.route(logits, top_k=2, capacity_factor=1.0)
    assert routing.capacity == math.ceil(40 * 2 / 4)
    assert (routing.load() <= routing.capacity).all()
    assert routing.drops == int((routing.demand() - routing.load()).sum()) > 0
    # an expert's queue: every first choice before any second choice, then token order
    for e in range(4):
        first = routing.experts[:, 0] == e
        dropped_first = (first & ~routing.keep[:, 0]).nonzero().flatten()
        if len(dropped_first):
            assert not (routing.keep[:, 1] & (routing.experts[:, 1] == e)).any()
            assert (first & routing.keep[:, 0]).nonzero().max() < dropped_first.min()
    favourite = routing.experts[:, 0] == 0
    assert (~routing.keep[:, 0] & favourite).sum() == favourite.sum() - routing.capacity > 0
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(40))
    assert expert.route(logits, 2, None).drops == 0


def test_identity_experts_return_x_times_the_kept_gate_weights():
    torch.manual_seed(1)
    moe = expert.MoE(8, 16, 4, top_k=2, capacity_factor=0.75)
    moe.experts = nn.ModuleList(nn.Identity() for _ in range(4))
    x = torch.randn(24, 8)
    y, routing = moe(x)
    torch.testing.assert_close(y, x * (routing.weights * routing.keep).sum(-1, keepdim=True))


def test_aux_loss_is_one_when_balanced_and_evens_out_the_load():
    uniform = expert.route(torch.zeros(8, 4), top_k=1)
    uniform.experts = torch.arange(8).remainder(4)[:, None]  # a perfectly even assignment
    assert expert.aux_balance_loss(uniform).item() == pytest.approx(1.0)
    without = expert.balance_demo(aux_weight=0.0, steps=60)
    with_aux = expert.balance_demo(aux_weight=0.01, steps=60)
    assert without[0] == with_aux[0] > 3  # the skewed start
    assert without[-1] > 3  # the task loss alone keeps the router where it is
    assert with_aux[-1] < 0.5 * without[-1]
    assert expert.load_imbalance(torch.tensor([5, 5, 5, 5])) == 1.0


# --- planner ------------------------------------------------------------------


def test_llama3_405b_layouts_multiply_out():
    for row in planner.LLAMA3_405B_LAYOUTS:
        layout = planner.Layout(row["tp"], row["cp"], row["pp"], row["dp"])
        layout.check(row["gpus"])
        sequences_per_dp = planner.LLAMA3_BATCH_TOKENS // row["seq_len"] // row["dp"]
        assert sequences_per_dp * row["dp"] * row["seq_len"] == planner.LLAMA3_BATCH_TOKENS  # ≈16M tokens
    assert planner.LLAMA3_405B.n_params() == pytest.approx(405e9, rel=0.01)
    with pytest.raises(ValueError, match="TP·CP·PP·DP = 8·16·16·4 = 8192 must equal the number of GPUs 16384"):
        planner.Layout(8, 16, 16, 4).check(16384)


def test_llama3_estimates_memory_limits():
    cfg, batch = planner.LLAMA3_405B, planner.LLAMA3_BATCH_TOKENS
    for row in planner.LLAMA3_405B_LAYOUTS:
        layout = planner.Layout(row["tp"], row["cp"], row["pp"], row["dp"])
        assert planner.estimate(cfg, layout, row["seq_len"], batch, recompute="full").fits
        plain = planner.estimate(cfg, layout, row["seq_len"], batch, recompute="selective")
        # 8K tokens per rank: the first stage keeps 16 microbatches of its 8 layers in flight,
        # each 34·s·h/8 bytes: 73 GB of activations alone
        tokens = row["seq_len"] // row["cp"]
        assert plain.activation_bytes == pytest.approx(16 * 8 * 34 * tokens * 16384 / 8)
        assert not plain.fits
    # 128K tokens need context parallelism: with the pipeline kept full (m >= p microbatches),
    # no layout without it fits, even with full recompute
    for layout in planner.candidate_layouts(cfg, 16384, 131072, batch):
        e = planner.estimate(cfg, layout, 131072, batch, recompute="full")
        if layout.cp == 1 and e.microbatches >= layout.pp:
            assert not e.fits, layout


def test_planner_proposes_a_full_node_of_tp_and_beats_its_own_estimate_of_llama3():
    cfg, batch = planner.LLAMA3_405B, planner.LLAMA3_BATCH_TOKENS
    best = planner.plan(cfg, 16384, 8192, batch)
    assert all(e.fits and e.layout.gpus == 16384 for e in best)
    assert best[0].layout.tp == 8
    assert best == sorted(best, key=lambda e: e.step_time)
    llama = planner.estimate(cfg, planner.Layout(8, 1, 16, 128), 8192, batch, recompute="full", chunks=8)
    assert best[0].step_time <= llama.step_time
    long = planner.plan(cfg, 16384, 131072, batch)[0]
    assert long.layout.cp >= 16 and long.fits


def test_planner_says_what_does_not_fit_and_why():
    with pytest.raises(planner.DoesNotFit, match="do not fit on 8 × H100.*GB per GPU"):
        planner.plan(planner.LLAMA3_405B, 8, 8192, 8 * 8192)
    with pytest.raises(planner.DoesNotFit, match="whole sequences"):
        planner.plan(planner.LLAMA3_8B, 1024, 8192, 8192)  # one sequence; TP·CP·PP reaches 512 at most
    with pytest.raises(ValueError, match="whole number of sequences"):
        planner.plan(planner.LLAMA3_8B, 8, 8192, 1000)
    assert "does not fit" in planner.show_plan(planner.LLAMA3_405B, 8, 8192, 8 * 8192)


def _mesh_worker(rank, world_size):
    groups = planner.mesh_groups(rank, world_size, planner.Layout(tp=2, cp=1, pp=1, dp=2))
    try:
        planner.named_mesh(planner.Layout(tp=2, cp=1, pp=1, dp=1))
        error = ""
    except ValueError as e:
        error = str(e)
    return groups, error


def test_named_mesh_groups_and_bad_product():
    layout = planner.Layout(tp=2, cp=1, pp=1, dp=2)
    for rank, (groups, error) in enumerate(launch(_mesh_worker, 4)):
        assert groups == planner.group_ranks(rank, layout)
        assert "TP·CP·PP·DP = 2·1·1·1 = 2 must equal the number of GPUs 4" in error
    assert planner.group_ranks(1, layout)["tp"] == [0, 1]
    assert planner.group_ranks(1, layout)["dp"] == [1, 3]


def test_planner_with_measured_fits_is_the_ring_model_plus_alpha_per_call():
    """α–β pricing: with α = 0 and 1/β the link's bandwidth it is the ring model exactly; α adds calls·α."""
    from llmsys.parallel.alpha_beta import FIT_OPS, Fit

    cfg, layout, seq, batch = planner.LLAMA3_8B, planner.Layout(tp=2, cp=2, pp=2, dp=2), 8192, 8 * 8192
    bandwidth = 40e9
    ring = planner.Cluster(nvlink_bytes_per_s=bandwidth, network_bytes_per_s=bandwidth)
    no_latency = planner.Cluster(nvlink_bytes_per_s=bandwidth, network_bytes_per_s=bandwidth,
                                 fits={op: Fit(op, 0.0, 1 / bandwidth, 1.0) for op in FIT_OPS})
    alpha = 3e-4
    measured = planner.Cluster(fits={op: Fit(op, alpha, 1 / bandwidth, 1.0) for op in FIT_OPS})
    base = planner.estimate(cfg, layout, seq, batch, ring)
    assert planner.estimate(cfg, layout, seq, batch, no_latency).times == pytest.approx(base.times, rel=1e-12)
    with_alpha = planner.estimate(cfg, layout, seq, batch, measured)
    m, layers_here, passes = 8 // 2, cfg.n_layers // 2, 2  # 8 sequences over DP 2; 32 layers over PP 2; selective recompute
    assert with_alpha.comm_calls == {"tp": m * layers_here * passes * 4, "cp": m * layers_here * passes, "pp": 2 * m, "dp": 1}
    for dim in ("tp", "cp", "pp"):
        assert with_alpha.times[dim] == pytest.approx(base.times[dim] + with_alpha.comm_calls[dim] * alpha, rel=1e-12)
    assert with_alpha.step_time > base.step_time
    with pytest.raises(ValueError, match="no fit for \\['broadcast'\\]"):
        planner.estimate(cfg, layout, seq, batch, planner.Cluster(fits={op: Fit(op, 0.0, 1e-9, 1.0) for op in FIT_OPS
                                                                       if op != "broadcast"}))
