"""Measuring memory the way autograd sees it.

``saved_activation_bytes`` runs a forward pass and adds up the tensors autograd keeps
for backward (through ``torch.autograd.graph.saved_tensors_hooks``), each storage once
and without the module's parameters: the activation memory a formula must predict.
"""

from __future__ import annotations

import torch


def saved_activation_bytes(module: torch.nn.Module, *inputs, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves during ``module(*inputs)``, parameters
    and the tensors in ``exclude`` (constant tables such as RoPE's cos/sin) left out."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(seen.values())
