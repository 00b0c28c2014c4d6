"""The embedded model zoo: deterministic builds and a cache that never half-loads."""

import dataclasses
import json
import math
import multiprocessing
import shutil
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from llmsys.core import cache as store
from llmsys.core import zoo
from llmsys.course import catalog



@pytest.fixture(scope="session")
def built_zoo(tmp_path_factory):
    """The tokenizer and the tiny model, built once per session; tests copy them."""
    root = tmp_path_factory.mktemp("zoo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMSYS_CACHE", str(root))
        catalog.build("tiny", progress=False)
        tiny = weights(zoo.load("tiny", device="cpu"))
    return root / "zoo", tiny


@pytest.fixture
def cache(tmp_path, monkeypatch, built_zoo):
    """An empty cache except for the tokenizer."""
    monkeypatch.setenv("LLMSYS_CACHE", str(tmp_path))
    shutil.copytree(built_zoo[0] / zoo.TOKENIZER, tmp_path / "zoo" / zoo.TOKENIZER)
    return tmp_path / "zoo"


@pytest.fixture
def cache_with_tiny(cache, built_zoo):
    """The tokenizer and a valid tiny entry; yields (zoo folder, tiny's weights)."""
    shutil.copytree(built_zoo[0] / "tiny", cache / "tiny")
    return cache, built_zoo[1]


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_corpus_is_the_pydoc_topics_text():
    from pydoc_data.topics import topics

    text = zoo.corpus()
    assert len(text.encode()) > 400_000
    assert all(topics[k] in text for k in ("if", "while", "lambda"))


def test_tokenizer_is_cached_and_round_trips(cache):
    tok = zoo.tokenizer()
    assert tok.vocab_size == zoo.VOCAB_SIZE
    sample = zoo.corpus()[10_000:15_000]
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.compression_ratio(sample) > 2.0
    assert zoo.tokenizer() == tok


def test_dataset_is_an_interleaved_90_10_split_of_the_tokenized_corpus(cache):
    train_ids, val_ids = zoo.dataset()
    assert train_ids.dtype == val_ids.dtype == torch.long
    # Put the blocks back in order: every VAL_EVERY-th one came from the val split.
    train_blocks, val_blocks = list(train_ids.split(zoo.SPLIT_BLOCK)), list(val_ids.split(zoo.SPLIT_BLOCK))
    n_blocks = len(train_blocks) + len(val_blocks)
    order = [val_blocks.pop(0) if i % zoo.VAL_EVERY == zoo.VAL_EVERY - 1 else train_blocks.pop(0) for i in range(n_blocks)]
    assert torch.cat(order).tolist() == zoo.tokenizer().encode(zoo.corpus())
    assert 0.08 < len(val_ids) / (len(train_ids) + len(val_ids)) < 0.12


def test_batch_targets_are_inputs_shifted_by_one():
    ids = torch.arange(1000)
    x, y = zoo.batch(ids, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)  # with ids = arange, the next token is the id plus one
    x2, _ = zoo.batch(ids, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="more than seq_len"):
        zoo.batch(ids[:16], 1, 16)


def test_lr_schedule_warms_up_then_decays_by_cosine():
    spec = zoo.SPECS["tiny"]
    lrs = [zoo.lr_at(s, spec) for s in range(spec.steps)]
    w = spec.warmup_steps
    assert lrs[w] == pytest.approx(spec.lr) and max(lrs) == lrs[w] and lrs.count(lrs[w]) == 1  # one peak
    assert lrs[0] == pytest.approx(spec.lr / (w + 1)) and lrs[0] > 0
    assert all(a < b for a, b in zip(lrs[: w + 1], lrs[1 : w + 1]))  # strictly up, then
    assert lrs[-1] == pytest.approx(spec.lr * spec.min_lr_ratio)
    after = lrs[w:]
    assert all(a > b for a, b in zip(after, after[1:]))  # strictly down
    past_the_end = [zoo.lr_at(s, spec) for s in range(spec.steps, 2 * spec.steps)]
    assert past_the_end == pytest.approx([spec.lr * spec.min_lr_ratio] * spec.steps)  # held, no climb back
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        zoo.lr_at(-1, spec)
    mid = spec.warmup_steps + (spec.steps - 1 - spec.warmup_steps) / 2
    if mid == int(mid):  # halfway through the decay the cosine sits halfway between the ends
        assert lrs[int(mid)] == pytest.approx(spec.lr * (1 + spec.min_lr_ratio) / 2)


def test_tiny_build_is_deterministic(cache_with_tiny):
    _, first = cache_with_tiny  # built by the session fixture, in another cache folder
    catalog.build("tiny", force=True, progress=False)
    assert_same_weights(first, weights(zoo.load("tiny", device="cpu")))


def test_build_leaves_the_global_rng_alone(cache):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    catalog.build("tiny", progress=False)
    assert torch.equal(torch.rand(3), expected)


def test_cached_load_does_not_retrain(cache_with_tiny, monkeypatch):
    _, built = cache_with_tiny

    def no_training(*args, **kwargs):
        raise AssertionError("a valid cache entry must be loaded, not retrained")

    monkeypatch.setattr(zoo, "train", no_training)
    model = zoo.load("tiny", device="cpu")
    assert not model.training
    assert_same_weights(built, weights(model))


def test_load_with_a_longer_context_keeps_the_weights(cache_with_tiny):
    short = zoo.load("tiny", device="cpu")
    long = zoo.load("tiny", device="cpu", max_seq_len=4 * short.cfg.max_seq_len)
    assert long.cfg.max_seq_len == 4 * short.cfg.max_seq_len and long is not short
    assert_same_weights(weights(short), weights(long))
    ids = torch.randint(0, short.cfg.vocab_size, (1, short.cfg.max_seq_len))
    torch.testing.assert_close(long(ids), short(ids), rtol=0, atol=0)  # positions inside the old context: same model
    long(torch.randint(0, short.cfg.vocab_size, (1, 2 * short.cfg.max_seq_len)))  # and past it: RoPE has no table
    with pytest.raises(ValueError, match="max_seq_len"):
        short(torch.randint(0, short.cfg.vocab_size, (1, short.cfg.max_seq_len + 1)))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated model.pt": lambda d: truncate(d / "model.pt"),
    "flipped byte in model.pt": lambda d: flip_a_byte(d / "model.pt"),
    "missing manifest (partial entry)": lambda d: (d / "manifest.json").unlink(),
    "truncated manifest": lambda d: truncate(d / "manifest.json"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_entry_is_detected_and_rebuilt(cache_with_tiny, damage):
    cache, built = cache_with_tiny
    DAMAGE[damage](cache / "tiny")
    assert not next(r for r in catalog.status() if r["name"] == "tiny")["cached"]
    with pytest.warns(store.CacheWarning, match="corrupted|partial"):
        model = zoo.load("tiny", device="cpu")
    assert_same_weights(built, weights(model))  # rebuilt, deterministically
    assert next(r for r in catalog.status() if r["name"] == "tiny")["cached"]


def test_stale_spec_triggers_rebuild(cache_with_tiny, monkeypatch):
    cache, _ = cache_with_tiny
    old_hash = json.loads((cache / "tiny" / "manifest.json").read_text())["spec_hash"]
    spec = zoo.SPECS["tiny"]
    monkeypatch.setitem(zoo.SPECS, "tiny", dataclasses.replace(spec, steps=spec.steps + 2))
    with pytest.warns(store.CacheWarning, match="stale"):
        zoo.load("tiny", device="cpu")
    manifest = json.loads((cache / "tiny" / "manifest.json").read_text())
    assert manifest["spec"]["steps"] == spec.steps + 2
    assert manifest["spec_hash"] != old_hash


def test_leftovers_of_an_interrupted_build_are_ignored(cache):
    debris = cache / ".tiny.tmp-crashed"
    debris.mkdir()
    (debris / "model.pt").write_bytes(b"half")
    catalog.build("tiny", progress=False)
    assert not debris.exists()
    assert sorted(p.name for p in (cache / "tiny").iterdir()) == ["manifest.json", "model.pt"]


def test_concurrent_builds_train_once(cache, monkeypatch):
    calls = []
    real_train = zoo.train

    def counting_train(*args, **kwargs):
        calls.append(1)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(zoo, "train", counting_train)
    models = [None, None]

    def worker(i):
        models[i] = zoo.load("tiny", device="cpu")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert_same_weights(weights(models[0]), weights(models[1]))


def test_metrics_match_an_independent_evaluation(cache_with_tiny):
    cache, _ = cache_with_tiny
    metrics = json.loads((cache / "tiny" / "manifest.json").read_text())["metrics"]
    model, tok, spec = zoo.load("tiny", device="cpu"), zoo.tokenizer(), zoo.SPECS["tiny"]
    _, val_ids = zoo.dataset()

    T = spec.seq_len
    n = (len(val_ids) - 1) // T
    with torch.no_grad():
        logits = model(val_ids[: n * T].view(n, T))
    targets = val_ids[1 : n * T + 1]
    nats = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets, reduction="sum").item()
    n_bytes = sum(len(tok.vocab[i]) for i in targets.tolist())

    assert metrics["val_tokens"] == n * T and metrics["val_bytes"] == n_bytes
    assert metrics["val_loss"] == pytest.approx(nats / (n * T), rel=1e-4)
    assert metrics["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-4)
    uniform_bpb = math.log2(zoo.VOCAB_SIZE) * n * T / n_bytes  # guessing every token uniformly
    assert math.isfinite(metrics["bits_per_byte"]) and 0 < metrics["bits_per_byte"] < min(8, uniform_bpb)
    assert metrics["params"] == spec.config.n_params() == sum(p.numel() for p in model.parameters())


def test_status_and_report(cache_with_tiny):
    rows = {r["name"]: r for r in catalog.status()}
    assert set(rows) == set(catalog.ENTRIES)
    assert not rows[zoo.PRETRAINED]["cached"]  # this cache holds only the tokenizer and tiny
    assert rows["tiny"]["cached"] and rows["tiny"]["bits_per_byte"] > 0 and rows["tiny"]["build_seconds"] > 0
    assert not rows["target"]["cached"] and rows["target"]["val_loss"] is None
    text = catalog.report()
    assert "tiny" in text and "target" in text and "1024 tokens" in text


def test_zoo_specs_share_the_tokenizer_and_the_target_is_bigger():
    target, draft = zoo.SPECS["target"].config, zoo.SPECS["draft"].config
    assert target.vocab_size == draft.vocab_size == zoo.VOCAB_SIZE
    assert 2_000_000 < target.n_params() and draft.n_params() * 5 < target.n_params()


def test_bad_names_and_specs_raise(cache):
    with pytest.raises(ValueError, match="no model named"):
        zoo.load("huge")
    with pytest.raises(ValueError, match="vocab_size"):
        dataclasses.replace(zoo.SPECS["tiny"], config=dataclasses.replace(zoo.SPECS["tiny"].config, vocab_size=50))
    with pytest.raises(ValueError, match="seq_len"):
        dataclasses.replace(zoo.SPECS["tiny"], seq_len=10_000)


def _cached_text(folder_for_builds):
    def build(folder, progress):
        with open(folder_for_builds / "builds.log", "a") as log:  # one line per build, whoever built
            log.write("built\n")
        time.sleep(0.5)  # long enough for the other process to be waiting on the lock
        (folder / "value.txt").write_text("forty-two")
        return {"note": "test entry"}

    def parse(folder, manifest, files):
        return files["value.txt"].decode(), manifest["note"]

    return store.entry("test-entry", store.spec_hash({"value": 42}), build, parse, progress=False)


def test_cached_builds_once_across_processes_and_rebuilds_a_damaged_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSYS_CACHE", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_cached_text, args=(tmp_path,)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0]
    assert (tmp_path / "builds.log").read_text() == "built\n", "two processes, one build"
    assert _cached_text(tmp_path) == ("forty-two", "test entry")
    (store.entry_dir("test-entry") / "value.txt").write_text("torn")
    with pytest.warns(store.CacheWarning, match="corrupted"):
        assert _cached_text(tmp_path) == ("forty-two", "test entry")
    assert (tmp_path / "builds.log").read_text() == "built\nbuilt\n"
