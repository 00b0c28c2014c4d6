import json
from pathlib import Path

import pytest

from llmsys.core import accounting, ledger, techniques


@pytest.fixture
def path(tmp_path):
    return tmp_path / "ledger.json"


def _entry(table, name):
    return next(e for e in table.body if e["technique"] == name)


def test_record_then_render(path):
    ledger.record("ZeRO-1", estimate=100.0, measured=101.0, unit="bytes", path=path)
    table = ledger.Table(upto=1, path=path)
    record = _entry(table, "ZeRO-1")["record"]
    assert (record["estimate"], record["measured"], record["ratio"], record["kind"]) == (100, 101, 1.01, "measured")
    assert record["provenance"] == ""  # recorded here, now
    assert all(e["chapter"] <= 1 for e in table.body)
    html = table._repr_html_()
    assert html.startswith("<table") and "ZeRO-1" in html and "<td" in html and "Llama-3-8B" in html
    text = str(table)
    # the terminal keeps the words that make the table a decision aid
    for words in ["ZeRO-1", "1.01", "optimizer state ÷ N", "saves", "adds", "trades", "use when", "measured"]:
        assert words in text


def test_unmeasured_rows_say_so(path):
    body = ledger.Table(upto=0, path=path).body
    assert {e["technique"] for e in body} == {"Kernel fusion", "FlashAttention", "Scoring k tokens per call"}
    assert all(e["record"] is None for e in body)
    assert "not run yet" in str(ledger.Table(upto=0, path=path))


def test_measurements_accumulate_and_persist(path):
    ledger.record("DDP", 2.0, 2.0, path=path)
    ledger.record("ZeRO-3 / FSDP", 1.5, 1.5, kind="modelled", path=path)
    assert set(ledger.load_measurements(path)) == {"DDP", "ZeRO-3 / FSDP"}
    assert ledger.load_measurements(path)["ZeRO-3 / FSDP"]["kind"] == "modelled"


def test_foreign_and_stale_records_are_marked(path):
    ledger.record("DDP", 2.0, 2.0, path=path)
    data = json.loads(path.read_text())
    data["measurements"]["DDP"]["machine"] = "another-box (x86_64, 64 cores, H100)"
    data["measurements"]["ZeRO-1"] = {**data["measurements"]["DDP"], "machine": ledger.origin()["machine"],
                                      "torch": "2.6.0"}
    path.write_text(json.dumps(data))
    table = ledger.Table(path=path)
    assert _entry(table, "DDP")["record"]["provenance"].startswith("foreign: another-box")
    assert _entry(table, "ZeRO-1")["record"]["provenance"].startswith("stale:")
    assert "foreign" in str(table) and "stale" in str(table)


def test_malformed_file_is_reported_and_kept(path):
    path.write_text("{not json")
    with pytest.raises(ledger.LedgerError, match="move it away"):
        ledger.record("DDP", 2.0, 2.0, path=path)
    assert path.read_text() == "{not json"
    path.write_text(json.dumps({"measurements": []}))
    with pytest.raises(ledger.LedgerError):
        ledger.Table(path=path)


def test_unknown_row_bad_number_and_bad_kind(path):
    with pytest.raises(KeyError, match="known rows"):
        ledger.record("ZeRO-4", 1, 1, path=path)
    with pytest.raises(ValueError, match="not finite"):
        ledger.record("DDP", 1, float("nan"), path=path)
    with pytest.raises(ValueError, match="kind must be one of"):
        ledger.record("DDP", 1, 1, kind="guessed", path=path)


def test_every_chapter_has_rows():
    from llmsys.course.runner import CHAPTERS

    assert {row.chapter for row in ledger.ROWS} == {c.number for c in CHAPTERS}
    names = [row.technique for row in ledger.ROWS]
    assert len(names) == len(set(names))
    assert all(row.use_when for row in ledger.ROWS)


def test_reference_scale_figures():
    """The reference-scale numbers equal the papers' formulas written out by hand."""
    psi, n = techniques.TRAIN.n_params, techniques.TRAIN.gpus
    assert 8.0e9 < psi < 8.1e9  # Llama-3-8B
    row = {r.technique: r for r in ledger.ROWS}
    # ZeRO (Rajbhandari et al. 2020): stage 1 shards K = 12 bytes of optimizer state, stage 3 all 16
    assert row["ZeRO-1"].saves_bytes == pytest.approx(12 * psi * (1 - 1 / n))
    assert row["ZeRO-3 / FSDP"].saves_bytes == pytest.approx(16 * psi * (1 - 1 / n))
    # DDP: ring all-reduce of bf16 gradients sends 2(N-1)/N · 2Ψ bytes per rank; ZeRO-3 adds half of that
    assert row["DDP"].adds_bytes == pytest.approx(2 * (n - 1) / n * 2 * psi)
    assert row["ZeRO-3 / FSDP"].adds_bytes == pytest.approx(row["DDP"].adds_bytes / 2)
    # KV quantization to int8 halves 2 · layers · kv_heads · head_dim · 2 bytes per token
    serve = techniques.SERVE
    kv = accounting.kv_cache_bytes(32, 8, 128, serve.seq * serve.batch)
    assert row["KV quantization"].saves_bytes == pytest.approx(kv / 2)
    assert row["KV cache"].saves_bytes == pytest.approx(-kv)
    # a KV reload over PCIe and a disaggregated prefill's transfer move one 8k-token sequence's KV
    assert row["KV tiers"].adds_bytes == row["Prefill/decode disaggregation"].adds_bytes == pytest.approx(kv / 32)

    # Drafters at the serving scale. Llama-3.2-1B (tied embeddings): 16 blocks of wq, wo (2048²), wk, wv
    # (2048 × 512), SwiGLU (3 · 2048 · 8192) and two norms, a final norm, one 128256 × 2048 table; plus its KV
    draft_params = 16 * (2 * 2048**2 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048) + 2048 + 128256 * 2048
    draft = 2 * draft_params + 2 * 16 * 8 * 64 * 2 * serve.seq * serve.batch
    assert row["Speculative decoding"].saves_bytes == pytest.approx(-draft)
    # EAGLE: one Llama-3-8B block, a 2d → d fusion layer, and one layer's KV
    block = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert row["EAGLE-style drafting"].saves_bytes == pytest.approx(draft - 2 * (block + 2 * 4096**2) - kv / 32)
    # VeRA against rank-16 LoRA on all seven linears, 16 bytes of training state per trainable parameter
    linears = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    lora = 32 * sum(16 * (i + o) for i, o in linears)
    vera = 32 * sum(256 + o for _, o in linears)
    assert row["VeRA"].saves_bytes == pytest.approx(16 * (lora - vera))
    # every row but expert parallelism (the reference model is dense) has a figure at a reference scale
    assert [r.technique for r in ledger.ROWS if r.scale is None] == ["Expert parallel"]


def test_json_view_and_plot(path):
    ledger.record("QLoRA", 0.25, 0.26, path=path)
    data = ledger.entries(path=path)
    json.dumps(data)  # plain data
    assert _entry(ledger.Table(path=path), "QLoRA")["record"]["measured"] == 0.26
    import matplotlib

    matplotlib.use("Agg")
    ax = ledger.plot(path=path)
    assert len(ax.collections) == sum(e["memory_saved_per_gpu_bytes"] is not None for e in data)


def test_records_from_processes_side_by_side_are_all_kept(tmp_path):
    """Chapters run side by side record into one ledger: no read-modify-write may lose a row."""
    import multiprocessing

    path = tmp_path / "ledger.json"
    rows = [row.technique for row in techniques.ROWS][:8]
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        pool.starmap(record_many, [(str(path), rows[i::4]) for i in range(4)])
    assert set(ledger.load_measurements(path)) == set(rows)


def record_many(path, rows):
    for row in rows:
        for _ in range(5):
            ledger.record(row, 1.0, 1.0, path=Path(path))
