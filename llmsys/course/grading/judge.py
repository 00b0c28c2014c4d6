"""The grader's judgement of a graded cell, in its own process, on the plain data the kernel sent.

``decode`` turns the records back into numbers, lists and tensors (``.npy``
read with ``allow_pickle=False``; anything else is refused). ``judge``
evaluates each assert with the grader's torch and math: for
``assert_close``/``allclose``/``isclose``/``equal`` against both the
student's expected value and the solution's run on the same inputs, for any
other assert on the student's values. A cell passes when it began and ended,
and each assert ran as many times as in the solution's run and always held.
"""

from __future__ import annotations

import ast
import base64
import io
import math
from dataclasses import dataclass, field

from .probes import PROBE_MIME, SOLUTION_RUN, AssertSpec, call_name, constant_kwargs

MAX_VALUE_BYTES = 8_000_000  # larger values are refused: a check compares small tensors


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
        measured = _solution_run_operands(spec.test)
        shown = ", ".join(_short(values[j]) for j in sorted(values) if j not in measured)
        theirs = [_short(reference[j]) for j in sorted(measured) if j in reference]
        theirs = f"; solution_run(...) is {', '.join(theirs)} in the solution's run" if theirs else ""
        return f"the assert does not hold for the values your code gave ({shown}{theirs})"
    return None


def _solution_run_operands(test: ast.expr) -> set[int]:
    return {int(n.args[0].id[2:]) for n in ast.walk(test) if isinstance(n, ast.Call) and call_name(n) == SOLUTION_RUN}


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
        if isinstance(node, ast.BinOp):
            import operator

            ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
            return ops[type(node.op)](_number(ev(node.left)), _number(ev(node.right)))
        if isinstance(node, ast.Call) and call_name(node) == SOLUTION_RUN:
            j = int(node.args[0].id[2:])
            # judging the solution's own run (no reference): it is compared with itself
            return reference[j] if j in reference else ev(node.args[0])
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name == "isinstance":
                return _isinstance(ev(node.args[0]), node.args[1])
            a, b = ev(node.args[0]), ev(node.args[1])
            expected = [b] + ([reference[int(node.args[1].id[2:])]] if isinstance(node.args[1], ast.Name)
                              and int(node.args[1].id[2:]) in reference else [])
            kw = constant_kwargs(node)
            return all(_close_call(name, a, want, kw) for want in expected)
        raise ValueError(f"cannot judge {ast.unparse(node)}")

    return _truth(ev(test))


def _number(value):
    import torch

    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise ValueError(f"cannot do arithmetic on {_short(value)}")
    return value


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
