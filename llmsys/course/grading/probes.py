"""Checks the student's process cannot forge: its values come out as data, the grader judges them.

A graded cell is an ordinary cell of asserts. Before it runs, the grader
rewrites it (``instrument``):

- every ``assert TEST`` sends the values of TEST's operands (the two sides of a
  comparison, the arguments of ``torch.equal``/``allclose``/``math.isclose``,
  the object of ``isinstance``, any other expression whole) as plain data;
- every ``...assert_close(actual, expected, ...)`` sends both tensors;
- every seed (``manual_seed(n)``, ``random.Random(n)``) becomes a seed drawn
  for this grading, so the inputs are new each time.

The kernel still runs the asserts (students see the same messages), but its
verdict is ignored. Records travel as JSON display data; tensors and arrays as
``.npy`` bytes read with ``allow_pickle=False``; nothing the kernel sends can
execute code in the grader. The grader then evaluates each assert itself
(``judge``) with its own torch and math on the decoded values, so a patched
``assert_close``, a silenced traceback or an ``int`` whose ``==`` is always
true changes nothing. For ``assert_close``/``allclose``/``isclose``/``equal``
the expected side is also taken from the solution's run on the same inputs,
so a reference patched inside the student's kernel does not help either.
A cell passes when every assert it holds reported, in the same number as in
the solution's run, and every one holds.
"""

from __future__ import annotations

import ast
import base64
import io
import math
from dataclasses import dataclass, field

PROBE_MIME = "application/vnd.llmsys.probe+json"
PROBE = "__llmsys_probe__"
CLOSE_CALLS = {"assert_close": ("rtol", "atol"), "allclose": ("rtol", "atol"), "isclose": ("rel_tol", "abs_tol"),
               "equal": ()}
SEED_CALLS = {"manual_seed", "seed", "Random", "default_rng", "RandomState"}
MAX_VALUE_BYTES = 8_000_000  # larger values are refused: a check compares small tensors

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
        name = _call_name(node)
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
        if isinstance(call, ast.Call) and _call_name(call) == "assert_close" and len(call.args) >= 2:
            k = len(self.specs)
            self.specs.append(AssertSpec(close="assert_close", tolerances=_constant_kwargs(call), line=node.lineno))
            # both arguments are sent before the kernel's own assert_close runs (and perhaps raises)
            call.args[0] = _probe_call("v", [ast.Constant(k), ast.Constant(0), call.args[0]])
            call.args[1] = _probe_call("last", [ast.Constant(k), ast.Constant(1), call.args[1]])
        return node


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _probe_call(method: str, args: list[ast.expr]) -> ast.Call:
    return ast.Call(ast.Attribute(ast.Name(PROBE, ast.Load()), method, ast.Load()), args, [])


def _constant_kwargs(call: ast.Call) -> dict:
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
        if isinstance(node, ast.Call) and _call_name(node) in CLOSE_CALLS and len(node.args) >= 2:
            return ast.Call(node.func, [leaf(a) for a in node.args[:2]], node.keywords)
        if isinstance(node, ast.Call) and _call_name(node) == "isinstance" and len(node.args) == 2:
            return ast.Call(node.func, [leaf(node.args[0]), node.args[1]], [])
        return leaf(node)

    def walk_side(node):
        return node if isinstance(node, ast.Constant) else leaf(node)

    return walk(test)


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


# ---------------------------------------------------------------- judging


class Opaque:
    """A value the kernel could not send as data (an object of the student's own)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


def decode(value):
    """Plain data back into Python values, tensors and arrays; never runs code."""
    import numpy as np
    import torch

    if value is None or type(value) in (bool, str):
        return value
    if not isinstance(value, dict) or len(value) == 0:
        raise ValueError("malformed probe value")
    if "int" in value:
        return int(value["int"])
    if "float" in value:
        return float(value["float"])
    for kind, make in (("list", list), ("tuple", tuple), ("set", lambda xs: set(map(_hashable, xs)))):
        if kind in value:
            return make([decode(x) for x in value[kind]])
    if "dict" in value:
        return {_hashable(decode(k)): decode(x) for k, x in value["dict"]}
    if "tensor" in value or "array" in value:
        raw = base64.b64decode(value.get("tensor") or value.get("array"))
        if len(raw) > MAX_VALUE_BYTES:
            raise ValueError("a probed value is too large")
        array = np.load(io.BytesIO(raw), allow_pickle=False)
        if "array" in value:
            return array
        tensor = torch.from_numpy(array.copy())
        dtype = getattr(torch, str(value.get("dtype")), None)
        tensor = tensor.to(dtype) if isinstance(dtype, torch.dtype) else tensor
        return torch.nn.Parameter(tensor, requires_grad=False) if value.get("parameter") is True else tensor
    if "name" in value:
        return str(value["name"])
    if "opaque" in value:
        return Opaque(str(value["opaque"]))
    raise ValueError(f"malformed probe value with keys {sorted(value)[:5]}")


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


@dataclass
class CellRecords:
    """What one graded cell sent: whether it began and ended, and each assert's values in order."""

    began: bool = False
    ended: bool = False
    asserts: dict[int, list[dict]] = field(default_factory=dict)


def collect(outputs: list, cell_name: str) -> CellRecords:
    records = CellRecords()
    for output in outputs:
        data = output.get("data", {}) if isinstance(output, dict) else {}
        record = data.get(PROBE_MIME)
        if not isinstance(record, dict) or record.get("cell") != cell_name:
            continue
        event = record.get("event")
        if event == "begin":
            records.began = True
        elif event == "end":
            records.ended = True
        elif event == "asserts" and isinstance(record.get("asserts"), list):
            for item in record["asserts"]:
                if isinstance(item, dict) and isinstance(item.get("k"), int) and isinstance(item.get("values"), dict):
                    records.asserts.setdefault(item["k"], []).append(item["values"])
    return records


def judge(specs: list[AssertSpec], mine: CellRecords, reference: CellRecords | None) -> str | None:
    """None when the cell's asserts all held on the submitted values, else why not."""
    if not mine.began:
        return "the check did not run"
    for k, spec in enumerate(specs):
        ref_runs = reference.asserts.get(k, []) if reference is not None else []
        for n, run in enumerate(mine.asserts.get(k, [])):
            ref_run = ref_runs[n] if n < len(ref_runs) else None
            try:
                failure = _judge_one(spec, run, ref_run)
            except Exception as err:  # any value the grader cannot judge fails the assert
                failure = f"{type(err).__name__}: {err}"
            if failure:
                return f"line {spec.line}: {failure}"
    if not mine.ended:
        return "the check stopped before its end"
    for k, spec in enumerate(specs):
        runs, ref_runs = mine.asserts.get(k, []), reference.asserts.get(k, []) if reference is not None else None
        if ref_runs is not None and len(runs) != len(ref_runs):
            return (f"line {spec.line}: the assert ran {len(runs)} time(s), "
                    f"{len(ref_runs)} in the solution's run on the same inputs")
    return None


def _judge_one(spec: AssertSpec, run: dict, ref_run: dict | None) -> str | None:
    values = {int(j): decode(v) for j, v in run.items()}
    reference = {int(j): decode(v) for j, v in ref_run.items()} if ref_run is not None else {}
    if spec.close:
        if 0 not in values or 1 not in values:
            return "assert_close did not report its arguments"
        expected = [values[1]] + ([reference[1]] if 1 in reference else [])
        for want in expected:
            failure = _close(values[0], want, spec.tolerances)
            if failure:
                return failure
        return None
    if not _evaluate(spec.test, values, reference):
        shown = ", ".join(_short(values[j]) for j in sorted(values))
        return f"the assert does not hold for the values your code gave ({shown})"
    return None


def _close(actual, expected, tolerances: dict) -> str | None:
    import torch

    if isinstance(actual, Opaque) or isinstance(expected, Opaque):
        return f"cannot compare {_short(actual)} with {_short(expected)}"
    kwargs = {k: v for k, v in tolerances.items() if k in ("rtol", "atol", "equal_nan", "check_dtype")}
    if ("rtol" in kwargs) != ("atol" in kwargs):
        kwargs.pop("rtol", None), kwargs.pop("atol", None)
    try:
        torch.testing.assert_close(actual, expected, **kwargs)
    except (AssertionError, TypeError, ValueError, RuntimeError) as err:
        return " ".join(str(err).split())[:300]
    return None


def _evaluate(test: ast.expr, values: dict, reference: dict) -> bool:
    """Evaluate an assert's test on decoded values with the grader's own functions."""
    import torch

    def ev(node):
        if isinstance(node, ast.Name) and node.id.startswith("_v"):
            j = int(node.id[2:])
            if j not in values:
                raise ValueError("an operand was not reported")
            return values[j]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BoolOp):
            results = (ev(v) for v in node.values)
            return all(map(_truth, results)) if isinstance(node.op, ast.And) else any(map(_truth, results))
        if isinstance(node, ast.UnaryOp):
            return not _truth(ev(node.operand))
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = ev(right_node)
                if not _truth(_compare(op, left, right)):
                    return False
                left = right
            return True
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name == "isinstance":
                return _isinstance(ev(node.args[0]), node.args[1])
            a, b = ev(node.args[0]), ev(node.args[1])
            expected = [b] + ([reference[int(node.args[1].id[2:])]] if isinstance(node.args[1], ast.Name)
                              and int(node.args[1].id[2:]) in reference else [])
            kw = _constant_kwargs(node)
            return all(_close_call(name, a, want, kw) for want in expected)
        raise ValueError(f"cannot judge {ast.unparse(node)}")

    return _truth(ev(test))


def _truth(value) -> bool:
    import torch

    if isinstance(value, Opaque):
        raise ValueError(f"cannot judge the truth of {value!r}")
    if isinstance(value, torch.Tensor):
        return bool(value.item()) if value.numel() == 1 else bool(value.all())
    return bool(value)


def _compare(op: ast.cmpop, a, b):
    import operator

    if isinstance(a, Opaque) or isinstance(b, Opaque):
        raise ValueError(f"cannot compare {a!r} with {b!r}")
    ops = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda x, y: x in y,
           ast.NotIn: lambda x, y: x not in y, ast.Is: operator.is_, ast.IsNot: operator.is_not}
    return ops[type(op)](a, b)


def _close_call(name: str, a, b, kw: dict) -> bool:
    import torch

    if name == "isclose" and not isinstance(a, torch.Tensor):
        return math.isclose(float(a), float(b), **{k: v for k, v in kw.items() if k in ("rel_tol", "abs_tol")})
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if name == "equal":
        return torch.equal(a, b)
    return bool(torch.allclose(a, b, **{k: v for k, v in kw.items() if k in ("rtol", "atol", "equal_nan")}))


def _isinstance(value, type_node: ast.expr) -> bool:
    import torch

    known = {"torch.Tensor": torch.Tensor, "nn.Parameter": torch.nn.Parameter, "torch.nn.Parameter": torch.nn.Parameter,
             "int": int, "float": float, "bool": bool, "str": str, "list": list, "tuple": tuple, "dict": dict}
    names = [ast.unparse(e) for e in (type_node.elts if isinstance(type_node, ast.Tuple) else [type_node])]
    if any(n not in known for n in names):
        raise ValueError(f"cannot judge isinstance(..., {ast.unparse(type_node)})")
    return isinstance(value, tuple(known[n] for n in names))


def _short(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
