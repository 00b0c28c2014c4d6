"""The Llama decoder: parameter and FLOP formulas, transformers equivalence, KV cache invariants."""

import types

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import torch.nn.functional as F

from llmsys.core.model import KVCache, ModelConfig, Transformer, masked_mean, sample_rollout

TINY = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48)
CONFIGS = {
    "gqa": ModelConfig(**TINY),
    "mha": ModelConfig(**{**TINY, "n_kv_heads": 4}),
    "mqa_tied": ModelConfig(**{**TINY, "n_kv_heads": 1, "tie_embeddings": True}),
    "ffn_theta": ModelConfig(**{**TINY, "ffn_hidden": 40, "rope_theta": 500.0, "norm_eps": 1e-6}),
}


def make_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains, so a swapped or misnamed norm weight shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def tokens(cfg: ModelConfig, B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- sizes and formulas

@pytest.mark.parametrize("name", CONFIGS)
def test_n_params_equals_parameter_count(name):
    cfg = CONFIGS[name]
    model = Transformer(cfg)
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    assert cfg.n_params(include_embedding=False) == cfg.n_params() - model.tok_embeddings.weight.numel()
    assert cfg.memory_bytes(2) == 2 * cfg.n_params()


def test_tied_embeddings_share_one_tensor():
    model = Transformer(CONFIGS["mqa_tied"])
    assert model.output.weight is model.tok_embeddings.weight
    untied = ModelConfig(**{**TINY, "n_kv_heads": 1})
    assert untied.n_params() - CONFIGS["mqa_tied"].n_params() == TINY["vocab_size"] * TINY["dim"]


@pytest.mark.parametrize("dim,multiple_of", [(256, 32), (96, 32), (4096, 256), (64, 1)])
def test_swiglu_hidden_follows_eight_thirds_rule(dim, multiple_of):
    cfg = ModelConfig(dim=dim, n_heads=4, n_kv_heads=4, multiple_of=multiple_of)
    assert cfg.hidden % multiple_of == 0
    assert int(8 * dim / 3) <= cfg.hidden < int(8 * dim / 3) + multiple_of


def test_swiglu_hidden_matches_llama_2_7b():
    # Llama-2-7B: dim 4096, multiple_of 256, published intermediate_size 11008
    assert ModelConfig(dim=4096, n_heads=32, n_kv_heads=32, multiple_of=256).hidden == 11008
    assert Transformer(CONFIGS["gqa"]).layers[0].feed_forward.w1.out_features == CONFIGS["gqa"].hidden


def test_config_dict_round_trip_and_unknown_keys():
    cfg = CONFIGS["ffn_theta"]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="n_embd"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_embd": 32})


@pytest.mark.parametrize("bad,message", [
    (dict(n_heads=6, n_kv_heads=4, dim=48), "n_kv_heads"),
    (dict(dim=36, n_heads=4), "even"),          # head_dim 9 cannot be split into RoPE pairs
    (dict(dim=30, n_heads=4), "divisible by n_heads"),
    (dict(vocab_size=0), "vocab_size must be a positive"),
    (dict(n_layers=-1), "n_layers must be a positive"),
    (dict(ffn_hidden=0), "ffn_hidden"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(norm_eps=float("nan")), "norm_eps must be a finite positive"),
    (dict(rope_theta=float("inf")), "rope_theta must be a finite positive"),
    (dict(tie_embeddings="no"), "tie_embeddings must be True or False"),
    (dict(dim=32.0), "dim must be a positive integer"),
    (dict(n_layers=True), "n_layers must be a positive integer"),
])
def test_bad_config_raises_helpful_error(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, **bad})


@pytest.mark.parametrize("name", ["gqa", "mqa_tied"])
@pytest.mark.parametrize("T", [48, 20])
def test_flops_per_token_matches_flop_counter(name, T):
    cfg = CONFIGS[name]
    model = make_model(cfg)
    B = 2
    # FlopCounterMode counts matmuls only: every nn.Linear (the layers' q/k/v/o and w1/w2/w3 and
    # the LM head, 2 FLOPs per weight per token) and the two attention bmm's (QKᵀ and PV, over
    # the full T x T matrix: a causal mask does not reduce what it counts). RMSNorm, RoPE, SiLU,
    # softmax and the embedding lookup are not counted, and the formula leaves them out too.
    # The fused CPU attention kernel has no flop formula registered, so we pick the math
    # backend, which runs attention as those two bmm's.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens(cfg, B, T))
    measured = counter.get_total_flops() / (B * T)
    assert measured / cfg.flops_per_token(seq_len=T) == pytest.approx(1.0, abs=0.02)


def test_flops_per_token_defaults_to_max_seq_len_and_grows_with_context():
    cfg = CONFIGS["gqa"]
    assert cfg.flops_per_token() == cfg.flops_per_token(cfg.max_seq_len)
    per_extra_token = 2 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert cfg.flops_per_token(11) - cfg.flops_per_token(10) == per_extra_token


@pytest.mark.parametrize("name", ["gqa", "mqa_tied"])
@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_kv_bytes_per_token_equals_cache_bytes(name, dtype, nbytes):
    cfg = CONFIGS[name]
    B, max_len = 3, 40
    cache = Transformer(cfg).new_cache(B, max_len=max_len, dtype=dtype)
    assert isinstance(cache, KVCache) and cache.k[0].shape == (B, cfg.n_kv_heads, max_len, cfg.head_dim)
    assert cache.nbytes / (B * max_len) == cfg.kv_bytes_per_token(nbytes)


# ----------------------------------------------------------------------------- transformers equivalence

@pytest.mark.parametrize("name", CONFIGS)
def test_to_hf_and_back_gives_the_same_logits(name, tmp_path):
    cfg = CONFIGS[name]
    model = make_model(cfg)
    idx = tokens(cfg, 2, 17)
    with torch.no_grad():
        ours = model(idx)
        hf = model.to_hf()
        assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
        assert (hf(idx).logits - ours).abs().max() < 1e-4

        back = Transformer.from_hf(hf)
        assert back.cfg.to_dict() == {**cfg.to_dict(), "ffn_hidden": cfg.hidden}
        for key, value in model.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), key
        assert (back(idx) - ours).abs().max() < 1e-4

        hf.save_pretrained(tmp_path)
        loaded = Transformer.from_hf(str(tmp_path))
        assert (loaded(idx) - ours).abs().max() < 1e-4
        assert (loaded.output.weight is loaded.tok_embeddings.weight) == cfg.tie_embeddings


def test_hidden_is_the_final_norm_output():
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    idx = tokens(cfg, 2, 9)
    with torch.no_grad():
        logits, hidden = model(idx, return_hidden=True)
        assert hidden.shape == (2, 9, cfg.dim)
        assert torch.allclose(model.output(hidden), logits)
        hf_hidden = model.to_hf().model(idx).last_hidden_state  # after LlamaModel's final norm
        assert (hf_hidden - hidden).abs().max() < 1e-5


def test_from_hf_rejects_an_architecture_it_does_not_implement():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, attention_bias=True))
    with pytest.raises(ValueError, match="attention_bias"):
        Transformer.from_hf(hf)
    with pytest.raises(ValueError, match="checkpoint directory"):
        Transformer.from_hf("/nonexistent/checkpoint")


# ----------------------------------------------------------------------------- KV cache

@pytest.mark.parametrize("name", ["gqa", "mha", "mqa_tied"])
def test_token_by_token_decoding_equals_full_recomputation(name):
    cfg = CONFIGS[name]
    model = make_model(cfg)
    idx = tokens(cfg, 2, 20)
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(2)
        steps = [model(idx[:, :8], cache)]  # prefill
        for t in range(8, 20):
            steps.append(model(idx[:, t:t + 1], cache))
    assert cache.length == 20
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5


@pytest.mark.parametrize("k", [2, 4, 7])
def test_block_verification_equals_full_recomputation(k):
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    idx = tokens(cfg, 3, 9 + 2 * k)
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(3, max_len=9 + 2 * k)
        prefill = model(idx[:, :9], cache)
        block1 = model(idx[:, 9:9 + k], cache)  # k drafted tokens scored in one call
        block2 = model(idx[:, 9 + k:], cache)
    assert (torch.cat([prefill, block1, block2], dim=1) - full).abs().max() < 1e-5


def test_truncate_rolls_back_rejected_tokens():
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    prompt, draft, correction = tokens(cfg, 2, 10, seed=1), tokens(cfg, 2, 5, seed=2), tokens(cfg, 2, 3, seed=3)
    with torch.no_grad():
        cache = model.new_cache(2)
        model(prompt, cache)
        model(draft, cache)  # verify 5 drafted tokens ...
        cache.truncate(10 + 2)  # ... accept 2, discard the rest
        after_rollback = model(correction, cache)
        accepted = torch.cat([prompt, draft[:, :2], correction], dim=1)
        reference = model(accepted)[:, -3:]
    assert cache.length == 15
    assert (after_rollback - reference).abs().max() < 1e-5
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(16)  # cannot roll forward


def test_cache_clone_is_independent():
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    idx = tokens(cfg, 1, 12)
    with torch.no_grad():
        cache = model.new_cache(1)
        model(idx[:, :6], cache)
        snapshot = cache.clone()
        first = model(idx[:, 6:], cache)
        model(tokens(cfg, 1, 6, seed=9), snapshot)  # a different continuation
        snapshot.truncate(6)
        again = model(idx[:, 6:], snapshot)
    assert cache.length == snapshot.length == 12
    assert torch.equal(first, again)


def test_exceeding_max_seq_len_or_cache_raises():
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(cfg, 1, cfg.max_seq_len + 1))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.new_cache(1, max_len=cfg.max_seq_len + 1)
    small = model.new_cache(1, max_len=8)
    model(tokens(cfg, 1, 6), small)
    with pytest.raises(ValueError, match="new_cache"):
        model(tokens(cfg, 1, 3), small)
    full = model.new_cache(1)
    model(tokens(cfg, 1, cfg.max_seq_len), full)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(cfg, 1, 1), full)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(tokens(cfg, 1, 40), max_new_tokens=9)
    with pytest.raises(ValueError, match="batch"):
        model(tokens(cfg, 2, 1), model.new_cache(1))


# ----------------------------------------------------------------------------- generation

@pytest.mark.parametrize("name", ["gqa", "mqa_tied"])
def test_greedy_generate_equals_argmax_loop_without_cache(name):
    cfg = CONFIGS[name]
    model = make_model(cfg)
    idx = tokens(cfg, 2, 5)
    out = model.generate(idx, max_new_tokens=12)
    expected = idx
    with torch.no_grad():
        for _ in range(12):
            next_token = model(expected)[:, -1].argmax(dim=-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert out.shape == (2, 17)
    assert torch.equal(out, expected)


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    idx = tokens(cfg, 2, 4)
    draw = lambda seed, **kw: model.generate(idx, 10, generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(draw(0, temperature=1.0), draw(0, temperature=1.0))
    assert not torch.equal(draw(0, temperature=5.0), draw(1, temperature=5.0))
    assert torch.equal(draw(0, temperature=1.0, top_k=1), model.generate(idx, 10))
    # top_k=k never emits a token outside the k most likely ones
    with torch.no_grad():
        logits = model(idx)[:, -1]
    first = draw(3, temperature=10.0, top_k=3)[:, 4]
    allowed = logits.topk(3).indices
    assert all(first[b] in allowed[b] for b in range(2))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 2, temperature=-1.0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature=1.0, top_k=0), "top_k must be None"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be None"),
])
def test_generate_rejects_bad_sampling_settings(kwargs, message):
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    with pytest.raises(ValueError, match=message):
        model.generate(tokens(cfg, 1, 4), 3, **kwargs)


def test_generate_rejects_a_1d_prompt_and_out_of_vocabulary_ids():
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    with pytest.raises(ValueError, match=r"prompt\[None\]"):
        model.generate(tokens(cfg, 1, 4)[0], 3)
    with pytest.raises(ValueError, match=r"token ids must be in 0..96"):
        model(torch.tensor([[1, cfg.vocab_size]]))
    with pytest.raises(ValueError, match=r"token ids must be in 0..96"):
        model.generate(torch.tensor([[-1, 2]]), 2)
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 3))


def test_sampler_generator_must_live_with_the_logits():
    cfg = CONFIGS["gqa"]
    model = make_model(cfg)
    cuda_gen = types.SimpleNamespace(device=torch.device("cuda"))  # what the check reads of a CUDA generator
    with pytest.raises(ValueError, match="torch.Generator\\(device='cpu'\\)"):
        model.generate(tokens(cfg, 1, 4), 2, temperature=1.0, generator=cuda_gen)


@pytest.mark.parametrize("top_k", [None, 5])
def test_sample_rollout_equals_full_recompute_with_per_row_stop(top_k):
    """The KV-cached loop draws what recomputing the whole sequence draws, each row stops at its
    own stop token (kept, then padded and masked), and the log-probs are the sampling distribution's."""
    cfg, stop, T = ModelConfig(**{**TINY, "vocab_size": 8}), 3, 1.5  # 8 tokens: every row stops soon
    model = make_model(cfg)
    prompts = tokens(cfg, 6, 4)
    roll = sample_rollout(model, prompts, 40, T, top_k, stop_token=stop, generator=torch.Generator().manual_seed(7))
    g, seq, alive = torch.Generator().manual_seed(7), prompts, torch.ones(6, dtype=torch.bool)
    N = roll.completions.size(1)
    for t in range(N):
        with torch.no_grad():
            logits = model(seq)[:, -1].float() / T
        if top_k is not None:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[:, -1:], float("-inf"))
        token = torch.multinomial(F.softmax(logits, -1), 1, generator=g)[:, 0]
        token = torch.where(alive, token, torch.full_like(token, stop))
        assert torch.equal(roll.completion_mask[:, t].bool(), alive)
        want_lp = torch.where(alive, F.log_softmax(logits, -1).gather(1, token[:, None])[:, 0], 0.0)
        torch.testing.assert_close(roll.logprobs[:, 4 - 1 + t], want_lp, rtol=1e-4, atol=1e-5)
        alive = alive & (token != stop)
        seq = torch.cat([seq, token[:, None]], 1)
    assert torch.equal(roll.tokens, seq)
    assert N < 40 and not alive.any(), "every row stopped, so decoding ended early"
    assert roll.mask[:, :3].sum() == 0 and roll.mask.shape == roll.logprobs.shape == (6, 4 + N - 1)


def test_greedy_rollout_is_generate_with_zero_logprobs():
    cfg = CONFIGS["mqa_tied"]
    model = make_model(cfg)
    prompts = tokens(cfg, 2, 5)
    roll = sample_rollout(model, prompts, 6, temperature=0.0)
    assert torch.equal(roll.tokens, model.generate(prompts, 6)) and roll.logprobs.abs().sum() == 0
    assert roll.completion_mask.min() == 1


def test_masked_mean_ignores_masked_positions_and_checks_shapes():
    x = torch.tensor([[1.0, 5.0, 3.0]])
    assert masked_mean(x, torch.tensor([[1, 0, 1]])).item() == 2.0
    assert masked_mean(x, torch.zeros(1, 3)).item() == 0.0  # all masked: 0, not NaN
    assert masked_mean(x).item() == 3.0
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(x, torch.ones(3))
