"""Quantization-aware training: train through the rounding so the weights settle where it hurts least.

The forward pass uses fake-quantized weights Q(W) (quantize, dequantize); rounding has zero
gradient almost everywhere, so the backward pass treats Q as the identity: the straight-through
estimator, dL/dW := dL/dQ(W). The fp32 weights keep accumulating small updates that a 3- or
4-bit grid alone could not represent, and they move towards values that round well.

QAT vs PTQ at equal training tokens: both start from the same model and train the same steps on
the same batches, one with fake quantization in the loop, one without; both are then rounded to
nearest on the same grid.

References: Bengio et al. 2013 (arXiv 1308.3432) for the straight-through estimator; Jacob et
al. 2018 (arXiv 1712.05877) for fake quantization in training; LLM-QAT (Liu et al., arXiv 2305.17888).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core import zoo
from llmsys.compress.formats import fake_quantize
from llmsys.lora.quant import replace_linears


class FakeQuantizeSTE(torch.autograd.Function):
    """Forward: RTN fake quantization of w. Backward: the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, w, bits, granularity, symmetric):
        return fake_quantize(w, bits, granularity, symmetric)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class QATLinear(nn.Module):
    """A linear layer that trains its fp32 weight through fake quantization."""

    def __init__(self, linear: nn.Linear, bits: int, granularity=32, symmetric: bool = True):
        super().__init__()
        self.weight = linear.weight
        self.bits, self.granularity, self.symmetric = bits, granularity, symmetric

    def quantized_weight(self) -> torch.Tensor:
        return FakeQuantizeSTE.apply(self.weight, self.bits, self.granularity, self.symmetric)

    def forward(self, x):
        return F.linear(x, self.quantized_weight())


def qat_linears(model: nn.Module, bits: int, granularity=32, symmetric: bool = True) -> list[str]:
    """Replace every linear except the (tied) LM head by a QATLinear, in place."""
    return replace_linears(model, ("output",), lambda linear: QATLinear(linear, bits, granularity, symmetric))


def round_linears(model: nn.Module, bits: int, granularity=32, symmetric: bool = True) -> nn.Module:
    """PTQ: the model with every (QAT)linear except the head replaced by its RTN weights, as plain linears."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (nn.Linear, QATLinear)) and not name.endswith("output"):
            plain = nn.Linear(module.weight.size(1), module.weight.size(0), bias=False)
            plain.weight = nn.Parameter(fake_quantize(module.weight.detach(), bits, granularity, symmetric))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, plain)
    return model


def finetune(model: nn.Module, train_ids: torch.Tensor, steps: int, lr: float = 3e-4, batch_size: int = 8,
             seq_len: int = 128, seed: int = 0, progress: bool = False) -> list[float]:
    """Plain AdamW steps on random windows (fixed by ``seed``); returns the losses."""
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in tqdm(range(steps), desc="finetune", disable=not progress, leave=False):
        x, y = zoo.batch(train_ids, batch_size, seq_len, generator)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def val_loss(model: nn.Module, val_ids: torch.Tensor, seq_len: int = 256, max_windows: int = 16) -> float:
    """The zoo's held-out loss over the first ``max_windows`` windows."""
    return zoo.evaluate(model, val_ids[: max_windows * seq_len + 1], seq_len, zoo.tokenizer())["val_loss"]


def qat_vs_ptq(model: nn.Module, bits: int, steps: int, granularity=32, lr: float = 3e-4,
               progress: bool = False) -> dict[str, float]:
    """Held-out loss of: the model as is, PTQ after ``steps`` plain steps, QAT after the same steps."""
    train_ids, val_ids = zoo.dataset()
    ptq = copy.deepcopy(model)
    finetune(ptq, train_ids, steps, lr, progress=progress)
    qat = copy.deepcopy(model)
    qat_linears(qat, bits, granularity)
    finetune(qat, train_ids, steps, lr, progress=progress)
    return {"full precision": val_loss(model, val_ids),
            "PTQ (RTN after plain training)": val_loss(round_linears(ptq, bits, granularity), val_ids),
            "QAT (RTN after training through it)": val_loss(round_linears(qat, bits, granularity), val_ids)}
