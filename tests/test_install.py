"""The learner's install runs everything: every package a chapter, a lab or the library imports
comes with `pip install -e .` (the README's first command), not only with the test extra.

Imports are read from the code (notebooks' cells and the library's modules, imports inside
functions included), mapped to the distributions that provide them, and looked up in the
closure of llmsys's default requirements. An import guarded by `except ImportError` is
optional by construction and left out."""

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import nbformat
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIRS = ["notebooks", "solutions", "solutions/chapters", "labs"]
OPTIONAL_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception"}


def guarded(node, parents) -> bool:
    """The import sits in a `try` whose handlers catch a failed import."""
    while node in parents:
        node, child = parents[node], node
        if isinstance(node, ast.Try) and child in node.body:
            for handler in node.handlers:
                names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
                if handler.type is None or any(getattr(n, "id", None) in OPTIONAL_ERRORS for n in names):
                    return True
    return False


def imported_modules(source: str) -> set[str]:
    """Top-level names of the absolute imports in ``source`` that are not optional."""
    source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if not guarded(node, parents):
            found |= {name.split(".")[0] for name in names}
    return found


def code_imports() -> dict[str, set[str]]:
    """{top-level module: where it is imported} over notebooks and the library."""
    where: dict[str, set[str]] = {}
    sources = [(path, path.read_text()) for folder in ("llmsys", "kernels") for path in sorted((ROOT / folder).rglob("*.py"))]
    for folder in NOTEBOOK_DIRS:
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            cells = nbformat.read(path, as_version=4).cells
            sources += [(path, cell.source) for cell in cells if cell.cell_type == "code"]
    for path, text in sources:
        for module in imported_modules(text):
            where.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    return where


def default_closure() -> set[str]:
    """Normalized names of llmsys and every distribution its default requirements pull in."""
    seen, todo = set(), ["llmsys"]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def test_every_import_of_the_course_comes_with_the_default_install():
    providers = metadata.packages_distributions()
    closure = default_closure()
    missing = []
    for module, places in sorted(code_imports().items()):
        if module in sys.stdlib_module_names or module in ("llmsys", "__future__"):
            continue
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [])}
        if not dists & closure:
            missing.append(f"{module} (from {sorted(dists) or 'no installed distribution'}), imported by "
                           f"{', '.join(sorted(places)[:3])}")
    assert not missing, "not in `pip install -e .`: " + "; ".join(missing)


def test_the_check_sees_a_test_only_package():
    # hypothesis comes with the test extra only: an unguarded import of it must be reported
    assert "hypothesis" in imported_modules("import hypothesis\n")
    assert not imported_modules("try:\n    import hypothesis\nexcept ImportError:\n    hypothesis = None\n")
    assert "hypothesis" not in {re.sub(r"[-_.]+", "-", d).lower() for d in default_closure()}
