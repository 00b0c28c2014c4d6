"""llmsys.zero: ZeRO-1/2/3 by hand, FSDP2, distributed checkpoints, activation checkpointing.

Every distributed test runs 2 gloo ranks (3 or 4 where the world size is the
point) on a model of a few thousand parameters for a few steps.
"""

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmsys.core import accounting
from llmsys import zero
from llmsys.core.comm import CommCounter
from llmsys.core.dist import WorkerError, launch
from llmsys.core.model import ModelConfig

REPO = Path(__file__).resolve().parents[1]
BATCH = 12  # splits over 2, 3 and 4 ranks
CONFIG = zero.TrainConfig(steps=3, batch_size=BATCH, seq_len=16)
# Parameters differ from one process only by the fp32 rounding of the gradient sum
# (two half-batch sums added vs one full-batch sum): typically ~1e-8, but Adam's
# g/sqrt(v) amplifies it where a gradient is near 0, for a fraction of a percent of
# the elements, up to ~1% of one step. A wrong algorithm is off by whole steps (lr).
PARAM_ATOL, PARAM_MEDIAN = 0.02 * CONFIG.lr, 1e-7


@functools.cache
def reference(steps=CONFIG.steps):
    return zero.train_single_process(zero.TrainConfig(steps=steps, batch_size=BATCH))


@functools.cache
def zero_run(stage, world_size=2):
    return launch(zero.train_zero, world_size, args=(stage, CONFIG))


def assert_params_close(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
    differences = torch.cat([(got[name] - want[name]).abs().flatten() for name in want])
    assert differences.median() <= PARAM_MEDIAN, f"median |difference| {differences.median():.2e} is not rounding"


# --- formulas ------------------------------------------------------------------


def test_padding_rounds_up_to_a_multiple_of_the_world_size():
    assert zero.padded_numel(10, 4) == 12 and zero.padded_numel(12, 4) == 12 and zero.padded_numel(5, 1) == 5
    with pytest.raises(ValueError, match="world_size"):
        zero.padded_numel(10, 0)


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_state_bytes_split_the_zero_paper_example(stage, expected_gb):
    parts = zero.state_bytes_estimate(7.5e9, 64, stage, **zero.MIXED_ADAMW)
    assert sum(parts.values()) / accounting.GB == pytest.approx(expected_gb, abs=0.05)
    # fp32 AdamW without a master copy: 4 + 4 + 8, the same 16 bytes per parameter for DP
    assert sum(zero.state_bytes_estimate(1000, 4, stage).values()) == accounting.zero_bytes_per_device(
        1000, 4, stage, **zero.FP32_ADAMW)
    fp32 = zero.state_bytes_estimate(1000, 4, stage)
    assert fp32 == {"params": 4000 / (4 if stage >= 3 else 1), "grads": 4000 / (4 if stage >= 2 else 1),
                    "optimizer": 8000 / (4 if stage >= 1 else 1)}


def test_comm_estimate_is_the_ring_share_of_2psi_and_3psi():
    for n in (2, 4, 8):
        assert zero.comm_bytes_estimate(100, n, 0) == zero.comm_bytes_estimate(100, n, 1) == 2 * 400 * (n - 1) / n
        assert zero.comm_bytes_estimate(100, n, 3) == 1.5 * zero.comm_bytes_estimate(100, n, 2)


@pytest.mark.parametrize("stage", [-1, 4, "3", None])
def test_unknown_stage_is_refused(stage):
    with pytest.raises(ValueError, match="stage"):
        zero.state_bytes_estimate(100, 2, stage)


def test_memory_per_rank_adds_activations_to_the_zero_table():
    mem = zero.memory_per_rank(7.5e9, 64, 1, precision="bf16", batch=2, seq=1024, hidden=4096, layers=32, heads=32)
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    assert states == pytest.approx(accounting.zero_bytes_per_device(7.5e9, 64, 1))
    assert mem["activations"] == 32 * accounting.activation_bytes_per_layer(1024, 2, 4096, 32)
    fp32 = zero.memory_per_rank(7.5e9, 64, 1, precision="fp32", batch=2, seq=1024, hidden=4096, layers=32, heads=32)
    assert fp32["activations"] == 2 * mem["activations"]
    with pytest.raises(ValueError, match="precision"):
        zero.memory_per_rank(1e9, 8, 0, precision="int3")


def test_mixed_precision_holds_16_bytes_per_parameter():
    cfg = zero.tiny_model_config()
    model = zero.build_model(zero.TrainConfig(model=cfg))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(cfg.vocab_size, (1, 8))
    held = zero.mixed_precision_state_bytes(model, x, x)
    n = sum(p.numel() for p in model.parameters())
    assert held == {"bf16 params": 2 * n, "bf16 grads": 2 * n, "fp32 master": 4 * n, "fp32 AdamW m, v": 8 * n}
    assert sum(held.values()) / n == accounting.training_bytes_per_param("bf16", "adamw") == 16
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # model untouched


def test_train_config_checks_its_input():
    with pytest.raises(ValueError, match="batch_size"):
        zero.TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        zero.TrainConfig(seq_len=10_000)


# --- ZeRO by hand ----------------------------------------------------------------


@pytest.mark.parametrize("stage", zero.STAGES)
def test_each_stage_trains_exactly_like_one_process(stage):
    ref = reference()
    for rank, result in enumerate(zero_run(stage)):
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert_params_close(result["params"], ref["params"])
        # the averaged gradient (AdamW alone would hide a missing 1/N: it is scale-invariant)
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-3, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("stage", zero.STAGES)
def test_bytes_held_per_rank_equal_the_zero_table(stage):
    for result in zero_run(stage):
        padded = result["padded_params"]
        assert result["n_params"] <= padded < result["n_params"] + 2 * (CONFIG.model.n_layers + 1)
        assert result["state_bytes"] == zero.state_bytes_estimate(padded, 2, stage)  # exactly, fp32: 4 + 4 + 8
        ratio = sum(result["state_bytes"].values()) / accounting.zero_bytes_per_device(
            result["n_params"], 2, stage, **zero.FP32_ADAMW)
        assert ratio == pytest.approx(1.0, abs=1e-3)  # padding is all the difference


def test_bytes_communicated_zero12_equal_ddp_and_zero3_is_one_and_a_half():
    psi = 4 * zero_run(0)[0]["padded_params"]  # fp32 bytes of the (padded) model
    n_units = CONFIG.model.n_layers + 1
    expected_calls = {
        0: {"all_reduce": 1},  # DDP: the whole model fits in one 25 MB bucket
        1: {"reduce_scatter": n_units, "all_gather": n_units},
        2: {"reduce_scatter": n_units, "all_gather": n_units},
        3: {"all_gather": 2 * n_units, "reduce_scatter": n_units},  # gathered in forward and again in backward
    }
    ring = {}
    for stage in zero.STAGES:
        for result in zero_run(stage):
            assert result["calls"] == expected_calls[stage]
            ring[stage] = sum(result["ring_bytes"].values())
            assert ring[stage] == zero.comm_bytes_estimate(psi / 4, 2, stage)
    assert ring[1] == ring[2] == ring[0] == psi  # 2(N-1)/N·Ψ with N = 2
    assert ring[3] == 1.5 * ring[0]


def test_a_world_size_that_does_not_divide_the_units_is_padded():
    # 3 ranks: the units' sizes (multiples of dim = 32) do not all split in 3
    results = zero_run(3, world_size=3)
    ref = reference()
    assert results[0]["padded_params"] > results[0]["n_params"]
    table = zero.state_bytes_estimate(results[0]["padded_params"], 3, 3)
    for result in results:
        assert_params_close(result["params"], ref["params"])
        # the flat shards (parameters and gradients) hold the padding; AdamW's m and v exist only for
        # the named parameters' parts, as in FSDP2, so over all ranks they cover every element once
        assert result["state_bytes"]["params"] == table["params"] and result["state_bytes"]["grads"] == table["grads"]
    assert sum(r["state_bytes"]["optimizer"] for r in results) == 8 * results[0]["n_params"] < 3 * table["optimizer"]


def forward_keeps(rank, world_size, config):
    """Bytes created in forward and still alive at its end (kept for backward), stage 0 vs 3."""
    kept = {}
    for stage in (0, 3):
        engine = zero.ZeroEngine(zero.build_model(config), stage)
        x, y = (zero.local_batch(t, rank, world_size) for t in zero.global_batch(config, 0))
        with zero.LiveBytes() as mem:
            loss = engine.forward_loss(x, y)
            kept[stage] = mem.now
        engine.backward_and_step(loss)
        kept[f"in flight {stage}"] = engine.peak_in_flight_bytes
        kept[f"units {stage}"] = [4 * unit.padded for unit in engine.units]
    return kept


def test_zero3_keeps_no_gathered_parameters_between_forward_and_backward():
    for kept in launch(forward_keeps, 2, args=(CONFIG,)):
        assert kept[3] == kept[0]  # only activations: every gathered unit was freed after its forward
        assert kept["in flight 0"] == 0
        root, largest_block = kept["units 3"][-1], max(kept["units 3"][:-1])
        assert kept["in flight 3"] == root + largest_block  # the root stays gathered around the blocks


def test_engine_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        zero.ZeroEngine(zero.build_model(CONFIG), 1)


def test_a_batch_that_does_not_split_over_the_ranks_is_refused():
    x, _ = zero.global_batch(zero.TrainConfig(batch_size=5), 0)
    with pytest.raises(ValueError, match="multiple of the world size"):
        zero.local_batch(x, 0, 2)


def die_in_second_step(rank, world_size, config):
    engine = zero.ZeroEngine(zero.build_model(config), 3)
    for step in range(2):
        if step == 1 and rank == 1:
            os._exit(7)
        x, y = (zero.local_batch(t, rank, world_size) for t in zero.global_batch(config, step))
        engine.train_step(x, y)


@pytest.mark.timeout(90)
def test_a_rank_that_dies_is_named_without_a_hang():
    with pytest.raises(WorkerError) as info:
        launch(die_in_second_step, 2, args=(CONFIG,), timeout=60)
    assert_rank_1_died(info.value, exitcode=7)


def assert_rank_1_died(error, exitcode):
    # Either the launcher saw rank 1's exit first, or rank 0's report that its peer vanished
    # arrived before rank 1 could be reaped (llmsys.core.dist reports whichever it sees first).
    message = str(error)
    assert f"rank 1 died with exit code {exitcode}" in message or "rank 0 lost a peer" in message, message


# --- wrappers behave like torch's -------------------------------------------------------


class PartlyTrained(torch.nn.Module):
    """A frozen scale, a head used on even steps only, a head used only on rank 0, and a spare never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Parameter(torch.full((6,), 2.0), requires_grad=False)
        self.even_head = torch.nn.Linear(6, 3)
        self.rank0_head = torch.nn.Linear(6, 3)
        self.spare = torch.nn.Parameter(torch.ones(4))

    def loss(self, x, step, rank):
        h = torch.tanh(self.body(x) * self.frozen)
        loss = h.square().mean()
        if step % 2 == 0:
            loss = loss + self.even_head(h).square().mean()
        if rank == 0:
            loss = loss + self.rank0_head(h).abs().mean()
        return loss


def sharded_against_torch(rank, world_size, optimizer_class, steps=10):
    """The wrapped optimizer and the plain one, side by side in this process: same model, same data.

    Every rank computes the loss of the whole batch (so the mean over ranks of a
    gradient is exactly the gradient), except ``rank0_head``, which only rank 0
    uses: the plain optimizer there sees the loss averaged over both ranks' losses.
    """
    wrapped, plain = PartlyTrained(), PartlyTrained()
    sharded = zero.ShardedOptimizer(wrapped.parameters(), optimizer_class, lr=0.05, weight_decay=0.1)
    reference = optimizer_class(plain.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        sharded.zero_grad()
        wrapped.loss(x, step, rank).backward()
        sharded.step()
        reference.zero_grad()
        ((plain.loss(x, step, 0) + plain.loss(x, step, 1)) / world_size).backward()
        reference.step()
    owner = {name: r for r, ps in enumerate(sharded.owned) for name, p in wrapped.named_parameters() if
             any(p is q for q in ps)}
    return {"wrapped": {n: p.detach().clone() for n, p in wrapped.named_parameters()},
            "plain": {n: p.detach().clone() for n, p in plain.named_parameters()}, "owner": owner,
            "state_steps": {n: float(sharded.optimizer.state[p]["step"]) for n, p in wrapped.named_parameters()
                            if sharded.optimizer is not None and p in sharded.optimizer.state},
            "reference_steps": {n: float(reference.state[p]["step"]) for n, p in plain.named_parameters()
                                if p in reference.state}}


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.Adam])
def test_sharded_optimizer_skips_parameters_without_a_gradient_like_torch(optimizer_class):
    results = launch(sharded_against_torch, 2, args=(optimizer_class,))
    assert {r for r in results[0]["owner"].values()} == {0, 1}  # both ranks own something
    # rank 1 owns the head only rank 0 uses: it must step it on a gradient that came from rank 0 alone
    assert results[0]["owner"]["rank0_head.weight"] == results[0]["owner"]["rank0_head.bias"] == 1
    for result in results:
        wrapped, plain = result["wrapped"], result["plain"]
        assert torch.equal(wrapped["frozen"], torch.full((6,), 2.0))  # never decayed
        assert torch.equal(wrapped["spare"], torch.ones(4))  # never used: never stepped
        for name in ("body.weight", "body.bias", "even_head.weight", "even_head.bias", "frozen", "spare"):
            assert torch.equal(wrapped[name], plain[name]), name  # bitwise: the same operations on the same values
        for name in ("rank0_head.weight", "rank0_head.bias"):  # one rank's gradient, halved: rounding apart
            torch.testing.assert_close(wrapped[name], plain[name], rtol=1e-5, atol=1e-6)
            assert not torch.equal(wrapped[name], PartlyTrained().state_dict()[name])  # it did train
    steps = {**results[0]["state_steps"], **results[1]["state_steps"]}
    assert steps == results[0]["reference_steps"]  # the even head counted 5 steps, frozen and spare none
    assert steps["even_head.weight"] == 5 and "frozen" not in steps and "spare" not in steps


def ours_and_fsdp2(rank, world_size, param_dtype, reduce_dtype, config):
    """``FullyShardedDataParallel`` and FSDP2's ``fully_shard`` with the same units and the same policy,
    trained side by side in this process on the same batches."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from llmsys.core.dist import cpu_mesh
    from llmsys.zero.training import adamw, train_step

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ours = zero.FullyShardedDataParallel(zero.build_model(config), zero.block_names(zero.build_model(config)),
                                         mp_policy=policy)
    fsdp2 = zero.shard_with_fsdp2(zero.build_model(config), cpu_mesh((world_size,), ("dp",)), True, policy)
    out = {}
    for name, model in (("ours", ours), ("fsdp2", fsdp2)):
        optimizer, comm, logits = adamw(model.parameters(), config), CommCounter(), []
        model.register_forward_hook(lambda module, args, output: logits.append(output.dtype))
        for step in range(config.steps):
            x, y = (zero.local_batch(t, rank, world_size) for t in zero.global_batch(config, step))
            with comm:
                train_step(model, optimizer, x, y)
        out[name] = {"bytes": dict(comm.bytes), "names": [n for n, _ in model.named_parameters()],
                     "keys": list(model.state_dict()), "master": {p.dtype for p in model.parameters()},
                     "logits": set(logits)}
    out["ours"]["held"] = {n: p.numel() for n, p in ours.named_parameters()}
    out["ours"]["views"] = all(ours.state_dict()[n].data_ptr() == p.data_ptr() for n, p in ours.named_parameters())
    out["ours"]["params"] = ours.full_parameters()
    out["fsdp2"]["params"] = {n: p.full_tensor().detach() for n, p in fsdp2.named_parameters(remove_duplicate=False)}
    return out


@pytest.mark.parametrize("param_dtype, reduce_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, None),
                                                       (None, None)], ids=["bf16-fp32", "bf16", "fp32"])
def test_fsdp_keeps_names_and_mixed_precision_like_fsdp2(param_dtype, reduce_dtype):
    config = zero.TrainConfig(steps=3, batch_size=BATCH)
    results = launch(ours_and_fsdp2, 2, args=(param_dtype, reduce_dtype, config))
    fp32 = reference()["params"]
    full = dict(zero.build_model(config).named_parameters())
    for result in results:
        ours, fsdp2 = result["ours"], result["fsdp2"]
        assert ours["names"] == fsdp2["names"] == list(full)  # the module's names, no wrapper prefix
        assert ours["keys"] == fsdp2["keys"] == list(zero.build_model(config).state_dict())
        assert ours["views"] and ours["master"] == fsdp2["master"] == {torch.float32}  # fp32 master shards
        assert ours["logits"] == fsdp2["logits"] == {param_dtype or torch.float32}  # computed in param_dtype
        # bytes handed to each collective: gathers in param_dtype, reduce-scatters in reduce_dtype
        assert ours["bytes"] == fsdp2["bytes"]
        assert_params_close(ours["params"], fsdp2["params"])
        # the policy changes the result: far more than ours and FSDP2 differ
        off_fp32 = max((fp32[n] - fsdp2["params"][n]).abs().max().item() for n in fp32)
        apart = max((ours["params"][n] - fsdp2["params"][n]).abs().max().item() for n in fp32)
        assert apart <= off_fp32 / 100 if param_dtype else off_fp32 < PARAM_ATOL
    for name, p in full.items():  # each element lives in one rank's sharded view of its parameter
        assert sum(result["ours"]["held"][name] for result in results) == p.numel()


def fsdp_state_dict_and_accumulation(rank, world_size, config):
    import torch.nn.functional as F

    model = zero.FullyShardedDataParallel(zero.build_model(config), zero.block_names(zero.build_model(config)))
    saved = {name: t.clone() for name, t in model.state_dict().items()}
    before = model.full_parameters()
    x, y = (zero.local_batch(t, rank, world_size) for t in zero.global_batch(config, 0))
    grads = []  # after half 1, after half 2 added to it, and of half 2 alone
    for half, fresh in ((slice(0, 3), True), (slice(3, 6), False), (slice(3, 6), True)):
        if fresh:
            model.zero_grad()
        F.cross_entropy(model(x[half]).flatten(0, 1), y[half].flatten()).backward()
        grads.append(model.full_gradients())
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    changed = model.full_parameters()
    model.load_state_dict(saved)  # in place, into the flat shards
    errors = []
    for bad in (lambda: model.load_state_dict(saved, assign=True),
                lambda: zero.FullyShardedDataParallel(torch.nn.Linear(2, 2), [], mp_policy="bf16")):
        try:
            bad()
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    return {"before": before, "changed": changed, "restored": model.full_parameters(), "grads": grads,
            "errors": errors}


def test_fsdp_state_dict_round_trips_and_gradients_accumulate():
    for result in launch(fsdp_state_dict_and_accumulation, 2, args=(CONFIG,)):
        first, both, second = result["grads"]
        for name, want in result["before"].items():
            torch.testing.assert_close(both[name], first[name] + second[name], rtol=1e-5, atol=1e-7)
            assert torch.equal(result["restored"][name], want), name  # the saved views, copied back in place
        assert any(not torch.equal(result["changed"][n], result["before"][n]) for n in result["before"])
        assert "assign=True" in result["errors"][0] and "MixedPrecisionPolicy" in result["errors"][1]


# --- FSDP2 -------------------------------------------------------------------------


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp2_gradients_equal_the_full_batch_gradients(reshard_after_forward):
    # Regression guard for pytorch#162338 (gloo averaged by summing): torch 2.13 divides correctly.
    want = zero.single_process_gradients(CONFIG)
    for got in launch(zero.fsdp_gradients, 2, args=(CONFIG, reshard_after_forward)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_fsdp2_moves_what_zero3_moves_and_without_resharding_what_ddp_moves():
    config = zero.TrainConfig(steps=1, batch_size=BATCH)
    hand = zero_run(3)[0]
    zero3, zero2_like = (launch(zero.train_fsdp, 2, args=(config, reshard))[0] for reshard in (True, False))
    assert zero3["ring_bytes"] == hand["ring_bytes"]  # same units, no padding needed at N = 2
    assert sum(zero2_like["ring_bytes"].values()) == sum(zero_run(0)[0]["ring_bytes"].values())
    assert zero3["param_bytes"] == 4 * hand["padded_params"] / 2  # each rank holds Ψ/N
    assert zero3["losses"][0] == pytest.approx(reference()["losses"][0], rel=1e-6)


def die_before_saving(rank, world_size, config, path):
    model, _ = zero.fsdp_setup(world_size, config, True, False)
    optimizer = torch.optim.AdamW(model.parameters())
    if rank == 1:
        os._exit(3)  # rank 0 is left inside save_checkpoint
    zero.save_checkpoint(path, model, optimizer, step=99)


@pytest.mark.timeout(240)
def test_checkpoint_resumes_on_another_world_size_with_the_same_losses(tmp_path):
    path = tmp_path / "ckpt"
    config = zero.TrainConfig(steps=4, batch_size=BATCH)
    ref = reference(steps=4)
    first = launch(zero.train_fsdp, 2, args=(zero.TrainConfig(steps=2, batch_size=BATCH), True, str(path)))
    assert (path / zero.COMPLETE).exists() and not path.with_name("ckpt.partial").exists()
    assert first[0]["losses"] == pytest.approx(ref["losses"][:2], rel=1e-6)

    # a save that dies midway leaves the finished checkpoint as it was
    with pytest.raises(WorkerError) as info:
        launch(die_before_saving, 2, args=(config, str(path)), timeout=60)
    assert_rank_1_died(info.value, exitcode=3)
    assert (path / zero.COMPLETE).read_text().startswith("step 2, world size 2")

    resumed = launch(zero.train_fsdp, 4, args=(config, True, None, str(path)))
    assert resumed[0]["start"] == 2
    assert resumed[0]["losses"] == pytest.approx(ref["losses"][2:], rel=1e-6)
    assert_params_close(resumed[0]["params"], ref["params"])


def test_loading_an_unfinished_checkpoint_is_refused(tmp_path):
    model = zero.build_model(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters())
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="COMPLETE marker"):
        zero.load_checkpoint(tmp_path / "half", model, optimizer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        zero.load_checkpoint(tmp_path / "missing", model, optimizer)


# --- activation checkpointing ---------------------------------------------------------


def test_activation_checkpointing_keeps_less_and_recomputes_the_blocks():
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32)
    cost = zero.activation_checkpointing_cost(cfg, batch_size=2, seq_len=32)
    plain, ckpt = cost["plain"], cost["checkpointed"]
    assert cost["same_grads"]
    assert ckpt["kept"] < plain["kept"] / 3 and ckpt["peak"] < plain["peak"]
    # FlopCounterMode counts the matmuls here (it has no formula for the CPU attention kernel)
    assert ckpt["flops"] / plain["flops"] == pytest.approx(
        zero.recompute_flops_estimate(cfg, 32, include_attention=False), rel=1e-9)


def test_live_bytes_sees_a_tensor_freed_and_ignores_views():
    with zero.LiveBytes() as mem:
        a = torch.ones(1000)  # 4000 bytes
        a.view(10, 100).t()  # views: no new memory
        b = a * 2
        del b
        assert mem.now == 4000
    assert mem.peak == 8000


# --- the script ---------------------------------------------------------------------------


def run_script(*args, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "llmsys.zero", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**env, "OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(240)
def test_python_m_llmsys_zero_runs_two_gloo_ranks():
    out = run_script("--model", "tiny", "--data", "random", "--steps", "2", "--stage", "3")
    assert out.returncode == 0, out.stderr
    assert "2 rank(s) on gloo" in out.stdout and "ZeRO-3 step    1" in out.stdout
    assert out.stdout.count("ratio 1.0000") == 3


def test_script_rejects_a_sequence_longer_than_the_model(capsys):
    with pytest.raises(SystemExit) as info:  # before any process starts
        zero.main(["--model", "tiny", "--seq-len", "1000", "--steps", "1"])
    assert info.value.code == 2 and "--seq-len in 1..64" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_torchrun_on_a_port_in_use_fails_fast():
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this python")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([str(torchrun), "--nproc-per-node=2", f"--master-port={port}", "--master-addr=127.0.0.1",
                              "-m", "llmsys.zero", "--model", "tiny", "--data", "random", "--steps", "1"],
                             cwd=REPO, capture_output=True, text=True, timeout=100)
    assert out.returncode != 0
    assert "address already in use" in out.stderr
