"""The notebook exercises' self-check: right answers are used, stubs and wrong answers fall back."""

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


def test_a_known_mistake_gets_its_own_hint(capsys):
    def doubled_twice(x):
        return x * 4

    def off(x):
        return x * 5

    mistakes = {"you doubled twice": doubled_twice}
    assert check("ex", doubled_twice, reference, [(torch.ones(3),)], "generic", mistakes=mistakes) is reference
    out = capsys.readouterr().out
    assert "you doubled twice" in out and "generic" not in out
    assert check("ex", off, reference, [(torch.ones(3),)], "generic", mistakes=mistakes) is reference
    out = capsys.readouterr().out
    assert "generic" in out and "you doubled twice" not in out


def test_chapter_10_exercises_accept_a_solution_and_refuse_a_mistake(capsys):
    """The exercises written into notebook 10 (RTN, one GPTQ column update, a 2:4 Wanda mask), on a
    small model of the same shape family: untouched, solved and wrong."""
    import nbformat

    from llmsys.compress import calibrate, formats, gptq, prune
    from llmsys.model import ModelConfig, Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=5, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=16)
    model = Transformer(cfg).eval()
    block_stats = {}
    calibrate.sequential(model, torch.randint(0, 64, (2, 16)), lambda i, b, s: block_stats.update(s) if i == 4 else None,
                         progress=False)
    ns = {"torch": torch, "formats": formats, "gptq": gptq, "prune": prune, "calibrate": calibrate, "check": check,
          "model": model, "BLOCK": 4, "block_stats": block_stats, "H": block_stats["attention.wq"].hessian.value,
          "cached": None}
    for cell in nbformat.read(REPO / "notebooks" / "10_quantization.ipynb", as_version=4).cells:
        if cell.cell_type == "code" and ("# YOUR CODE HERE" in cell.source or " = check(" in cell.source):
            exec(cell.source, ns)
    assert capsys.readouterr().out.count("not attempted") == 3

    def rtn_right(w, bits, group):
        g = w.reshape(-1, group)
        qmax = 2 ** (bits - 1) - 1
        s = g.abs().amax(1, keepdim=True) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (torch.clamp(torch.round(g / s), -qmax, qmax) * s).reshape(w.shape)

    def update_right(W, Hinv, j, q):
        err = (W[:, j] - q) / Hinv[j, j]
        W = W.clone()
        W[:, j:] -= err[:, None] * Hinv[j, j:][None, :]
        W[:, j] = q
        return W, Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]

    def mask_right(W, norm):
        scores = (W.abs() * norm[None, :]).reshape(-1, 4)
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(2, dim=1).indices, True).view(W.shape)

    exercises = [  # (cases, library version, hint, a right answer, a common mistake, what its hint says)
        (ns["rtn_cases"], lambda w, b, g: formats.fake_quantize(w, b, g), ns["rtn_hint"], rtn_right,
         lambda w, b, g: formats.fake_quantize(w, b, "channel"), "one scale per row"),
        (ns["update_cases"], gptq.obq_step, ns["update_hint"], update_right,
         lambda W, Hinv, j, q: (update_right(W, Hinv, j, q)[0], Hinv), "remove column j from Hinv"),
        (ns["prune_cases"], lambda W, n: prune.n_m_mask(prune.wanda_scores(W, n)), ns["prune_hint"], mask_right,
         lambda W, n: prune.n_m_mask(W.abs()), "magnitude mask"),
    ]
    for cases, reference, hint, right, wrong, says in exercises:
        assert check("ex", right, reference, cases, hint, rtol=1e-6, atol=1e-9) is right
        assert check("ex", wrong, reference, cases, hint, rtol=1e-6, atol=1e-9) is reference
        assert says in capsys.readouterr().out
