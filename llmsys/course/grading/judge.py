"""The grader's judgement of a graded cell, in its own process, on the plain data the kernel sent.

``decode`` turns the records back into numbers, lists and tensors (raw bytes
with a dtype and a shape; object dtypes, which would unpickle, are refused).
``judge`` evaluates each assert with the grader's torch and math on the
student's operands and, for the expected ones, the solution's run on the same
inputs (``AssertSpec.expected``); an expected side computed from the
student's own values is a relation, checked on both runs. A measured operand
(``measurements.py``) is the grader's measurement of the choice the kernel
sent last from that site before the assert ran, provided the kernel sent it in
the same order and with the same inputs as the solution's run. A cell passes
when it began and ended, and each assert ran as many times as in the
solution's run and always held.
"""

from __future__ import annotations

import ast
import base64
import math
from dataclasses import dataclass, field

from .probes import PROBE_MIME, SOLUTION_RUN, AssertSpec, call_name, constant_kwargs

REFUSED = "refused"  # the event the grader puts in place of an output over its caps

MAX_VALUE_BYTES = 8_000_000  # larger values are refused: a check compares small tensors


class Opaque:
    """A value the kernel could not send as data (an object of the student's own)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


class Failed:
    """An operand whose evaluation raised in the student's kernel (sent as its error's name)."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self):
        return f"<raised {self.message}>"


def decode(value):
    """Plain data back into Python values, tensors and arrays; never runs code."""
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
        array = _array(value)
        if "array" in value:
            return array
        tensor = torch.from_numpy(array)
        dtype = getattr(torch, str(value.get("dtype")), None)
        tensor = tensor.to(dtype) if isinstance(dtype, torch.dtype) else tensor
        return torch.nn.Parameter(tensor, requires_grad=False) if value.get("parameter") is True else tensor
    if "name" in value:
        return str(value["name"])
    if "opaque" in value:
        return Opaque(str(value["opaque"]))
    if "error" in value:
        return Failed(str(value["error"])[:500])
    raise ValueError(f"malformed probe value with keys {sorted(value)[:5]}")


def _array(value: dict):
    """Raw bytes, a dtype and a shape back into an array; object (pickled) dtypes are refused."""
    import numpy as np

    try:
        raw = base64.b64decode(value.get("tensor") or value.get("array"), validate=True)
        dtype, shape = np.dtype(str(value["descr"])), tuple(int(n) for n in value["shape"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed array: {err}") from None
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError("a probed value is too large")
    if dtype.hasobject or any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != len(raw):
        raise ValueError("an array of Python objects, or whose bytes do not match its shape, is refused")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


@dataclass
class CellRecords:
    """What one graded cell sent: whether it began and ended, and each assert's values in order."""

    began: bool = False
    ended: bool = False
    asserts: dict[int, list[dict]] = field(default_factory=dict)
    refused: str = ""  # why the grader dropped part of what the cell sent (over a cap)
    measures: list[tuple[int, list]] = field(default_factory=list)  # (site, arguments) sent to be measured, in order
    seen: dict[int, list[dict]] = field(default_factory=dict)  # per assert run: measurements sent before it, per site
    results: list[dict] = field(default_factory=list)  # the grader's measurement of each of ``measures``


def collect(outputs: list, cell_name: str, measured: list | None = None) -> CellRecords:
    """A cell's records; ``measured``: the grader's results for the measurements it sent (``measurements.py``)."""
    records = CellRecords(results=list(measured or []))
    counts: dict[int, int] = {}
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
        elif event == REFUSED:
            records.refused = records.refused or str(record.get("why", "an output over the grader's cap"))
        elif event == "measure" and isinstance(record.get("site"), int) and isinstance(record.get("args"), list):
            records.measures.append((record["site"], record["args"]))
            counts[record["site"]] = counts.get(record["site"], 0) + 1
        elif event == "asserts" and isinstance(record.get("asserts"), list):
            for item in record["asserts"]:
                if isinstance(item, dict) and isinstance(item.get("k"), int) and isinstance(item.get("values"), dict):
                    records.asserts.setdefault(item["k"], []).append(item["values"])
                    records.seen.setdefault(item["k"], []).append(dict(counts))
    return records


def fill_measured(specs: list[AssertSpec], mine: CellRecords, reference: CellRecords | None) -> None:
    """Put the grader's measurements (``mine.results``, ``measurements.py``) in the places of the measured
    operands, or an error where there is none: nothing measured yet, another order than the solution's run
    (``reference``), or other inputs than its."""
    sites = _by_site(mine)
    reference_sites = _by_site(reference) if reference is not None else None
    for k, spec in enumerate(specs):
        for n, run in enumerate(mine.asserts.get(k, []) if spec.measured else []):
            for j, (site, part) in spec.measured.items():
                count = mine.seen[k][n].get(site, 0)
                why = "nothing was measured before this assert" if count == 0 else None
                if why is None and reference is not None:
                    theirs = reference.seen.get(k, [])
                    if n >= len(theirs) or theirs[n].get(site, 0) != count:
                        why = "the measurements and the asserts ran in another order than in the solution's run"
                    elif mine.measures[sites[site][count - 1]][1][1:] != \
                            reference.measures[reference_sites[site][count - 1]][1][1:]:
                        why = "measured on other inputs than the solution's run (only the choice is yours)"
                run[str(j)] = {"error": why} if why else _part(mine.results, sites[site][count - 1], part)


def _by_site(records: CellRecords) -> dict[int, list[int]]:
    sites: dict[int, list[int]] = {}
    for index, (site, _) in enumerate(records.measures):
        sites.setdefault(site, []).append(index)
    return sites


def _part(results: list[dict], index: int, part: int | None):
    result = results[index] if index < len(results) else {"error": "the grader did not measure it"}
    if "error" in result:
        return {"error": f"the grader's measurement of your choice failed: {result['error']}"}
    value = result.get("value")
    if part is None:
        return value
    items = value.get("tuple", value.get("list")) if isinstance(value, dict) else None
    if not isinstance(items, list) or part >= len(items):
        return {"error": "the measurement did not return as many values as the check names"}
    return items[part]


def judge(specs: list[AssertSpec], mine: CellRecords, reference: CellRecords | None) -> str | None:
    """None when the cell's asserts all held on the submitted values, else why not."""
    if mine.refused:
        return mine.refused
    fill_measured(specs, mine, reference)  # the grader's measurements, in the places of the measured operands
    if not mine.began:
        return "the check did not run"
    for k, spec in enumerate(specs):
        ref_runs = reference.asserts.get(k, []) if reference is not None else []
        for n, run in enumerate(mine.asserts.get(k, [])):
            if reference is not None and n >= len(ref_runs):
                return f"line {spec.line}: the assert ran more times than in the solution's run on the same inputs"
            ref_run = ref_runs[n] if reference is not None else None
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
    """One run of one assert: the student's operands, the expected ones from the solution's run."""
    values = {int(j): decode(v) for j, v in run.items()}
    reference = {int(j): decode(v) for j, v in ref_run.items()} if ref_run is not None else {}
    if ref_run is not None:
        for j in spec.expected:  # one the solution's run skipped (`a or b`) fails only where it is needed
            values[j] = reference.get(j, Failed("nothing: the solution's run did not compute it"))
    also = {j: x for j, x in reference.items() if j not in spec.expected}  # a relation is checked on both runs
    said = f"{_filled(spec, values)}: " if spec.message else ""
    if spec.close:
        if 0 not in values or 1 not in values:
            return "assert_close did not report its arguments"
        for want in [values[1]] + ([also[1]] if 1 in also else []):
            failure = _close(values[0], want, spec.tolerances)
            if failure:
                return said + failure
        return None
    if not _evaluate(spec.test, values, also, spec.operands):
        shown = ", ".join(_short(values[j]) for j in sorted(values) if j not in spec.expected)
        theirs = ", ".join(_short(values[j]) for j in sorted(spec.expected) if j in values and ref_run is not None)
        theirs = f"; the solution's run gives {theirs}" if theirs else ""
        return f"{said}the assert does not hold for the values your code gave ({shown}{theirs})"
    return None


def _filled(spec: AssertSpec, values: dict) -> str:
    """The assert's message with each ``{operand}`` it shares with the test replaced by the value judged."""
    text = spec.message
    for j, source in spec.operands.items():
        if j in values and "{" + source + "}" in text:
            text = text.replace("{" + source + "}", _short(values[j]) if not isinstance(values[j], (int, float, str))
                                else str(values[j]))
    return text


def _close(actual, expected, tolerances: dict) -> str | None:
    import torch

    if isinstance(actual, Failed):
        return f"computing it raised {actual.message}"
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


def _evaluate(test: ast.expr, values: dict, also: dict, sources: dict) -> bool:
    """Evaluate an assert's test on decoded values with the grader's own functions."""
    def ev(node):
        if isinstance(node, ast.Name) and node.id.startswith("_v"):
            j = int(node.id[2:])
            if j not in values:
                raise ValueError("an operand was not reported")
            if isinstance(values[j], Failed):
                message, source = values[j].message, sources.get(j, ast.unparse(node))
                raise ValueError(f"`{source}`: {message}" if " " in message  # a sentence (the grader's), else a name
                                 else f"computing `{source}` raised {message}")
            return values[j]
        if isinstance(node, (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp)) and _literal(node):
            return ast.literal_eval(node)
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
        if isinstance(node, ast.Call) and call_name(node) == SOLUTION_RUN:  # its operand is the solution's
            return ev(node.args[0])
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name == "isinstance":
                return _isinstance(ev(node.args[0]), node.args[1])
            a, b = ev(node.args[0]), ev(node.args[1])
            expected = [b] + ([also[int(node.args[1].id[2:])]] if isinstance(node.args[1], ast.Name)
                              and int(node.args[1].id[2:]) in also else [])
            kw = constant_kwargs(node)
            return all(_close_call(name, a, want, kw) for want in expected)
        raise ValueError(f"cannot judge {ast.unparse(node)}")

    return _truth(ev(test))


def _literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


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
