"""Library answers: what a lab asks students to write is absent from the library their kernels see.

A lab's solution notebook lists, per graded check, the ``llmsys`` names that
answer it, in its metadata::

    "llmsys": {"library_answers": {"rmsnorm_matches_reference": ["llmsys.core.model.RMSNorm"]}}

For a student's sandbox the grader copies the package and replaces each such
function (or every method of such a class) with a body that raises
"not available in this lab: write it yourself". Reading the student's code
cannot catch an import hidden behind ``importlib`` or a copied ``__code__``;
a function that is not there can be reached by no path. The solution's run,
which computes the expected values, sees the whole library. A name outside
``llmsys`` (torch's own ``GradScaler``) cannot be taken away and stays.

A declared answer that the lab's own cells call where a student's kernel runs
them (a setup helper, a relation a check computes) cannot be taken away either
(``needed_by_lab``): it stays, the report says so, and a submission whose own
code names it gets zero for that check (``library_answer_notes``, which reads
the code, so it catches the plain use, not code written to hide it).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import py_compile
import shutil
from pathlib import Path

from .. import labs
from .merge import normalized
from .report import STATUS_FAILED
from .sides import root_name

UNAVAILABLE = "not available in this lab: write it yourself"


def declared_answers(solution_nb) -> list[str]:
    mark = solution_nb.metadata.get("llmsys", {}) if isinstance(solution_nb.metadata, dict) else {}
    policy = mark.get("library_answers", {}) if isinstance(mark, dict) else {}
    return sorted({name for names in policy.values() for name in names if name.startswith("llmsys.")})


def needed_by_lab(names: list[str], lab_sources: list[str], answer_sources: list[str]) -> set[str]:
    """The declared answers that the lab's own code (as a student's kernel runs it) reaches through llmsys.

    ``answer_sources``: the solution's answer cells, whose imports the lab's code may use.
    """
    modules, imported = set(), {}  # names bound to llmsys modules; names bound by `from llmsys... import x`
    trees, answer_trees = [], []
    for source in [*lab_sources, *answer_sources]:
        try:
            (trees if len(trees) + len(answer_trees) < len(lab_sources) else answer_trees).append(ast.parse(source))
        except SyntaxError:
            (trees if len(trees) + len(answer_trees) < len(lab_sources) else answer_trees).append(ast.Module([], []))
    for node in (n for tree in trees + answer_trees for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "llmsys"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "llmsys":
            for alias in node.names:
                modules.add(alias.asname or alias.name)  # a submodule or a function: either may be reached through
                imported[alias.asname or alias.name] = alias.name
    used = set()
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and root_name(node.value) in modules:
            used.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in imported:
            used.add(imported[node.id])
    return {name for name in names if name.split(".")[-1] in used}


def library_answer_notes(solution_nb, submission_nb, report, names: set[str]) -> list[str]:
    """Fail the checks whose answer, among ``names``, the submission's own code takes from the library."""
    mark = solution_nb.metadata.get("llmsys", {}) if isinstance(solution_nb.metadata, dict) else {}
    policy = mark.get("library_answers", {}) if isinstance(mark, dict) else {}
    lab_sources = {normalized(labs.source_text(c)) for c in labs.build_lab(solution_nb).cells}
    student_code = [c.source for c in submission_nb.cells if c.get("cell_type") == "code"
                    and not labs.is_graded(c) and normalized(c.source) not in lab_sources]
    used = set().union(set(), *(_names_used(source) for source in student_code))
    notes, checks = [], {c.id: c for c in report.checks}
    for check_id, answers in policy.items():
        found = [name for name in answers if name in names and _refers_to(used, name)]
        if found and check_id in checks:
            check = checks[check_id]
            check.status, check.score = STATUS_FAILED, 0
            check.message = f"used the reference implementation {found[0]} (the lab's policy gives zero for it)"
            notes.append(f"{check_id}: your code uses {found[0]}, the library's answer to this task")
    return notes


def _names_used(source: str) -> set[str]:
    """Dotted names the code imports or touches: ``llmsys.core.model.RMSNorm``, ``model.RMSNorm``, ``RMSNorm``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            used |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            used |= {alias.name for alias in node.names}
        elif isinstance(node, (ast.Attribute, ast.Name)):
            used.add(ast.unparse(node))
    return used


def _refers_to(used: set[str], answer: str) -> bool:
    """Whether the code imports ``answer`` or names it by a tail of its dotted path after importing llmsys."""
    if answer in used:
        return True
    imports_library = any(name == "llmsys" or name.startswith("llmsys.") for name in used)
    parts = answer.split(".")
    tails = {".".join(parts[i:]) for i in range(1, len(parts))}
    return imports_library and any(name in tails or name.endswith("." + parts[-1]) for name in used)


def library_without_answers(names: list[str], into: Path) -> Path:
    """``into`` holding a copy of ``llmsys`` (and its kernels) whose ``names`` raise when called; for PYTHONPATH."""
    import llmsys
    import llmsys.kernels

    package = Path(llmsys.__file__).resolve().parent
    shutil.copytree(package, into / "llmsys")  # modification times kept: the compiled caches stay valid
    kernels = Path(llmsys.kernels.__path__[0]).resolve()
    if package not in kernels.parents:
        shutil.copytree(kernels, into / "kernels")
    edits: dict[Path, list[tuple[tuple[str, ...], str]]] = {}
    for name in names:
        source_file, qualname = _definition(name)
        edits.setdefault(into / "llmsys" / source_file.relative_to(package), []).append((tuple(qualname.split(".")), name))
    for path, qualnames in edits.items():
        path.write_text(_without(path.read_text(encoding="utf-8"), qualnames), encoding="utf-8")
        py_compile.compile(str(path), cfile=importlib.util.cache_from_source(str(path)), doraise=True)
    return into


def _definition(name: str) -> tuple[Path, str]:
    """The file and qualified name where ``name`` (``llmsys.module.function``) is defined."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    for attribute in parts[cut:]:
        target = getattr(target, attribute)
    target = inspect.unwrap(target)
    return Path(inspect.getsourcefile(target)).resolve(), target.__qualname__


def _without(source: str, qualnames: list[tuple[tuple[str, ...], str]]) -> str:
    """The module's source with each named function's body (each method, for a class) replaced by a raise."""
    tree, lines = ast.parse(source), source.splitlines(keepends=True)
    bodies = []
    for qualname, name in qualnames:
        node = _find(tree.body, qualname)
        functions = [node] if not isinstance(node, ast.ClassDef) else \
            [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if any(f.body[0].lineno == f.lineno for f in functions):
            raise LookupError(f"{'.'.join(qualname)} has a body on its def line; put it on lines of its own")
        bodies += [(f.body[0].lineno, f.body[-1].end_lineno, f.body[0].col_offset, name) for f in functions]
        if isinstance(node, ast.ClassDef) and not any(f.name == "__init__" for f in functions):
            bodies.append((node.body[0].lineno, node.body[0].lineno - 1, node.body[0].col_offset, name))
    unique = {(first, last): (first, last, indent, name) for first, last, indent, name in bodies}  # declared twice
    for first, last, indent, name in sorted(unique.values(), reverse=True):
        stub = f"raise NotImplementedError({f'{UNAVAILABLE} ({name})'!r})\n"
        if last < first:  # a class without __init__: one that raises, before its first statement
            stub = " " * indent + "def __init__(self, *args, **kwargs):\n" + " " * (indent + 4) + stub
        else:
            stub = " " * indent + stub
        lines[first - 1:last] = [stub]
    return "".join(lines)


def _find(body: list[ast.stmt], qualname: tuple[str, ...]) -> ast.AST:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == qualname[0]:
            return node if len(qualname) == 1 else _find(node.body, qualname[1:])
    raise LookupError(f"no definition of {'.'.join(qualname)}")
