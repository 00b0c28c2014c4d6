"""Trusted measurements: a tuning task's choice is sent as data and measured by the grader in a clean process.

The kernel side runs here (``run_instrumented``: an instrumented cell executed
as a kernel would); the measuring side is the grader's own subprocess. The
attacks through the command line are in test_grading_attacks.py.
"""

import pytest

from llmsys.course import grading, tasks
from llmsys.course.grading import judge, measurements, probes, sides
from test_grading import run_instrumented  # tests/ is on sys.path: pytest puts it there

TUNED = """
choice = choose()
loss = measure(task, choice, held_out)
assert loss <= 1.05 * solution_run(loss), "held-out loss {loss}"
peak, speed = measure(task, choice, held_out)
assert peak <= 100
assert speed >= 0.5 * solution_run(speed)
"""


def never_run(*args):
    raise AssertionError("a kernel ran the task: the grader measures it")


def kernel_run(choice, held_out=(1, 2), student=True, source=TUNED):
    """What a kernel sends for TUNED, the task never running there."""
    namespace = {"choose": lambda: choice, "measure": grading.measure, "task": never_run, "held_out": list(held_out),
                 "solution_run": grading.solution_run}
    return run_instrumented(source, namespace, student=student, trusted={"measure", "task", "held_out", "solution_run"})


def measured(records, results):
    """``records`` with the grader's results, one per measurement it sent."""
    records.results = [{"error": r} if isinstance(r, str) else {"value": measurements.encode_result(r)} for r in results]
    return records


def verdict(mine, theirs, source=TUNED):
    return judge.judge(probes.instrument(source, "c").specs, mine, theirs)


def test_a_kernel_sends_the_choice_and_never_runs_the_task():
    records = kernel_run({"lr": 0.1})
    assert [site for site, _ in records.measures] == [0, 1]
    assert [judge.decode(a) for a in records.measures[0][1]] == [{"lr": 0.1}, [1, 2]]
    assert records.ended


def test_measured_operands_are_the_graders_measurements():
    solution = measured(kernel_run({"lr": 0.1}, student=False), [0.9, (50, 10.0)])
    assert verdict(solution, None) is None  # the solution passes its own checks on the grader's numbers
    assert verdict(measured(kernel_run({"lr": 0.2}), [0.92, (60, 6.0)]), solution) is None
    worse = verdict(measured(kernel_run({"lr": 3.0}), [1545.0, (60, 6.0)]), solution)
    assert "line 4: held-out loss 1545.0" in worse and "0.9" in worse
    assert "line 6" in verdict(measured(kernel_run({"lr": 0.2}), [0.9, (101, 10.0)]), solution)
    assert "line 7" in verdict(measured(kernel_run({"lr": 0.2}), [0.9, (50, 4.0)]), solution)
    failed = verdict(measured(kernel_run({"lr": "x"}), ["ValueError: lr must be a number", (50, 10.0)]), solution)
    assert "measurement of your choice failed: ValueError: lr must be a number" in failed


def test_only_the_choice_is_the_students():
    solution = measured(kernel_run({"lr": 0.1}, student=False), [0.9, (50, 10.0)])
    other_inputs = verdict(measured(kernel_run({"lr": 0.1}, held_out=(9, 9)), [0.5, (50, 10.0)]), solution)
    assert "other inputs than the solution's run" in other_inputs
    # a kernel that measures twice before the first assert, to pair an assert with the better measurement
    reordered = TUNED.replace("loss = measure(task, choice, held_out)\n",
                              "loss = measure(task, choice, held_out)\nloss = measure(task, choice, held_out)\n")
    with pytest.raises(ValueError, match="measured twice"):
        probes.instrument(reordered, "c")
    forged = kernel_run({"lr": 0.1})
    forged.measures.insert(0, forged.measures[0])
    forged.seen = {k: [{site: count + (site == 0) for site, count in seen.items()} for seen in runs]
                   for k, runs in forged.seen.items()}
    assert "another order" in verdict(measured(forged, [0.5, 0.9, (50, 10.0)]), solution)
    early = "assert x <= 1\nx = measure(task, choose(), held_out)"
    assert "nothing was measured" in verdict(measured(kernel_run({"lr": 0.1}, source=early), [0.5]), None, early)


@pytest.mark.parametrize("source, says", [
    ("x = 1 + measure(task, c)", "on a line of its own"),
    ("measure(task, c)", "on a line of its own"),
    ("x = measure(task)", "on a line of its own"),
    ("x = measure(task, c)\nprint(x)", "only as a whole operand"),
    ("x = measure(task, c)\nassert x / 2 <= 1", "only as a whole operand"),
    ("x = measure(task, c)\ny = measure(task, c)\nx = y", "only as a whole operand"),
    ("x = measure(task, c)\nx = 0\nassert x <= 1", "only as a whole operand"),
])
def test_a_measured_name_stands_only_as_an_operand(source, says):
    with pytest.raises(ValueError, match=says):
        probes.instrument(source, "c")


def test_only_a_marked_task_in_llmsys_is_run():
    assert measurements.resolve("llmsys.course.tasks.step_budget") is tasks.step_budget
    for path, says in [("os.system", "llmsys package"),
                       ("llmsys.course.grading.measurements.resolve", "not a tuning task")]:
        with pytest.raises(ValueError, match=says):
            measurements.resolve(path)
    with pytest.raises(TypeError, match="not a tuning task"):
        grading.measure(print, 1)


def test_a_check_names_its_task_through_the_labs_imports():
    imports = sides.imported_names(["from llmsys.course import tasks\nimport llmsys.course.tasks as t\nimport os"])
    assert measurements.task_path("tasks.step_budget", imports) == "llmsys.course.tasks.step_budget"
    assert measurements.task_path("t.layout_step_time", imports) == "llmsys.course.tasks.layout_step_time"
    with pytest.raises(ValueError, match="llmsys package"):
        measurements.task_path("os.system", imports)


def test_the_clean_process_ignores_what_this_process_patched(monkeypatch):
    monkeypatch.setattr(tasks, "adamw_held_out_loss", grading.tuning_task(lambda choice: 0.0))
    choice = measurements.encode_result({"lr": 3.0, "weight_decay": 0.0})
    got = measurements.run_in_clean_process("llmsys.course.tasks.adamw_held_out_loss", [choice])
    assert float(got["value"]["float"]) > 100  # lr = 3.0 diverges, whatever this process says
    bad = measurements.run_in_clean_process("llmsys.course.tasks.adamw_held_out_loss",
                                            [measurements.encode_result({"lr": -1.0, "weight_decay": 0.0})])
    assert "lr > 0" in bad["error"]


def test_a_choice_is_measured_once_per_grading(monkeypatch):
    calls = []
    monkeypatch.setattr(measurements, "run_in_clean_process",
                        lambda task, args, timeout: calls.append(args) or {"value": 1})
    measurer = measurements.Measurer()
    for choice in [1, 2, 1, 1]:
        assert measurer.measure("llmsys.course.tasks.step_budget", [{"int": str(choice)}]) == {"value": 1}
    assert len(calls) == 2


def test_the_budget_task_sees_what_the_setting_allocates():
    fits, _ = tasks.step_budget({"checkpointing": False, "micro_batch": 2})
    over, _ = tasks.step_budget({"checkpointing": False, "micro_batch": 16})
    assert fits <= 12_000_000 < 4 * fits < over  # activations grow with the micro-batch
    with pytest.raises(ValueError, match="micro_batch divides"):
        tasks.step_budget({"checkpointing": False, "micro_batch": 3})


def test_the_lora_task_measures_the_adapters_and_a_tuned_choice_beats_a_poor_one():
    from llmsys import lora
    from llmsys.core import zoo

    tuned, tuned_bytes = tasks.lora_held_out_loss({"r": 4, "alpha": 64, "lr": 3e-3})
    poor, poor_bytes = tasks.lora_held_out_loss({"r": 4, "alpha": 8, "lr": 2e-3})
    all_linears = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
    # weights, gradients, Adam's m and v: 16 bytes per trainable number, counted from the tensors
    assert tuned_bytes == poor_bytes == 16 * lora.count_adapter_parameters(zoo.SPECS["target"].config, all_linears, 4)
    assert tuned < 0.98 * poor  # alpha and lr change the loss, by more than lab03's margin
    for bad, says in [({"r": 0, "alpha": 8, "lr": 1e-3}, "r is an int"), ({"r": True, "alpha": 8, "lr": 1e-3}, "r is an int"),
                      ({"r": 4, "alpha": 8, "lr": float("nan")}, "lr <= 1"), ({"r": 4, "alpha": 8}, "keys r, alpha and lr")]:
        with pytest.raises(ValueError, match=says):
            tasks.lora_held_out_loss(bad)


def test_the_quantization_task_counts_the_bytes_and_gptq_beats_rounding_at_two_bits():
    from llmsys.core import zoo

    gptq, gptq_bytes = tasks.quantized_perplexity({"method": "gptq", "bits": 2, "group": 128})
    rtn, rtn_bytes = tasks.quantized_perplexity({"method": "rtn", "bits": 2, "group": 128})
    model = zoo.load("target")
    linears = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
    others = sum(p.numel() for p in model.parameters()) - sum(w.numel() for w in linears)  # embedding / head, norms
    # 2-bit codes, one fp16 scale per group of 128 inputs of a row (a shorter last group where 128 does not divide)
    codes_and_scales = sum(w.numel() * 2 + w.size(0) * -(-w.size(1) // 128) * 16 for w in linears)
    assert gptq_bytes == rtn_bytes == (codes_and_scales + others * 16) / 8
    assert gptq < 0.9 * rtn  # error feedback matters at 2 bits
    for bad, says in [({"method": "gptq", "bits": 1, "group": 128}, "bits is an int"),
                      ({"method": "gptq", "bits": 2, "group": 100}, "group one of"),
                      ({"method": "hqq", "bits": 2, "group": 128}, "method is one of")]:
        with pytest.raises(ValueError, match=says):
            tasks.quantized_perplexity(bad)



def test_the_serving_task_rewards_a_budget_between_the_two_latency_limits():
    """lab09: goodput on the engine's cost-model clock. A budget too small for the prompts (TTFT) and
    one so large that prefill chunks stretch the decodes' steps (TPOT) both lose to the solution's."""
    best, met = tasks.serving_goodput({"token_budget": 192, "max_batch": 16})
    assert 0 < met <= 1 and best > 0
    assert best == tasks.serving_goodput({"token_budget": 192, "max_batch": 16})[0]  # the clock is a cost model
    for poor in ({"token_budget": 32, "max_batch": 16}, {"token_budget": 512, "max_batch": 16},
                 {"token_budget": 192, "max_batch": 4}):
        assert tasks.serving_goodput(poor)[0] < 0.9 * best, poor
    for bad in ({"token_budget": 8, "max_batch": 4}, {"token_budget": 64, "max_batch": True},
                {"token_budget": 64}, [64, 4]):
        with pytest.raises(ValueError, match="token_budget"):
            tasks.serving_goodput(bad)
