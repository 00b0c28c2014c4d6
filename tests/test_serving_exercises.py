"""Chapter 9's exercises, as written into notebooks/09_serving.ipynb: untouched, solved and wrong."""

import nbformat
import torch

from llmsys.course.exercises import check
from llmsys.course.runner import REPO
from llmsys.serving import BlockManager, Request, SchedulerConfig, block_hash
from llmsys.serving.blocks import NO_PARENT


def chained(tokens, block_size):
    hashes, parent = [], NO_PARENT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


def unchained(tokens, block_size):  # every block hashed on its own: a block after another prefix would match
    return [block_hash(NO_PARENT, tokens[s:s + block_size]) for s in range(0, len(tokens) - block_size + 1, block_size)]


def blocks_to_write(table, ref_counts, start, n, block_size):
    last = (start + n - 1) // block_size
    copies = sum(ref_counts[table[i]] > 1 for i in range(start // block_size, min(last + 1, len(table))))
    return max(0, last + 1 - len(table)) + copies


def new_blocks_only(table, ref_counts, start, n, block_size):  # forgets copy-on-write
    return max(0, (start + n - 1) // block_size + 1 - len(table))


def schedule_step(running, waiting, max_batch, budget, prompts_first=False):
    plan, slots = [], len(running)
    queues = [("running", running), ("waiting", waiting)]
    queues = queues[::-1] if prompts_first else queues
    for kind, queue in queues:
        for rid, left in queue:
            if budget <= 0 or (kind == "waiting" and slots >= max_batch):
                break
            plan.append((rid, min(left, budget)))
            budget -= min(left, budget)
            slots += kind == "waiting"
    return plan


def prompts_first(running, waiting, max_batch, budget):  # a long prompt would stall every decode behind it
    return schedule_step(running, waiting, max_batch, budget, prompts_first=True)


def exercise_namespace() -> dict:
    """The notebook's exercise cells, run untouched, with what the cells before them import."""
    namespace = {"torch": torch, "BlockManager": BlockManager, "Request": Request, "SchedulerConfig": SchedulerConfig}
    for cell in nbformat.read(REPO / "notebooks" / "09_serving.ipynb", as_version=4).cells:
        if cell.cell_type == "code" and "from llmsys.course.exercises import check" in cell.source:
            exec(cell.source, namespace)
    return namespace


def test_chapter_9_exercises_accept_a_solution_and_refuse_a_mistake(capsys):
    ns = exercise_namespace()
    assert capsys.readouterr().out.count("not attempted") == 3
    exercises = [  # (cases, library version, a right answer, a common mistake)
        (ns["hash_cases"], ns["prefix_hashes"], chained, unchained),
        (ns["cow_cases"], ns["library_blocks_to_write"], blocks_to_write, new_blocks_only),
        (ns["step_cases"], ns["library_schedule_step"], schedule_step, prompts_first),
    ]
    for cases, reference, right, wrong in exercises:
        assert check("ex", right, reference, cases, hint="h") is right
        assert check("ex", wrong, reference, cases, hint="h") is reference


def test_chapter_9_hints_name_what_is_off(capsys):
    """Each exercise's own hint, on its planted mistake, points at the invariant that is broken."""
    ns = exercise_namespace()
    capsys.readouterr()
    check("ex", unchained, ns["prefix_hashes"], ns["hash_cases"], hint=ns["hash_hint"])
    assert "chain each on the previous block's hash" in capsys.readouterr().out
    check("ex", new_blocks_only, ns["library_blocks_to_write"], ns["cow_cases"], hint=ns["cow_hint"])
    assert "copies of touched blocks whose count is > 1" in capsys.readouterr().out
    check("ex", prompts_first, ns["library_schedule_step"], ns["step_cases"], hint=ns["step_hint"])
    assert "Running sequences (decodes) come first" in capsys.readouterr().out
