"""Checks the student's process cannot forge: its values come out as data, the grader judges them.

A graded cell is an ordinary cell of asserts. Before it runs, the grader
rewrites it (``instrument``):

- every ``assert TEST`` sends the values of TEST's operands (the two sides of a
  comparison, the arguments of ``torch.equal``/``allclose``/``math.isclose``,
  the object of ``isinstance``, any other expression whole) as plain data;
- every ``...assert_close(actual, expected, ...)`` sends both tensors;
- every seed (``manual_seed(n)``, ``random.Random(n)``) becomes a seed drawn
  for this grading, so the inputs are new each time;
- ``solution_run(x)`` on one side of a comparison, inside ``+ - * /``
  arithmetic with constants, sends ``x``; the grader puts in its place the
  value ``x`` had in the solution's run in the same grading. A measured
  outcome is then graded against the reference's measurement on the same
  machine, as a ratio (``assert tokens_per_s >= 0.5 * solution_run(tokens_per_s)``),
  never against a number written down on another machine. In a student's own
  kernel ``solution_run`` returns its argument: there the check compares a run
  with itself.

The kernel still runs the asserts (students see the same messages), but its
verdict is ignored. Records travel as JSON display data; tensors and arrays as
``.npy`` bytes; nothing the kernel sends can execute code in the grader, which
judges them itself (``judge.py``), so a patched ``assert_close``, a silenced
traceback or an ``int`` whose ``==`` is always true changes nothing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

PROBE_MIME = "application/vnd.llmsys.probe+json"
PROBE = "__llmsys_probe__"
CLOSE_CALLS = {"assert_close", "allclose", "isclose", "equal"}  # comparisons whose expected side is checked twice
SEED_CALLS = {"manual_seed", "seed", "Random", "default_rng", "RandomState"}
SOLUTION_RUN = "solution_run"  # the value of its argument in the solution's run of this grading
ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div)


def solution_run(value):
    """In a graded check, the value ``value`` had in the solution's run; outside the grader, ``value`` itself."""
    return value

# Runs in the kernel before the lab's cells. Only encodes and sends data; the grader trusts none of it.
KERNEL_SIDE = r'''
class __LlmsysProbe:
    def __init__(self, salt):
        self.salt, self.cell, self.pending, self.batch = salt, None, {}, []
    def seed(self, n):
        return (int(n) * 1000003 + self.salt) % 2**31
    def begin(self, cell):
        self.cell, self.pending, self.batch = cell, {}, []
        self._send({"cell": cell, "event": "begin"})
    def end(self, cell):
        self._send({"cell": cell, "event": "end"})
    def v(self, k, j, value):
        self.pending.setdefault(k, {})[str(j)] = self._encode(value)
        return value
    def last(self, k, j, value):  # the arguments of an assert_close, sent before it runs (and may raise)
        self.v(k, j, value)
        self.probe(k, result=False)
        return value
    def probe(self, k, result=True):
        self.batch.append({"k": k, "values": self.pending.pop(k, {})})
        if not result or len(self.batch) >= 200:  # an assert about to fail sends what came before it
            self._flush()
        return result
    def _flush(self):
        if self.batch:
            batch, self.batch = self.batch, []
            self._publish({"cell": self.cell, "event": "asserts", "asserts": batch})
    def _send(self, record):
        self._flush()
        self._publish(record)
    def _publish(self, record):
        from IPython.display import publish_display_data
        publish_display_data({"application/vnd.llmsys.probe+json": record})
    def _encode(self, value, depth=0):
        import base64, io
        import numpy as np
        if depth > 8:
            return {"opaque": "too deep"}
        if value is None or type(value) in (bool, str):
            return value
        if type(value) is int:
            return {"int": str(value)}
        if type(value) is float:
            return {"float": repr(value)}
        if type(value) in (list, tuple, set, frozenset):
            kind = "set" if type(value) is frozenset else type(value).__name__
            return {kind: [self._encode(x, depth + 1) for x in value]}
        if type(value) is dict:
            return {"dict": [[self._encode(k, depth + 1), self._encode(x, depth + 1)] for k, x in value.items()]}
        try:
            import torch
            if isinstance(value, torch.Tensor):
                t = value.detach().cpu()
                dtype = str(t.dtype).replace("torch.", "")
                t = t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
                buf = io.BytesIO(); np.save(buf, t.numpy(), allow_pickle=False)
                return {"tensor": base64.b64encode(buf.getvalue()).decode(), "dtype": dtype,
                        "parameter": isinstance(value, torch.nn.Parameter)}
            if isinstance(value, (torch.Size,)):
                return {"tuple": [self._encode(int(x)) for x in value]}
            if isinstance(value, (torch.dtype, torch.device)):
                return {"name": str(value)}
        except ImportError:
            pass
        if isinstance(value, np.ndarray) and value.dtype != object:
            buf = io.BytesIO(); np.save(buf, value, allow_pickle=False)
            return {"array": base64.b64encode(buf.getvalue()).decode()}
        if isinstance(value, np.generic):
            return self._encode(value.item(), depth)
        return {"opaque": type(value).__name__}
__llmsys_probe__ = __LlmsysProbe({salt})
del __LlmsysProbe
try:  # imported here, under the grader's startup limit, so no student cell pays for it
    import numpy as __llmsys_numpy, torch as __llmsys_torch
except ImportError:
    pass
'''


def kernel_setup(salt: int) -> str:
    return KERNEL_SIDE.replace("{salt}", str(int(salt)))


# ---------------------------------------------------------------- rewriting


@dataclass
class AssertSpec:
    """What the grader needs to judge one assert: its test, or a close-call and its tolerances."""

    test: ast.expr | None = None  # for assert statements, with operands replaced by Name("_v<j>")
    close: str | None = None  # for assert_close-like calls: the function's name
    tolerances: dict = field(default_factory=dict)
    line: int = 0


class _Rewriter(ast.NodeTransformer):
    def __init__(self):
        self.specs: list[AssertSpec] = []

    def visit_Call(self, node):  # seeds, inside any expression
        self.generic_visit(node)
        name = call_name(node)
        if name in SEED_CALLS and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int):
            node.args[0] = _probe_call("seed", [node.args[0]])
        return node

    def visit_Assert(self, node):
        self.generic_visit(node)
        k = len(self.specs)
        spec = AssertSpec(line=node.lineno)
        self.specs.append(spec)
        counter = [0]
        spec.test = _operands(node.test, k, counter, recorded := [])
        node.test = _probe_call("probe", [ast.Constant(k), _wrapped(node.test, k, recorded)])
        return node

    def visit_Expr(self, node):
        self.generic_visit(node)
        call = node.value
        if isinstance(call, ast.Call) and call_name(call) == "assert_close" and len(call.args) >= 2:
            k = len(self.specs)
            self.specs.append(AssertSpec(close="assert_close", tolerances=constant_kwargs(call), line=node.lineno))
            # both arguments are sent before the kernel's own assert_close runs (and perhaps raises)
            call.args[0] = _probe_call("v", [ast.Constant(k), ast.Constant(0), call.args[0]])
            call.args[1] = _probe_call("last", [ast.Constant(k), ast.Constant(1), call.args[1]])
        return node


def call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _probe_call(method: str, args: list[ast.expr]) -> ast.Call:
    return ast.Call(ast.Attribute(ast.Name(PROBE, ast.Load()), method, ast.Load()), args, [])


def constant_kwargs(call: ast.Call) -> dict:
    return {kw.arg: kw.value.value for kw in call.keywords
            if kw.arg and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, (int, float, bool))}


def _operands(test: ast.expr, k: int, counter: list[int], recorded: list) -> ast.expr:
    """A copy of the test where each operand is ``_v<j>``; ``recorded`` gets (j, original node)."""
    def leaf(node):
        j = counter[0]
        counter[0] += 1
        recorded.append((j, node))
        return ast.Name(f"_v{j}", ast.Load())

    def walk(node):
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [walk(v) for v in node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ast.UnaryOp(node.op, walk(node.operand))
        if isinstance(node, ast.Compare):
            return ast.Compare(walk_side(node.left), node.ops, [walk_side(c) for c in node.comparators])
        if isinstance(node, ast.Call) and call_name(node) in CLOSE_CALLS and len(node.args) >= 2:
            return ast.Call(node.func, [leaf(a) for a in node.args[:2]], node.keywords)
        if isinstance(node, ast.Call) and call_name(node) == "isinstance" and len(node.args) == 2:
            return ast.Call(node.func, [leaf(node.args[0]), node.args[1]], [])
        return leaf(node)

    def walk_side(node):
        if isinstance(node, ast.Constant):
            return node
        return arithmetic(node) if _mentions_solution_run(node) else leaf(node)

    def arithmetic(node):  # constants, + - * / and solution_run(<operand>): evaluated by the grader
        if isinstance(node, ast.BinOp) and isinstance(node.op, ARITHMETIC):
            return ast.BinOp(arithmetic(node.left), node.op, arithmetic(node.right))
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node
        if isinstance(node, ast.Call) and call_name(node) == SOLUTION_RUN and len(node.args) == 1 and not node.keywords:
            return ast.Call(ast.Name(SOLUTION_RUN, ast.Load()), [leaf(node.args[0])], [])
        return leaf(node)

    judged = walk(test)
    for _, node in recorded:
        if _mentions_solution_run(node):  # the kernel would compute it: the reference's value would be lost
            raise ValueError(f"line {test.lineno}: {SOLUTION_RUN}(x) must stand alone on one side of a comparison "
                              f"or inside + - * / with constants, as in `assert y >= 0.5 * {SOLUTION_RUN}(y)`")
    return judged


def _mentions_solution_run(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and call_name(n) == SOLUTION_RUN for n in ast.walk(node))


def _wrapped(test: ast.expr, k: int, recorded: list) -> ast.expr:
    """The original test with each recorded operand wrapped in ``probe.v(k, j, ...)`` (same evaluation order)."""
    wrap = {id(node): j for j, node in recorded}

    class Wrap(ast.NodeTransformer):
        def visit(self, node):
            if id(node) in wrap:
                return _probe_call("v", [ast.Constant(k), ast.Constant(wrap[id(node)]), node])
            return super().visit(node)

    return Wrap().visit(test)


def instrument(source: str, cell_name: str) -> tuple[str, list[AssertSpec]]:
    """The graded cell as the kernel runs it, and what the grader judges it by."""
    tree = ast.parse(source)
    rewriter = _Rewriter()
    tree = rewriter.visit(tree)
    begin = ast.parse(f"{PROBE}.begin({cell_name!r})").body
    end = ast.parse(f"{PROBE}.end({cell_name!r})").body
    tree.body = begin + tree.body + end
    ast.fix_missing_locations(tree)
    return ast.unparse(tree), rewriter.specs
