"""DDP, ZeRO-1 and ZeRO-3 from llmsys.zero on modules that are not the course's: each equal to one process.

Every run: 2 gloo ranks (3 where uneven shards are the point), each given its
half of the batch; the reference trains the same module on the whole batch.
Sums of two half-batch gradients differ from one full-batch sum only by fp32
rounding, which Adam's g/sqrt(v) can amplify where a gradient is near 0:
parameters are compared to a fraction of one step (lr), gradients closely.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys import zero
from llmsys.core.comm import CommCounter
from llmsys.core.dist import WorkerError, launch

LR, STEPS, BATCH = 1e-2, 3, 12
PARAM_ATOL = 0.02 * LR


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 5))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def mlp_batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=gen), torch.randint(5, (BATCH,), generator=gen)


def token_batch(step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(64, (BATCH, 17), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def loss_of(model, x, y):
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def train(model, optimizer, batch, rank=0, world_size=1):
    """STEPS steps on this rank's part of each batch; returns the loss of the last one."""
    for step in range(STEPS):
        x, y = (zero.local_batch(t, rank, world_size) for t in batch(step))
        optimizer.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
    return loss.detach()


def single_process(make, batch, optimizer_class=torch.optim.AdamW, groups=None):
    """The reference on the whole batch: final parameters, last gradients, optimizer state bytes."""
    model = make()
    optimizer = optimizer_class(groups(model) if groups else model.parameters(), lr=LR)
    train(model, optimizer, batch)
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    return ({name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)},
            {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)},
            sum(t.numel() * t.element_size() for t in state))


def assert_close(got: dict, want: dict, atol=PARAM_ATOL, rtol=0.0):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# --- DDP ---------------------------------------------------------------------------------


def ddp_worker(rank, world_size, make, batch, bucket_cap_mb):
    module = make()
    model = zero.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    train(model, torch.optim.AdamW(module.parameters(), lr=LR), batch, rank, world_size)
    return {"params": {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)},
            "grads": {n: p.grad for n, p in module.named_parameters(remove_duplicate=False)},
            "buckets": len(model.buckets), "log": model.launch_log}


@pytest.mark.parametrize("make, batch", [(mlp, mlp_batch), (tiny_llama, token_batch)], ids=["mlp", "llama"])
def test_ddp_trains_like_one_process_with_buckets_reduced_during_backward(make, batch):
    want_params, want_grads, _ = single_process(make, batch)
    for result in launch(ddp_worker, 2, args=(make, batch, 5e-4)):  # 0.5 KB buckets: several
        assert_close(result["params"], want_params)
        assert_close(result["grads"], want_grads, atol=1e-6, rtol=1e-4)
        n = result["buckets"]
        assert n >= 3
        # every bucket's all-reduce started inside backward, before its end: communication overlaps compute
        assert [kind for kind, _ in result["log"]] == ["launch"] * n + ["end"]
        assert sorted(i for kind, i in result["log"][:-1]) == list(range(n))


def ddp_with_an_unused_parameter(rank, world_size):
    module = mlp()
    module.register_parameter("spare", nn.Parameter(torch.zeros(3)))  # never used in forward
    model = zero.DistributedDataParallel(module)
    loss_of(model, *mlp_batch(0)).backward()


def test_ddp_names_a_parameter_that_got_no_gradient():
    with pytest.raises(WorkerError, match="spare got no gradient"):
        launch(ddp_with_an_unused_parameter, 2, timeout=60)


# --- ZeRO-1: ShardedOptimizer ---------------------------------------------------------------


def decay_groups(model):
    """Weight decay on matrices only: two parameter groups, as a real recipe has."""
    return [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]


def sharded_optimizer_worker(rank, world_size, optimizer_class, groups):
    model = mlp()
    params = groups(model) if groups else model.parameters()
    optimizer = zero.ShardedOptimizer(params, optimizer_class, lr=LR)
    with CommCounter() as comm:
        train(model, optimizer, mlp_batch, rank, world_size)
    return {"params": {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)},
            "state_bytes": optimizer.state_bytes(), "owned": sum(p.numel() for p in optimizer.owned[rank]),
            "calls": dict(comm.calls)}


@pytest.mark.parametrize("optimizer_class, groups, world_size", [
    (torch.optim.AdamW, decay_groups, 2),
    (torch.optim.AdamW, None, 3),  # 3 ranks: parts of unequal size, padded
    (torch.optim.Adafactor, None, 2),  # not elementwise: row and column statistics of whole matrices
], ids=["adamw-groups", "adamw-3-ranks", "adafactor"])
def test_sharded_optimizer_steps_like_one_process_and_holds_its_part_of_the_state(optimizer_class, groups,
                                                                                  world_size):
    want_params, _, total_state = single_process(mlp, mlp_batch, optimizer_class, groups)
    results = launch(sharded_optimizer_worker, world_size, args=(optimizer_class, groups))
    for result in results:
        assert_close(result["params"], want_params)
        assert result["calls"] == {"reduce_scatter": STEPS, "all_gather": STEPS}
    assert sum(r["state_bytes"] for r in results) == total_state  # each rank: only its own parameters'
    assert sum(r["owned"] for r in results) == sum(p.numel() for p in mlp().parameters())
    if optimizer_class is torch.optim.AdamW:  # m and v: 8 bytes per owned parameter, about 1/N of the model each
        assert all(r["state_bytes"] == 8 * r["owned"] < 0.75 * total_state for r in results)


def test_sharded_optimizer_refuses_a_parameter_twice():
    def worker(rank, world_size):
        p = nn.Parameter(torch.zeros(3))
        zero.ShardedOptimizer([p, p], torch.optim.SGD, lr=0.1)

    with pytest.raises(WorkerError, match="appears twice"):
        launch(worker, 2, timeout=60)


# --- ZeRO-3: FullyShardedDataParallel ---------------------------------------------------------


def fsdp_worker(rank, world_size, make, batch, unit_names):
    model = zero.FullyShardedDataParallel(make(), unit_names)
    with CommCounter() as comm:
        train(model, torch.optim.AdamW(model.parameters(), lr=LR), batch, rank, world_size)
    return {"params": model.full_parameters(), "grads": model.full_gradients(), "calls": dict(comm.calls),
            "units": [(u.name, 4 * u.padded) for u in model.units], "in_flight": model.peak_in_flight_bytes,
            "held": sum(p.numel() for p in model.parameters()), "shard": sum(u.shard.numel() for u in model.units)}


@pytest.mark.parametrize("make, batch, unit_names, world_size, regathered", [
    # 3 ranks: units padded to a multiple of 3. The first Linear's input needs no gradient,
    # so its backward (dW = gᵀx) never needs W: only "2" and the root are gathered again.
    (mlp, mlp_batch, ["0", "2"], 3, 2),
    (tiny_llama, token_batch, ["model.layers.0", "model.layers.1"], 2, 3),
], ids=["mlp", "llama"])
def test_fsdp_trains_like_one_process_and_holds_a_shard(make, batch, unit_names, world_size, regathered):
    want_params, want_grads, _ = single_process(make, batch)
    results = launch(fsdp_worker, world_size, args=(make, batch, unit_names))
    n_params = sum(p.numel() for p in make().parameters())
    for result in results:
        assert_close(result["params"], want_params)
        assert_close(result["grads"], want_grads, atol=1e-6, rtol=1e-4)
        names = [name for name, _ in result["units"]]
        assert names == [*unit_names, "root"]
        # per step: every unit gathered in forward, again in backward where backward needs its
        # weights, and its gradient reduce-scattered once
        assert result["calls"] == {"all_gather": (len(names) + regathered) * STEPS,
                                   "reduce_scatter": len(names) * STEPS}
        assert result["shard"] * world_size == sum(size for _, size in result["units"]) / 4 >= n_params
        # the root stays gathered around the units it calls; no two named units at once
        sizes = dict(result["units"])
        assert result["in_flight"] == sizes["root"] + max(sizes[name] for name in unit_names)
    assert sum(result["held"] for result in results) == n_params  # every element in one rank's parameters


@pytest.mark.parametrize("unit_names, problem", [
    (["7"], "not a sub-module"),
    (["1.weight"], "not a sub-module"),
    ([""], "not a sub-module"),
    (["1", "1"], "named twice"),
    (["0", "0.0"], "must not nest"),
])
def test_fsdp_refuses_bad_unit_names(unit_names, problem):
    def worker(rank, world_size):
        nested = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 2))
        zero.FullyShardedDataParallel(nested, unit_names)

    with pytest.raises(WorkerError, match=problem):
        launch(worker, 2, timeout=60)


def test_fsdp_refuses_frozen_or_mixed_parameters():
    def worker(rank, world_size, change):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        change(model)
        zero.FullyShardedDataParallel(model, ["0"])

    with pytest.raises(WorkerError, match="1.bias is frozen"):
        launch(worker, 2, args=(lambda m: m[1].bias.requires_grad_(False),), timeout=60)
    with pytest.raises(WorkerError, match="differ in dtype"):
        launch(worker, 2, args=(lambda m: m[1].double(),), timeout=60)


def test_fsdp_refuses_a_parameter_shared_by_two_units():
    def worker(rank, world_size):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight
        zero.FullyShardedDataParallel(model, ["0", "1"])

    with pytest.raises(WorkerError, match="shared by units '0' and '1'"):
        launch(worker, 2, timeout=60)


def test_wrappers_need_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        zero.DistributedDataParallel(mlp())
    with pytest.raises(RuntimeError, match="process group"):
        zero.ShardedOptimizer(mlp().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="process group"):
        zero.FullyShardedDataParallel(mlp(), ["0"])
