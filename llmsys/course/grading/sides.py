"""Which values of a graded cell are the student's, and which are expected values the kernel never computes.

A graded check compares the student's value (first: the left side of a
comparison, the first argument of ``assert_close``) with an expected value
(second). The expected value is taken from the solution's run of the same
cell on the same inputs, and the student's kernel never computes it: the
statements that only feed it are left out of the cell the kernel runs. So a
kernel that copies "the expected operand over the actual one" finds nothing
to copy.

An expected-side operand stays the student's (a relation between two of the
student's values, judged on both) when it may hold a value the student's code
produced. The analysis is a small, conservative data flow over the cell:

- *student* names: anything the cell reads that it did not assign, unless the
  lab's own setup binds it to a module, a constant or a function that calls
  only such names (``trusted_names``); and whatever is computed from them;
- *touched* names: passed to, or called on, the student's code, which may
  change them in place (``adamw_step(theta, ...)``): an expected-side operand
  that is such a name itself stays the student's.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field

SAFE_BUILTINS = {name for name in dir(builtins) if not name.startswith("_")} - {
    "exec", "eval", "compile", "globals", "locals", "vars", "open", "input", "breakpoint", "help", "exit", "quit",
    "__import__", "getattr", "setattr", "delattr"}
RANDOM_WORDS = ("rand", "normal", "uniform", "bernoulli", "multinomial", "shuffle", "sample", "choice", "seed",
                "dropout", "generator")  # a left-out statement must not move a random stream the kernel uses


def free_names(node: ast.AST) -> set[str]:
    """Names an expression or statement reads, without those bound inside it (comprehensions, lambdas)."""
    bound = set()
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension):
            bound |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
        elif isinstance(n, ast.Lambda):
            bound |= {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
        elif isinstance(n, ast.NamedExpr):
            bound.add(n.target.id)
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def stored_names(targets) -> set[str]:
    names = set()
    for target in targets:
        for n in ast.walk(target):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
        root = root_name(target)
        if root is not None:
            names.add(root)
    return names


def setup_statements(setup_sources: list[str]):
    """The top-level statements of the setup cells that parse, in cell order."""
    for source in setup_sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        yield from tree.body


def trusted_names(setup_sources: list[str]) -> set[str]:
    """Names the lab's setup binds to modules, constants or functions of those alone (in cell order)."""
    trusted: set[str] = set()
    for node in setup_statements(setup_sources):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            trusted |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Assign) and free_names(node.value) <= trusted | SAFE_BUILTINS:
            trusted |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef):
            local = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
            local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            pure = free_names(node) - local <= trusted | SAFE_BUILTINS | {node.name}
            defaults = set().union(*map(free_names, node.args.defaults + node.decorator_list)) if (
                node.args.defaults or node.decorator_list) else set()
            if pure and defaults <= trusted | SAFE_BUILTINS:
                trusted.add(node.name)
            else:
                trusted.discard(node.name)
        else:  # anything else the setup binds may hold the student's values
            for n in ast.walk(node):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    trusted.discard(n.id)
            if isinstance(node, (ast.ClassDef, ast.AsyncFunctionDef)):
                trusted.discard(node.name)
    return trusted


def imported_names(setup_sources: list[str]) -> dict[str, str]:
    """Name -> the dotted module or object the lab's setup imports as it (``tasks`` -> ``llmsys.course.tasks``)."""
    names: dict[str, str] = {}
    for node in setup_statements(setup_sources):
        if isinstance(node, ast.Import):
            names.update({a.asname: a.name for a in node.names if a.asname})
            names.update({a.name.split(".")[0]: a.name.split(".")[0] for a in node.names if not a.asname})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names if a.name != "*"})
    return names


@dataclass
class Flow:
    """The data flow of one cell: what is the student's where, and which statements the kernel may skip."""

    trusted: set[str]
    student: set[str] = field(default_factory=set)  # assigned from the student's values
    touched: set[str] = field(default_factory=set)  # handed to the student's code
    assigned: set[str] = field(default_factory=set)

    def copy(self) -> "Flow":
        return Flow(self.trusted, set(self.student), set(self.touched), set(self.assigned))

    def join(self, other: "Flow") -> "Flow":
        """After two paths: what either made the student's is the student's."""
        return Flow(self.trusted, self.student | other.student, self.touched | other.touched,
                    self.assigned | other.assigned)

    def is_students(self, node: ast.AST) -> bool:
        for name in free_names(node):
            if name in self.student or (name not in self.assigned and name not in self.trusted | SAFE_BUILTINS):
                return True
        return False

    def expected_side_is_trusted(self, node: ast.AST) -> bool:
        """An expected-side operand the solution's run computes as the student's would, were it right."""
        if isinstance(node, ast.Constant):
            return False
        return not self.is_students(node) and root_name(node) not in self.touched

    def statement(self, node: ast.stmt) -> None:
        """Follow one simple statement (assignments; calls that may change their arguments)."""
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if self.is_students(call):
                for arg in [call.func, *call.args, *(k.value for k in call.keywords)]:
                    self.touched |= {n for n in free_names(arg) if n in self.assigned}
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value_is_students = node.value is not None and self.is_students(node.value)
            if isinstance(node, ast.AugAssign):
                value_is_students = value_is_students or self.is_students(ast.Name(root_name(node.target) or "_", ast.Load()))
            for target in targets:
                plain = isinstance(target, (ast.Name, ast.Tuple, ast.List))
                for name in stored_names([target]):
                    if value_is_students:
                        self.student.add(name)
                    elif plain and isinstance(target, ast.Name):
                        self.student.discard(name)
                        self.touched.discard(name)
                    self.assigned.add(name)
        elif isinstance(node, ast.Expr):
            root = root_name(node.value.func) if isinstance(node.value, ast.Call) else None
            if root in self.assigned and self.is_students(node.value):  # a method of the cell's own object
                self.student.add(root)

    def loop_target(self, target: ast.expr, iterable: ast.expr) -> None:
        for name in stored_names([target]):
            (self.student.add if self.is_students(iterable) else self.student.discard)(name)
            self.assigned.add(name)


def is_random(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if any(word in name.lower() for word in RANDOM_WORDS):
                return True
    return False


def read_before_assigned(source: str) -> set[str]:
    """Names a cell reads that it never assigns itself: what it needs from the cells above."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    assigned |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    return free_names(tree) - assigned
