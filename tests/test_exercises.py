"""The notebook exercises' self-check: right answers are used, stubs and wrong answers fall back."""

import re

import torch

from llmsys.course.exercises import check
from llmsys.course.runner import REPO


def reference(x):
    return x * 2


def test_a_correct_answer_is_used(capsys):
    def mine(x):
        return x + x
    assert check("ex", mine, reference, [(torch.ones(3),)], "hint") is mine
    assert "correct" in capsys.readouterr().out


def test_an_untouched_stub_is_not_attempted_and_falls_back(capsys):
    def stub(x):
        raise NotImplementedError("write it")
    assert check("ex", stub, reference, [(torch.ones(3),)], "hint") is reference
    assert "not attempted" in capsys.readouterr().out


def test_a_wrong_answer_gets_its_hint_and_falls_back(capsys):
    def wrong(x):
        return x * 3
    got = check("ex", wrong, reference, [(torch.ones(3),)], lambda args, got, expected: f"off by {float((got - expected)[0])}")
    assert got is reference
    assert "off by 1.0" in capsys.readouterr().out


def test_a_crash_is_reported_and_falls_back(capsys):
    def crashes(x):
        return x.reshape(7)
    assert check("ex", crashes, reference, [(torch.ones(3),)], "hint") is reference
    assert "raised RuntimeError" in capsys.readouterr().out


def test_chapter_0_and_3_exercises_accept_a_solution_and_refuse_a_mistake(capsys):
    """The exercises written into notebooks 00 and 03: untouched, solved and wrong."""
    import nbformat
    import torch.nn.functional as F

    from llmsys import lora
    from llmsys.model import ModelConfig

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)
    namespace = {"torch": torch, "cfg": cfg, "llama7b": cfg, "lora": lora}
    for name in ("00_foundations", "03_lora"):
        for cell in nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4).cells:
            if cell.cell_type == "code" and "from llmsys.course.exercises import check" in cell.source:
                exec(cell.source, namespace)
    assert capsys.readouterr().out.count("not attempted") == 3
    ns = namespace
    exercises = [  # (cases, library version, a right answer, a common mistake)
        (ns["block_cases"], lambda b, x, c, s: b(x, c, s),
         lambda b, x, c, s: (lambda h: h + b.feed_forward(b.ffn_norm(h)))(x + b.attention(b.attention_norm(x), c, s)),
         lambda b, x, c, s: b.feed_forward(b.ffn_norm(x + b.attention(b.attention_norm(x), c, s)))),
        (ns["ff_cases"], lambda ff, x: ff(x), lambda ff, x: ff.w2(F.silu(ff.w1(x)) * ff.w3(x)),
         lambda ff, x: ff.w2(ff.w1(x) * F.silu(ff.w3(x)))),
        (ns["lora_cases"], lambda layer, x: layer(x),
         lambda layer, x: layer.base(x) + x @ layer.lora_A.T @ layer.lora_B.T * layer.scaling,
         lambda layer, x: layer.base(x) + x @ layer.lora_A.T @ layer.lora_B.T),
    ]
    for cases, reference, right, wrong in exercises:
        assert check("ex", right, reference, cases, hint="h") is right
        assert check("ex", wrong, reference, cases, hint="h") is reference


def test_chapter_4_exercises_accept_a_solution_and_refuse_a_mistake(capsys):
    """The exercises written into notebook 04: untouched, solved and wrong."""
    import types

    import nbformat

    from llmsys import specdec

    fake_run = types.SimpleNamespace(acceptance_by_position=lambda: [0.8, 0.5, float("nan")])
    namespace = {"torch": torch, "specdec": specdec, "stats": fake_run, "c_draft": 0.2, "alpha_draft": 0.6,
                 "gammas": [1, 2], "sweep": {1: {"speedup": 1.1}, 2: {"speedup": 1.0}}}
    cells = [cell.source for cell in nbformat.read(REPO / "notebooks" / "04_speculative_decoding.ipynb", as_version=4).cells
             if cell.cell_type == "code" and "from llmsys.course.exercises import check" in cell.source]
    for source in cells:
        exec(source, namespace)
    assert capsys.readouterr().out.count("not attempted") == 4
    ns = namespace

    def greedy_right(t, d):
        n = (d == t[:, :-1]).long().cumprod(-1).sum(-1)
        return n, t.gather(1, n[:, None]).squeeze(1)

    def mask_right(parents, prefix_len):
        mask = torch.zeros(len(parents), prefix_len + len(parents), dtype=torch.bool)
        mask[:, :prefix_len] = True
        for i in range(len(parents)):
            node = i
            while node >= 0:
                mask[i, prefix_len + node] = True
                node = parents[node]
        return mask

    def gamma_right(alphas, c):
        def speedup(g):
            survive, total = 1.0, 1.0
            for a in alphas[:g]:
                survive *= a
                total += survive
            return total / (g * c + 1)
        return max(range(1, len(alphas) + 1), key=speedup)

    exercises = [  # (cases, library version, a right answer, a common mistake and the words of its hint)
        (ns["residual_cases"], ns["library_residual"],
         lambda p, q: (p - q).clamp(min=0) / (p - q).clamp(min=0).sum(-1, keepdim=True),
         lambda p, q: (p - q).clamp(min=0), "divide by the row's sum"),
        (ns["greedy_cases"], specdec.greedy_accept, greedy_right,
         lambda t, d: ((d == t[:, :-1]).sum(-1), t.gather(1, (d == t[:, :-1]).sum(-1)[:, None]).squeeze(1)),
         "cumulative product"),
        (ns["gamma_cases"], specdec.best_gamma_by_position, gamma_right,
         lambda a, c: max(range(1, len(a) + 1), key=lambda g: (1 + sum(a[:g])) / (g * c + 1)), "overcounts"),
        (ns["mask_cases"], specdec.tree_attention_mask, mask_right, ns["_parents_only"], "walk up to the root"),
    ]
    for source, (cases, reference, right, wrong, words) in zip(cells, exercises):
        assert check("ex", right, reference, cases, hint="h") is right
        assert check("ex", wrong, reference, cases, hint="h") is reference
        # the cell itself, with the stub filled in as a learner would: right, then the planted mistake
        name, args = re.search(r"def (my_\w+)\((.*?)\):", source).groups()
        solved = re.sub(r"raise NotImplementedError\(.*?\)\n", f"return ANSWER({args})\n", source, count=1)
        capsys.readouterr()
        exec(solved, {**namespace, "ANSWER": right})
        assert "correct" in capsys.readouterr().out, name
        exec(solved, {**namespace, "ANSWER": wrong})
        assert words in capsys.readouterr().out, name
