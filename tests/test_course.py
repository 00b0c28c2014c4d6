"""The course runner, the command line, and the repository's hygiene rules."""

import json
import re
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from llmsys.course.runner import CHAPTERS, REPO, run_notebook

NOTEBOOK_DIRS = ["notebooks", "labs", "solutions"]


def test_runner_names_the_failing_cell(tmp_path):
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("print(x)"), new_code_cell("1 / 0"),
                             new_code_cell("never = True")])
    path = tmp_path / "demo.ipynb"
    nbformat.write(nb, path)
    result = run_notebook(path, tmp_path / "out", cell_timeout=60)
    assert result.error is not None
    assert "demo.ipynb: code cell 3 of 4" in result.error and "ZeroDivisionError" in result.error
    executed = nbformat.read(tmp_path / "out" / "demo.ipynb", as_version=4)
    assert executed.cells[1].outputs[0]["text"] == "1\n"
    assert not executed.cells[3].get("outputs")
    assert (tmp_path / "out" / "demo.html").read_text().startswith("<!DOCTYPE html>")


def test_chapters_side_by_side_each_get_their_share_of_the_cores(tmp_path, monkeypatch, capsys):
    from llmsys.course import runner

    for name in ("a", "b", "c"):
        nb = new_notebook(cells=[new_code_cell("import os; print(os.environ['OMP_NUM_THREADS'])")])
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    monkeypatch.setattr(runner, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(runner, "CHAPTERS", [runner.Chapter(i, f"{n}.ipynb", n, "", "") for i, n in enumerate("abc")])
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 4)
    results = runner.run_course(None, tmp_path / "out", build_zoo=False, jobs=2)
    assert [r.notebook.name for r in results] == ["a.ipynb", "b.ipynb", "c.ipynb"] and not any(r.error for r in results)
    for name in "abc":
        assert nbformat.read(tmp_path / "out" / f"{name}.ipynb", as_version=4).cells[0].outputs[0]["text"] == "2\n"
    assert "total (2 side by side)" in capsys.readouterr().out


def test_each_chapter_names_the_zoo_entries_its_cells_load():
    """The runner builds only what the chosen chapters need; a chapter that loads an entry
    missing from its list would build it mid-run, without the word before."""
    from llmsys.course import catalog
    from llmsys.course.runner import CHAPTERS, NOTEBOOKS

    loaders = {name: [f'zoo.load(\\"{name}\\"', f'load_served(\\"{name}\\"'] for name in ("target", "draft", "tiny", "smollm2")}
    loaders |= {"smollm2-eagle": [" chat.entry(", "specdec.chat.entry("], "smollm2-student": ["distill_chat.entry("],
                "addition-teacher": ["equal_compute.run_seeds(", "addition.load_teacher("]}
    assert set(loaders) == set(catalog.names())
    for chapter in CHAPTERS:
        text = (NOTEBOOKS / chapter.notebook).read_text()
        loaded = {name for name, calls in loaders.items() if any(call in text for call in calls)}
        assert loaded == set(chapter.zoo), (chapter.notebook, sorted(loaded))


def test_every_chapter_notebook_and_lab_exists():
    for chapter in CHAPTERS:
        assert (REPO / "notebooks" / chapter.notebook).exists(), chapter.notebook
        for lab in chapter.lab.split(", "):
            assert (REPO / "solutions" / f"{lab}.ipynb").exists(), lab


def test_a_chapter_number_selects_all_of_its_notebooks():
    from llmsys.course.runner import select

    assert [c.notebook for c in select([9, 8])] == ["09_serving.ipynb", "09b_kv_distributed.ipynb", "08_muon.ipynb"]
    with pytest.raises(ValueError, match="no chapter"):
        select([12])


def test_readme_chapter_map_names_the_same_notebooks_and_labs():
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| [^|]+ \| [^|]+ \| [^|]+ \| ([^|]+) \|$",
                      (REPO / "README.md").read_text(), re.M)
    readme = [(int(n), f"{stem}.ipynb", ", ".join(re.findall(r"`(\w+)`", labs))) for n, stem, labs in rows]
    assert readme == [(c.number, c.notebook, c.lab) for c in CHAPTERS]


@pytest.mark.parametrize("folder", NOTEBOOK_DIRS)
def test_notebooks_committed_without_outputs(folder):
    for path in sorted((REPO / folder).glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert not cell["outputs"] and cell["execution_count"] is None, f"{path.name} has outputs"


def readme_block(heading: str) -> str:
    """The first fenced shell block after a README heading."""
    text = (REPO / "README.md").read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S).group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = readme_block("## Run the tests")
    ci = (REPO / ".ci" / "run").read_text()
    assert command in ci, "the test command in README.md and .ci/run differ"


def test_cli_info():
    out = subprocess.run([sys.executable, "-m", "llmsys", "info"], capture_output=True, text=True, check=True)
    assert "device" in out.stdout and "triton" in out.stdout and "ch9" in out.stdout


@pytest.mark.parametrize("argv,says", [
    (["zoo", "nope"], "no zoo model named 'nope'; choose from target, draft, tiny, smollm2, smollm2-eagle, smollm2-student"),
    (["course", "--chapters", "42"], "no chapter 42; chapters are 0,"),
    (["ledger", "--upto", "-3"], "--upto -3 is not a chapter"),
])
def test_cli_misuse_is_one_clear_line_and_a_nonzero_exit(argv, says, capsys):
    from llmsys.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_pinned_dependencies_are_imported_not_skipped():
    """A test of a pinned dependency imports it: a skip on import (or on any exception) would turn
    that dependency's API break into a silent skip of the cross-check."""
    skip_on_import = "importor" + "skip("
    skip_on_anything = re.compile(r"except Exception[^\n]*:\s*\n\s*pytest\.skip")
    offenders = [path.name for path in sorted((REPO / "tests").glob("test_*.py"))
                 if skip_on_import in path.read_text() or skip_on_anything.search(path.read_text())]
    assert offenders == []
