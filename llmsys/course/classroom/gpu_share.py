"""Installed as ``sitecustomize`` on a class hub: caps this process's share of GPU memory.

When ``LLMSYS_GPU_MEMORY_FRACTION`` is set, the first ``import torch`` is
followed by ``torch.cuda.set_per_process_memory_fraction(fraction, device)``
for every visible device, so students sharing one GPU (or MIG slice) each get
an out-of-memory error of their own instead of taking down the others.
Nothing happens before torch is imported, and nothing without CUDA.
"""

import importlib.abc
import importlib.util
import os
import sys


def cap(torch) -> None:
    fraction = float(os.environ["LLMSYS_GPU_MEMORY_FRACTION"])
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(fraction, device)


class CapAfterTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # find torch's real spec, then run cap() right after its module runs
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            cap(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("LLMSYS_GPU_MEMORY_FRACTION"):
    sys.meta_path.insert(0, CapAfterTorchImport())
