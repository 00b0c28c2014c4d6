"""A paged KV cache's bookkeeping: physical blocks, block tables, reference
counts, copy-on-write and a hash-chained prefix cache.

Physical KV memory is cut into ``num_blocks`` blocks of ``block_size`` token
slots. A sequence owns a *block table*: logical block i (its tokens
i·block_size .. (i+1)·block_size - 1) lives in physical block table[i]. A
sequence of L tokens holds ⌈L / block_size⌉ blocks, so at most one partly
filled block is wasted per sequence, instead of a whole reserved maximum.

Blocks are reference counted. Forked sequences (parallel sampling, beam
search) share every block; the first write into a shared block copies it
(copy-on-write). With prefix caching, every *full* block is indexed by a hash
of its tokens chained on the hash of the block before it, so two requests that
start with the same system prompt share its blocks, while equal tokens after a
different prefix (different keys and values, because attention saw other
tokens) hash differently. A partial block is never shared through the cache.
Freed cached blocks stay indexed until they are handed out again, oldest
freed first (LRU eviction); with KV tiers below the pool (``tiers``) an evicted
block is copied down to RAM or disk and reloaded on a later miss.

References: vLLM (Kwon et al., SOSP'23, arXiv 2309.06180); nano-vllm's block
manager; vLLM v1's KV cache manager.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

NO_PARENT = 0  # the chained hash "before" a sequence's first block


def block_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    """Hash of one full block's tokens, chained on the hash of the block before it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of every full block of ``tokens`` (a trailing partial block has none)."""
    hashes, parent = [], NO_PARENT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


def blocks_for(n_tokens: int, block_size: int) -> int:
    """⌈n_tokens / block_size⌉: blocks a sequence of n_tokens holds."""
    return -(-n_tokens // block_size)


class OutOfBlocks(RuntimeError):
    """No free block is left; the scheduler must wait or preempt a sequence."""


class BlockAllocator:
    """Physical block ids 0 .. num_blocks-1 with reference counts.

    A block is free when its count is 0. Free blocks wait in ``free_ids`` in the
    order they were freed; ``allocate`` takes the oldest, so a cached block
    freed long ago is evicted before one freed a moment ago.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = False):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_of: dict[int, int] = {}  # block -> chained hash of its (full) contents
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its tokens, to re-check a hit
        self.block_by_hash: dict[int, int] = {}
        self.evictions = 0
        self.on_evict = None  # called (block, hash, tokens) before a cached block is overwritten: KV tiers

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def allocate(self) -> int:
        """A fresh block with reference count 1; evicts the oldest cached free block if need be."""
        if not self.free_ids:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self.free_ids.popitem(last=False)
        if block in self.hash_of:  # its cached contents are about to be overwritten
            if self.on_evict is not None:
                self.on_evict(block, self.hash_of[block], self.tokens_of[block])
            del self.block_by_hash[self.hash_of.pop(block)]
            del self.tokens_of[block]
            self.evictions += 1
        self.ref_counts[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more owner; a free cached block comes back to life."""
        if self.ref_counts[block] == 0:
            del self.free_ids[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One owner fewer; at zero the block joins the free list (keeping its cache entry)."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is already free; releasing it twice would corrupt the pool")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_ids[block] = None

    def lookup(self, h: int, tokens: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens after this prefix, or None."""
        block = self.block_by_hash.get(h)
        if block is None or self.tokens_of[block] != tuple(tokens):  # a hash collision is a miss
            return None
        return block

    def register(self, block: int, h: int, tokens: Sequence[int]) -> None:
        """Index a block whose keys and values are now complete, so later requests can share it."""
        if not self.prefix_caching or h in self.block_by_hash or block in self.hash_of:
            return  # the first copy of a prefix stays the cached one
        self.block_by_hash[h] = block
        self.hash_of[block] = h
        self.tokens_of[block] = tuple(tokens)

    @property
    def num_cached(self) -> int:
        return len(self.block_by_hash)


class BlockManager:
    """Block tables of sequences over one ``BlockAllocator``.

    A sequence is known by any hashable id. ``prepare(seq, start, n)`` makes
    positions start .. start+n-1 writable (new blocks, or a private copy of a
    shared one) and returns the (src, dst) block copies the KV store must do
    first; ``commit(seq, tokens, n_computed)`` indexes the full blocks whose
    keys and values are now stored.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = False):
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.block_size = block_size
        self.tables: dict = {}
        self.committed: dict = {}  # seq -> chained hashes of its full blocks indexed so far
        self.tiers = None  # KV tiers below the pool (``tiers.KVTiers``), asked on a prefix-cache miss

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def table(self, seq) -> list[int]:
        return self.tables[seq]

    def add(self, seq, tokens: Sequence[int] = ()) -> int:
        """Start a block table for ``seq``; with prefix caching, claim the cached blocks of the
        longest cached prefix of ``tokens`` and return how many tokens they hold.

        At least the last token is always left to compute: its logits choose the next token."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already has a block table")
        self.tables[seq], self.committed[seq] = [], []
        if not self.allocator.prefix_caching:
            return 0
        for i, h in enumerate(prefix_hashes(tokens[:len(tokens) - 1], self.block_size)):
            block_tokens = tokens[i * self.block_size:(i + 1) * self.block_size]
            block = self.allocator.lookup(h, block_tokens)
            if block is not None:
                self.allocator.retain(block)
            elif (block := self.reload(h, block_tokens)) is None:
                break
            self.tables[seq].append(block)
            self.committed[seq].append(h)
        return len(self.tables[seq]) * self.block_size

    def reload(self, h: int, tokens: Sequence[int]) -> int | None:
        """On a pool miss: a fresh block holding the keys and values a lower tier kept for this prefix, or None."""
        if self.tiers is None or not self.allocator.num_free:
            return None
        block = self.tiers.reload(h, tokens, self.allocator.allocate)
        if block is not None:
            self.allocator.register(block, h, tokens)
        return block

    def blocks_to_write(self, seq, start: int, n: int) -> int:
        """Blocks ``prepare(seq, start, n)`` would take from the free list."""
        table, bs = self.tables[seq], self.block_size
        new = max(0, blocks_for(start + n, bs) - len(table))
        first, last = start // bs, min(len(table), blocks_for(start + n, bs)) - 1
        shared = sum(1 for i in range(first, last + 1) if self.allocator.ref_counts[table[i]] > 1)
        return new + shared

    def can_prepare(self, seq, start: int, n: int) -> bool:
        return self.blocks_to_write(seq, start, n) <= self.allocator.num_free

    def prepare(self, seq, start: int, n: int) -> list[tuple[int, int]]:
        """Make slots start .. start+n-1 of ``seq`` writable; return the block copies to do first."""
        if n < 0 or start < 0:
            raise ValueError(f"start and n must be >= 0, got start={start}, n={n}")
        if not self.can_prepare(seq, start, n):
            raise OutOfBlocks(f"sequence {seq!r} needs {self.blocks_to_write(seq, start, n)} free blocks, "
                              f"{self.allocator.num_free} are left")
        table, bs, copies = self.tables[seq], self.block_size, []
        for i in range(start // bs, min(len(table), blocks_for(start + n, bs))):
            if self.allocator.ref_counts[table[i]] > 1:  # copy-on-write: others still read the old one
                fresh = self.allocator.allocate()
                copies.append((table[i], fresh))
                self.allocator.release(table[i])
                table[i] = fresh
        while len(table) < blocks_for(start + n, bs):
            table.append(self.allocator.allocate())
        return copies

    def commit(self, seq, tokens: Sequence[int], n_computed: int) -> None:
        """Index every full block among the first ``n_computed`` tokens (their KV are stored)."""
        if not self.allocator.prefix_caching:
            return
        hashes, bs, table = self.committed[seq], self.block_size, self.tables[seq]
        while (len(hashes) + 1) * bs <= n_computed:
            i = len(hashes)
            block_tokens = tokens[i * bs:(i + 1) * bs]
            h = block_hash(hashes[-1] if hashes else NO_PARENT, block_tokens)
            self.allocator.register(table[i], h, block_tokens)
            hashes.append(h)

    def truncate(self, seq, n_tokens: int) -> None:
        """Give back the blocks of ``seq`` past its first ``n_tokens`` slots (speculative decoding's rejected
        drafts). Only slots past the computed tokens may go: blocks the prefix cache indexed stay."""
        table, keep = self.tables[seq], blocks_for(n_tokens, self.block_size)
        if keep < len(self.committed[seq]):
            raise ValueError(f"truncating {seq!r} to {n_tokens} tokens would drop blocks it has committed")
        while len(table) > keep:
            self.allocator.release(table.pop())

    def fork(self, parent, child) -> None:
        """``child`` starts as a copy of ``parent``, sharing every block until one of them writes."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already has a block table")
        for block in self.tables[parent]:
            self.allocator.retain(block)
        self.tables[child] = list(self.tables[parent])
        self.committed[child] = list(self.committed[parent])

    def free(self, seq) -> None:
        """Give back every block of ``seq``; the last blocks go first so shared prefixes stay cached longest."""
        for block in reversed(self.tables.pop(seq)):
            self.allocator.release(block)
        del self.committed[seq]

    def filled_slots(self, lengths: dict) -> int:
        """Distinct token slots holding keys and values, given each sequence's stored length
        (a block shared by several sequences counts once)."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for seq, length in lengths.items():
            for i, block in enumerate(self.tables.get(seq, ())):
                filled[block] = max(filled.get(block, 0), min(bs, max(0, length - i * bs)))
        return sum(filled.values())
