"""KV tiers below the block pool: reloaded blocks give the tokens recomputing gives, hits are counted
per tier, full tiers evict least recently used first (RAM down to disk, disk to nothing), and a disk
file that is half-written, missing, altered or for other tokens is a miss, never a wrong answer."""

import os

import pytest
import torch

from llmsys.core.model import ModelConfig, Transformer
from llmsys.serving import (
    BlockManager,
    Engine,
    PagedKVCache,
    Request,
    SchedulerConfig,
    next_turn,
    prefix_hashes,
)
from llmsys.serving import tiers as tiers_module
from llmsys.serving.tiers import KVTiers

BS = 4


@pytest.fixture(scope="module")
def model():
    """A small fp32 decoder with well-separated logits, so greedy choices do not hinge on float rounding."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 3.0 / p.size(1) ** 0.5)
    return m


def transcripts(model, sessions=3, turns=3):
    """Multi-turn sessions (each turn's prompt holds the earlier turns) and every turn's greedy answer,
    decoded by the model alone: the reference the engines must match."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for s in range(sessions):
        rows, request = [], None
        for t in range(turns):
            user = torch.randint(1, 64, (9,), generator=gen).tolist()
            request = (Request((s, t), user, 6) if request is None else
                       next_turn(request, rows[-1][1], user, id=(s, t)))
            answer = model.generate(torch.tensor([request.prompt]), 6)[0, len(request.prompt):].tolist()
            rows.append((request, answer))
        out.append(rows)
    return out


def serve_interleaved(engine, sessions):
    """Turn 0 of every session, then turn 1 of every session, ...: a pool too small for all of them
    evicts each session's history before its next turn."""
    outputs, computed = {}, 0
    for t in range(len(sessions[0])):
        for rows in sessions:
            request, _ = rows[t]
            report = engine.run([request])
            outputs[request.id] = report.results[0].output
            computed += report.prefill_computed
    return outputs, computed


def engine(model, tiers=None, num_blocks=20):
    return Engine(model, num_blocks, BS, SchedulerConfig(prefix_caching=True), clock="cpu", tiers=tiers)


@pytest.mark.parametrize("ram, disk", [(64, 0), (0, 64), (3, 64)])
def test_reloaded_blocks_give_the_tokens_recomputing_gives(model, tmp_path, ram, disk):
    sessions = transcripts(model)
    expected = {request.id: answer for rows in sessions for request, answer in rows}
    recompute, recomputed = serve_interleaved(engine(model), sessions)
    tiers = KVTiers(ram, disk, tmp_path)
    reload, computed = serve_interleaved(engine(model, tiers), sessions)
    assert recompute == expected
    assert reload == expected
    stats = tiers.stats()
    hits = sum(stats[name]["hits"] for name in ("ram", "disk") if name in stats)
    assert hits > 0 and computed == recomputed - hits * BS  # every reloaded block is a block not recomputed
    if ram == 0:
        assert stats["ram"]["hits"] == 0 and stats["disk"]["hits"] == hits
    if disk == 0:
        assert stats["ram"]["hits"] == hits


def pool(model, tiers, num_blocks=2):
    blocks, cache = BlockManager(num_blocks, BS, prefix_caching=True), PagedKVCache(model, num_blocks, BS)
    tiers.attach(cache, blocks)
    return blocks, cache


def fill(blocks, cache, seq, tokens, value):
    """Compute a one-sequence prefix by hand: its blocks hold ``value`` + block index everywhere."""
    blocks.add(seq, tokens)
    blocks.prepare(seq, 0, len(tokens))
    for i, block in enumerate(blocks.table(seq)):
        for layer in cache.k + cache.v:
            layer[block] = value + i
    blocks.commit(seq, tokens, len(tokens))
    blocks.free(seq)


def holds(cache, block, value) -> bool:
    """Every layer's keys and values in ``block`` equal ``value`` (a reload is a copy: exact)."""
    return all(torch.equal(layer[block], torch.full_like(layer[block], value)) for layer in cache.k + cache.v)


def test_hits_are_counted_per_tier_and_reload_the_stored_values(model, tmp_path):
    tiers = KVTiers(1, 4, tmp_path)
    blocks, cache = pool(model, tiers, num_blocks=2)  # each fill takes both blocks and evicts the last one's
    a, b, c = [1] * BS + [9], [2] * BS + [9], [3] * BS + [9]  # one full block each (the last token is computed)
    fill(blocks, cache, "a", a, 10.0)
    fill(blocks, cache, "b", b, 20.0)
    fill(blocks, cache, "c", c, 30.0)  # evicts a's block into RAM
    fill(blocks, cache, "d", [4] * BS + [9], 40.0)  # evicts c's: RAM is full, b moves down to disk
    assert tiers.stats()["ram"]["held"] == 1 and tiers.stats()["disk"]["held"] == 2
    assert blocks.add("a2", a) == BS  # from disk
    assert holds(cache, blocks.table("a2")[0], 10.0)
    blocks.free("a2")
    assert blocks.add("c2", c) == BS  # from RAM
    assert holds(cache, blocks.table("c2")[0], 30.0)
    blocks.free("c2")
    ram, disk = tiers.tiers  # a hit takes the block out of its tier (one copy only); d's came down
    assert (ram.hashes(), disk.hashes()) == (prefix_hashes([4] * BS, BS), prefix_hashes(b, BS))
    assert blocks.add("new", [5] * BS + [9]) == 0  # nowhere: a miss
    stats = tiers.stats()
    assert (stats["ram"]["hits"], stats["disk"]["hits"], stats["misses"]) == (1, 1, 5)  # a, b, c, d and "new" missed
    assert blocks.tiers is tiers and stats["ram"]["moved_down"] >= 1


def test_full_tiers_evict_least_recently_used_first(model, tmp_path):
    tiers = KVTiers(2, 2, tmp_path)
    pool(model, tiers)
    ram, disk = tiers.tiers
    tokens = {h: (h,) * BS for h in range(1, 10)}
    for h in (1, 2, 3, 4, 5):  # evicted from the pool in this order
        tiers.offload(0, h, tokens[h])
    assert (ram.hashes(), disk.hashes()) == ([4, 5], [2, 3])  # 1, the least recently used, was dropped
    misses = tiers.stats()["misses"]
    assert tiers.reload(1, tokens[1], lambda: 1) is None  # the dropped block: a miss (recomputed), no stale copy
    assert tiers.reload(2, tokens[5], lambda: 1) is None  # a held hash asked for with other tokens: a miss too
    assert tiers.stats()["misses"] == misses + 2 and tiers.holds(2, tokens[2])
    assert tiers.reload(3, tokens[3], lambda: 1) == 1  # a hit moves it up, out of its tier
    assert not tiers.holds(3, tokens[3])
    tiers.offload(0, 6, tokens[6])  # 4 moves down into the room 3 left
    assert (ram.hashes(), disk.hashes()) == ([5, 6], [2, 4])
    tiers.offload(0, 2, tokens[2])  # a hash stored again is the newest; its older copy below is gone
    assert (ram.hashes(), disk.hashes()) == ([6, 2], [4, 5])
    tiers.offload(0, 7, tokens[7])  # 6 moves down, disk is full: 4 goes
    assert (ram.hashes(), disk.hashes()) == ([2, 7], [5, 6])
    stats = tiers.stats()
    assert (stats["ram"]["moved_down"], stats["disk"]["dropped"]) == (6, 2)  # 3, 4, 5, 6, 2 and 7 pushed one out of RAM
    assert sorted(os.listdir(disk.folder)) == [f"{h:016x}.kv" for h in (5, 6)]


def test_disk_writes_are_atomic(model, tmp_path, monkeypatch):
    tiers = KVTiers(0, 2, tmp_path)
    pool(model, tiers)
    disk = tiers.tiers[1]

    def crash(src, dst):
        raise OSError("no space left on device")

    monkeypatch.setattr(tiers_module.os, "replace", crash)  # the write fails before it is published
    tiers.offload(0, 7, (7,) * BS)
    assert os.listdir(disk.folder) == [] and not tiers.holds(7, (7,) * BS)
    assert tiers.stats()["disk"]["write_errors"] == 1
    monkeypatch.undo()
    tiers.offload(0, 8, (8,) * BS)
    assert os.listdir(disk.folder) == [f"{8:016x}.kv"]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete", "swap"])
def test_a_damaged_or_missing_file_is_a_miss(model, tmp_path, damage):
    tiers = KVTiers(0, 8, tmp_path)
    blocks, cache = pool(model, tiers)
    disk = tiers.tiers[1]
    a, b = [1] * BS + [9], [2] * BS + [9]
    for seq, tokens, value in (("a", a, 10.0), ("b", b, 20.0), ("c", [3] * BS + [9], 30.0), ("d", [4] * BS + [9], 40.)):
        fill(blocks, cache, seq, tokens, value)  # a's and b's blocks go down to disk
    ha, hb = prefix_hashes(a, BS)[0], prefix_hashes(b, BS)[0]
    path = disk.path(ha)
    if damage == "flip a byte":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "delete":
        path.unlink()
    else:  # b's file under a's name: a whole, valid file for other tokens
        os.replace(disk.path(hb), path)
    misses = tiers.stats()["misses"]
    assert blocks.add("a2", a) == 0  # recomputed, not served from a bad file
    assert not path.exists() and tiers.stats()["misses"] == misses + 1 and tiers.stats()["disk"]["hits"] == 0
    assert tiers.stats()["disk"]["corrupt"] == 1


def test_corrupt_disk_files_still_give_the_right_tokens(model, tmp_path):
    sessions = transcripts(model, sessions=3, turns=2)
    expected = {request.id: answer for rows in sessions for request, answer in rows}
    tiers = KVTiers(0, 64, tmp_path)
    e = engine(model, tiers, num_blocks=8)  # room for one session: the others go down to disk
    for rows in sessions:
        e.run([rows[0][0]])
    for path in tiers.tiers[1].folder.iterdir():  # every stored block altered on disk
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
    outputs = {rows[1][0].id: e.run([rows[1][0]]).results[0].output for rows in sessions}
    assert outputs == {rows[1][0].id: expected[rows[1][0].id] for rows in sessions}
    assert tiers.stats()["disk"]["corrupt"] > 0


def test_bad_settings_say_what_to_change(model, tmp_path):
    with pytest.raises(ValueError, match="ram_blocks must be an integer >= 0"):
        KVTiers(-1)
    with pytest.raises(ValueError, match="both tiers have capacity 0"):
        KVTiers(0, 0)
    with pytest.raises(ValueError, match="not an existing folder"):
        KVTiers(1, 1, tmp_path / "missing")
    with pytest.raises(ValueError, match="prefix_caching=True"):
        Engine(model, 8, BS, SchedulerConfig(), tiers=KVTiers(4))
    tiers = KVTiers(4, 4, tmp_path)
    engine(model, tiers)
    with pytest.raises(ValueError, match="one KVTiers per engine"):
        engine(model, tiers)
    folder = tiers.tiers[1].folder
    assert folder.is_dir() and folder.parent == tmp_path
    tiers.close()
    assert not folder.exists()


def test_the_crossover_is_where_reloading_and_recomputing_a_token_cost_the_same():
    """T* from tier_costs: a prefix's prefill FLOPs are the model's per-token FLOPs without the LM head (which
    runs on the last token only), and at T* a token's reload time equals its average recompute time."""
    from llmsys.serving import tier_costs

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96)
    head = 2 * cfg.vocab_size * cfg.dim
    assert tier_costs.prefill_flops(cfg, 5) == pytest.approx(sum(cfg.flops_per_token(t) - head for t in range(1, 6)))
    b, rate = cfg.kv_bytes_per_token(4), 1e10
    T = tier_costs.crossover(b, 1e6, cfg, rate)
    assert T > 1 and b / 1e6 == pytest.approx(tier_costs.prefill_flops(cfg, T) / T / rate)
    assert tier_costs.crossover(b, 1e15, cfg, rate) == 1.0  # a link this fast: reloading wins from the first block
