"""LoRA, rsLoRA, DoRA, VeRA and LoRA+ from llmsys.lora, checked against peft 0.21 on the same weights."""

import math
import warnings

import bitsandbytes as bnb
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmsys import lora
from llmsys.core.model import ModelConfig, Transformer, _hf_name

CFG = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
# ours -> transformers' Llama names, for the layers these tests adapt
HF_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w2": "down_proj",
              "w3": "up_proj"}
TARGETS = ["wq", "wv", "w2"]
# our adapter parameter -> its name inside a peft tuner layer
PEFT_PARAM = {"lora_A": "lora_A.default.weight", "lora_B": "lora_B.default.weight",
              "lora_magnitude": "lora_magnitude_vector.default.weight",
              "vera_lambda_b": "vera_lambda_b.default", "vera_lambda_d": "vera_lambda_d.default"}



def base_model(seed=0):
    torch.manual_seed(seed)
    return Transformer(CFG).eval()


def tokens(seed=1, batch=2, length=12):
    return torch.randint(CFG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def peft_name(ours: str) -> str:
    """'layers.0.attention.wq.lora_A' -> 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'."""
    module, _, param = ours.rpartition(".")
    if param not in PEFT_PARAM:  # a base parameter made trainable
        return "base_model.model." + _hf_name(ours)
    return "base_model.model." + _hf_name(module + ".weight")[: -len(".weight")] + "." + PEFT_PARAM[param]


def peft_twin(model, variant, r, alpha, targets=TARGETS, seed=0):
    """peft's version of apply_lora(base_model(seed), ...), adapter weights copied from ``model``."""
    import peft

    hf_targets = [HF_TARGETS[t] for t in targets]
    if variant == "vera":
        config = peft.VeraConfig(r=r, target_modules=hf_targets, projection_prng_key=0, d_initial=0.1)
    else:
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=hf_targets, lora_dropout=0.0,
                                 use_rslora=variant == "rslora", use_dora=variant == "dora")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = peft.get_peft_model(base_model(seed).to_hf(), config).eval()
    theirs = dict(twin.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                theirs[peft_name(name)].copy_(p)
    return twin


def randomize_adapters(model, seed=3):
    """Move the adapters away from their init (B = 0 makes every check trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def adapted(variant, r=4, alpha=8, targets=TARGETS, seed=0):
    model = base_model(seed)
    lora.apply_lora(model, targets, r=r, alpha=alpha, variant=variant, generator=torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("variant", lora.VARIANTS)
def test_adapted_output_equals_base_output_at_init(variant):
    idx = tokens()
    with torch.no_grad():
        before = base_model()(idx)
        after = adapted(variant)(idx)
    assert torch.equal(before, after)


def test_lora_init_and_scaling():
    model = adapted("lora", r=8, alpha=16, targets=["w1"])
    layer = model.layers[0].feed_forward.w1
    bound = 1 / math.sqrt(CFG.dim)
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > 0.9 * bound  # U(±1/√in)
    assert layer.lora_A.std().item() == pytest.approx(1 / math.sqrt(3 * CFG.dim), rel=0.1)
    assert torch.count_nonzero(layer.lora_B) == 0
    assert layer.scaling == 2.0
    assert adapted("rslora", r=8, alpha=16, targets=["w1"]).layers[0].feed_forward.w1.scaling == pytest.approx(16 / math.sqrt(8))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert "layers.0.feed_forward.w1.base.weight" in frozen and "tok_embeddings.weight" in frozen


@pytest.mark.parametrize("variant", lora.VARIANTS)
def test_outputs_and_gradients_match_peft(variant):
    """Same base weights, same adapter weights: same logits, same gradients, same trainable count."""
    model = adapted(variant)
    randomize_adapters(model)
    twin = peft_twin(model, variant, r=4, alpha=8)
    idx = tokens()
    ours, theirs = model(idx), twin(input_ids=idx).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    (ours.square().mean()).backward()
    (theirs.square().mean()).backward()
    their_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, their_params[peft_name(name)].grad, rtol=1e-4, atol=1e-6)
    n_trainable = lora.trainable_parameters(model)
    assert n_trainable == twin.get_nb_trainable_parameters()[0]
    assert n_trainable == lora.count_adapter_parameters(CFG, TARGETS, 4, variant)


def test_vera_projections_match_peft():
    """The shared frozen matrices come from the same seeded generator as peft's projection_prng_key."""
    model = adapted("vera", r=8)
    twin = peft_twin(model, "vera", r=8, alpha=None)
    vera_layer = twin.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(model.vera_projections.A, vera_layer.vera_A["default"])
    assert torch.equal(model.vera_projections.B, vera_layer.vera_B["default"])
    # one pair for the whole model: every layer holds the same tensors
    assert model.layers[1].feed_forward.w2.projections is model.vera_projections
    assert lora.trainable_parameters(model) == sum(CFG.n_layers * (8 + out) for _, out in
                                                   [lora.linear_shapes(CFG)[t] for t in TARGETS])


@pytest.mark.parametrize("variant", ["lora", "dora", "vera"])
def test_loraplus_groups_match_peft(variant):
    from peft.optimizers import create_loraplus_optimizer

    model = adapted(variant)
    model.layers[0].ffn_norm.weight.requires_grad_(True)  # another trainable 1-D parameter: goes with B
    twin = peft_twin(model, variant, r=4, alpha=8)
    twin.base_model.model.model.layers[0].post_attention_layernorm.weight.requires_grad_(True)
    ours = lora.loraplus_optimizer(model, torch.optim.AdamW, lr=1e-4, lr_ratio=16)
    theirs = create_loraplus_optimizer(twin, torch.optim.AdamW, lr=1e-4, loraplus_lr_ratio=16)
    our_names = {id(p): peft_name(n) for n, p in model.named_parameters()}
    their_names = {id(p): n for n, p in twin.named_parameters()}
    assert len(ours.param_groups) == len(theirs.param_groups) == 4
    for mine, peft_group in zip(ours.param_groups, theirs.param_groups):
        assert mine["lr"] == pytest.approx(peft_group["lr"])
        assert mine["weight_decay"] == peft_group["weight_decay"]
        assert sorted(our_names[id(p)] for p in mine["params"]) == sorted(their_names[id(p)] for p in peft_group["params"])
    # A at lr; B, DoRA magnitudes, VeRA vectors and the norm gain at 16·lr
    for group in ours.param_groups:
        for p in group["params"]:
            assert group["lr"] == pytest.approx(1e-4 if "lora_A" in our_names[id(p)] else 1.6e-3)


@pytest.mark.parametrize("variant", lora.VARIANTS)
def test_merge_is_exact_and_matches_peft(variant):
    model = adapted(variant)
    randomize_adapters(model)
    idx = tokens()
    twin = peft_twin(model, variant, r=4, alpha=8)
    with torch.no_grad():
        unmerged = model(idx)
        originals = {n: p.clone() for n, p in model.named_parameters() if n.endswith("base.weight")}
        lora.merge(model)
        merged = model(idx)
        merged_weights = {n: p.clone() for n, p in model.named_parameters() if n.endswith("base.weight")}
        torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
        # the merged weights are peft's merged weights
        their_merged = twin.merge_and_unload().state_dict()
        for name, w in merged_weights.items():
            torch.testing.assert_close(w, their_merged[_hf_name(name.replace(".base.weight", ".weight"))], rtol=1e-5, atol=1e-6)
        # and a merged layer is just a linear layer: no adapter compute left
        plain = base_model()
        plain.load_state_dict({n.replace(".base.", "."): p for n, p in model.state_dict().items()
                               if "lora_" not in n and "vera_" not in n and "projections" not in n})
        torch.testing.assert_close(plain(idx), merged, rtol=1e-5, atol=1e-5)
        lora.unmerge(model)
        for name, w in originals.items():
            torch.testing.assert_close(model.get_parameter(name), w, rtol=0, atol=1e-6)
        torch.testing.assert_close(model(idx), unmerged, rtol=1e-5, atol=1e-5)


def test_count_formulas_match_built_models():
    for variant in lora.VARIANTS:
        for targets in (["wq"], ["wq", "wk", "wv", "wo"], ["w1", "w2", "w3", "output"]):
            model = adapted(variant, r=4, targets=targets)
            assert lora.trainable_parameters(model) == lora.count_adapter_parameters(CFG, targets, 4, variant)
    assert lora.adapter_parameters(4096, 4096, 8, "lora") == 65536  # r(in + out)
    assert lora.adapter_parameters(4096, 4096, 8, "dora") == 65536 + 4096
    assert lora.adapter_parameters(4096, 4096, 256, "vera") == 256 + 4096


def test_finetune_state_bytes():
    full = lora.finetune_state_bytes(1e9, 1e9, full=True)
    assert full["total"] == 16e9  # mixed-precision Adam: 2 + 2 + 4 + 8
    qlora = lora.finetune_state_bytes(1e9, 1e6, backbone="nf4")
    assert qlora["weights"] == pytest.approx((1e9 - 1e6) * 4.127 / 8 + 4e6, rel=1e-3)
    assert qlora["total"] == pytest.approx(qlora["weights"] + 4e6 + 8e6)


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="exceeds min"):
        adapted("lora", r=CFG.n_kv_heads * CFG.head_dim + 1, targets=["wk"])
    with pytest.raises(ValueError, match="matches no module.*wq"):
        adapted("lora", targets=["q_proj"])
    with pytest.raises(ValueError, match="not a linear layer"):
        adapted("lora", targets=["attention"])
    with pytest.raises(ValueError, match="unknown variant"):
        adapted("lora+")
    with pytest.raises(ValueError, match="positive integer"):
        adapted("lora", r=0)
    model = adapted("lora")
    with pytest.raises(ValueError, match="already has adapters"):
        lora.apply_lora(model, ["wq"])
    lora.merge(model)
    with pytest.raises(ValueError, match="already merged"):
        lora.merge(model)
    frozen = base_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        lora.loraplus_param_groups(frozen, lr=1e-4)


def _fit(model, optimizer, steps=8):
    idx = tokens(batch=4, length=16)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_lora_over_bitsandbytes_linear4bit_trains_on_cpu():
    model = base_model()
    from llmsys.lora.quant import bnb_linears

    assert len(bnb_linears(model, skip=("wk", "wv", "wo", "w1", "w2", "w3", "output"))) == CFG.n_layers
    assert all(type(block.attention.wq) is bnb.nn.Linear4bit for block in model.layers)
    packed = model.layers[0].attention.wq.weight.data.clone()
    lora.apply_lora(model, ["wq"], r=4, alpha=8)
    layer = model.layers[0].attention.wq
    assert lora.is_quantized(layer.base)
    losses = _fit(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    assert losses[-1] < losses[0]
    assert torch.equal(layer.base.weight.data, packed)  # the 4-bit backbone never changed
    assert layer.lora_B.abs().sum() > 0
    with pytest.raises(ValueError, match="4-bit"):
        layer.merge()


def test_adamw_state_bytes_fp32_and_8bit():
    shapes = [(512, 256), (256, 640)]
    results = {}
    for name, cls in [("fp32", torch.optim.AdamW), ("8bit", bnb.optim.AdamW8bit)]:
        params = [nn.Parameter(torch.randn(s)) for s in shapes]
        optimizer = cls(params, lr=1e-3)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        results[name] = lora.optimizer_state_bytes(optimizer)
    n = sum(a * b for a, b in shapes)
    assert results["fp32"] == lora.adam_state_bytes(n, 32) == 8 * n
    assert results["8bit"] == lora.adam_state_bytes([a * b for a, b in shapes], 8)
    assert 0.25 < results["8bit"] / results["fp32"] < 0.26  # 2 bytes of state per parameter instead of 8


def test_paged_adamw_keeps_fp32_state_bytes():
    """Paging moves state to CPU memory under GPU pressure; it does not shrink it (on a CPU it is a no-op)."""
    p = nn.Parameter(torch.randn(256, 64))
    optimizer = bnb.optim.PagedAdamW([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer.step()
    assert lora.optimizer_state_bytes(optimizer) == lora.adam_state_bytes(p.numel(), 32)


def test_every_method_trains_on_the_same_batches():
    ids = (torch.arange(400) * 7) % CFG.vocab_size  # a learnable rule: the next token is this one + 7
    base = base_model()
    before = lora.eval_loss(base, ids, seq_len=16, max_windows=4)
    results = {m: lora.run_method(m, base, ids, steps=6, batch_size=4, seq_len=16, r=4, vera_r=16,
                                  eval_sets={"train": ids}) for m in lora.METHODS}
    assert results["full"]["train loss"] < before and results["lora"]["train loss"] < before
    for method, result in results.items():
        assert len(result["losses"]) == 6
        # the same first batch: at step 0 every adapter method sees the base model's loss
        if method not in ("full", "qlora"):
            assert result["losses"][0] == pytest.approx(results["full"]["losses"][0], abs=1e-5), method
        assert result["optimizer_bytes"] == 8 * result["trainable"]  # AdamW: m and v in fp32
        assert result["grad_bytes"] == 4 * result["trainable"]
        assert result["state_bytes"] == result["weight_bytes"] + result["grad_bytes"] + result["optimizer_bytes"]
    assert results["full"]["trainable"] == CFG.n_params()
    assert results["lora"]["trainable"] == results["lora+"]["trainable"] == results["qlora"]["trainable"]
    assert results["vera"]["trainable"] < results["lora"]["trainable"] < results["dora"]["trainable"] < CFG.n_params()
    assert results["qlora"]["weight_bytes"] < results["lora"]["weight_bytes"]  # a 4-bit backbone
    assert lora.eval_loss(base, ids, seq_len=16, max_windows=4) == before  # the base model was copied, not changed
    with pytest.raises(ValueError, match="unknown method"):
        lora.prepare(base_model(), "prefix")
