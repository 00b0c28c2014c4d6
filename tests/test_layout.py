"""The tree shows the architecture: imports flow one way, core <- chapters <- course.

The shared core (``llmsys.core``) never imports a chapter package or the course machinery;
chapter packages never import the course machinery; ``kernels/`` imports only the standard
library, torch and triton; and no chain of imports comes back to where it started (imports
only a type checker reads are left out). Every module also imports on its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "llmsys"
LAYERS = {"core": 0, "kernels": 0, "course": 2, "__main__": 3}  # every other package: a chapter, layer 1
NOT_IMPORTABLE_ALONE = {"llmsys.course.classroom.hub_config_template"}  # JupyterHub runs it, with its own globals


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_imports(tree: ast.AST):
    """Import nodes, without those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the llmsys modules it imports (at the top or inside a function)."""

    def owner(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in found.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
                base = ".".join(filter(None, [base, node.module]))
                # `from pkg import sub` imports pkg.sub when sub is a module, else a name of pkg
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in found else base for a in node.names]
            for name in names:
                target = owner(name) if name.startswith("llmsys") else None
                ancestors = {".".join(module.split(".")[:i]) for i in range(1, len(module.split(".")))}
                if target and target != module and target not in ancestors:
                    targets.add(target)
        graph[module] = targets
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    return 0 if len(parts) == 1 else LAYERS.get(parts[1], 1)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_imports_flow_one_way_without_cycles():
    graph = import_graph(modules())
    upward = [f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer(t) > layer(m)]
    assert not upward, "core <- chapters <- course: these import a layer above them:\n" + "\n".join(upward)
    assert not cycles(graph), "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles(graph))


def test_the_checks_see_a_cycle_and_an_upward_import():
    graph = {"llmsys.core.a": {"llmsys.lora"}, "llmsys.lora": {"llmsys.core.a"}}
    assert [f"{m} -> {t}" for m, ts in graph.items() for t in ts if layer(t) > layer(m)] == ["llmsys.core.a -> llmsys.lora"]
    assert cycles(graph) == [["llmsys.core.a", "llmsys.lora", "llmsys.core.a"]]
    found = modules()
    assert {"llmsys.core.zoo", "llmsys.core.cache", "llmsys.course.catalog"} <= set(found)
    graph = import_graph(found)
    assert "llmsys.core.cache" in graph["llmsys.core.zoo"] and "llmsys.specdec.chat" in graph["llmsys.course.catalog"]


def test_kernels_import_only_torch_triton_and_the_standard_library():
    allowed = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)
    for path in sorted((REPO / "kernels").glob("*.py")):
        for node in _runtime_imports(ast.parse(path.read_text())):
            roots = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else \
                [] if node.level else [node.module.split(".")[0]]
            assert set(roots) <= allowed, (path.name, roots)


def test_every_module_imports_on_its_own():
    """Each module imported first, with no other llmsys module loaded before it (torch and other
    libraries stay loaded, so this takes seconds): an import that works only after something
    else was imported (a hidden order dependency, a cycle) fails here."""
    names = [m for m in modules() if m not in NOT_IMPORTABLE_ALONE]
    script = ("import importlib, sys, traceback\n"
              "failed = []\n"
              "for name in sys.argv[1:]:\n"
              "    for loaded in [m for m in sys.modules if m == 'llmsys' or m.startswith('llmsys.')]:\n"
              "        del sys.modules[loaded]\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except Exception as e:\n"
              "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
              "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    done = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
