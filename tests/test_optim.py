"""llmsys.optim: each optimizer against torch.optim, the decoupled-decay numbers,
Newton–Schulz's singular-value band, Muon against torch.optim.Muon, QK-clip's
exact clipping, and the Triton Newton–Schulz kernel under the interpreter."""

import math

from llmsys.core.device import configure_triton

configure_triton()  # before anything imports triton (torch.utils.flop_counter does): it fixes the interpreter mode

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from llmsys import optim  # noqa: E402
from llmsys.core.model import ModelConfig, Transformer  # noqa: E402


def _regression(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(12, 20, generator=g)), nn.Parameter(torch.randn(20, generator=g))]
    x, y = torch.randn(32, 12, generator=g), torch.randn(32, 20, generator=g)

    def loss_fn():
        W, b = params
        return ((torch.tanh(x @ W) + b - y) ** 2).mean() + 0.01 * (W ** 4).mean()

    return params, loss_fn


def _train(optimizer_cls, steps=100, **kwargs):
    params, loss_fn = _regression()
    opt = optimizer_cls(params, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    return [p.detach() for p in params]


CASES = [
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.05)),
    ("RMSProp", dict(lr=0.01)),
    ("RMSProp", dict(lr=0.01, weight_decay=0.1, alpha=0.9)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.99))),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, weight_decay=0.5, eps=1e-6)),
]


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_scratch_optimizer_equals_torch_over_100_steps(name, kwargs):
    ours_cls, torch_cls = optim.SCRATCH_AND_TORCH[name]
    ours = _train(ours_cls, **kwargs)
    theirs = _train(torch_cls, foreach=False, **kwargs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # and the run really moved the parameters
    start, _ = _regression()
    assert (ours[0] - start[0]).abs().max() > 1e-2


def test_bad_hyperparameters_raise_clear_errors():
    p = [nn.Parameter(torch.ones(2, 2))]
    with pytest.raises(ValueError, match="lr must be >= 0"):
        optim.AdamW(p, lr=-1e-3)
    with pytest.raises(ValueError, match="betas"):
        optim.Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        optim.Muon(p, momentum=1.0)


def test_adamw_zero_gradient_decays_exactly_by_one_minus_lr_wd():
    got = optim.zero_gradient_decay(optim.AdamW, steps=3, theta0=1.0, lr=0.1, weight_decay=0.5)
    assert got == pytest.approx([0.95, 0.9025, 0.857375], abs=1e-12)
    torch_got = optim.zero_gradient_decay(torch.optim.AdamW, steps=3, theta0=1.0, lr=0.1, weight_decay=0.5)
    assert torch_got == pytest.approx(got, abs=1e-12)


def test_adam_l2_zero_gradient_moves_about_lr_per_step():
    got = optim.zero_gradient_decay(optim.Adam, steps=3, theta0=1.0, lr=0.1, weight_decay=0.5)
    assert [round(v, 4) for v in got] == [0.9, 0.8004, 0.7016]
    assert optim.zero_gradient_decay(torch.optim.Adam, steps=3) == pytest.approx(got, abs=1e-12)
    # the L2 term is normalised away: a 10x larger λ moves θ by almost the same amount
    stronger = optim.zero_gradient_decay(optim.Adam, steps=3, weight_decay=5.0)
    assert stronger[0] == pytest.approx(got[0], abs=1e-6)


def test_decay_strength_ignores_gradient_scale_only_for_adamw():
    adamw = [optim.effective_decay(optim.AdamW, s) for s in (1e-2, 1.0, 1e2)]
    adam = [optim.effective_decay(optim.Adam, s) for s in (1e-2, 1.0, 1e2)]
    assert max(adamw) - min(adamw) < 1e-3 * max(adamw)  # Adam's step is scale-free, so is decoupled decay
    assert 0.9 < adamw[0] <= 1.0
    assert adam[0] > 10 * adam[2]  # L2 decay fades where gradients are large


def test_compare_with_torch_and_decay_trajectories():
    # (100-step equality is tested above; here the helper itself, on short runs)
    assert optim.compare_with_torch("AdamW", steps=20, lr=0.01, weight_decay=0.1) < 1e-6
    assert optim.compare_with_torch("Muon", steps=20, lr=0.02) < 1e-6
    assert optim.compare_with_torch("Adam", steps=20, lr=0.01, weight_decay=0.1, betas=(0.5, 0.6)) < 1e-6
    with pytest.raises(ValueError, match="name must be"):
        optim.compare_with_torch("Lion", lr=0.1)
    # with no gradient at all, AdamW's trajectory is the geometric decay and Adam + L2's the table above
    runs = optim.decay_trajectories(lr=0.1, weight_decay=0.5, grad_scale=0.0, steps=3)
    assert runs["AdamW"] == pytest.approx([0.95, 0.9025, 0.857375], abs=1e-12)
    assert runs["Adam + L2"] == pytest.approx(optim.zero_gradient_decay(optim.Adam), abs=1e-12)
    assert runs["no decay"] == [1.0, 1.0, 1.0]


def test_adam_update_rms_matches_the_step_taken():
    p = nn.Parameter(torch.randn(30, 20))
    opt = optim.AdamW([p], lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        before = p.detach().clone()
        p.grad = torch.randn(30, 20)
        opt.step()
    step_rms = ((p.detach() - before) / 1e-2).pow(2).mean().sqrt().item()
    assert optim.adam_update_rms(opt.state[p]) == pytest.approx(step_rms, rel=1e-4)


def test_state_bytes_adam_two_states_muon_one():
    model = nn.Linear(16, 8, bias=False)
    n = sum(p.numel() for p in model.parameters())
    for cls, per_param in [(optim.AdamW, 8), (optim.Muon, 4)]:
        opt = cls(model.parameters(), lr=1e-3)
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        assert optim.state_bytes(opt) == per_param * n


# ---------------------------------------------------------------- Newton–Schulz


def _spectrum_matrix(rows, cols, smallest=1e-4, seed=0):
    """A matrix with singular values log-spaced from 1 down to ``smallest``, and its singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=g))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=g))
    sigma = torch.logspace(0, math.log10(smallest), k)
    return U @ torch.diag(sigma) @ V.T, U, sigma, V


def _assert_in_band(G, U=None, V=None, sigma=None):
    """Every direction whose σ is at least 2e-3·‖G‖_F comes out with a singular value in [0.5, 1.5]."""
    out = optim.newton_schulz(G).float()
    assert out.dtype == torch.float32 and out.shape == G.shape
    if U is None:
        U, sigma, Vh = torch.linalg.svd(G.float(), full_matrices=False)
        V = Vh.mT
    gain = torch.diagonal(U.T @ out @ V)  # what NS did to each input direction
    big = sigma / sigma.norm() >= 2e-3
    assert big.sum() > 0
    assert gain[big].min() > 0.5 and gain[big].max() < 1.5, (gain[big].min(), gain[big].max())
    assert torch.linalg.svdvals(out).max() < 1.5


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (48, 48)])
def test_newton_schulz_band_on_random_matrices(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    _assert_in_band(G)
    if shape[0] != shape[1]:  # well-conditioned: every singular value lands in the band
        s = torch.linalg.svdvals(optim.newton_schulz(G).float())
        assert s.min() > 0.5 and s.max() < 1.5


def test_newton_schulz_band_on_a_wide_spectrum():
    G, U, sigma, V = _spectrum_matrix(96, 160)
    _assert_in_band(G, U, V, sigma)
    # directions far below the threshold are only amplified, not orthogonalised
    gain = torch.diagonal(U.T @ optim.newton_schulz(G).float() @ V)
    assert gain[-1] < 0.5


def test_newton_schulz_band_on_real_momentum_matrices():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16)
    model = Transformer(cfg)
    opt = optim.build_optimizer(model, "muon", lr=1e-2)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (2000,), generator=g)
    for _ in range(5):
        x, y = optim.random_batch(data, 4, 16, g)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    momenta = [opt.state[p]["momentum_buffer"] for p in optim.split_muon_adamw(model)[0]]
    assert len(momenta) == 7
    for M in momenta:
        _assert_in_band(M)


def test_newton_schulz_transpose_and_scale_invariance():
    G = torch.randn(40, 72, generator=torch.Generator().manual_seed(2))
    base = optim.newton_schulz(G).float()
    torch.testing.assert_close(optim.newton_schulz(G.T).float(), base.T, rtol=0, atol=0)
    for scale in (1e-3, 1e3):
        torch.testing.assert_close(optim.newton_schulz(scale * G).float(), base, rtol=2e-2, atol=2e-2)
    # fp32 agrees with the bf16 default up to bf16 rounding
    torch.testing.assert_close(optim.newton_schulz(G, dtype=torch.float32), base, rtol=5e-2, atol=5e-2)


def test_newton_schulz_flops_formula_matches_counted_flops():
    for shape in [(24, 40), (40, 24)]:
        G = torch.randn(*shape)
        with FlopCounterMode(display=False) as counter:
            optim.newton_schulz(G, dtype=torch.float32)
        assert counter.get_total_flops() == optim.newton_schulz_flops(*shape)


def test_newton_schulz_rejects_bad_input():
    with pytest.raises(ValueError, match="matrix"):
        optim.newton_schulz(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="steps"):
        optim.newton_schulz(torch.randn(3, 4), steps=-1)


# ---------------------------------------------------------------- Muon


def _train_matrices(optimizer_cls, steps=100, **kwargs):
    g = torch.Generator().manual_seed(0)
    W1, W2 = nn.Parameter(torch.randn(24, 40, generator=g)), nn.Parameter(torch.randn(40, 16, generator=g))
    x, y = torch.randn(64, 24, generator=g), torch.randn(64, 16, generator=g)
    opt = optimizer_cls([W1, W2], **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        ((torch.tanh(x @ W1) @ W2 - y) ** 2).mean().backward()
        opt.step()
    return W1.detach(), W2.detach()


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.02),
    dict(lr=0.02, adjust_lr_fn="match_rms_adamw", weight_decay=0.0),
    dict(lr=0.01, nesterov=False, momentum=0.9, adjust_lr_fn="original", ns_steps=3),
])
def test_muon_equals_torch_optim_muon_over_100_steps(kwargs):
    ours = _train_matrices(optim.Muon, **kwargs)
    theirs = _train_matrices(torch.optim.Muon, **kwargs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_adjust_lr_formulas():
    assert optim.adjust_lr(0.02, (1024, 256)) == pytest.approx(0.04)  # √(A/B) for tall matrices
    assert optim.adjust_lr(0.02, (256, 1024), "original") == pytest.approx(0.02)  # never below lr
    assert optim.adjust_lr(1e-3, (256, 1024), "match_rms_adamw") == pytest.approx(1e-3 * 0.2 * 32)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        optim.adjust_lr(1e-3, (4, 4), "spectral")


def test_match_rms_adamw_gives_update_rms_of_0_2():
    """Moonlight's rule: the orthogonalised update, scaled by 0.2·√max(A, B), has RMS ≈ 0.2·lr."""
    for shape in [(64, 256), (256, 64)]:
        O = optim.newton_schulz(torch.randn(*shape), dtype=torch.float32)
        exact = torch.linalg.svd(O)[0][:, :min(shape)] @ torch.linalg.svd(O)[2][:min(shape)]  # U Vᵀ
        rms = (optim.adjust_lr(1.0, shape, "match_rms_adamw") * exact).pow(2).mean().sqrt()
        assert rms.item() == pytest.approx(0.2, rel=1e-4)


def test_muon_rejects_vectors_and_unknown_scaling():
    with pytest.raises(ValueError, match="AdamW"):
        optim.Muon([nn.Parameter(torch.ones(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        optim.Muon([nn.Parameter(torch.ones(4, 4))], adjust_lr_fn="spectral")


@pytest.mark.parametrize("tie", [False, True])
def test_split_muon_adamw(tie):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, tie_embeddings=tie)
    model = Transformer(cfg)
    muon, adamw = optim.split_muon_adamw(model)
    assert len(muon) == 7 * cfg.n_layers and all(p.ndim == 2 for p in muon)
    ids = {id(p) for p in muon} | {id(p) for p in adamw}
    assert len(ids) == len(muon) + len(adamw) == len(list(model.parameters()))
    adamw_ids = {id(p) for p in adamw}
    assert id(model.tok_embeddings.weight) in adamw_ids and id(model.output.weight) in adamw_ids
    assert id(model.norm.weight) in adamw_ids
    assert sum(p.numel() for p in muon) + sum(p.numel() for p in adamw) == cfg.n_params()


def test_build_optimizer_trains_and_rejects_unknown_kind():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=16)
    data = torch.arange(2000) % 32  # a perfectly predictable sequence
    for kind in ("adamw", "muon"):
        model = Transformer(cfg)
        opt = optim.build_optimizer(model, kind, lr=1e-2)
        history = optim.train_lm(model, opt, data, data, steps=30, batch_size=4, seq_len=16, eval_every=10)
        assert history["val_loss"][-1] < 0.5 * history["val_loss"][0]
    with pytest.raises(ValueError, match="kind"):
        optim.build_optimizer(model, "lion")


def test_probe_run_records_logits_momenta_and_clips():
    cfg = ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16)
    data = torch.randint(0, 32, (3000,), generator=torch.Generator().manual_seed(0))
    kw = dict(steps=6, batch_size=4, seq_len=16, lr=3e-2, snapshot_steps=(2, 6), eval_every=3)
    free = optim.probe_run(cfg, "muon", data, data, **kw)
    assert len(free["max_logit"]) == 6 and sorted(free["momenta"]) == [2, 6]
    assert set(free["momenta"][6]) == {n for n, p in free["model"].named_parameters() if n.startswith("layers.")
                                       and p.ndim == 2}
    assert torch.equal(free["momenta"][6]["layers.0.attention.wq.weight"],
                       free["optimizer"].state[free["model"].layers[0].attention.wq.weight]["momentum_buffer"])
    tau = 0.5 * free["max_logit"][0]
    clipped = optim.probe_run(cfg, "muon", data, data, tau=tau, **kw)
    assert clipped["max_logit"][0] == free["max_logit"][0]  # the first forward happens before any clip
    # after the first clip, each step starts from logits at most τ, moved only by one update
    assert max(clipped["max_logit"][1:]) < max(free["max_logit"][1:])
    built = []  # a given build function makes the optimizer: the same one gives the same run
    same = optim.probe_run(cfg, "muon", data, data, **kw,
                           build=lambda *a, **k: built.append(a[1]) or optim.build_optimizer(*a, **k))
    assert built == ["muon"] and same["max_logit"] == free["max_logit"]


def test_tokens_to_reach_interpolates():
    tokens, losses = [100, 200, 300], [5.0, 4.0, 3.0]
    assert optim.tokens_to_reach(tokens, losses, 3.5) == pytest.approx(250)
    assert optim.tokens_to_reach(tokens, losses, 6.0) == 100
    assert optim.tokens_to_reach(tokens, losses, 2.0) == math.inf


def test_rank_measures():
    low = torch.randn(50, 1) @ torch.randn(1, 40)
    assert optim.effective_rank(low) == pytest.approx(1.0, abs=1e-3)
    assert optim.stable_rank(low) == pytest.approx(1.0, abs=1e-3)
    assert optim.effective_rank(torch.eye(20)) == pytest.approx(20.0, rel=1e-5)
    assert optim.stable_rank(torch.eye(20)) == pytest.approx(20.0, rel=1e-5)


# ---------------------------------------------------------------- QK-clip


def _model_with_hot_heads(n_kv_heads, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=32)
    model = Transformer(cfg)
    with torch.no_grad():  # make a few heads' logits large: scale their query rows
        for layer, head, factor in [(0, 1, 60.0), (1, 3, 40.0), (1, 0, 25.0)]:
            model.layers[layer].attention.wq.weight[head * 16:(head + 1) * 16] *= factor
    idx = torch.randint(0, 64, (3, 32), generator=torch.Generator().manual_seed(seed))
    return model, idx


def test_attention_logits_reproduce_the_models_attention():
    model, idx = _model_with_hot_heads(n_kv_heads=2)
    attn = model.layers[0].attention
    seen = {}
    attn.register_forward_pre_hook(lambda m, args: seen.update(args=args))
    attn.register_forward_hook(lambda m, args, out: seen.update(out=out))
    with torch.no_grad():
        model(idx)
    x, cos, sin = seen["args"][:3]
    B, T, _ = x.shape
    probs = optim.attention_logits(attn, x, cos, sin).softmax(dim=-1)  # (B, nh, T, T)
    v = attn.wv(x).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
    y = attn.wo((probs @ v).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(y, seen["out"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_qk_clip_sets_clipped_heads_to_tau_and_leaves_others_identical(n_kv_heads):
    model, idx = _model_with_hot_heads(n_kv_heads)
    inputs = optim.attention_inputs(model, idx)
    before = optim.attention_max_logits(model, idx)
    torch.testing.assert_close(before, optim.max_logits_from_inputs(model, inputs), rtol=0, atol=0)
    tau = 0.8 * float(before.flatten().sort().values[-3])  # at least the three hottest heads get clipped
    wk_before = [layer.attention.wk.weight.clone() for layer in model.layers]
    wq_before = [layer.attention.wq.weight.clone() for layer in model.layers]
    gamma = optim.qk_clip_(model, before, tau)
    # recomputed on the same attention inputs (a clipped layer 0 changes what layer 1 sees)
    after = optim.max_logits_from_inputs(model, inputs)
    clipped = before > tau
    assert clipped.sum() >= 3 and (~clipped).sum() >= 3
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5, atol=0)
    assert torch.equal(after[~clipped], before[~clipped])  # bit-identical
    assert torch.equal(gamma[~clipped], torch.ones_like(gamma[~clipped]))
    hs = model.cfg.head_dim
    for li, layer in enumerate(model.layers):
        for h in range(model.cfg.n_heads):
            rows = slice(h * hs, (h + 1) * hs)
            g = gamma[li, h].item()
            want_q = g if n_kv_heads < model.cfg.n_heads else math.sqrt(g)
            torch.testing.assert_close(layer.attention.wq.weight[rows], wq_before[li][rows] * want_q)
            if n_kv_heads == model.cfg.n_heads:
                torch.testing.assert_close(layer.attention.wk.weight[rows], wk_before[li][rows] * math.sqrt(g))
        if n_kv_heads < model.cfg.n_heads:  # shared key heads are never touched
            assert torch.equal(layer.attention.wk.weight, wk_before[li])


def test_qk_clip_is_a_no_op_below_tau_and_rejects_bad_input():
    model, idx = _model_with_hot_heads(n_kv_heads=2)
    before = optim.attention_max_logits(model, idx)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gamma = optim.qk_clip_(model, before, float(before.max()) + 1)
    assert torch.equal(gamma, torch.ones_like(gamma))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="tau"):
        optim.qk_clip_(model, before, 0.0)
    with pytest.raises(ValueError, match="n_layers, n_heads"):
        optim.qk_clip_(model, before[0], 10.0)


def test_max_logit_tracker_keeps_the_running_max():
    model, idx = _model_with_hot_heads(n_kv_heads=2)
    with optim.MaxLogitTracker(model) as tracker:
        with torch.no_grad():
            model(idx[:1])
            model(idx[1:])
    torch.testing.assert_close(tracker.max_logits, optim.attention_max_logits(model, idx))
    assert not tracker.handles  # hooks removed on exit


def test_mla_clip_factors_scale_every_logit_by_gamma():
    g = torch.Generator().manual_seed(0)
    q_nope, k_nope, q_rope, k_rope = (torch.randn(8, generator=g) for _ in range(4))
    gamma = 0.37
    f = optim.mla_clip_factors(gamma)
    before = q_nope @ k_nope + q_rope @ k_rope
    after = (f["q_nope"] * q_nope) @ (f["k_nope"] * k_nope) + (f["q_rope"] * q_rope) @ (f["k_rope"] * k_rope)
    assert after.item() == pytest.approx(gamma * before.item(), rel=1e-6)
    assert f["k_rope"] == 1.0  # the rotary key is shared by all heads


# ---------------------------------------------------------------- Triton kernel (interpreter on CPU)


@pytest.fixture(scope="module")
def kernels():
    from llmsys import kernels as k

    if k.TRITON_MODE == "interpreter" and not k.interpreter_ok():
        pytest.skip("the Triton interpreter returns wrong results in this environment (copy canary failed)")
    return k


def _kernel_tensor(*shape, seed=0):
    from llmsys.core.device import kernel_dtype

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dev, kernel_dtype())


def test_ns_matmul_kernel_equals_torch(kernels):
    X, D, Y = _kernel_tensor(40, 70), _kernel_tensor(40, 40, seed=1), _kernel_tensor(70, 33, seed=2)
    tol = dict(rtol=2e-2, atol=2e-1) if X.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    gram = kernels.ns_matmul(X, X.mT, symmetric=True)
    torch.testing.assert_close(gram, X @ X.T, **tol)
    # Off-diagonal tiles are written twice from one accumulator, so they mirror bit for bit;
    # a diagonal tile is computed in full, and BLAS-like kernels may round (r, c) and (c, r)
    # differently there (OpenBLAS's Haswell kernels do), so it is only close to symmetric.
    block = kernels.newton_schulz.BLOCK
    tile = torch.arange(gram.shape[0]) // block
    off_diagonal = tile[:, None] != tile[None, :]
    assert off_diagonal.any(), "the test matrix must span more than one tile"
    assert torch.equal(gram[off_diagonal], gram.T[off_diagonal])
    torch.testing.assert_close(gram, gram.T, **tol)
    S = D + D.T
    torch.testing.assert_close(kernels.ns_matmul(X, X.mT, S, alpha=0.5, beta=-2.0, symmetric=True),
                               0.5 * X @ X.T - 2.0 * S, **tol)
    torch.testing.assert_close(kernels.ns_matmul(X, Y), X @ Y, **tol)


def test_newton_schulz_kernel_equals_library(kernels):
    for shape in [(36, 50), (50, 36)]:
        G = _kernel_tensor(*shape, seed=3)
        got = kernels.newton_schulz_triton(G).float().cpu()
        want = optim.newton_schulz(G.float().cpu(), dtype=torch.float32)
        tol = 5e-2 if G.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_ns_matmul_rejects_bad_input(kernels):
    X = _kernel_tensor(8, 6)
    with pytest.raises(ValueError, match="inner dimensions"):
        kernels.ns_matmul(X, X)
    with pytest.raises(ValueError, match="square"):
        kernels.ns_matmul(X, X.mT[:, :4], symmetric=True)
    with pytest.raises(ValueError, match="d must be"):
        kernels.ns_matmul(X, X.mT, _kernel_tensor(8, 7))


def test_decay_run_conventions_differ_only_in_how_lambda_is_scaled():
    lr, wd = 3e-2, 0.5
    plain = [optim.decay_run(c, lr, 0.0, steps=30) for c in optim.DECAY_CONVENTIONS]
    assert max(plain) - min(plain) < 1e-6 * max(plain)  # no decay: one and the same run
    torch_form = optim.decay_run("AdamW, torch: θ(1 - lr·λ)", lr, wd, steps=30)
    paper_form = optim.decay_run("AdamW, paper: θ(1 - η_t·λ)", lr, wd * lr, steps=30)  # η_t·(λ·lr) = lr_t·λ
    assert abs(torch_form - paper_form) < 1e-5 * torch_form
    assert abs(optim.decay_run("Adam + L2", lr, wd, steps=30) - torch_form) > 1e-3 * torch_form
    calls = []
    grid = optim.lr_wd_grid("Adam + L2", [1e-2, 1e-1], [0.0, 1.0, 2.0], steps=3,
                            run=lambda *args: calls.append(args) or float(len(calls)))
    assert grid.shape == (2, 3) and grid[-1, -1] == 6 and calls[0] == ("Adam + L2", 1e-2, 0.0, 3, 0)
    with pytest.raises(ValueError, match="convention must be one of"):
        optim.decay_run("AdamW", lr, wd)


# --- chapter 7's decoupling experiment (llmsys.optim.decoupling) -------------------------------------


def test_best_decay_finds_the_vertex_between_grid_points():
    wds = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]
    vertex = -2.3  # log10 of the true best λ, between the grid's 1e-3 and 1e-2
    losses = [(math.log10(wd) - vertex) ** 2 + 1.0 for wd in wds]
    assert math.log10(optim.best_decay(losses, wds)) == pytest.approx(vertex, abs=1e-9)
    assert optim.best_decay([1, 2, 3, 4, 5], wds) == 1e-4  # the grid's end: no neighbour on one side


def test_argmin_slope_is_one_when_the_best_decay_follows_the_learning_rate_and_zero_when_it_stays():
    lrs, wds = [1e-4, 1e-3, 1e-2], [10 ** (k / 2) for k in range(-12, 1)]
    follows = torch.tensor([[(math.log10(wd) - math.log10(lr)) ** 2 for wd in wds] for lr in lrs])
    stays = torch.tensor([[(math.log10(wd) + 2) ** 2 for wd in wds] for _ in lrs])
    assert optim.argmin_slope(follows, lrs, wds) == pytest.approx(1.0, abs=1e-6)
    assert optim.argmin_slope(stays, lrs, wds) == pytest.approx(0.0, abs=1e-6)


def test_the_mlp_overfits_without_decay_so_the_grid_has_a_best_decay():
    """The experiment needs a generalization gap: moderate decay beats none on held-out loss."""
    from llmsys.optim import decoupling

    (X, y), (X_val, y_val) = optim.classification_task(0)
    assert X.shape == (200, 20) and X_val.shape == (2000, 20) and set(y.tolist()) <= {0, 1, 2, 3}
    none = optim.mlp_run(decoupling.PAPER, 3e-3, 1e-4, steps=300)
    some = optim.mlp_run(decoupling.PAPER, 3e-3, 3e-2, steps=300)
    assert some < none
    assert optim.mlp_run(decoupling.L2, 3e-3, 0.0, steps=20, seed=1) != optim.mlp_run(decoupling.L2, 3e-3, 0.0,
                                                                                        steps=20, seed=2)


def test_argmin_slope_leaves_out_learning_rates_that_do_not_train():
    lrs, wds = [1e-5, 1e-3, 1e-2], [10 ** (k / 2) for k in range(-12, 1)]
    grid = torch.tensor([[(math.log10(wd) + 2) ** 2 + (5.0 if lr == 1e-5 else 1.0) for wd in wds] for lr in lrs])
    grid[0, 0] = 5.0  # the untrained row's best λ sits at the grid's edge
    assert optim.argmin_slope(grid, lrs, wds) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="two learning rates"):
        optim.argmin_slope(grid[:2], lrs[:2], wds)
