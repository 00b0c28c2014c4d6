"""LoRA and its variants, from scratch: LoRA, rsLoRA, DoRA, VeRA, LoRA+ and QLoRA.

A frozen linear layer W0 (out, in) gets a trainable low-rank update:

    y = W0 x + s · B A x,    A (r, in) random,  B (out, r) zero,  s = α / r

so the adapted model equals the base model at initialisation, and only
r·(in + out) numbers per layer train. After training, W0 + s·BA can be merged
into one matrix (no extra inference cost) and unmerged again.

- rsLoRA: s = α / √r, which keeps the update's scale stable as r grows.
- DoRA: W' = m · (W0 + s·BA) / ‖W0 + s·BA‖ per output row; the magnitude m
  (out,) trains too and starts at ‖W0‖, the norm is detached (DoRA §4.3).
- VeRA: one pair of frozen random matrices A, B shared by every layer; only
  two vectors train per layer: y = W0 x + λ_b ⊙ B (λ_d ⊙ A x), λ_b = 0 at init.
- LoRA+: an optimizer change, not a layer change: B (and every other 1-D
  trainable parameter) learns λ times faster than A.
- QLoRA: LoRA over a 4-bit NF4 backbone (``llmsys.lora.quant``) or over
  bitsandbytes' ``Linear4bit``.

Adapters are kept in fp32 whatever the backbone's dtype; their output is cast
back to the layer's output dtype.

Parameter names follow peft (``lora_A``, ``lora_B``, ``lora_magnitude``,
``vera_lambda_b``, ``vera_lambda_d``), and tests check the layers against
peft 0.21 on the same weights.

References:
1) LoRA (Hu et al., arXiv 2106.09685); rsLoRA (Kalajdzievski, arXiv 2312.03732)
2) DoRA (Liu et al., arXiv 2402.09353); VeRA (Kopiczko et al., arXiv 2310.11454)
3) LoRA+ (Hayou et al., arXiv 2402.12354); QLoRA (Dettmers et al., arXiv 2305.14314)
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys.core import accounting
from llmsys.lora.quant import NF4Linear, bits_per_param, model_weight_bytes
from llmsys.core.zoo import batch

VARIANTS = ("lora", "rslora", "dora", "vera")


# ---------------------------------------------------------------------------
# The base layer: nn.Linear, our NF4Linear, or bitsandbytes' Linear4bit


def _is_bnb_4bit(module: nn.Module) -> bool:
    return getattr(getattr(module, "weight", None), "quant_state", None) is not None


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, NF4Linear) or _is_bnb_4bit(module)


def is_linear(module: nn.Module) -> bool:
    """A layer LoRA can adapt: nn.Linear (bitsandbytes' Linear4bit is one) or NF4Linear."""
    return isinstance(module, (nn.Linear, NF4Linear))


def base_weight(module: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The base layer's weight (out, in) as a dense tensor, dequantized if it is 4-bit."""
    if isinstance(module, NF4Linear):
        return module.dequantize(dtype)
    if _is_bnb_4bit(module):
        import bitsandbytes.functional as bnbF

        return bnbF.dequantize_4bit(module.weight.data, module.weight.quant_state).to(dtype)
    return module.weight.to(dtype)


def _check_rank(r, in_features: int, out_features: int, name: str = "this layer") -> None:
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"rank r must be a positive integer, got {r!r}")
    if r > min(in_features, out_features):
        raise ValueError(f"r={r} exceeds min(in_features, out_features) = min({in_features}, {out_features}) of {name}: "
                         f"BA would then cost more than W itself and its rank is capped anyway; "
                         f"choose r <= {min(in_features, out_features)}")


# ---------------------------------------------------------------------------
# LoRA (with rsLoRA and DoRA)


class LoRALinear(nn.Module):
    """A frozen linear layer plus s·B A x; rsLoRA changes s, DoRA adds a trained magnitude."""

    def __init__(self, base: nn.Module, r: int, alpha: float, *, rslora: bool = False, dora: bool = False,
                 dropout: float = 0.0, generator: torch.Generator | None = None, name: str = "this layer"):
        super().__init__()
        if not is_linear(base):
            raise ValueError(f"LoRA adapts linear layers; {name} is a {type(base).__name__}")
        in_features, out_features = base.in_features, base.out_features
        _check_rank(r, in_features, out_features, name)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.r, self.alpha, self.rslora, self.dora = r, alpha, rslora, dora
        self.scaling = alpha / math.sqrt(r) if rslora else alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base_weight_device(base)
        # A ~ U(±1/√in), nn.Linear's default (kaiming_uniform with a=√5); B = 0 so BA = 0 at init
        bound = 1 / math.sqrt(in_features)
        A = torch.empty(r, in_features).uniform_(-bound, bound, generator=generator)  # drawn on the CPU generator
        self.lora_A = nn.Parameter(A.to(device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, device=device))
        if dora:
            # the magnitude starts at the row norms of W0 (BA = 0), so W' = W0 at init
            self.lora_magnitude = nn.Parameter(base_weight(base).norm(dim=1))  # (out,)
        self.merged = False
        self._merged_norm = None  # DoRA: the norm used at merge time, needed to unmerge

    def delta_weight(self) -> torch.Tensor:
        """s · B A, (out, in)."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling  # (..., out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.merged:
            return result
        xa = x.to(self.lora_A.dtype)
        if not self.dora:
            return result + self._lora(xa).to(result.dtype)
        # DoRA: m/‖W0 + sBA‖ · (W0 x + sBA x); the norm is treated as a constant (detached)
        weight = base_weight(self.base, self.lora_A.dtype)
        norm = (weight + self.delta_weight().detach()).norm(dim=1).detach()  # (out,)
        scale = self.lora_magnitude / norm  # (out,)
        bias = getattr(self.base, "bias", None)
        w0x = result.to(scale.dtype) - (bias.to(scale.dtype) if bias is not None else 0)
        return result + ((scale - 1) * w0x + scale * self._lora(xa)).to(result.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into W0: W0 + sBA (DoRA: m · (W0 + sBA) / ‖W0 + sBA‖)."""
        if self.merged:
            raise ValueError("this layer is already merged; unmerge() first")
        if is_quantized(self.base):
            raise ValueError("cannot merge into a 4-bit base layer without re-quantizing it (which loses the "
                             "update); merge into a dequantized copy: nn.Linear with base_weight(layer.base)")
        weight = self.base.weight
        new = weight.float() + self.delta_weight()
        if self.dora:
            self._merged_norm = new.norm(dim=1)
            new = (self.lora_magnitude / self._merged_norm)[:, None] * new
        weight.copy_(new.to(weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo merge(): subtract the same update (exact up to floating-point rounding)."""
        if not self.merged:
            raise ValueError("this layer is not merged; nothing to unmerge")
        weight = self.base.weight
        new = weight.float()
        if self.dora:
            new = new / (self.lora_magnitude / self._merged_norm)[:, None]
            self._merged_norm = None
        weight.copy_((new - self.delta_weight()).to(weight.dtype))
        self.merged = False

    def extra_repr(self) -> str:
        kind = "dora" if self.dora else "rslora" if self.rslora else "lora"
        return f"{kind}, r={self.r}, alpha={self.alpha}, scaling={self.scaling:.4g}"


def base_weight_device(module: nn.Module) -> torch.device:
    tensor = next(iter(list(module.parameters()) + list(module.buffers())), None)
    return tensor.device if tensor is not None else torch.device("cpu")


# ---------------------------------------------------------------------------
# VeRA


def _kaiming_uniform(shape, generator: torch.Generator) -> torch.Tensor:
    """U(±√(6 / fan_in)) (Kaiming, gain √2), drawn from ``generator`` so every run shares the same matrices."""
    bound = math.sqrt(6 / shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class VeRAProjections(nn.Module):
    """The frozen random A (r, max_in) and B (max_out, r) that every VeRA layer of a model shares.

    Drawn from a generator seeded with ``seed``: A first, then B (as peft does
    with its ``projection_prng_key``), so the pair can be rebuilt from the seed."""

    def __init__(self, r: int, max_in: int, max_out: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("A", _kaiming_uniform((r, max_in), generator))
        self.register_buffer("B", _kaiming_uniform((max_out, r), generator))


class VeRALinear(nn.Module):
    """y = W0 x + λ_b ⊙ B (λ_d ⊙ A x): only λ_b (out) and λ_d (r) train; A, B are shared and frozen."""

    def __init__(self, base: nn.Module, projections: VeRAProjections, d_initial: float = 0.1,
                 dropout: float = 0.0, name: str = "this layer"):
        super().__init__()
        if not is_linear(base):
            raise ValueError(f"VeRA adapts linear layers; {name} is a {type(base).__name__}")
        r, max_in = projections.A.shape
        if base.in_features > max_in or base.out_features > projections.B.size(0):
            raise ValueError(f"{name} ({base.in_features} -> {base.out_features}) is larger than the shared "
                             f"projections ({max_in} -> {projections.B.size(0)}); build them for the largest layer")
        _check_rank(r, base.in_features, base.out_features, name)
        self.base, self.projections = base, projections
        self.in_features, self.out_features, self.r = base.in_features, base.out_features, r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base_weight_device(base)
        self.vera_lambda_b = nn.Parameter(torch.zeros(self.out_features, device=device))  # 0: output unchanged at init
        self.vera_lambda_d = nn.Parameter(torch.full((r,), float(d_initial), device=device))
        self.merged = False

    def _sliced(self):
        return self.projections.A[:, : self.in_features], self.projections.B[: self.out_features]  # (r, in), (out, r)

    def delta_weight(self) -> torch.Tensor:
        A, B = self._sliced()
        return (self.vera_lambda_b[:, None] * B) @ (self.vera_lambda_d[:, None] * A)  # (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.merged:
            return result
        A, B = self._sliced()
        xa = self.dropout(x.to(self.vera_lambda_d.dtype))
        update = self.vera_lambda_b * F.linear(self.vera_lambda_d * F.linear(xa, A), B)
        return result + update.to(result.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        if self.merged:
            raise ValueError("this layer is already merged; unmerge() first")
        if is_quantized(self.base):
            raise ValueError("cannot merge into a 4-bit base layer without re-quantizing it")
        self.base.weight.add_(self.delta_weight().to(self.base.weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            raise ValueError("this layer is not merged; nothing to unmerge")
        self.base.weight.sub_(self.delta_weight().to(self.base.weight.dtype))
        self.merged = False

    def extra_repr(self) -> str:
        return f"vera, r={self.r}"


ADAPTERS = (LoRALinear, VeRALinear)


# ---------------------------------------------------------------------------
# Wrapping a model by module name


def _matches(name: str, target: str) -> bool:
    """peft's rule: the full name, or its dotted suffix ("wq" matches "layers.0.attention.wq")."""
    return name == target or name.endswith("." + target)


def find_targets(model: nn.Module, target_modules) -> list[str]:
    """Names of the linear layers ``target_modules`` selects; a clear error if one selects nothing."""
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    target_modules = list(target_modules)
    if not target_modules:
        raise ValueError("target_modules is empty; name at least one linear layer, e.g. ['wq', 'wv']")
    modules = dict(model.named_modules())
    if any(isinstance(m, ADAPTERS) for m in modules.values()):
        raise ValueError("this model already has adapters; apply_lora once, to a fresh model")
    linear_names = sorted({n.rpartition(".")[2] for n, m in modules.items() if is_linear(m)})
    chosen = []
    for target in target_modules:
        hits = [n for n in modules if _matches(n, target)]
        if not hits:
            raise ValueError(f"target module {target!r} matches no module of {type(model).__name__}; "
                             f"its linear layers are named {', '.join(linear_names)}")
        not_linear = [n for n in hits if not is_linear(modules[n])]
        if not_linear:
            raise ValueError(f"target module {target!r} matches {not_linear[0]!r}, a {type(modules[not_linear[0]]).__name__}, "
                             f"not a linear layer; target its linear layers ({', '.join(linear_names)})")
        chosen += [n for n in hits if n not in chosen]
    return sorted(chosen, key=list(modules).index)


def apply_lora(model: nn.Module, target_modules=("wq", "wv"), r: int = 8, alpha: float = 16, variant: str = "lora",
               dropout: float = 0.0, d_initial: float = 0.1, vera_seed: int = 0,
               generator: torch.Generator | None = None) -> nn.Module:
    """Freeze ``model`` and wrap the linear layers named by ``target_modules`` with adapters, in place.

    variant: "lora" (s = α/r), "rslora" (s = α/√r), "dora", or "vera" (α unused;
    the shared projections are built for the largest targeted layer and stored
    as ``model.vera_projections``). Returns the model.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)} "
                         f"(LoRA+ is an optimizer setting: see loraplus_param_groups)")
    names = find_targets(model, target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    layers = {name: model.get_submodule(name) for name in names}
    for name, layer in layers.items():
        _check_rank(r, layer.in_features, layer.out_features, name)
    if variant == "vera":
        max_in = max(m.in_features for m in layers.values())
        max_out = max(m.out_features for m in layers.values())
        projections = VeRAProjections(r, max_in, max_out, vera_seed).to(base_weight_device(next(iter(layers.values()))))
        model.vera_projections = projections
    for name, layer in layers.items():
        if variant == "vera":
            adapter = VeRALinear(layer, projections, d_initial, dropout, name=name)
        else:
            adapter = LoRALinear(layer, r, alpha, rslora=variant == "rslora", dora=variant == "dora",
                                 dropout=dropout, generator=generator, name=name)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, adapter)
    return model


def adapters(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ADAPTERS)}


def merge(model: nn.Module) -> None:
    for layer in adapters(model).values():
        layer.merge()


def unmerge(model: nn.Module) -> None:
    for layer in adapters(model).values():
        layer.unmerge()


# ---------------------------------------------------------------------------
# LoRA+: parameter groups


def loraplus_param_groups(model: nn.Module, lr: float, lr_ratio: float = 16.0, weight_decay: float = 0.0,
                          embedding_lr: float = 1e-6) -> list[dict]:
    """Optimizer groups of LoRA+, in peft's order: A at lr; embedding adapters at embedding_lr;
    B and every other trainable 1-D parameter (DoRA magnitudes, VeRA vectors, norm gains) at lr·lr_ratio.

    Biases and LayerNorm parameters get no weight decay; the rest ``weight_decay``
    (peft's ``loraplus_weight_decay``, 0 by default). We adapt no embeddings, so
    that group is empty; it is kept so the groups line up with peft's.
    """
    if lr <= 0 or lr_ratio <= 0:
        raise ValueError(f"lr and lr_ratio must be positive, got {lr} and {lr_ratio}")
    no_decay = {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() if isinstance(m, nn.LayerNorm)
                for pn, _ in m.named_parameters(recurse=False)}
    group_a, group_b, group_b_no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_B" in name or p.ndim == 1:
            (group_b_no_decay if "bias" in name or name in no_decay else group_b).append(p)
        else:
            group_a.append(p)
    if not group_a and not group_b and not group_b_no_decay:
        raise ValueError("the model has no trainable parameters; call apply_lora first")
    return [
        {"params": group_a, "weight_decay": weight_decay, "lr": lr},
        {"params": [], "weight_decay": weight_decay, "lr": embedding_lr},
        {"params": group_b, "weight_decay": weight_decay, "lr": lr * lr_ratio},
        {"params": group_b_no_decay, "weight_decay": 0.0, "lr": lr * lr_ratio},
    ]


def loraplus_optimizer(model: nn.Module, optimizer_cls=torch.optim.AdamW, *, lr: float, lr_ratio: float = 16.0,
                       weight_decay: float = 0.0, **kwargs) -> torch.optim.Optimizer:
    return optimizer_cls(loraplus_param_groups(model, lr, lr_ratio, weight_decay), lr=lr, **kwargs)


# ---------------------------------------------------------------------------
# Counting: parameters and bytes


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def total_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in the optimizer's state (Adam's m and v; bitsandbytes' 8-bit codes and scales), shared tensors once."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1 and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.nbytes
    return total


def adam_state_bytes(sizes, bits: int = 32, blocksize: int = 256) -> float:
    """Estimate of Adam's state for tensors of ``sizes`` numbers (an int or a list): m and v at 4 bytes
    each in fp32; in 8-bit (bitsandbytes' blockwise dynamic quantization) 1 byte each plus an fp32
    scale per block of 256, and one 256-entry fp32 code table per state for the whole optimizer."""
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    if bits == 32:
        return 2 * 4 * sum(sizes)
    if bits == 8:
        return 2 * sum(n + 4 * math.ceil(n / blocksize) for n in sizes) + 2 * 4 * 256
    raise ValueError(f"bits must be 32 or 8, got {bits}")


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer name of llmsys.core.model.Transformer(cfg)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"wq": (cfg.dim, q), "wk": (cfg.dim, kv), "wv": (cfg.dim, kv), "wo": (q, cfg.dim),
            "w1": (cfg.dim, cfg.hidden), "w3": (cfg.dim, cfg.hidden), "w2": (cfg.hidden, cfg.dim),
            "output": (cfg.dim, cfg.vocab_size)}


def adapter_parameters(in_features: int, out_features: int, r: int, variant: str = "lora") -> int:
    """Trainable numbers one adapted layer adds: r(in + out); DoRA + out; VeRA r + out."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
    if variant == "vera":
        return r + out_features
    return r * (in_features + out_features) + (out_features if variant == "dora" else 0)


def count_adapter_parameters(cfg, target_modules, r: int, variant: str = "lora") -> int:
    """The trainable-parameter estimate for apply_lora(Transformer(cfg), target_modules, r, variant)."""
    shapes = linear_shapes(cfg)
    unknown = [t for t in target_modules if t not in shapes]
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; use names from {', '.join(shapes)}")
    total = 0
    for t in target_modules:
        copies = 1 if t == "output" else cfg.n_layers
        total += copies * adapter_parameters(*shapes[t], r, variant)
    return total


def finetune_state_bytes(n_params: float, n_trainable: float, backbone: str = "bf16", optimizer: str = "adamw",
                         full: bool = False, adapter_bytes: float = 4) -> dict[str, float]:
    """Model-state bytes of a fine-tune, activations excluded.

    Full fine-tuning in mixed precision: 16 bytes per parameter (bf16 weights and
    grads, fp32 master copy, Adam's m and v). Adapters: the frozen backbone in
    ``backbone`` precision ("fp32", "bf16", or "nf4" with double-quantized
    scales, 4.127 bits), the adapters and their gradients at ``adapter_bytes``
    each (4: fp32, as llmsys.lora keeps them; 2: bf16), and optimizer state
    ("adamw" 8 bytes, "adam8bit" 2 bytes per trainable parameter).
    """
    if full:
        per_param = accounting.training_bytes_per_param("bf16", optimizer)
        return {"weights": 2 * n_params, "gradients": 2 * n_params,
                "optimizer": (per_param - 4) * n_params, "total": per_param * n_params}
    frozen = n_params - n_trainable
    weight = bits_per_param() / 8 if backbone == "nf4" else accounting.bytes_per_element(backbone)
    state = accounting.OPTIMIZER_STATE_BYTES.get(optimizer)
    if state is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(accounting.OPTIMIZER_STATE_BYTES)}")
    parts = {"weights": frozen * weight + adapter_bytes * n_trainable, "gradients": adapter_bytes * n_trainable,
             "optimizer": state * n_trainable}
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------
# The chapter's experiment: adapt a model to new text with each method at equal steps

METHODS = ("full", "lora", "lora+", "dora", "vera", "qlora")
# Learning rates for a few hundred steps on the embedded target; VeRA trains only
# vectors that scale fixed random projections and needs a much larger one (VeRA §4).
DEFAULT_LR = {"full": 1e-3, "lora": 2e-3, "lora+": 2e-3, "dora": 2e-3, "vera": 2e-2, "qlora": 2e-3}


def prepare(model: nn.Module, method: str, target_modules=("wq", "wk", "wv", "wo", "w1", "w2", "w3"), r: int = 8,
            alpha: float = 16, lr: float | None = None, lora_plus_ratio: float = 16.0, vera_r: int = 64,
            generator: torch.Generator | None = None):
    """(model, optimizer) ready to fine-tune with ``method`` (one of METHODS); ``model`` is changed in place."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    lr = DEFAULT_LR[method] if lr is None else lr
    if method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if method == "qlora":
        from llmsys.lora.quant import quantize_linears

        quantize_linears(model)
    variant = {"dora": "dora", "vera": "vera"}.get(method, "lora")
    apply_lora(model, target_modules, r=vera_r if variant == "vera" else r, alpha=alpha, variant=variant,
               generator=generator)
    if method == "lora+":
        return model, loraplus_optimizer(model, lr=lr, lr_ratio=lora_plus_ratio)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def finetune(model: nn.Module, optimizer: torch.optim.Optimizer, batches, loss_fn=None) -> dict:
    """Train on every (x, y) of ``batches``; returns losses, mean seconds per step and the bytes held.

    ``state_bytes`` = weights (parameters and buffers, 4-bit ones included) + gradients + optimizer
    state, measured from the tensors after the last step; on CUDA also ``peak_cuda_bytes``, the
    allocator's peak less what other tensors (models kept by earlier cells) held at the start."""
    loss_fn = loss_fn or (lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))
    cuda = next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        others = torch.cuda.memory_allocated() - model_weight_bytes(model)  # alive before, not this run's
    model.train()
    losses, seconds = [], []
    for x, y in batches:
        start = time.perf_counter()
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # .item() waits for the GPU, so the time below is honest
        seconds.append(time.perf_counter() - start)
    model.eval()
    steady = seconds[1:] or seconds  # the first step pays for allocating state
    result = {"losses": losses, "sec_per_step": sum(steady) / len(steady),
              "weight_bytes": model_weight_bytes(model),
              "grad_bytes": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
              "optimizer_bytes": optimizer_state_bytes(optimizer)}
    result["state_bytes"] = result["weight_bytes"] + result["grad_bytes"] + result["optimizer_bytes"]
    if cuda:
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated() - others
    return result


@torch.no_grad()
def eval_loss(model: nn.Module, ids: torch.Tensor, seq_len: int = 64, max_windows: int = 32) -> float:
    """Mean next-token loss over up to ``max_windows`` consecutive windows of ``ids``."""
    n = min(max_windows, (len(ids) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"need more than seq_len={seq_len} tokens to evaluate, got {len(ids)}")
    dev = next(model.parameters()).device
    x = ids[: n * seq_len].view(n, seq_len).to(dev)
    y = ids[1 : n * seq_len + 1].view(n, seq_len).to(dev)
    was_training = model.training
    model.eval()
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item()
    model.train(was_training)
    return loss


def run_method(method: str, base: nn.Module, train_ids: torch.Tensor, steps: int, batch_size: int = 8,
               seq_len: int = 64, seed: int = 0, eval_sets: dict | None = None, **prepare_kwargs) -> dict:
    """Fine-tune a copy of ``base`` with ``method`` for ``steps`` steps and evaluate it.

    Every method sees the same batches (drawn from a generator seeded with
    ``seed``), so their losses compare step for step. ``eval_sets`` maps a name
    to token ids; each gets a "<name> loss" entry."""
    model, optimizer = prepare(copy.deepcopy(base), method, generator=torch.Generator().manual_seed(seed),
                               **prepare_kwargs)
    dev = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    batches = ([t.to(dev) for t in batch(train_ids, batch_size, seq_len, generator)] for _ in range(steps))
    result = finetune(model, optimizer, batches)
    result.update(method=method, trainable=trainable_parameters(model), total=total_parameters(model))
    for name, ids in (eval_sets or {}).items():
        result[f"{name} loss"] = eval_loss(model, ids, seq_len)
    result["model"] = model
    return result


# Python's own source code: a new domain for a model trained on English help text
DOMAIN_MODULES = ("textwrap", "shlex", "fractions", "heapq", "bisect", "colorsys", "graphlib", "statistics")


def domain_text(modules=DOMAIN_MODULES) -> str:
    """The source of a few standard-library modules (shipped with every Python), joined."""
    import importlib
    import inspect

    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)
