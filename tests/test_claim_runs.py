"""The benchmarks whose stored runs feed the claims table, each on its smallest configuration: it runs,
writes its JSON, and the claim's extractor reads that JSON into evidence (never the full runs)."""

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from llmsys.course import claims

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decoupling_grid_feeds_the_adamw_claim(tmp_path):
    path = tmp_path / "decoupling.json"
    assert benchmark("decoupling").main(["--seeds", "2", "--steps", "10", "--json", str(path)]) == 0
    evidence = claims.decoupling_slope(json.loads(path.read_text()))
    assert evidence.seeds == 2 and evidence.low <= evidence.value <= evidence.high


def test_muon_seeds_feed_the_muon_claim(tmp_path):
    path = tmp_path / "muon_seeds.json"
    args = ["--sizes", "16", "--seeds", "2", "--steps", "25", "--lrs", "3e-3", "1e-2", "--json", str(path)]
    assert benchmark("muon_seeds").main(args) == 0
    evidence = claims.muon_token_ratio(json.loads(path.read_text()))
    assert evidence.seeds == 2 and "width 16" in evidence.unit
    # a seed where Muon never reaches AdamW's loss makes the ratio inf, never a crash or a finite mean
    assert evidence.low <= evidence.value <= evidence.high or math.isinf(evidence.low)


def test_grpo_seeds_feed_the_length_bias_claim(tmp_path):
    path = tmp_path / "grpo_seeds.json"
    args = ["--seeds", "2", "--variant-seeds", "0", "--steps", "10", "--json", str(path)]
    assert benchmark("grpo_seeds").main(args) == 0
    evidence = claims.ramble_growth(json.loads(path.read_text()))
    assert evidence.seeds == 2 and evidence.low <= evidence.value <= evidence.high


def test_specdec_rows_feed_the_speedup_claim(tmp_path, monkeypatch):
    """On the zoo models (the stored run is SmolLM2's, too slow for CI): the same JSON rows."""
    path = tmp_path / "specdec.json"
    # one prompt of 16 new tokens (--quick would raise both to its own sizes)
    monkeypatch.setattr(sys, "argv", ["specdec.py", "--prompts", "1", "--new-tokens", "16", "--json", str(path)])
    benchmark("specdec").main()
    result = json.loads(path.read_text())
    evidence = claims.best_lossless_speedup(result)
    lossless = [m["speedup"] for m in result["methods"] if m.get("lossless") and m["name"] != "target only"]
    assert evidence.value == max(lossless, default=0.0) and evidence.value > 0


@pytest.fixture
def tiny_checkpoint(tmp_path, monkeypatch):
    """An unquantized Llama checkpoint in transformers' format, made here (no network), with a small
    byte-level BPE tokenizer trained on the course corpus; the course cache is a temporary one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from llmsys.core import zoo

    monkeypatch.setenv("LLMSYS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny-llama"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([zoo.corpus()[:100_000]], trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_checkpoint_is_converted_once_into_its_own_entry(tiny_checkpoint):
    from transformers import LlamaForCausalLM

    from llmsys.core import pretrained

    (model, tok), manifest = pretrained.checkpoint_entry(str(tiny_checkpoint))
    ids = torch.tensor([tok("def f(x): return x")["input_ids"]])
    reference = LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval()
    with torch.no_grad():
        assert torch.allclose(model(ids), reference(ids).logits, atol=1e-4)
    again = pretrained.checkpoint_entry(str(tiny_checkpoint))[1]
    assert again["created"] == manifest["created"]  # read from the cache, not rebuilt
    before = pretrained.checkpoint_hash(tiny_checkpoint)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    (tiny_checkpoint / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert pretrained.checkpoint_hash(tiny_checkpoint) != before  # a changed file is a new entry


def test_a_bf16_checkpoint_stays_bf16_in_its_entry(tiny_checkpoint, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from llmsys.core import cache, pretrained

    folder = tmp_path / "tiny-llama-bf16"
    LlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(folder)
    (model, _), _ = pretrained.checkpoint_entry(str(folder))
    state = torch.load(cache.entry_dir(pretrained.checkpoint_entry_name(str(folder))) / "model.pt")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}  # half the disk of fp32, and lossless
    assert model.tok_embeddings.weight.dtype == torch.float32  # loaded as every checkpoint is


def test_quant_source_runs_the_table_and_feeds_the_4bit_claim(tiny_checkpoint, tmp_path, monkeypatch):
    from llmsys.compress import measure

    path = tmp_path / "results" / "quant_source.json"
    quant = benchmark("quant")
    quant.main(["--source", str(tiny_checkpoint), "--parts", "perplexity", "--quick", "--windows", "1",
                "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["source"] == str(tiny_checkpoint) and not measure.results_path().exists()  # chapter 10's stay
    evidence = claims.quant_4bit_over_bf16(result)
    assert evidence.value > 0 and str(tiny_checkpoint) in evidence.unit
    claim = claims.BY_KEY["gptq-awq-4bit"]
    monkeypatch.setattr(claims, "RESULTS", path.parent)
    assert claims.judge(claim).verdict in (claims.SHOWN, claims.NOT_SHOWN)
    shutil.rmtree(path.parent)
    assert claims.judge(claim).verdict == claims.NOT_TESTABLE  # no stored run: the reason why, again


def test_quant_source_says_what_to_change(tmp_path, capsys):
    quant = benchmark("quant")
    with pytest.raises(SystemExit):
        quant.main(["--source", "no-such-checkpoint", "--json", str(tmp_path / "q.json")])
    with pytest.raises(SystemExit):
        quant.main(["--source", str(tmp_path)])
    assert "--source needs --json" in capsys.readouterr().err
