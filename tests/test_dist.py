"""llmsys.core.dist: launching ranks, their failure modes, meshes and the collective byte counter."""

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard  # imported once here, so forked ranks need not

from llmsys.core import device
from llmsys.core.comm import CommCounter, all_gather_single, collective_names, reduce_scatter_single
from llmsys.core.dist import WorkerError, cpu_mesh, device_mesh, free_port, launch

REPO = Path(__file__).resolve().parents[1]


def no_children_left():
    return multiprocessing.active_children() == []


# --- worker functions (module level, so a spawned rank can import them) ------


def matmul_sum(rank, world_size):
    a = torch.ones(256, 256)
    return float((a @ a).sum())


def who_am_i(rank, world_size):
    return rank, world_size, os.getpid(), torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


def all_reduce_random(rank, world_size, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    dist.all_reduce(x)
    return x


def backend_and_device(rank, world_size):
    return dist.get_backend(), torch.ones(1).device.type


def renamed_collectives(rank, world_size, rows):
    x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(rank))
    gathered = torch.empty(world_size * rows, 3)
    all_gather_single(gathered, x)
    scattered = torch.empty(rows // world_size, 3)
    reduce_scatter_single(scattered, x)
    return gathered, scattered, collective_names()


def raise_in_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    dist.all_reduce(torch.ones(3))  # rank 0 is left waiting for rank 1
    return rank


def exit_in_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(3))
    return rank


def deadlock(rank, world_size):
    if rank == 0:
        dist.recv(torch.empty(2), src=1)  # rank 1 never sends
    else:
        dist.barrier()  # ...and waits for rank 0 instead
    return rank


def count_collectives(rank, world_size, rows):
    x = torch.randn(rows, 4)  # fp32: 16 bytes a row
    with CommCounter() as comm:
        dist.all_reduce(x.clone())
        dist.all_gather_into_tensor(torch.empty(world_size * rows, 4), x)
        dist.reduce_scatter_tensor(torch.empty(rows // world_size, 4), x)
        dist.all_to_all_single(torch.empty(rows, 4), x)
    dist.all_reduce(x)  # outside the block: not counted
    return dict(comm.calls), dict(comm.bytes), dict(comm.ring_bytes)


def count_functional_collectives(rank, world_size, rows):
    # What FSDP2, DTensor and tensor-parallel layers call instead of dist.*
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    group = dist.group.WORLD
    x = torch.randn(rows, 4)
    with CommCounter() as comm:
        funcol.all_reduce(x, "sum", group).wait()
        funcol.all_gather_tensor(x, 0, group).wait()
        funcol.reduce_scatter_tensor(x, "sum", 0, group).wait()
        funcol.all_to_all_single(x, None, None, group).wait()
    mesh = cpu_mesh((world_size,), ("tp",))
    sharded = distribute_tensor(torch.randn(rows * world_size, 4), mesh, [Shard(0)])
    with CommCounter() as dtensor:
        sharded.redistribute(mesh, [Replicate()]).to_local()
    return (dict(comm.calls), dict(comm.bytes), dict(comm.ring_bytes),
            dict(dtensor.calls), dict(dtensor.bytes))


def uneven_all_to_all(rank, world_size, send_rows):
    # send_rows[i][j]: rows rank i sends to rank j
    x = torch.randn(sum(send_rows[rank]), 3, dtype=torch.float64)  # 24 bytes a row
    received = [send_rows[src][rank] for src in range(world_size)]
    out = torch.empty(sum(received), 3, dtype=torch.float64)
    with CommCounter() as comm:
        dist.all_to_all_single(out, x, output_split_sizes=received, input_split_sizes=send_rows[rank])
    return comm.bytes["all_to_all"], comm.ring_bytes["all_to_all"]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def ddp_vs_fsdp2_bytes(rank, world_size):
    """One step of plain data parallel (all-reduce grads) and of FSDP2 (ZeRO-3)."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    model = make_model()
    model(x).sum().backward()
    with CommCounter() as ddp:
        for p in model.parameters():
            dist.all_reduce(p.grad)

    mesh = cpu_mesh((world_size,), ("dp",))
    model = make_model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with CommCounter() as fsdp:
        model(x).sum().backward()
    return ddp.bytes, ddp.total_ring_bytes(), fsdp.calls, fsdp.bytes, fsdp.total_ring_bytes()


def mesh_checks(rank, world_size):
    errors = []
    for shape, names in [((3,), ("dp",)), ((2, 2), ("dp", "tp"))]:
        try:
            cpu_mesh(shape, names)
        except ValueError as error:
            errors.append(str(error))
    try:
        cpu_mesh((2,), ("dp", "tp"))
    except ValueError as error:
        errors.append(str(error))
    mesh = device_mesh((world_size,), ("dp",))
    return errors, mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names


# --- launch -----------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_launch_returns_each_ranks_result_in_rank_order(world_size):
    results = launch(who_am_i, world_size=world_size)
    assert [r[:2] for r in results] == [(rank, world_size) for rank in range(world_size)]
    assert len({r[2] for r in results}) == world_size  # separate processes
    # Forked ranks run one thread each (OpenMP after fork); spawned ones share the cores.
    assert all(r[3] == 1 and r[4] == "1" for r in results)
    assert no_children_left()


def test_launch_keeps_cpu_tensor_workers_on_gloo_on_a_gpu_server(monkeypatch):
    # Eight GPUs would have meant NCCL (and spawn) for every launch, though these workers build CPU tensors.
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert launch(backend_and_device, world_size=2) == [("gloo", "cpu")] * 2


@pytest.mark.parametrize("used, missing", [
    ("all_gather_single", []),
    ("all_gather_into_tensor", ["all_gather_single", "reduce_scatter_single"]),
    ("_all_gather_base", ["all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
                          "reduce_scatter_tensor"]),
])
def test_renamed_collectives_work_under_every_name(monkeypatch, used, missing):
    # Older torch lacks the *_single names (added in 2.13), older still the *_tensor ones.
    for name in missing:
        monkeypatch.delattr(dist, name)  # forked ranks inherit this torch
    world, rows = 2, 4
    inputs = [torch.randn(rows, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for rank, (gathered, scattered, names) in enumerate(launch(renamed_collectives, world, args=(rows,))):
        assert torch.equal(gathered, torch.cat(inputs))  # copies: exact
        torch.testing.assert_close(scattered, sum(inputs).chunk(world)[rank])  # a sum: gloo may order it differently
        assert names == collective_names() and names["all_gather_single"] == used


def test_forked_rank_computes_after_the_parent_used_threads():
    torch.randn(256, 256) @ torch.randn(256, 256)  # the parent's OpenMP pool is now running
    results = launch(matmul_sum, world_size=1, timeout=60)
    assert results[0] == pytest.approx(float(torch.ones(256, 256).sum() * 256))


def test_all_reduce_equals_the_sum_of_every_ranks_tensor():
    results = launch(all_reduce_random, world_size=3, args=(5,))
    expected = sum(torch.randn(5, generator=torch.Generator().manual_seed(r)) for r in range(3))
    for result in results:
        torch.testing.assert_close(result, expected)


def test_two_launches_in_a_row_do_not_collide():
    first = launch(who_am_i, world_size=2)
    second = launch(who_am_i, world_size=2)
    assert [r[0] for r in first] == [r[0] for r in second] == [0, 1]


def test_spawned_ranks_run_a_module_level_function():
    results = launch(all_reduce_random, world_size=2, args=(4,), start_method="spawn")
    expected = sum(torch.randn(4, generator=torch.Generator().manual_seed(r)) for r in range(2))
    torch.testing.assert_close(results[1], expected)


def test_spawn_refuses_a_function_it_cannot_pickle():
    with pytest.raises(ValueError, match="cannot be pickled"):
        launch(lambda rank, world_size: rank, start_method="spawn")


@pytest.mark.timeout(60)
def test_an_exception_names_the_rank_and_carries_its_traceback():
    with pytest.raises(WorkerError, match="rank 1 raised ValueError: bad shard on purpose") as info:
        launch(raise_in_rank_1, world_size=2)
    assert info.value.rank == 1
    assert "Traceback" in str(info.value) and "raise_in_rank_1" in str(info.value)
    assert no_children_left()


@pytest.mark.timeout(60)
def test_a_rank_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(WorkerError, match="rank 1 died with exit code 3") as info:
        launch(exit_in_rank_1, world_size=2)
    assert (info.value.rank, info.value.exitcode) == (1, 3)
    assert no_children_left()


@pytest.mark.timeout(60)
def test_a_deadlock_times_out_naming_the_stuck_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] had not finished after 5 s") as info:
        launch(deadlock, world_size=2, timeout=5)
    assert "same collectives in the same order" in str(info.value)
    assert no_children_left()


@pytest.mark.parametrize("world_size", [0, -1, 2.0, "2", True, None])
def test_world_size_must_be_a_positive_int(world_size):
    with pytest.raises(ValueError, match="world_size"):
        launch(who_am_i, world_size=world_size)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        launch(who_am_i, timeout=0)


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.timeout(120)
def test_a_function_defined_in_main_runs_like_a_notebook_cell():
    # `python -c` has a __main__ without a file, like a Jupyter kernel; torchrun_main
    # without torchrun's environment falls back to launch(world_size=$LLMSYS_WORLD_SIZE).
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from llmsys.core.dist import launch, torchrun_main
        def total(rank, world_size):
            x = torch.tensor([rank + 1.0])
            dist.all_reduce(x)
            return x.item()
        print("fallback", torchrun_main(total))
        try:
            launch(total, start_method="spawn")
        except ValueError as error:
            print("spawn refused:", "interactive session" in str(error))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**env, "LLMSYS_WORLD_SIZE": "3"})
    assert out.returncode == 0, out.stderr
    assert "fallback [6.0, 6.0, 6.0]" in out.stdout
    assert "spawn refused: True" in out.stdout


@pytest.mark.timeout(120)
def test_torchrun_main_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from llmsys.core.dist import torchrun_main
        def total(rank, world_size):
            x = torch.tensor([rank + 1.0])
            dist.all_reduce(x)
            print(f"rank {rank} of {world_size}: {x.item()}", flush=True)
        if __name__ == "__main__":
            torchrun_main(total)
    """))
    out = subprocess.run([str(torchrun), "--nproc-per-node=2", str(script)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2: 3.0" in out.stdout and "rank 1 of 2: 3.0" in out.stdout


# --- meshes -----------------------------------------------------------------


def test_mesh_shape_must_match_the_world():
    errors, device_type, shape, names = launch(mesh_checks, world_size=2)[0]
    assert "holds 3 ranks but the world has 2" in errors[0]
    assert "holds 4 ranks but the world has 2" in errors[1]
    assert "one name per dim" in errors[2]
    assert (device_type, shape, names) == ("cpu", (2,), ("dp",))


def test_a_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        cpu_mesh((2,), ("dp",))


# --- CommCounter (its ring cost model: llmsys.core.accounting.collective_bytes) --------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_counter_matches_the_ring_formulas(world_size):
    rows = 2 * world_size
    size = rows * 4 * 4  # bytes of each rank's (rows, 4) fp32 tensor
    n = world_size
    for calls, payload, ring in launch(count_collectives, world_size=world_size, args=(rows,)):
        assert calls == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
        assert payload == {"all_reduce": size, "all_gather": n * size, "reduce_scatter": size, "all_to_all": size}
        assert ring == {
            "all_reduce": 2 * (n - 1) / n * size,
            "all_gather": (n - 1) / n * (n * size),  # of the full gathered tensor
            "reduce_scatter": (n - 1) / n * size,  # of the full input
            "all_to_all": (n - 1) / n * size,
        }


def test_comm_counter_sees_functional_collectives_and_dtensor():
    n, rows = 2, 4
    size = rows * 4 * 4
    for calls, payload, ring, dt_calls, dt_payload in launch(count_functional_collectives, n, args=(rows,)):
        assert calls == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
        assert payload == {"all_reduce": size, "all_gather": n * size, "reduce_scatter": size, "all_to_all": size}
        assert ring == {
            "all_reduce": 2 * (n - 1) / n * size,
            "all_gather": (n - 1) / n * (n * size),
            "reduce_scatter": (n - 1) / n * size,
            "all_to_all": (n - 1) / n * size,
        }
        # Shard(0) -> Replicate() is one all-gather of the full tensor
        assert dt_calls == {"all_gather": 1} and dt_payload == {"all_gather": n * size}


def test_comm_counter_counts_uneven_all_to_all_exactly():
    send_rows = [[1, 4, 0], [2, 2, 2], [5, 0, 1]]
    results = launch(uneven_all_to_all, world_size=3, args=(send_rows,))
    for rank, (payload, ring) in enumerate(results):
        assert payload == 24 * sum(send_rows[rank])
        assert ring == 24 * (sum(send_rows[rank]) - send_rows[rank][rank])  # what leaves the rank


def test_comm_counter_sees_fsdp2_and_zero3_moves_one_and_a_half_times_ddp():
    params = sum(p.numel() for p in make_model().parameters())
    psi = 4 * params  # fp32 bytes
    for ddp_bytes, ddp_ring, fsdp_calls, fsdp_bytes, fsdp_ring in launch(ddp_vs_fsdp2_bytes, world_size=2):
        assert ddp_bytes == {"all_reduce": psi}
        # two layers: gathered in forward, re-gathered in backward, grads reduce-scattered
        assert fsdp_calls == {"all_gather": 4, "reduce_scatter": 2}
        assert fsdp_bytes == {"all_gather": 2 * psi, "reduce_scatter": psi}
        assert fsdp_ring == 1.5 * ddp_ring  # ZeRO-3: 3Ψ vs 2Ψ
