"""NF4 from llmsys.lora.quant, checked against bitsandbytes 0.50 (which runs on the CPU) and the QLoRA paper."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF

from llmsys import lora
from llmsys.lora import quant
from llmsys.core.model import ModelConfig, Transformer



def weights(n, seed=0, std=0.02):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * std


def test_nf4_values_are_normal_quantiles_and_match_bitsandbytes():
    theirs = bnbF.get_4bit_type("nf4", device="cpu")
    assert torch.equal(quant.nf4_code(), theirs)
    # rebuilt from N(0, 1) quantiles: equal up to the fp32 rounding of the published table
    torch.testing.assert_close(quant.nf4_code_from_quantiles(), theirs, rtol=0, atol=3e-7)
    code = quant.nf4_code()
    assert (code < 0).sum() == 7 and (code > 0).sum() == 8 and code[quant.NF4_ZERO_CODE] == 0
    assert code[0] == -1 and code[-1] == 1 and torch.all(code[1:] > code[:-1])


def test_dynamic_8bit_code_matches_bitsandbytes():
    assert torch.equal(quant.dynamic_code_8bit(), bnbF.create_dynamic_map(signed=True))


@pytest.mark.parametrize("n", [64 * 40, 64 * 7 + 10])  # whole blocks, a short last block
def test_nf4_codes_and_values_match_bitsandbytes(n):
    w = weights(n, seed=n)
    packed, absmax = quant.quantize_nf4(w)
    theirs, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    theirs = theirs.view(-1)
    # zero padding fills whole blocks: our extra bytes hold only the 0 code (0x77)
    assert packed.numel() == 32 * absmax.numel()
    assert torch.equal(packed[: theirs.numel()], theirs)
    assert torch.all(packed[theirs.numel():] == 0x77)
    assert torch.equal(absmax, state.absmax)
    ours = quant.dequantize_nf4(packed, absmax, w.shape)
    assert torch.equal(ours, bnbF.dequantize_4bit(theirs.view(-1, 1), state).view(-1))


def test_less_than_one_block_is_padded_like_bitsandbytes():
    w = weights(7, seed=7)
    packed, absmax = quant.quantize_nf4(w)
    theirs, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert packed.numel() == 32 and torch.equal(packed[:4], theirs.view(-1)) and torch.equal(absmax, state.absmax)
    deq = quant.dequantize_nf4(packed, absmax, (7,))
    assert deq.shape == (7,) and deq.abs().max() == w.abs().max()


def test_nf4_invariants():
    w = weights(64 * 16).view(16, 64)
    w[3] = 0  # an all-zero block
    w[5, 7] = 0
    packed, absmax = quant.quantize_nf4(w)
    assert packed.dtype == torch.uint8 and packed.numel() == w.numel() // 2  # two codes per byte
    assert torch.equal(absmax, w.abs().amax(dim=1))  # one absmax per block of 64 (a row here)
    codes = quant.unpack_4bit(packed).view(16, 64)
    deq = quant.dequantize_nf4(packed, absmax, w.shape)
    torch.testing.assert_close(deq, quant.nf4_code()[codes.long()] * absmax[:, None], rtol=0, atol=0)  # code × absmax
    assert torch.all(deq[3] == 0) and deq[5, 7] == 0  # 0 -> 0
    # each block's largest magnitude is stored exactly (it maps to ±1)
    assert torch.equal(deq.abs().amax(dim=1), absmax)
    # nearest code: the error is at most half the widest gap between neighbouring code values
    gap = (quant.nf4_code()[1:] - quant.nf4_code()[:-1]).max()
    assert torch.all((deq - w).abs() <= gap / 2 * absmax[:, None] + 1e-7)


def test_pack_unpack_roundtrip():
    codes = torch.randint(16, (101,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    packed = quant.pack_4bit(codes)
    assert packed.numel() == 51 and packed[0] == (codes[0] << 4) | codes[1]
    assert torch.equal(quant.unpack_4bit(packed, 101), codes)


def test_double_quantization_matches_bitsandbytes():
    w = weights(64 * 256 * 3 + 64 * 5, seed=4)  # 773 blocks: 3 full blocks of 256 scales and a short one
    _, absmax = quant.quantize_nf4(w)
    codes, scales, offset = quant.double_quantize(absmax)
    _, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert offset == state.offset and torch.equal(scales, state.state2.absmax)
    assert state.state2.blocksize == 256 and scales.numel() == 4
    # bitsandbytes' C kernel and a plain nearest-value search may round a value that sits on a
    # boundary differently: then the two codes must be neighbours
    differ = codes.long() != state.absmax.long()
    assert differ.float().mean() < 0.01
    assert torch.all((codes.long() - state.absmax.long())[differ].abs() == 1)
    restored = quant.double_dequantize(codes, scales, offset)
    theirs = bnbF.dequantize_blockwise(state.absmax, state.state2) + state.offset
    assert (restored - theirs).abs().max() <= (restored - absmax).abs().max() * 2 + 1e-9
    # 8 bits are plenty for similar positive scales: relative error well under 1%
    assert ((restored - absmax).abs() / absmax).max() < 0.01


def test_bits_per_param_formula_and_measurement():
    assert quant.bits_per_param(double_quant=False) == 4.5  # 4 + 32/64
    assert quant.bits_per_param() == pytest.approx(4.127, abs=5e-4)  # 4 + 8/64 + 32/(64·256)
    saving = quant.bits_per_param(double_quant=False) - quant.bits_per_param()
    assert saving == pytest.approx(0.373, abs=5e-4)
    assert saving * 65e9 / 8 / 1e9 == pytest.approx(3.03, abs=0.01)  # ≈3 GB at 65B (QLoRA)
    w = weights(64 * 256 * 4).view(256, 256)
    single, double = quant.NF4Weight(w, double_quant=False), quant.NF4Weight(w)
    assert single.measured_bits_per_param == 4.5
    # measured storage also holds one fp32 offset per tensor: 32 bits over the tensor
    assert double.measured_bits_per_param == pytest.approx(quant.bits_per_param() + 32 / w.numel(), rel=1e-12)
    # and bitsandbytes stores exactly as many bytes
    q, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    theirs = q.nbytes + state.absmax.nbytes + state.state2.absmax.nbytes + state.offset.nbytes
    assert double.nbytes == theirs


def test_nf4_linear_matches_bitsandbytes_linear4bit():
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    ours = quant.NF4Linear(linear)
    theirs = bnb.nn.Linear4bit(128, 96, bias=True, compute_dtype=torch.float32, quant_type="nf4",
                               compress_statistics=True)
    theirs.load_state_dict(linear.state_dict())
    theirs = theirs.to("cpu")
    x = torch.randn(5, 128)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-3, atol=1e-4)
    # the 4-bit weights are close to the originals, not equal
    relative_error = (ours.dequantize() - linear.weight).norm() / linear.weight.norm()
    assert 0 < relative_error < 0.15


def test_model_weight_bytes_counts_bitsandbytes_block_scales():
    # Linear4bit keeps its scales in weight.quant_state, not in buffers: a peak-memory baseline
    # that missed them would charge this model's own scales to "memory held by others".
    linear = nn.Linear(512, 256, bias=True)
    ours = quant.NF4Linear(linear)
    theirs = bnb.nn.Linear4bit(512, 256, bias=True, compute_dtype=torch.float32, quant_type="nf4",
                               compress_statistics=True)
    theirs.load_state_dict(linear.state_dict())
    theirs = theirs.to("cpu")
    lookup_tables = (16 + 256) * 4  # bitsandbytes also stores its NF4 and 8-bit code tables (fp32)
    assert quant.model_weight_bytes(ours) <= quant.model_weight_bytes(theirs) <= quant.model_weight_bytes(ours) + lookup_tables


def test_quantize_linears_and_qlora_trains():
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg)
    dense_bytes = sum(p.nbytes for n, p in model.named_parameters() if "layers" in n and p.dim() == 2)
    names = quant.quantize_linears(model)
    assert len(names) == 7 * cfg.n_layers and "output" not in names  # the head stays in full precision
    nf4 = [m.weight_nf4 for m in model.modules() if isinstance(m, quant.NF4Linear)]
    nf4_bytes = sum(w.nbytes for w in nf4)
    n = sum(w.shape.numel() for w in nf4)
    assert nf4_bytes == pytest.approx(quant.nf4_bytes(n), rel=0.02)  # + one fp32 offset per tensor, short scale blocks
    assert nf4_bytes / dense_bytes == pytest.approx(4.127 / 32, rel=0.02)
    lora.apply_lora(model, ["wq", "wv"], r=4, alpha=8)
    idx = torch.randint(cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    packed = nf4[0].packed.clone()
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert torch.equal(nf4[0].packed, packed)


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="positive even"):
        quant.quantize_nf4(torch.randn(64), blocksize=63)
    with pytest.raises(ValueError, match="floating-point"):
        quant.quantize_nf4(torch.arange(64))
    with pytest.raises(ValueError, match="empty"):
        quant.quantize_nf4(torch.randn(0))
    packed, absmax = quant.quantize_nf4(torch.randn(128))
    with pytest.raises(ValueError, match="blocksize=32"):
        quant.dequantize_nf4(packed, absmax, (128,), blocksize=32)
    with pytest.raises(ValueError, match="needs 256 values"):
        quant.dequantize_nf4(packed, absmax, (16, 16))
    with pytest.raises(ValueError, match="nn.Linear"):
        quant.NF4Linear(nn.Embedding(4, 4))
