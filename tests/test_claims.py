"""The claims table: every chapter's claims, verdicts that follow the evidence, honest intervals."""

import json
import random
import re
from pathlib import Path

import pytest

from llmsys.core import ledger, stats
from llmsys.course import claims


def test_every_chapter_has_claims_with_sources_and_experiments():
    assert len(claims.CLAIMS) >= 30 and len(claims.BY_KEY) == len(claims.CLAIMS)
    for chapter in range(12):
        assert sum(c.chapter == chapter for c in claims.CLAIMS) >= 2, chapter
    for c in claims.CLAIMS:
        assert c.says and c.source and c.experiment, c.key
        assert c.rule is not None or c.untestable, c.key  # no rule: it must say why


def test_ledger_rows_named_by_claims_exist():
    from llmsys.core.techniques import ROWS

    named = [getattr(c.evidence, "technique", None) for c in claims.CLAIMS]
    assert len([n for n in named if n]) >= 30
    assert {n for n in named if n} <= {row.technique for row in ROWS}


@pytest.fixture
def own_ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    monkeypatch.setattr(ledger, "ledger_path", lambda: path)
    return path


def test_a_verdict_follows_the_measurement(own_ledger):
    claim = claims.BY_KEY["zero3-comm"]  # counted bytes must be within 5% of the formula's 1.5×
    assert claims.judge(claim).verdict == claims.NOT_MEASURED
    ledger.record("ZeRO-3 / FSDP", 1.5, 1.52, kind="counted")
    assert claims.judge(claim).verdict == claims.SHOWN
    ledger.record("ZeRO-3 / FSDP", 1.5, 2.0, kind="counted")
    verdict = claims.judge(claim)
    assert verdict.verdict == claims.NOT_SHOWN and "within 5% of the formula" in verdict.reason


def test_a_caveat_keeps_a_good_number_from_counting(own_ledger):
    ledger.record("GRPO", 1.0, 1.4)
    verdict = claims.judge(claims.BY_KEY["grpo-pass-rate"])
    assert verdict.verdict == claims.NOT_SHOWN and "one seed" in verdict.reason and "1.4" in verdict.reason


def test_a_seeded_interval_lifts_the_caveat():
    claim = claims.Claim("k", 8, "says", "source", "experiment", lambda: claims.Evidence(0.5, "", "x", low=0.4,
                                                                                         high=0.6, seeds=3),
                         claims.at_most(0.75), caveat="one seed")
    assert claims.judge(claim).verdict == claims.SHOWN
    one_seed = claims.Claim("k", 8, "says", "source", "experiment", lambda: claims.Evidence(0.5, "", "x"),
                            claims.at_most(0.75), caveat="one seed")
    assert claims.judge(one_seed).verdict == claims.NOT_SHOWN


def test_within_needs_the_whole_interval_inside():
    rule = claims.within(0.25)
    assert rule.holds(claims.Evidence(0.1, "", "x", low=-0.1, high=0.2, seeds=3))
    assert not rule.holds(claims.Evidence(0.1, "", "x", low=-0.3, high=0.2, seeds=3))
    assert not rule.holds(claims.Evidence(0.5, "", "x"))


def test_an_untestable_claim_says_why():
    verdict = claims.judge(claims.BY_KEY["gptq-awq-4bit"])
    assert verdict.verdict == claims.NOT_TESTABLE and "Q4_1" in verdict.reason


def test_a_claim_untestable_here_is_judged_once_a_stored_run_exists():
    def claim(evidence):
        return claims.Claim("k", 10, "says", "source", "experiment", lambda: evidence, claims.at_most(1.05),
                            untestable="no full-precision weights here")
    assert claims.judge(claim(None)).verdict == claims.NOT_TESTABLE
    assert claims.judge(claim(claims.Evidence(1.02, "", "x"))).verdict == claims.SHOWN
    assert claims.judge(claim(claims.Evidence(1.30, "", "x"))).verdict == claims.NOT_SHOWN


def test_an_interval_that_crosses_the_line_is_not_shown():
    rule = claims.at_least(0.0)
    assert rule.holds(claims.Evidence(3.0, "", "x", low=0.5, high=5.5, seeds=6))
    assert not rule.holds(claims.Evidence(3.0, "", "x", low=-0.5, high=6.5, seeds=6))
    assert not claims.at_most(1.0).holds(claims.Evidence(0.8, "", "x", low=0.5, high=1.1, seeds=6))


def test_welch_intervals_cover_the_true_difference_95_percent_of_the_time():
    rng = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):
        a = [rng.gauss(1.0, 1.0) for _ in range(6)]
        b = [rng.gauss(0.0, 3.0) for _ in range(6)]
        _, low, high = stats.difference_interval(a, b)
        covered += low <= 1.0 <= high
    assert 0.93 <= covered / trials <= 0.97  # binomial sd at 2000 trials: 0.005


def test_mean_interval_covers_the_mean_95_percent_of_the_time():
    rng = random.Random(1)
    hits = sum(low <= 2.0 <= high for low, high in
               (stats.mean_interval([rng.gauss(2.0, 0.5) for _ in range(4)])[1:] for _ in range(2000)))
    assert 0.93 <= hits / 2000 <= 0.97
    assert stats.mean_interval([3.0]) == (3.0, 3.0, 3.0)


def test_stored_runs_give_their_verdicts():
    grpo = claims.judge(claims.BY_KEY["dr-grpo-length"])
    assert grpo.evidence is not None and grpo.evidence.seeds >= 3 and grpo.evidence.low <= grpo.evidence.value
    for key in ("adamw-decoupled", "muon-tokens"):  # seeded runs: an interval, and no one-seed caveat
        verdict = claims.judge(claims.BY_KEY[key])
        assert verdict.evidence.seeds >= 3 and verdict.evidence.low <= verdict.evidence.value <= verdict.evidence.high
        assert "one seed" not in verdict.reason
    specdec = claims.judge(claims.BY_KEY["specdec-speedup"])
    assert specdec.evidence is not None
    assert specdec.verdict == (claims.SHOWN if specdec.evidence.value >= 2.0 else claims.NOT_SHOWN)


def test_the_command_line_prints_and_writes_the_table(tmp_path, capsys, own_ledger):
    from llmsys.__main__ import main

    assert main(["claims", "--chapter", "6", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "Dr. GRPO" in out and (tmp_path / "c.json").exists()
    assert main(["claims", "--chapter", "12"]) == 2


# --- prose that states an outcome is printed from the run, never written into a markdown cell ---------------------

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
VERDICT_WORDS = re.compile(r"\bclaims? (?:holds?|held|does not hold|did not hold|fails|failed)\b"
                           r"|\b(?:did|does|do) not show\b|\b(?:is|was|are|were) (?:not )?shown\b|\bnot shown here\b",
                           re.IGNORECASE)


def stored_figures() -> dict[int, set[str]]:
    """{chapter: the figures the table computes from stored benchmark runs, as prose would write them}: a
    claim's value at 2 decimals and at 3 significant digits, its interval's ends at 3 significant digits.
    (Ledger figures are measured on each reader's machine: no prose can state them, and none is checked.)"""
    figures: dict[int, set[str]] = {}
    for claim in claims.CLAIMS:
        e = claim.evidence()
        if e is None:
            continue
        forms = [f"{e.value:.2f}", f"{e.value:.3g}"] + [f"{end:.3g}" for end in (e.low, e.high) if end is not None]
        figures.setdefault(claim.chapter, set()).update(f for f in forms if "." in f and "inf" not in f)
    return figures


def prose_problems(notebook: Path, figures: dict[int, set[str]]) -> list[str]:
    """The markdown sentences of ``notebook`` that state a claim's outcome, or a stored run's figure of one of
    its chapter's claims (a figure: not part of a longer number, e.g. "0.77" or "2.78×" but not "10.771")."""
    chapter = int(notebook.name[:2])
    problems = []
    for number, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        problems += [f"{notebook.name} cell {number}: states a verdict: {m.group(0)!r}"
                     for m in VERDICT_WORDS.finditer(text)]
        problems += [f"{notebook.name} cell {number}: states the stored figure {figure}"
                     for figure in sorted(figures.get(chapter, ()))
                     if re.search(rf"(?<![\w.]){re.escape(figure)}(?!\d)", text)]
    return problems


def test_notebook_prose_leaves_outcomes_to_the_printed_verdicts(own_ledger):
    """Markdown in notebooks/ may describe an experiment, never its outcome: a verdict ("the claim holds",
    "did not show") or a figure the claims table computes from a stored run. Those are printed by
    ``claims.verdict_line`` from the same records, so prose cannot disagree with the table when a run changes."""
    figures = stored_figures()
    assert sum(map(len, figures.values())) >= 10  # the stored runs are read: an empty set would check nothing
    notebooks = sorted(NOTEBOOKS.glob("[01][0-9]*_*.ipynb"))  # 09b_...: a chapter's second notebook
    assert len(notebooks) == 13
    problems = [p for nb in notebooks for p in prose_problems(nb, figures)]
    assert not problems, "print these from the run instead (claims.verdict_line):\n" + "\n".join(problems)


@pytest.mark.parametrize("sentence", ["Muon needed {figure}× AdamW's tokens.", "So the lecture's claim holds here.",
                                      "Under decoupling the effect did not show."])
def test_a_planted_outcome_in_prose_is_caught(own_ledger, tmp_path, sentence):
    figures = stored_figures()
    notebook = tmp_path / "08_muon.ipynb"
    cells = json.loads((NOTEBOOKS / notebook.name).read_text())
    assert not prose_problems(NOTEBOOKS / notebook.name, figures)
    figure = f"{claims.judge(claims.BY_KEY['muon-tokens']).evidence.value:.2f}"
    cells["cells"].append({"cell_type": "markdown", "metadata": {}, "source": [sentence.format(figure=figure)]})
    notebook.write_text(json.dumps(cells))
    assert len(prose_problems(notebook, figures)) == 1
