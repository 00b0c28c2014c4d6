"""An agentic workload built offline from what ships with Python: multi-turn sessions in which
the model re-reads and re-emits what it has seen, the workload where drafting from the context
pays (SuffixDecoding, Oliaro et al., arXiv 2411.04975, reports its largest gains on agents).

Two kinds of session, each turn's context holding every earlier turn:

- a coding agent: it reads a standard-library function (tool output: the source), renames a
  parameter and shows the whole function; a checker (``compile`` and ``ast``) reports what is
  wrong or asks for the next edit, and the agent re-emits the function again;
- a SQL agent: a ``sqlite3`` database built from the standard library's own facts, its schema
  in the context; the agent writes a query, the tool runs it and returns the rows or the
  error, and the agent revises the query in full.

Tool messages are computed from the agent's answers, so a session depends on the model that
answers it; lossless decoding methods answer alike and see identical sessions.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import keyword
import re
import sqlite3
import sys
from dataclasses import dataclass
from typing import Callable

SYSTEM = "You are a careful coding agent. Answer with code in one fenced block, then one short sentence."

# (module, function, parameter to rename, its new name): small functions whose source ships with Python
CODE_TASKS = [("textwrap", "indent", "prefix", "margin"), ("shlex", "quote", "s", "word"),
              ("statistics", "median", "data", "values"), ("fnmatch", "filter", "names", "candidates"),
              ("html", "escape", "s", "text"), ("string", "capwords", "s", "phrase")]
SQL_TASKS = ["the five longest Python keywords, longest first",
             "how many standard-library modules start with each letter, for the letters with more than ten",
             "the keywords that are also the name of a standard-library module"]


@dataclass(frozen=True)
class Session:
    """``steps[i](answers)`` is the message of turn i, from the agent's answers to turns 0..i-1."""
    name: str
    steps: tuple[Callable[[list[str]], str], ...]


def code_block(answer: str) -> str:
    """The first fenced block of an answer (its text when there is none)."""
    found = re.search(r"```(?:[a-zA-Z]*)\n(.*?)```", answer, re.S)
    return (found.group(1) if found else answer).strip()


def check_function(answer: str, name: str, old: str, new: str) -> str:
    """The checker's report on a renamed function: what is wrong, or "" when it is right."""
    code = code_block(answer)
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        return f"SyntaxError: {err.msg} (line {err.lineno})"
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name]
    if not functions:
        return f"no function named `{name}` in your code block"
    params = [a.arg for a in functions[0].args.args + functions[0].args.kwonlyargs]
    used = {n.id for n in ast.walk(functions[0]) if isinstance(n, ast.Name)}
    if old in params or old in used:
        return f"`{old}` is still used in `{name}`: rename every use to `{new}`"
    if new not in params:
        return f"`{name}` has no parameter `{new}`"
    return ""


def coding_session(module: str, name: str, old: str, new: str) -> Session:
    source = inspect.getsource(getattr(importlib.import_module(module), name))

    def read(answers):
        return (f"Tool output (cat {module}.py, function {name}):\n```python\n{source}```\n"
                f"Rename the parameter `{old}` of `{name}` to `{new}` everywhere and show the whole function.")

    def check(answers):
        problem = check_function(answers[-1], name, old, new)
        verdict = f"Checker: {problem}. Fix it, then" if problem else "Checker: ok, it compiles and takes the new name. Now"
        return f"{verdict} add a one-line docstring at the top of `{name}` and show the whole function again."

    def again(answers):
        problem = check_function(answers[-1], name, old, new)
        verdict = f"Checker: {problem}." if problem else "Checker: ok."
        return f"{verdict} Show the final version of `{name}` once more, unchanged, for the commit."

    return Session(f"code: {module}.{name}", (read, check, again))


def stdlib_database() -> sqlite3.Connection:
    """Two tables of facts about this Python: its keywords and its standard-library modules."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE keywords (word TEXT PRIMARY KEY, length INTEGER)")
    db.execute("CREATE TABLE modules (name TEXT PRIMARY KEY, first_letter TEXT, private INTEGER)")
    db.executemany("INSERT INTO keywords VALUES (?, ?)", [(w, len(w)) for w in keyword.kwlist])
    db.executemany("INSERT INTO modules VALUES (?, ?, ?)",
                   [(m, m[0], int(m.startswith("_"))) for m in sorted(sys.stdlib_module_names)])
    return db


MAX_QUERY_STEPS = 10_000  # thousands of SQLite VM instructions a query may take

SCHEMA = ("CREATE TABLE keywords (word TEXT PRIMARY KEY, length INTEGER);\n"
          "CREATE TABLE modules (name TEXT PRIMARY KEY, first_letter TEXT, private INTEGER);")


def run_query(answer: str, limit: int = 12) -> str:
    """The tool's output for the query in an answer: its rows (at most ``limit``) or the error."""
    query = code_block(answer)
    db = stdlib_database()
    steps = iter(range(MAX_QUERY_STEPS))
    db.set_progress_handler(lambda: next(steps, None) is None, 1000)  # a runaway query is stopped, not waited for
    try:
        rows = db.execute(query).fetchmany(limit + 1)
    except (sqlite3.Error, sqlite3.Warning) as err:
        return f"error: {err}"
    finally:
        db.close()
    shown = "\n".join(" | ".join(map(str, row)) for row in rows[:limit])
    return f"{len(rows) if len(rows) <= limit else f'more than {limit}'} row(s):\n{shown}"


def sql_session(question: str) -> Session:
    def ask(answers):
        return f"Database schema:\n```sql\n{SCHEMA}\n```\nWrite one SQLite query for {question}."

    def result(answers):
        return (f"Tool output (sqlite3):\n```\n{run_query(answers[-1])}\n```\n"
                f"If the result is wrong, fix the query; otherwise add a column with the row count. "
                f"Show the whole query again.")

    def final(answers):
        return f"Tool output (sqlite3):\n```\n{run_query(answers[-1])}\n```\nShow the final query once more, unchanged."

    return Session(f"sql: {question}", (ask, result, final))


def sessions(n: int | None = None) -> list[Session]:
    """Coding and SQL sessions, interleaved; the first ``n``."""
    code = [coding_session(*task) for task in CODE_TASKS]
    sql = [sql_session(q) for q in SQL_TASKS]
    mixed = [s for pair in zip(code, sql) for s in pair] + code[len(sql):]
    return mixed[:n] if n is not None else mixed


def run(session: Session, answer: Callable[[list[dict]], str]) -> list[dict]:
    """Play a session: ``answer(messages) -> text`` is the agent. Returns the whole conversation."""
    messages = [{"role": "system", "content": SYSTEM}]
    answers: list[str] = []
    for step in session.steps:
        messages.append({"role": "user", "content": step(answers)})
        answers.append(answer(messages))
        messages.append({"role": "assistant", "content": answers[-1]})
    return messages


def played_prompts(target, tok, n_sessions: int, new_tokens: int) -> list:
    """Every turn's prompt (1, T) of the first ``n_sessions`` sessions, played once by the target's own greedy
    decoding, each answer cut at the end of its turn (lossless methods answer alike, so every method sees
    these prompts)."""
    from llmsys.core.pretrained import chat_ids
    from llmsys.specdec.decode import autoregressive_decode

    dev = target.tok_embeddings.weight.device
    prompts = []

    def answer(messages):
        ids = chat_ids(tok, messages).to(dev)
        prompts.append(ids)
        out = autoregressive_decode(target, ids, new_tokens)[0][0, ids.size(1):]
        stops = (out == tok.eos_token_id).nonzero()
        return tok.decode(out[:stops[0, 0]] if len(stops) else out, skip_special_tokens=True).strip()

    for session in sessions(n_sessions):
        run(session, answer)
    return prompts
