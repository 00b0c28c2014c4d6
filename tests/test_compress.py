"""Chapter 10's compression methods, each checked by the invariant that defines it."""

import copy

import gguf
import pytest
import torch

from llmsys.core import cache, pretrained, zoo
from llmsys.lora import quant
from llmsys.compress import awq, calibrate, formats, gptq, kvcache, prune, qat, smoothquant, weightonly
from llmsys.core.model import ModelConfig, Transformer, rope_tables
from llmsys.serving import kvquant


def correlated_inputs(n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("granularity", ["tensor", "channel", 16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_round_trip_within_half_a_step(bits, granularity, symmetric):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(bits)) * 0.1
    groups = formats.grouped(w, granularity)
    scale, _ = formats.rtn_scales(groups, bits, symmetric)
    err = (formats.fake_quantize(w, bits, granularity, symmetric) - w).abs()
    bound = (scale / 2).expand_as(groups).reshape(w.shape)
    assert (err <= bound * (1 + 1e-5) + 1e-9).all()
    codes = formats.rtn_codes(groups, *formats.rtn_scales(groups, bits, symmetric), bits)
    assert len(codes.unique()) <= 2**bits


def test_rtn_of_a_grid_value_is_exact_and_bits_count_the_scales():
    w = torch.arange(-7, 8, dtype=torch.float32).repeat(2, 2)[:, :16] * 0.25  # on the 4-bit symmetric grid
    assert torch.equal(formats.fake_quantize(w, 4, 16, True), w)
    assert formats.bits_per_weight(4, 128, True) == 4 + 16 / 128
    assert formats.bits_per_weight(4, 32, False) == 5.0  # = GGUF Q4_1
    with pytest.raises(ValueError, match="positive group size"):
        formats.fake_quantize(torch.randn(4, 10), 4, 0)
    with pytest.raises(ValueError, match="bits must be"):
        formats.fake_quantize(torch.randn(4, 8), 1, "channel")


def test_a_group_size_that_does_not_divide_the_row_leaves_one_shorter_group():
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    for symmetric in (True, False):
        whole = formats.fake_quantize(w, 4, 16, symmetric)  # groups 0-15, 16-31, then 32-39
        torch.testing.assert_close(whole[:, :32], formats.fake_quantize(w[:, :32], 4, 16, symmetric), rtol=0, atol=0)
        torch.testing.assert_close(whole[:, 32:], formats.fake_quantize(w[:, 32:], 4, 8, symmetric), rtol=0, atol=0)
    # 576 inputs in groups of 128: five scales per row (the last for 64 weights)
    assert formats.bits_per_weight(4, 128, True, (8, 576)) == 4 + 16 * 5 / 576
    assert formats.bits_per_weight(4, "channel", False, (8, 576)) == 4 + 32 / 576


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_round_trip_within_its_relative_precision(dtype):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    back = formats.fp8_fake_quantize(w, dtype)
    scale = w.abs().amax(dim=1, keepdim=True) / torch.finfo(dtype).max
    smallest_normal = torch.finfo(dtype).smallest_normal * scale
    # normal numbers: half a unit in the last place, 2^-(mantissa + 1) relative; subnormals: absolute
    bound = torch.maximum(w.abs() * 2.0 ** -(formats.fp8_mantissa_bits(dtype) + 1), smallest_normal * 2.0 ** -formats.fp8_mantissa_bits(dtype))
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()


def test_nf4_comes_from_chapter_3():
    w = torch.randn(8, 64)
    packed, absmax = quant.quantize_nf4(w)
    assert torch.equal(formats.nf4_fake_quantize(w), quant.dequantize_nf4(packed, absmax, w.shape))


def test_gguf_blocks_decode_like_the_gguf_package_and_match_the_model():
    path = cache.entry_dir(zoo.PRETRAINED) / pretrained.GGUF_FILE
    if not path.is_file():
        pytest.skip("the SmolLM2 GGUF file is not in the zoo cache: run `python -m llmsys zoo smollm2`")
    names = {"token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_v.weight"}
    ours = formats.read_gguf(path, names)
    reader = gguf.GGUFReader(str(path))
    model = zoo.load("smollm2", device="cpu")
    mine = {"token_embd.weight": model.tok_embeddings.weight, "blk.0.ffn_down.weight": model.layers[0].feed_forward.w2.weight,
            "blk.0.attn_v.weight": model.layers[0].attention.wv.weight}
    for t in reader.tensors:
        if t.name in names:
            kind, w = ours[t.name]
            reference = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(w.shape)
            assert torch.equal(w, reference), t.name
            assert torch.equal(w, mine[t.name].detach()), t.name
    assert ours["token_embd.weight"][0] == "Q8_0" and ours["blk.0.ffn_down.weight"][0] == "Q4_1"
    assert formats.gguf_bits_per_weight("Q8_0") == 8.5 and formats.gguf_bits_per_weight("Q4_1") == 5.0
    # Q4_1 = asymmetric 4-bit RTN in groups of 32: re-quantizing the decoded weights gives them back
    w = ours["blk.0.ffn_down.weight"][1]
    assert torch.allclose(formats.fake_quantize(w, 4, 32, symmetric=False), w, atol=1e-3 * float(w.abs().max()))


# ---------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("granularity,symmetric", [("channel", True), ("tensor", False), (4, True), (8, False)])
def test_gptq_cholesky_lazy_batches_equal_the_explicit_obq_updates(granularity, symmetric):
    X = correlated_inputs(64, 16)
    W = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h = gptq.Hessian(16)
    h.add(X)
    fast = gptq.gptq_quantize(W, h.value, 3, granularity, symmetric, blocksize=8)
    exact = gptq.obq_reference(W, h.value, 3, granularity, symmetric)
    torch.testing.assert_close(fast, exact, rtol=0, atol=1e-9)


def test_gptq_act_order_is_gptq_in_the_order_of_decreasing_hessian_diagonal():
    X = correlated_inputs(64, 16, seed=6) * torch.linspace(0.2, 3, 16, dtype=torch.float64)
    W = torch.randn(8, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    h = gptq.Hessian(16)
    h.add(X)
    order = torch.argsort(torch.diag(h.value), descending=True)
    assert not torch.equal(order, torch.arange(16))
    exact = gptq.obq_reference(W[:, order], h.value[order][:, order], 3, 4, False)[:, torch.argsort(order)]
    torch.testing.assert_close(gptq.gptq_quantize(W, h.value, 3, 4, False, blocksize=8, act_order=True), exact,
                               rtol=0, atol=1e-9)


def test_gptq_with_a_shorter_last_group_equals_the_explicit_updates():
    X = correlated_inputs(64, 20, seed=8)
    W = torch.randn(6, 20, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    h = gptq.Hessian(20)
    h.add(X)
    torch.testing.assert_close(gptq.gptq_quantize(W, h.value, 3, 8, False, blocksize=8),
                               gptq.obq_reference(W, h.value, 3, 8, False), rtol=0, atol=1e-9)


def test_weights_on_the_q4_1_grid_come_back_exactly_from_rtn_and_gptq_on_that_grid():
    """The model's linears are GGUF Q4_1 (asymmetric 4-bit, blocks of 32): on that very grid RTN and GPTQ
    find nothing to round (GPTQ has no error to push on), while a group of 64 rounds them a second time."""
    path = cache.entry_dir(zoo.PRETRAINED) / pretrained.GGUF_FILE
    if not path.is_file():
        pytest.skip("the SmolLM2 GGUF file is not in the zoo cache: run `python -m llmsys zoo smollm2`")
    w = zoo.load("smollm2", device="cpu").layers[2].attention.wo.weight.detach()[:64]  # (64, 576)
    h = gptq.Hessian(576)
    h.add(correlated_inputs(1024, 576, seed=10))
    assert torch.equal(formats.fake_quantize(w, 4, 32, symmetric=False), w)
    assert torch.equal(gptq.gptq_quantize(w, h.value, 4, 32, symmetric=False), w)
    again = gptq.gptq_quantize(w, h.value, 4, 64, symmetric=False)
    assert float((again - w).norm() / w.norm()) > 0.01


def test_linears_sharing_an_input_share_its_statistics_and_one_stacked_gptq_pass():
    """q/k/v (and w1/w3) see the same input: one InputStats, and GPTQ on their stacked rows equals GPTQ
    on each (the rows of W are independent under one Hessian)."""
    from llmsys.compress import measure

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    model = Transformer(cfg).eval()
    calib = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    stacked = measure.quantized_copy(model, "gptq", 3, 16, False, calib)
    separate = copy.deepcopy(model)

    def each_linear(index, block, stats):
        assert stats["attention.wq"] is stats["attention.wv"] and stats["feed_forward.w1"] is stats["feed_forward.w3"]
        for name, linear in calibrate.block_linears(block).items():
            linear.weight.data = gptq.gptq_quantize(linear.weight.data, stats[name].hessian.value, 3, 16, False)

    calibrate.sequential(separate, calib, each_linear, progress=False)
    for a, b in zip(stacked.parameters(), separate.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_gptq_first_update_is_the_least_squares_optimum():
    """After column 0 is rounded, the other columns move to the exact minimiser of ‖(W - Ŵ) X‖ (no damping)."""
    X = correlated_inputs(200, 6)  # (n, in)
    W = torch.randn(5, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    H = 2 * X.T @ X / X.size(0)
    q0 = gptq.gptq_quantize(W[:, :1], H[:1, :1], 3, "channel", damp=0.0)[:, 0]
    # the OBQ step, by hand from the inverse Hessian
    Hinv = torch.linalg.inv(H)
    stepped = W - ((W[:, 0] - q0) / Hinv[0, 0])[:, None] * Hinv[0][None, :]
    # the least-squares answer: with column 0 fixed at q0, the rest minimises ‖(W - Ŵ) Xᵀ‖
    target = X @ W.T - X[:, :1] * q0[None, :]  # (n, out)
    rest = torch.linalg.lstsq(X[:, 1:], target).solution.T  # (out, in - 1)
    torch.testing.assert_close(stepped[:, 1:], rest, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(stepped[:, 0], q0)


def test_gptq_lowers_the_reconstruction_error_below_rtn():
    X = correlated_inputs(256, 64, seed=3)
    W = torch.randn(32, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    h = gptq.Hessian(64)
    h.add(X)
    for bits in (3, 4):
        err_gptq = gptq.reconstruction_error(W, gptq.gptq_quantize(W, h.value, bits, 16), h.value)
        err_rtn = gptq.reconstruction_error(W, formats.fake_quantize(W, bits, 16), h.value)
        assert err_gptq < 0.8 * err_rtn, (bits, err_gptq, err_rtn)
    with pytest.raises(ValueError, match="multiple of the group size"):
        gptq.gptq_quantize(W, h.value, 4, 16, blocksize=24)


# ---------------------------------------------------------------- AWQ, SmoothQuant, LLM.int8()


def tiny_block_and_stats(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    block = Transformer(cfg).layers[0].eval()
    with torch.no_grad():  # norms with uneven gains: some channels carry large activations
        block.attention_norm.weight.copy_(torch.rand(32) * 4 + 0.1)
        block.ffn_norm.weight.copy_(torch.rand(32) * 4 + 0.1)
    x = torch.randn(4, 16, 32)
    cos, sin = rope_tables(cfg.head_dim, torch.arange(16), cfg.rope_theta)
    return block, x, cos, sin, calibrate.block_input_stats(block, x, cos, sin)


@pytest.mark.parametrize("group", list(calibrate.FOLD_TARGETS))
def test_folding_a_scale_preserves_the_block_output(group):
    block, x, cos, sin, _ = tiny_block_and_stats()
    with torch.no_grad():
        before = block(x, cos, sin)
        calibrate.fold_input_scale(block, group, torch.rand(block.get_submodule(calibrate.SHARED_INPUTS[group][0]).in_features) * 3 + 0.2)
        torch.testing.assert_close(block(x, cos, sin), before, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no op to fold"):
        calibrate.fold_input_scale(block, "attention_out", torch.ones(32))


def test_awq_and_smoothquant_preserve_the_output_in_full_precision():
    block, x, cos, sin, stats = tiny_block_and_stats(1)
    with torch.no_grad():
        before = block(x, cos, sin)
        for group in calibrate.FOLD_TARGETS:
            weights = [block.get_submodule(n).weight for n in calibrate.SHARED_INPUTS[group]]
            s, alpha, errors = awq.search_scale(weights, stats[calibrate.SHARED_INPUTS[group][0]], 3, 16)
            assert errors[round(alpha * awq.GRID)] == min(errors) and errors[0] >= min(errors)
            calibrate.fold_input_scale(block, group, s)
        torch.testing.assert_close(block(x, cos, sin), before, rtol=1e-4, atol=1e-5)
        smoothquant.smooth_block(block, calibrate.block_input_stats(block, x, cos, sin))
        torch.testing.assert_close(block(x, cos, sin), before, rtol=1e-4, atol=1e-5)


def test_awq_scales_divide_the_hessian_gptq_sees_by_s_s():
    """AWQ + GPTQ rescales each Hessian instead of measuring again: the folded block's inputs,
    measured, give H / (s sᵀ)."""
    block, x, cos, sin, stats = tiny_block_and_stats(3)
    _, scales = awq.fold_scales(block, stats, 3, 16)
    again = calibrate.block_input_stats(block, x, cos, sin)
    for group, s in scales.items():
        name = calibrate.SHARED_INPUTS[group][0]
        H = stats[name].hessian.value
        torch.testing.assert_close(again[name].hessian.value, H / (s[:, None] * s[None, :]).to(H.dtype),
                                   rtol=1e-4, atol=1e-6 * float(H.abs().max()))


def test_awq_output_error_at_most_rtn():
    block, x, cos, sin, stats = tiny_block_and_stats(2)
    names = calibrate.SHARED_INPUTS["attention_norm"]
    weights = [block.get_submodule(n).weight for n in names]
    _, alpha, errors = awq.search_scale(weights, stats[names[0]], 3, 16)
    assert min(errors) <= errors[0]  # α = 0 is plain RTN


@pytest.mark.parametrize("granularity", [8, 12, "channel"])
def test_awq_clip_is_each_groups_best_range(granularity):
    """Every (row, group) gets the candidate range with the least output error on its inputs (the
    groups of 12 leave a shorter last group of 8 in rows of 32); a weight far out in a group makes
    a smaller range better than rounding it all."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 32, generator=g), torch.randn(40, 32, generator=g)
    w[0, 3] = 12.0
    clipped = awq.search_clip(w, x, 3, granularity, symmetric=False)
    size = 32 if granularity == "channel" else granularity
    for row in range(6):
        for start in range(0, 32, size):
            cols = slice(start, start + size)
            wg, xg = w[row:row + 1, cols], x[:, cols]
            n = wg.size(1)
            candidates = [wg.clamp(-wg.abs().max() * (1 - i / awq.GRID), wg.abs().max() * (1 - i / awq.GRID))
                          for i in range(int(awq.MAX_SHRINK * awq.GRID) + 1)]
            errors = [float((xg @ (formats.fake_quantize(c, 3, n, False) - wg).T).pow(2).sum()) for c in candidates]
            got = float((xg @ (formats.fake_quantize(clipped[row:row + 1, cols], 3, n, False) - wg).T).pow(2).sum())
            assert got == pytest.approx(min(errors), rel=1e-5), (row, start)
    assert not torch.equal(clipped[0], w[0])  # the outlier's row was clipped
    assert torch.equal(awq.search_clip(w, x, 3, "tensor"), w)


def test_smoothquant_makes_w8a8_better_on_outlier_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g)
    x[:, [5, 40]] *= 50  # outlier channels, in every token
    w = torch.randn(32, 128, generator=g) * 0.05
    exact = x @ w.T
    s = smoothquant.smooth_scale(x.abs().amax(dim=0), [w])
    plain = smoothquant.w8a8_matmul(x, w)
    smoothed = smoothquant.w8a8_matmul(x / s, w * s)
    torch.testing.assert_close((x / s) @ (w * s).T, exact, rtol=1e-4, atol=1e-4)  # the same function
    assert (smoothed - exact).norm() < 0.5 * (plain - exact).norm()


def test_llm_int8_split_matches_bitsandbytes():
    import bitsandbytes as bnb
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, bias=False)
    x = torch.randn(16, 256)
    x[:, [3, 77]] *= 60
    exact = x @ linear.weight.T
    reference = bnb.nn.Linear8bitLt(256, 64, bias=False, has_fp16_weights=False, threshold=6.0)
    reference.load_state_dict(linear.state_dict())
    with torch.no_grad():
        theirs = reference.to("cpu").eval()(x.half()).float()  # eval: the int8 path (training dequantizes)
        ours = smoothquant.int8_outlier_matmul(x, linear.weight)
        plain = smoothquant.w8a8_matmul(x, linear.weight)
    err = (ours - exact).norm()
    assert err < 0.3 * (plain - exact).norm()  # the split removes most of int8's error
    assert (theirs - ours).norm() < 0.5 * err  # and agrees with bitsandbytes up to its fp16 arithmetic


# ---------------------------------------------------------------- pruning


def test_two_four_mask_keeps_exactly_two_of_every_four_the_largest():
    scores = torch.rand(16, 64, generator=torch.Generator().manual_seed(0))
    keep = prune.n_m_mask(scores)
    groups, kept = keep.view(-1, 4), scores.view(-1, 4)
    assert (groups.sum(dim=1) == 2).all()
    assert (kept[groups].view(-1, 2).min(dim=1).values >= kept[~groups].view(-1, 2).max(dim=1).values).all()
    with pytest.raises(ValueError, match="multiple of m"):
        prune.n_m_mask(torch.rand(4, 6))


def test_magnitude_and_wanda_masks_drop_the_lowest_scores():
    w = torch.randn(8, 32)
    keep = prune.magnitude_mask(w, 0.5)
    assert int(keep.sum()) == 128 and w.abs()[keep].min() >= w.abs()[~keep].max()
    norm = torch.rand(32) * 10
    keep = prune.row_mask(prune.wanda_scores(w, norm), 0.25)
    scores = w.abs() * norm
    assert (keep.sum(dim=1) == 24).all()
    for r in range(8):
        assert scores[r][keep[r]].min() >= scores[r][~keep[r]].max()


def test_wanda_keeps_a_small_weight_on_a_large_input():
    w = torch.tensor([[1.0, 0.1, 0.5, 0.6]])
    keep = prune.row_mask(prune.wanda_scores(w, torch.tensor([1.0, 100.0, 1.0, 1.0])), 0.5)
    assert keep.tolist() == [[True, True, False, False]]


# ---------------------------------------------------------------- KV cache, kernels, QAT


def test_kv_keys_per_channel_values_per_token_and_int8_agrees_with_chapter_9():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 32, 16, generator=g)
    k[..., 3] *= 30  # an outlier channel
    v = torch.randn(1, 2, 32, 16, generator=g)
    k8 = kvcache.quantize_keys(k, 8, 16)
    serving = kvquant.dequantize_keys(*kvquant.quantize_keys(k, 16))
    # serving stores fp16 scales: a rounded scale may move a code by one step, never more
    torch.testing.assert_close(k8, serving, rtol=0, atol=1.01 * float(k.abs().max()) / 127)
    torch.testing.assert_close(kvcache.quantize_values(v, 8), kvquant.dequantize_values(*kvquant.quantize_values(v)),
                               rtol=0, atol=1.01 * float(v.abs().max()) / 127)
    # per token, the outlier channel sets every token's step and the other channels lose their precision
    normal = [c for c in range(16) if c != 3]
    per_channel = (kvcache.quantize_keys(k, 4, 16) - k)[..., normal].norm()
    per_token = (kvcache.quantize_values(k, 4) - k)[..., normal].norm()
    assert per_channel < 0.2 * per_token
    assert kvcache.bytes_per_token(30, 3, 64, None) == 2 * 30 * 3 * 64 * 2
    assert kvcache.bytes_per_token(30, 3, 64, 4, 32) < kvcache.bytes_per_token(30, 3, 64, None) / 3


def test_quantized_kv_cache_perplexity_is_exact_at_high_precision_and_grows_at_low():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    windows = torch.randint(0, 64, (2, 65))
    full = kvcache.perplexity(model, windows, None, group=16)
    with torch.no_grad():
        logits = model(windows[:, :-1])
    assert full == pytest.approx(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).exp()), rel=1e-5)
    assert kvcache.perplexity(model, windows, 8, 16) == pytest.approx(full, rel=1e-2)


@pytest.mark.skipif(not weightonly.has_cpu_kernels(), reason="this torch has no CPU weight-only kernels")
@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_kernels_equal_the_dequantized_matmul(bits):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    x = torch.randn(3, 128).to(torch.bfloat16)
    module = weightonly.Int8WeightOnlyLinear(linear) if bits == 8 else weightonly.Int4WeightOnlyLinear(linear, 32)
    grid = (formats.fake_quantize(linear.weight, 8, "channel") if bits == 8
            else formats.fake_quantize(linear.weight, 4, 32, symmetric=False))
    reference = x.float() @ grid.detach().T
    torch.testing.assert_close(module(x).float(), reference, rtol=0.02, atol=0.02 * float(reference.abs().max()))


def test_straight_through_estimator_passes_the_gradient():
    w = torch.randn(4, 32, requires_grad=True)
    y = qat.FakeQuantizeSTE.apply(w, 3, 32, True)
    assert torch.equal(y, formats.fake_quantize(w.detach(), 3, 32, True))
    upstream = torch.randn(4, 32)
    y.backward(upstream)
    assert torch.equal(w.grad, upstream)


def test_calibration_and_heldout_windows_are_fixed_and_come_from_different_text():
    from llmsys.compress import measure

    held, calib = measure.windows("heldout", 4, 64), measure.windows("calibration", 4, 64)
    assert held.shape == calib.shape == (4, 65) and torch.equal(held, measure.windows("heldout", 4, 64))
    calib_text = {tuple(w[i:i + 16].tolist()) for w in measure.windows("calibration", 64, 64) for i in range(0, 49, 16)}
    assert not any(tuple(w[i:i + 16].tolist()) in calib_text for w in held for i in range(0, 49, 16))
    with pytest.raises(ValueError, match="windows of"):
        measure.windows("heldout", 10**6)
    with pytest.raises(ValueError, match="split must be"):
        measure.windows("test", 1)
