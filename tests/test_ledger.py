import json

import pytest

from llmsys import ledger


@pytest.fixture
def path(tmp_path):
    return tmp_path / "ledger.json"


def test_record_then_render(path):
    ledger.record("ZeRO-1", estimate=100.0, measured=101.0, unit="bytes", path=path)
    table = ledger.Table(upto=1, path=path)
    row = next(r for r in table.body if r[1] == "ZeRO-1")
    assert row[-3:] == ["100", "101", "1.01"]
    assert all(int(r[0]) <= 1 for r in table.body)
    html = table._repr_html_()
    assert html.startswith("<table") and "ZeRO-1" in html and "<td" in html
    text = str(table)
    assert "ZeRO-1" in text and "1.01" in text


def test_unmeasured_rows_say_so(path):
    body = ledger.Table(upto=0, path=path).body
    assert {r[1] for r in body} == {"Kernel fusion", "FlashAttention", "Scoring k tokens per call"}
    assert all(r[-2] == "not run yet" for r in body)


def test_measurements_accumulate_and_persist(path):
    ledger.record("DDP", 2.0, 2.0, path=path)
    ledger.record("ZeRO-3 / FSDP", 1.5, 1.5, path=path)
    assert set(ledger.load_measurements(path)) == {"DDP", "ZeRO-3 / FSDP"}


def test_malformed_file_is_reported_and_kept(path):
    path.write_text("{not json")
    with pytest.raises(ledger.LedgerError, match="move it away"):
        ledger.record("DDP", 2.0, 2.0, path=path)
    assert path.read_text() == "{not json"
    path.write_text(json.dumps({"measurements": []}))
    with pytest.raises(ledger.LedgerError):
        ledger.Table(path=path)


def test_unknown_row_and_bad_number(path):
    with pytest.raises(KeyError, match="known rows"):
        ledger.record("ZeRO-4", 1, 1, path=path)
    with pytest.raises(ValueError, match="not finite"):
        ledger.record("DDP", 1, float("nan"), path=path)


def test_every_chapter_has_rows():
    assert {row.chapter for row in ledger.ROWS} == set(range(10))
    names = [row.technique for row in ledger.ROWS]
    assert len(names) == len(set(names))
