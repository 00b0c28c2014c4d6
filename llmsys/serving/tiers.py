"""KV tiers below the block pool: CPU RAM, then disk files, holding the full blocks the pool evicts,
by their chained prefix hash, so a later request reloads them instead of recomputing them.

The pool (``blocks``) keeps freed full blocks indexed until it needs their memory, then evicts the
least recently freed one. With tiers that block is not lost: its keys and values are copied down
into RAM; when RAM is full its least recently used block moves down to disk; when disk is full its
least recently used block is dropped. On a prefix-cache miss in the pool, ``BlockManager.add`` asks
the tiers before giving up: a hit copies the block into a fresh pool block (a reload) and prefill
starts after it. A block lives in one place at a time (exclusive tiers): a reload takes it out of
its tier, and the pool evicts it down again later.

Eviction order, every tier: least recently used first. A block enters RAM when the pool evicts it,
which the pool does least recently freed first, and enters disk when RAM pushes it out, so within a
tier the oldest entry is the least recently used; storing a hash already present makes it newest.

Disk files, one per block, are written to a temporary name and renamed (``os.replace``, atomic on
POSIX), so a reader sees a whole file or none. A file starts with a header (hash, tokens, dtype,
shape, BLAKE2b of the payload); a file that is missing, truncated, altered or for other tokens is a
miss (the block is recomputed), never a wrong answer. No fsync: the folder is this engine's private
spill space, removed when the tiers are closed or collected, so only atomic visibility matters, not
durability across a power cut. It is never shared: a block's hash names its tokens, not the model
that computed its keys and values.

References: LMCache (Cheng et al. 2025, arXiv 2510.09665), a KV layer storing blocks in CPU RAM and
on disk below vLLM; Mooncake (Qin et al., FAST 2025, arXiv 2407.00079), a KV pool over DRAM and SSD.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

FILE_FORMAT = 1


class RamTier:
    """Blocks as CPU tensors (2·layers, block_size, n_kv_heads, head_dim), oldest first."""

    name = "ram"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def tokens(self, h: int) -> tuple[int, ...] | None:
        entry = self.entries.get(h)
        return None if entry is None else entry[0]

    def hashes(self) -> list[int]:
        """Held hashes, least recently used first."""
        return list(self.entries)

    def put(self, h: int, tokens: tuple[int, ...], kv: torch.Tensor) -> bool:
        self.entries[h] = (tokens, kv)
        self.entries.move_to_end(h)
        return True

    def take(self, h: int) -> torch.Tensor | None:
        return self.entries.pop(h)[1]

    def discard(self, h: int) -> None:
        self.entries.pop(h, None)


class DiskTier:
    """Blocks as files ``<hash>.kv`` in a private folder made under ``folder``; the index stays in memory."""

    name = "disk"

    def __init__(self, capacity: int, folder=None):
        self.capacity = capacity
        self.folder = Path(tempfile.mkdtemp(prefix="kv-tier-", dir=folder))
        self.cleanup = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        self.index: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.corrupt = self.write_errors = 0

    def __len__(self) -> int:
        return len(self.index)

    def path(self, h: int) -> Path:
        return self.folder / f"{h:016x}.kv"

    def tokens(self, h: int) -> tuple[int, ...] | None:
        return self.index.get(h)

    def hashes(self) -> list[int]:
        return list(self.index)

    def put(self, h: int, tokens: tuple[int, ...], kv: torch.Tensor) -> bool:
        """Write the block atomically; a failed write (disk full, permissions) drops it, and says so."""
        payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
        header = {"format": FILE_FORMAT, "hash": h, "tokens": list(tokens), "dtype": str(kv.dtype),
                  "shape": list(kv.shape), "blake2b": hashlib.blake2b(payload).hexdigest()}
        final, partial = self.path(h), self.folder / f".{h:016x}.{os.getpid()}.partial"
        try:
            with open(partial, "wb") as f:
                f.write(json.dumps(header).encode() + b"\n")
                f.write(payload)
            os.replace(partial, final)  # readers see the old state or the whole new file, never a part
        except OSError:
            partial.unlink(missing_ok=True)
            self.discard(h)
            self.write_errors += 1
            return False
        self.index[h] = tokens
        self.index.move_to_end(h)
        return True

    def take(self, h: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The block's keys and values, or None when its file is missing or does not check out."""
        tokens, path = self.index.pop(h), self.path(h)
        try:
            data = path.read_bytes()
            end = data.index(b"\n")
            header, payload = json.loads(data[:end]), data[end + 1:]
            if (header.get("format") != FILE_FORMAT or header.get("hash") != h
                    or tuple(header.get("tokens", ())) != tokens or header.get("dtype") != str(dtype)
                    or tuple(header.get("shape", ())) != tuple(shape)
                    or hashlib.blake2b(payload).hexdigest() != header.get("blake2b")):
                raise ValueError("header or checksum does not match")
            kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)
        except (OSError, ValueError, TypeError, AttributeError, RuntimeError):  # unreadable, in any way
            self.corrupt += 1
            kv = None
        path.unlink(missing_ok=True)
        return kv

    def discard(self, h: int) -> None:
        if self.index.pop(h, None) is not None:
            self.path(h).unlink(missing_ok=True)


class KVTiers:
    """RAM (``ram_blocks`` blocks) and, with ``disk_blocks`` > 0, disk files under ``folder`` (default: the
    system's temporary folder), below one engine's block pool: ``Engine(..., tiers=KVTiers(64, 256))``.

    ``stats()`` counts per tier: hits (blocks reloaded from it), stored, moved down, dropped, held."""

    def __init__(self, ram_blocks: int, disk_blocks: int = 0, folder=None):
        for name, value in (("ram_blocks", ram_blocks), ("disk_blocks", disk_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (a capacity in KV blocks), got {value!r}")
        if ram_blocks + disk_blocks == 0:
            raise ValueError("both tiers have capacity 0: give ram_blocks or disk_blocks a positive number of blocks")
        if folder is not None and not Path(folder).is_dir():
            raise ValueError(f"folder {folder!r} is not an existing folder; create it or pass folder=None")
        self.tiers: list = [RamTier(ram_blocks)] + ([DiskTier(disk_blocks, folder)] if disk_blocks else [])
        self.counts = {t.name: {"hits": 0, "stored": 0, "moved_down": 0, "dropped": 0} for t in self.tiers}
        self.misses = 0  # pool misses no tier could serve
        self.cache = None
        self.wall_s = self.cpu_s = 0.0  # time spent copying blocks, not yet charged to an engine step

    def attach(self, cache, blocks) -> None:
        """Serve ``cache`` (a ``PagedKVCache``) and the ``BlockManager`` that indexes it."""
        if self.cache is not None:
            raise ValueError("these tiers already serve another engine's KV cache; make one KVTiers per engine")
        self.cache = cache
        blocks.allocator.on_evict = self.offload
        blocks.tiers = self

    @property
    def block_shape(self) -> tuple[int, ...]:
        c = self.cache
        return (2 * len(c.k), c.block_size, c.n_kv_heads, c.head_dim)

    def holds(self, h: int, tokens) -> bool:
        return any(t.tokens(h) == tuple(tokens) for t in self.tiers)

    def offload(self, block: int, h: int, tokens) -> None:
        """The pool is about to overwrite cached ``block``: copy its keys and values down into RAM."""
        t0, c0 = time.perf_counter(), time.process_time()
        # stack copies, so the pool may overwrite the block as soon as this returns
        kv = torch.stack([layer[block] for layer in self.cache.k + self.cache.v]).to("cpu")
        self.store(0, h, tuple(tokens), kv)
        self.charge(t0, c0)

    def store(self, level: int, h: int, tokens: tuple[int, ...], kv: torch.Tensor) -> None:
        """Put a block into tier ``level``; push that tier's least recently used blocks further down."""
        for other in self.tiers:
            if other is not self.tiers[level]:
                other.discard(h)  # one copy only: this one is the newest
        tier = self.tiers[level]
        if tier.put(h, tokens, kv):
            self.counts[tier.name]["stored"] += 1
        while len(tier) > tier.capacity:
            old = tier.hashes()[0]
            if level + 1 < len(self.tiers):
                old_tokens, old_kv = tier.tokens(old), tier.take(old)
                self.counts[tier.name]["moved_down"] += 1
                self.store(level + 1, old, old_tokens, old_kv)
            else:
                tier.discard(old)
                self.counts[tier.name]["dropped"] += 1

    def reload(self, h: int, tokens, allocate) -> int | None:
        """Take the block held for (h, tokens) out of its tier and copy it into a pool block from ``allocate()``
        (taken first, so the evictions that allocation causes cannot push it out); None on a miss."""
        t0, c0 = time.perf_counter(), time.process_time()
        kv, block = None, None
        for tier in self.tiers:
            if tier.tokens(h) == tuple(tokens):
                disk = isinstance(tier, DiskTier)
                kv = tier.take(h, self.cache.k[0].dtype, self.block_shape) if disk else tier.take(h)
                break
        if kv is None:
            self.misses += 1
        else:
            block, kv = allocate(), kv.to(self.cache.device)
            for layer, values in zip(self.cache.k + self.cache.v, kv):
                layer[block] = values
            self.counts[tier.name]["hits"] += 1
        self.charge(t0, c0)
        return block

    def charge(self, t0: float, c0: float) -> None:
        self.wall_s += time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0

    def take_time(self) -> tuple[float, float]:
        """(wall, CPU) seconds spent copying blocks since the last call: the engine adds them to its step."""
        spent, self.wall_s, self.cpu_s = (self.wall_s, self.cpu_s), 0.0, 0.0
        return spent

    def stats(self) -> dict:
        out = {t.name: self.counts[t.name] | {"held": len(t), "capacity": t.capacity} for t in self.tiers}
        if len(self.tiers) > 1:
            out["disk"] |= {"corrupt": self.tiers[1].corrupt, "write_errors": self.tiers[1].write_errors}
        return out | {"misses": self.misses}

    def close(self) -> None:
        """Remove the disk tier's folder now (it is also removed when these tiers are garbage-collected)."""
        for tier in self.tiers:
            if isinstance(tier, DiskTier):
                tier.index.clear()
                tier.cleanup()
