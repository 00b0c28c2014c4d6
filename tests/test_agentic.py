"""The agentic workload: its checker and SQL tool report what an agent did, and a session's
every turn holds the earlier ones."""

import re

import pytest

from llmsys.specdec import agentic


def fenced(code: str, lang: str = "python") -> str:
    return f"Here it is:\n```{lang}\n{code}\n```\nDone."


@pytest.mark.parametrize("module, name, old, new", agentic.CODE_TASKS)
def test_the_checker_accepts_the_rename_and_names_what_is_wrong(module, name, old, new):
    import importlib
    import inspect

    source = inspect.getsource(getattr(importlib.import_module(module), name))
    renamed = re.sub(rf"\b{old}\b", new, source)
    assert agentic.check_function(fenced(renamed), name, old, new) == ""
    assert f"`{old}` is still used" in agentic.check_function(fenced(source), name, old, new)
    assert "SyntaxError" in agentic.check_function(fenced(renamed.replace("def ", "def (", 1)), name, old, new)
    assert "no function" in agentic.check_function(fenced("x = 1"), name, old, new)
    other = re.sub(rf"\b{old}\b", "zzz", source)
    assert f"no parameter `{new}`" in agentic.check_function(fenced(other), name, old, new)


def test_the_sql_tool_returns_rows_errors_and_stops_runaway_queries():
    rows = agentic.run_query(fenced("SELECT word FROM keywords WHERE length = 8 ORDER BY word;", "sql"))
    assert rows.startswith("2 row(s)") and "continue" in rows and "nonlocal" in rows
    assert agentic.run_query(fenced("SELECT nope FROM keywords;", "sql")).startswith("error: no such column")
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c;"
    assert agentic.run_query(fenced(forever, "sql")) == "error: interrupted"
    many = agentic.run_query(fenced("SELECT name FROM modules;", "sql"), limit=3)
    assert many.startswith("more than 3 row(s)") and len(many.splitlines()) == 4


def test_a_session_holds_every_earlier_turn_and_its_tool_output_follows_the_answers():
    session = agentic.sessions(1)[0]
    answers = iter([fenced("def indent(text, prefix):\n    return prefix + text"),
                    fenced("def indent(text, margin):\n    return margin + text"),
                    fenced("def indent(text, margin):\n    return margin + text")])
    seen = []

    def agent(messages):
        seen.append([m["content"] for m in messages])
        return next(answers)

    conversation = agentic.run(session, agent)
    assert [m["role"] for m in conversation] == ["system"] + ["user", "assistant"] * 3
    assert "def indent(text, prefix, predicate=None)" in seen[0][1]  # the tool read the real source
    assert seen[1][:3] == seen[0] + [conversation[2]["content"]]  # the second turn holds the first
    assert "`prefix` is still used" in conversation[3]["content"]
    assert "Checker: ok." in conversation[5]["content"]
    kinds = [s.name.split(":")[0] for s in agentic.sessions()]
    assert kinds.count("code") == len(agentic.CODE_TASKS) and kinds.count("sql") == len(agentic.SQL_TASKS)
