"""What a kernel runs before the lab's cells: the probe that sends a graded cell's values out as plain data.

It is installed before any student code runs and holds its own references to
what it uses (numpy's and torch's functions, the builtins), so later patches
of torch, numpy or builtins do not change what it sends. A tensor is sent only
when its type is exactly ``torch.Tensor`` or ``nn.Parameter``, read with the
base class's methods while ``__torch_function__`` is disabled; a subclass is
refused. Values travel as JSON: numbers as text, tensors and arrays as raw
bytes with a dtype and a shape (``judge.decode`` refuses object dtypes).

The probe is an object in the kernel, so a student can replace it; that gains
nothing, because the kernel never holds an expected value (``probes.py``) and
the grader believes only the values, not any verdict.
"""

from __future__ import annotations

KERNEL_SIDE = r'''
def __llmsys_install(salt):
    import base64
    import collections
    import numpy as np
    from IPython.display import publish_display_data
    try:
        import torch
    except ImportError:
        torch = None
    b64, ndarray, tobytes, item = base64.b64encode, np.ndarray, np.ndarray.tobytes, np.generic.item
    scalars = frozenset(np.sctypeDict.values())
    type_, str_, int_, float_, bool_, dict_, list_, tuple_ = type, str, int, float, bool, dict, list, tuple
    set_, frozenset_, len_, range_, Exception_ = set, frozenset, len, range, Exception
    int_repr, float_repr, dict_items = int.__repr__, float.__repr__, dict.items
    ordered = collections.OrderedDict  # a module's state_dict()
    if torch is not None:
        base = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
        Tensor, Parameter, Size, plain = torch.Tensor, torch.nn.Parameter, torch.Size, torch._C.DisableTorchFunction
        detach, cpu, to, numpy_, contiguous = base.detach, base.cpu, base.to, base.numpy, base.contiguous
        dtype_of, halves, float32 = base.dtype.__get__, (torch.bfloat16, torch.float16), torch.float32
        named = (torch.dtype, torch.device)

    def array(a, key, extra):
        return dict_(extra, **{key: b64(tobytes(a)).decode(), "descr": a.dtype.str, "shape": [int_(n) for n in a.shape]})

    def tensor(value):
        with plain():
            t = detach(value)
            dtype = dtype_of(t)
            t = contiguous(cpu(t))
            t = to(t, float32) if dtype in halves else t
            return array(numpy_(t), "tensor", {"dtype": str_(dtype).replace("torch.", ""),
                                               "parameter": type_(value) is Parameter})

    def encode(value, depth=0):
        kind = type_(value)
        if depth > 8:
            return {"opaque": "too deep"}
        if value is None or kind is bool_ or kind is str_:
            return value
        if kind is int_:
            return {"int": int_repr(value)}
        if kind is float_:
            return {"float": float_repr(value)}
        if kind in (list_, tuple_, set_, frozenset_):
            name = "set" if kind is frozenset_ else kind.__name__
            return {name: [encode(x, depth + 1) for x in value]}
        if kind is dict_ or kind is ordered:
            return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in dict_items(value)]}
        if torch is not None and (kind is Tensor or kind is Parameter):
            return tensor(value)
        if torch is not None and kind is Size:
            return {"tuple": [{"int": int_repr(int_(n))} for n in tuple_.__iter__(value)]}
        if torch is not None and kind in named:
            return {"name": str_(value)}
        if torch is not None and isinstance(value, Tensor):
            return {"opaque": f"a subclass of torch.Tensor ({kind.__name__}); return a plain tensor"}
        if kind is ndarray and not value.dtype.hasobject:
            return array(value, "array", {})
        if kind in scalars:
            return encode(item(value), depth)
        return {"opaque": kind.__name__}

    def safe_encode(value):
        try:
            return encode(value)
        except Exception_ as err:
            return {"error": f"the grader could not read this value ({type_(err).__name__})"}

    class Probe:
        def __init__(self):
            self.cell, self.pending, self.batch = None, {}, []
        def seed(self, n):
            return (int_(n) * 1000003 + salt) % 2**31
        def begin(self, cell):
            self.cell, self.pending, self.batch = cell, {}, []
            self.send({"cell": cell, "event": "begin"})
        def end(self, cell):
            self.send({"cell": cell, "event": "end"})
        def v(self, k, j, value):  # the solution's run: an operand, as the assert evaluates it
            self.pending.setdefault(k, {})[str_(j)] = safe_encode(value)
            return value
        def last(self, k, j, value):  # the arguments of an assert_close, sent before it runs (and may raise)
            self.v(k, j, value)
            self.probe(k, result=False)
            return value
        def probe(self, k, result=True):
            self.batch.append({"k": k, "values": self.pending.pop(k, {})})
            if not result or len_(self.batch) >= 200:  # an assert about to fail sends what came before it
                self.flush()
            return result
        def operands(self, k, pairs):  # a student's run: each operand evaluated on its own
            values = {}
            for j, thunk in pairs:
                try:
                    values[str_(j)] = safe_encode(thunk())
                except Exception_ as err:
                    values[str_(j)] = {"error": type_(err).__name__}
            self.batch.append({"k": k, "values": values})
            if len_(self.batch) >= 200:
                self.flush()
        def measure(self, site, args, names):  # a choice the grader measures; the kernel holds no measurement
            self.send({"cell": self.cell, "event": "measure", "site": site, "args": [safe_encode(a) for a in args]})
            return None if names == 1 else (None,) * names
        def flush(self):
            if self.batch:
                batch, self.batch = self.batch, []
                publish_display_data({"application/vnd.llmsys.probe+json":
                                      {"cell": self.cell, "event": "asserts", "asserts": batch}})
        def send(self, record):
            self.flush()
            publish_display_data({"application/vnd.llmsys.probe+json": record})
    return Probe()
__llmsys_probe__ = __llmsys_install({salt})
del __llmsys_install
try:  # imported here, under the grader's startup limit, so no student cell pays for it
    import numpy as __llmsys_numpy, torch as __llmsys_torch
except ImportError:
    pass
'''


def kernel_setup(salt: int) -> str:
    return KERNEL_SIDE.replace("{salt}", str(int(salt)))


