"""Checks the student's process cannot forge: it sends its own values as data, the grader judges them.

A graded cell is an ordinary cell of asserts. The grader rewrites it twice
(``instrument``), with the same numbering of asserts and operands:

- for the **solution's run**, every operand of every assert (the two sides of
  a comparison, the arguments of ``torch.equal``/``allclose``/``math.isclose``,
  the object of ``isinstance``, any other expression whole) and both tensors
  of every ``assert_close`` are sent as plain data, and the asserts run;
- for a **student's run**, only the student's operands are sent (the first
  side of a comparison or ``assert_close``, or an expected side computed from
  the student's values: ``sides.py``); the expected operands, the messages and
  the statements that only feed them are left out, so the student's kernel
  never holds an expected value. Each operand is evaluated on its own (an
  error is sent as data), and the grader evaluates the asserts: the kernel
  runs none of them.

In both, every seed (``manual_seed(n)``, ``random.Random(n)``) becomes a seed
drawn for this grading, so the inputs are new each time. ``solution_run(x)``
on one side of a comparison, inside ``+ - * /`` arithmetic with constants, is
the value ``x`` had in the solution's run in the same grading: a measured
outcome is graded as a ratio to the reference's measurement on the same
machine (``assert tokens_per_s >= 0.5 * solution_run(tokens_per_s)``). In a
student's own kernel ``solution_run`` returns its argument.

``x = measure(task, choice, *inputs)`` (``measurements.py``) runs in neither
kernel: both send its arguments, the grader measures the choice in a clean
process of its own, and ``x`` is that measurement wherever it stands as a whole
operand of an assert (it may stand nowhere else). The asserts that judge a
measurement run in no kernel, the solution's included: the grader evaluates them.

The kernel sends values through ``encoder.py``; nothing it sends can execute
code in the grader, which judges it itself (``judge.py``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .sides import Flow, is_random, stored_names

PROBE_MIME = "application/vnd.llmsys.probe+json"
PROBE = "__llmsys_probe__"
CLOSE_CALLS = {"assert_close", "allclose", "isclose", "equal"}
SEED_CALLS = {"manual_seed", "seed", "Random", "default_rng", "RandomState"}
SOLUTION_RUN = "solution_run"  # the value of its argument in the solution's run of this grading
MEASURE = "measure"  # x = measure(task, choice, *inputs): x is what the grader measures (measurements.py)
ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div)


def solution_run(value):
    """In a graded check, the value ``value`` had in the solution's run; outside the grader, ``value`` itself."""
    return value


# ---------------------------------------------------------------- rewriting


@dataclass
class AssertSpec:
    """What the grader needs to judge one assert: its test, or a close-call and its tolerances."""

    test: ast.expr | None = None  # for assert statements, with operands replaced by Name("_v<j>")
    close: str | None = None  # for assert_close-like calls: the function's name
    tolerances: dict = field(default_factory=dict)
    line: int = 0
    expected: set = field(default_factory=set)  # operands taken from the solution's run only
    message: str = ""  # the assert's message as written (for the report)
    operands: dict = field(default_factory=dict)  # j -> the operand's source, to fill the message's {...}
    measured: dict = field(default_factory=dict)  # j -> (measurement site, which of its values or None)


@dataclass
class Instrumented:
    """A graded cell as the solution's kernel and as a student's kernel run it, and how to judge it."""

    reference: str
    student: str
    specs: list[AssertSpec]
    measures: list[str] = field(default_factory=list)  # per measurement site: its task, as the cell names it


def where(node: ast.AST) -> tuple | None:
    """A node's place in the cell's source: the same in every parse of it."""
    if getattr(node, "lineno", None) is None or getattr(node, "end_col_offset", None) is None:
        return None
    return (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)


def _is_assert_close(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and call_name(node.value) == "assert_close"
            and len(node.value.args) >= 2)


def analyse(tree: ast.Module, trusted: set[str]) -> tuple[set, set]:
    """Positions of the operands the solution's run may supply, and of the statements that call the student's code."""
    verdicts: dict[tuple, bool] = {}
    students: set[tuple] = set()

    def block(statements, flow: Flow) -> Flow:
        for node in statements:
            flow = statement(node, flow)
        return flow

    def statement(node, flow: Flow) -> Flow:
        if isinstance(node, ast.Assert) or _is_assert_close(node):
            for sub in ast.walk(node.test if isinstance(node, ast.Assert) else node.value):
                if isinstance(sub, ast.expr) and hasattr(sub, "lineno"):
                    verdicts[where(sub)] = verdicts.get(where(sub), True) and flow.expected_side_is_trusted(sub)
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            if not isinstance(node, ast.While):
                flow.loop_target(node.target, node.iter)
            for _ in range(2):  # twice: the second pass sees what the first one's end carries round
                flow = flow.join(block(node.body, flow.copy()))
                if not isinstance(node, ast.While):
                    flow.loop_target(node.target, node.iter)
            return block(node.orelse, flow)
        if isinstance(node, ast.If):
            return block(node.body, flow.copy()).join(block(node.orelse, flow.copy()))
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    flow.loop_target(item.optional_vars, item.context_expr)
            return block(node.body, flow)
        if isinstance(node, ast.Try):
            after = block(node.body, flow.copy())
            for handler in node.handlers:
                after = after.join(block(handler.body, flow.join(after)))
            return block(node.finalbody, block(node.orelse, after))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            block(node.body, flow.copy())
            flow.student.add(node.name)
            flow.assigned.add(node.name)
            return flow
        if any(flow.is_students(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)):
            students.add(where(node))  # runs the student's code: it stays, whatever it stores
        flow.statement(node)
        return flow

    block(tree.body, Flow(set(trusted)))
    return {pos for pos, ok in verdicts.items() if ok}, students


class _Rewriter(ast.NodeTransformer):
    def __init__(self, student: bool, trusted_operands: set, measured: dict, sites: dict):
        self.specs: list[AssertSpec] = []
        self.student, self.trusted_operands, self.measured, self.sites = student, trusted_operands, measured, sites

    def visit_Assign(self, node):
        site = self.sites.get(where(node.value))
        self.generic_visit(node)
        if site is not None:  # sent, and measured by the grader
            names = len(node.targets[0].elts) if isinstance(node.targets[0], ast.Tuple) else 1
            args = ast.List(node.value.args[1:], ast.Load())
            node.value = _probe_call("measure", [ast.Constant(site), args, ast.Constant(names)])
        return node

    def visit_Call(self, node):  # seeds, inside any expression
        self.generic_visit(node)
        name = call_name(node)
        if name in SEED_CALLS and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int):
            node.args[0] = _probe_call("seed", [node.args[0]])
        return node

    def visit_Assert(self, node):
        self.generic_visit(node)
        k = len(self.specs)
        spec = AssertSpec(line=node.lineno, message=message_text(node.msg))
        self.specs.append(spec)
        recorded = []
        spec.test = _operands(node.test, [0], recorded, self.trusted_operands)
        spec.expected = {j for j, _, expected in recorded if expected}
        spec.operands = {j: ast.unparse(operand) for j, operand, _ in recorded}
        spec.measured = {j: self.measured[operand.id] for j, operand, _ in recorded
                         if isinstance(operand, ast.Name) and operand.id in self.measured}
        if self.student:
            return ast.Expr(_send_operands(k, recorded))
        if spec.measured:  # the kernel holds no measurement: the grader evaluates this assert
            return ast.Expr(_send_operands(k, recorded, everything=True))
        node.test = _probe_call("probe", [ast.Constant(k), _wrapped(node.test, k, recorded)])
        return node

    def visit_Expr(self, node):
        self.generic_visit(node)
        if not _is_assert_close(node):
            return node
        call, k = node.value, len(self.specs)
        msg = next((kw.value for kw in call.keywords if kw.arg == "msg"), None)
        spec = AssertSpec(close="assert_close", tolerances=constant_kwargs(call), line=node.lineno,
                          message=message_text(msg.body if isinstance(msg, ast.Lambda) else msg))
        self.specs.append(spec)
        expected = where(call.args[1]) in self.trusted_operands
        spec.expected = {1} if expected else set()
        spec.operands = {0: ast.unparse(call.args[0]), 1: ast.unparse(call.args[1])}
        if self.student:
            return ast.Expr(_send_operands(k, [(0, call.args[0], False), (1, call.args[1], expected)]))
        # both arguments are sent before the kernel's own assert_close runs (and perhaps raises)
        call.args[0] = _probe_call("v", [ast.Constant(k), ast.Constant(0), call.args[0]])
        call.args[1] = _probe_call("last", [ast.Constant(k), ast.Constant(1), call.args[1]])
        return node


def message_text(msg: ast.expr | None) -> str:
    """An assert's message as its author wrote it: literal text, with each ``{expression}`` as source."""
    if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
        return msg.value
    if isinstance(msg, ast.JoinedStr):
        return "".join(p.value if isinstance(p, ast.Constant) else "{" + ast.unparse(p.value) + "}" for p in msg.values)
    if isinstance(msg, ast.BinOp):
        return message_text(msg.left) + message_text(msg.right)
    return ""


def _send_operands(k: int, recorded: list, everything: bool = False) -> ast.Call:
    """``probe.operands(k, [(j, lambda: operand), ...])`` for the student's operands (or ``everything``)."""
    no_args = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    pairs = [ast.Tuple([ast.Constant(j), ast.Lambda(no_args, node)], ast.Load()) for j, node, expected in recorded
             if everything or not expected]
    return _probe_call("operands", [ast.Constant(k), ast.List(pairs, ast.Load())])


def call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _probe_call(method: str, args: list[ast.expr]) -> ast.Call:
    return ast.Call(ast.Attribute(ast.Name(PROBE, ast.Load()), method, ast.Load()), args, [])


def constant_kwargs(call: ast.Call) -> dict:
    return {kw.arg: kw.value.value for kw in call.keywords
            if kw.arg and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, (int, float, bool))}


def _operands(test: ast.expr, counter: list[int], recorded: list, trusted_operands: set) -> ast.expr:
    """A copy of the test where each operand is ``_v<j>``; ``recorded`` gets (j, node, from the solution's run)."""
    def leaf(node, side="student"):
        j = counter[0]
        counter[0] += 1
        expected = side == "reference" or (side == "expected" and where(node) in trusted_operands)
        recorded.append((j, node, expected))
        return ast.Name(f"_v{j}", ast.Load())

    def walk(node):
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [walk(v) for v in node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ast.UnaryOp(node.op, walk(node.operand))
        if isinstance(node, ast.Compare):
            return ast.Compare(walk_side(node.left, "student"), node.ops, [walk_side(c, "expected") for c in node.comparators])
        if isinstance(node, ast.Call) and call_name(node) in CLOSE_CALLS and len(node.args) >= 2:
            return ast.Call(node.func, [leaf(node.args[0]), leaf(node.args[1], "expected")], node.keywords)
        if isinstance(node, ast.Call) and call_name(node) == "isinstance" and len(node.args) == 2:
            return ast.Call(node.func, [leaf(node.args[0]), node.args[1]], [])
        return leaf(node)

    def walk_side(node, side):
        if _is_literal(node):  # written in the check: the grader reads it from there
            return node
        return arithmetic(node, side) if _mentions_solution_run(node) else leaf(node, side)

    def arithmetic(node, side):  # constants, + - * / and solution_run(<operand>): evaluated by the grader
        if isinstance(node, ast.BinOp) and isinstance(node.op, ARITHMETIC):
            return ast.BinOp(arithmetic(node.left, side), node.op, arithmetic(node.right, side))
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node
        if isinstance(node, ast.Call) and call_name(node) == SOLUTION_RUN and len(node.args) == 1 and not node.keywords:
            return ast.Call(ast.Name(SOLUTION_RUN, ast.Load()), [leaf(node.args[0], "reference")], [])
        return leaf(node, side)

    judged = walk(test)
    for _, node, _ in recorded:
        if _mentions_solution_run(node):  # the kernel would compute it: the reference's value would be lost
            raise ValueError(f"line {test.lineno}: {SOLUTION_RUN}(x) must stand alone on one side of a comparison "
                             f"or inside + - * / with constants, as in `assert y >= 0.5 * {SOLUTION_RUN}(y)`")
    return judged


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _mentions_solution_run(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and call_name(n) == SOLUTION_RUN for n in ast.walk(node))


def _wrapped(test: ast.expr, k: int, recorded: list) -> ast.expr:
    """The original test with each recorded operand wrapped in ``probe.v(k, j, ...)`` (same evaluation order)."""
    wrap = {id(node): j for j, node, _ in recorded}

    class Wrap(ast.NodeTransformer):
        def visit(self, node):
            if id(node) in wrap:
                return _probe_call("v", [ast.Constant(k), ast.Constant(wrap[id(node)]), node])
            return super().visit(node)

    return Wrap().visit(test)


def _left_out(tree: ast.Module, students: set, later: set[str]) -> None:
    """Remove the statements that only feed expected values: the student's kernel never computes them."""
    def stores(node):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and not is_random(node):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(n, (ast.Name, ast.Tuple, ast.List, ast.Starred, ast.Store)) for t in targets
                   for n in ast.walk(t)) and (node.value is not None):
                return stored_names(targets)
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and isinstance(node.value.func.value, ast.Name) and not is_random(node)):
            return {node.value.func.value.id}
        return None

    candidates = {id(n): n for n in ast.walk(tree) if isinstance(n, ast.stmt) and where(n) is not None
                  and where(n) not in students
                  and stores(n) is not None}

    def loads(node, out: set):
        if id(node) in candidates:
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            out.add(node.id)
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        for child in ast.iter_child_nodes(node):
            loads(child, out)

    while True:
        needed = set(later)
        loads(tree, needed)
        kept = [key for key, node in candidates.items() if stores(node) & needed]
        if not kept:
            break
        for key in kept:
            del candidates[key]

    class Drop(ast.NodeTransformer):
        def generic_visit(self, node):
            super().generic_visit(node)
            for name in ("body", "orelse", "finalbody"):
                body = getattr(node, name, None)
                if isinstance(body, list) and body and all(isinstance(s, ast.stmt) for s in body):
                    body[:] = [s for s in body if id(s) not in candidates] or [ast.Pass()]
            return node

    Drop().visit(tree)


def instrument(source: str, cell_name: str, trusted: set[str] = frozenset(), later: set[str] = frozenset()) -> Instrumented:
    """The graded cell as the solution's and a student's kernel run it, and what the grader judges it by.

    ``trusted``: names the lab's setup binds to modules, constants and pure
    helpers (``sides.trusted_names``); ``later``: names later cells read.
    """
    trusted_operands, students = analyse(ast.parse(source), trusted)
    tasks, measured, sites = measurement_sites(ast.parse(source))
    out = []
    for student in (False, True):
        tree = ast.parse(source)
        rewriter = _Rewriter(student, trusted_operands, measured, sites)
        tree = rewriter.visit(tree)
        if student:
            _left_out(tree, students, later)
        begin = ast.parse(f"{PROBE}.begin({cell_name!r})").body
        end = ast.parse(f"{PROBE}.end({cell_name!r})").body
        tree.body = begin + tree.body + end
        ast.fix_missing_locations(tree)
        out.append((ast.unparse(tree), rewriter.specs))
    return Instrumented(out[0][0], out[1][0], out[0][1], tasks)


def measurement_sites(tree: ast.Module) -> tuple[list[str], dict, dict]:
    """Each ``x = measure(task, choice, ...)``'s task (in source order), the names it binds -> (site, which
    value or None), and the site of each call by its place in the source.

    A measured name exists only in the grader, so it may stand only as a whole
    operand of an assert (a comparison's side, ``solution_run``'s argument):
    anything else is refused here, when the lab is loaded.
    """
    tasks, measured, sites, bound = [], {}, {}, set()
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and call_name(n) == MEASURE), key=where)
    for node in calls:
        statement = next((s for s in ast.walk(tree) if isinstance(s, ast.Assign) and s.value is node), None)
        target = statement.targets[0] if statement is not None and len(statement.targets) == 1 else None
        names = target.elts if isinstance(target, ast.Tuple) else [target]
        if target is None or not all(isinstance(n, ast.Name) for n in names) or len(node.args) < 2 or node.keywords:
            raise ValueError(f"line {node.lineno}: write a measurement as `x = {MEASURE}(task, choice, *inputs)` "
                             "or `a, b = ...`, on a line of its own")
        for part, name in enumerate(names):
            if name.id in measured:
                raise ValueError(f"line {node.lineno}: {name.id!r} is measured twice; give each measurement a name")
            measured[name.id] = (len(tasks), part if isinstance(target, ast.Tuple) else None)
            bound.add(id(name))
        sites[where(node)] = len(tasks)
        tasks.append(ast.unparse(node.args[0]))
    allowed = set(bound)  # where a measured name may appear: its binding, an assert's operand or message
    for node in (n for n in ast.walk(tree) if isinstance(n, ast.Assert)):
        recorded: list = []
        _operands(node.test, [0], recorded, set())
        allowed |= {id(operand) for _, operand, _ in recorded if isinstance(operand, ast.Name)}
        allowed |= {id(n) for n in ast.walk(node.msg)} if node.msg is not None else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in measured and id(node) not in allowed:
            raise ValueError(f"line {node.lineno}: {node.id!r} is measured by the grader: use it only as a whole "
                             f"operand of an assert (`assert {node.id} <= ...`, `solution_run({node.id})`)")
    return tasks, measured, sites
