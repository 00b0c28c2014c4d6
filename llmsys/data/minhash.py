"""Exact and near-duplicate detection: hashing, MinHash and locality-sensitive hashing.

Lee et al. 2021, "Deduplicating Training Data Makes Language Models Better" (arXiv
2107.06499), find near-duplicates with MinHash over word 5-gram shingles and LSH bands.

MinHash (Broder 1997): apply k random permutations π_i to the hashed shingles of a
document and keep min π_i per permutation. For two sets, P[min π_i(A) = min π_i(B)] is their
Jaccard similarity J = |A ∩ B| / |A ∪ B|, so the share of equal signature entries estimates
J with standard error √(J(1 − J) / k). LSH cuts the signature into b bands of r rows and
makes two documents candidates when any band is equal: P[candidate] = 1 − (1 − J^r)^b.

The permutation family is datasketch's ``affine32`` scheme (``datasketch.MinHash``,
version 2): shingle bytes → first 4 bytes of SHA-1 (little-endian) → the MurmurHash3 32-bit
finalizer → a·h + b mod 2^32 with odd a. With the same (a, b) our signatures equal
datasketch's exactly (integer arithmetic), which the tests check.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import unicodedata

import numpy as np

MAX_HASH = np.uint32(0xFFFFFFFF)  # the signature of an empty set


def shingles(text: str, n: int = 5) -> set[str]:
    """Word n-grams of a document (Lee et al. use 5); a document of fewer words is one shingle."""
    w = text.split()
    if len(w) < n:
        return {" ".join(w)} if w else set()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def sha1_hash32(data: bytes) -> int:
    return int.from_bytes(hashlib.sha1(data).digest()[:4], "little")


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer: a fixed bijection that spreads similar inputs apart."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def permutations(num_perm: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of num_perm affine maps h -> a·h + b mod 2^32, a odd (so each map is a bijection)."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


class MinHasher:
    """Signatures (num_perm,) uint32 of shingle sets under one fixed family of permutations."""

    def __init__(self, num_perm: int = 128, seed: int = 1, perms: tuple[np.ndarray, np.ndarray] | None = None):
        self.a, self.b = perms if perms is not None else permutations(num_perm, seed)
        self.a, self.b = np.asarray(self.a, dtype=np.uint32), np.asarray(self.b, dtype=np.uint32)
        if (self.a & 1 == 0).any():
            raise ValueError("every multiplier a must be odd, or the map h -> a·h + b is not a permutation")
        self.num_perm = len(self.a)

    def signature(self, items) -> np.ndarray:
        if not items:
            return np.full(self.num_perm, MAX_HASH, dtype=np.uint32)
        h = fmix32(np.array([sha1_hash32(s.encode("utf-8")) for s in items], dtype=np.uint32))  # (n,)
        permuted = self.a[None, :] * h[:, None] + self.b[None, :]  # (n, num_perm), wraps mod 2^32
        return permuted.min(axis=0)


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    if sig_a.shape != sig_b.shape:
        raise ValueError(f"signatures of different lengths {sig_a.shape} and {sig_b.shape}")
    return float((sig_a == sig_b).mean())


def standard_error(j: float, num_perm: int) -> float:
    return (j * (1 - j) / num_perm) ** 0.5


def candidate_probability(j: float, bands: int, rows: int) -> float:
    """P[two documents with Jaccard j share at least one of b bands of r rows]."""
    return 1 - (1 - j ** rows) ** bands


class LSH:
    """Bands of a signature as bucket keys: documents sharing any bucket are candidate pairs."""

    def __init__(self, bands: int, rows: int):
        if bands < 1 or rows < 1:
            raise ValueError(f"bands and rows must be positive, got {bands} and {rows}")
        self.bands, self.rows = bands, rows
        self.buckets: list[dict[bytes, list]] = [{} for _ in range(bands)]

    def insert(self, key, signature: np.ndarray) -> None:
        if len(signature) < self.bands * self.rows:
            raise ValueError(f"a signature of {len(signature)} values cannot fill {self.bands} bands of {self.rows} rows")
        for band, table in enumerate(self.buckets):
            table.setdefault(signature[band * self.rows:(band + 1) * self.rows].tobytes(), []).append(key)

    def query(self, signature: np.ndarray) -> set:
        out = set()
        for band, table in enumerate(self.buckets):
            out.update(table.get(signature[band * self.rows:(band + 1) * self.rows].tobytes(), ()))
        return out

    def candidate_pairs(self) -> set[tuple]:
        pairs = set()
        for table in self.buckets:
            for keys in table.values():
                pairs.update(tuple(sorted(p)) for p in itertools.combinations(keys, 2))
        return pairs


def near_duplicates(texts: list[str], threshold: float = 0.7, num_perm: int = 128, bands: int = 32,
                    rows: int = 4, seed: int = 1) -> set[tuple[int, int]]:
    """Pairs (i, j), i < j, whose estimated Jaccard of 5-gram shingles (of the normalized text)
    is at least ``threshold``, among the LSH candidates (never comparing all pairs)."""
    hasher, lsh = MinHasher(num_perm, seed), LSH(bands, rows)
    signatures = [hasher.signature(shingles(normalize(t))) for t in texts]
    for i, sig in enumerate(signatures):
        lsh.insert(i, sig)
    return {(i, j) for i, j in lsh.candidate_pairs() if estimate_jaccard(signatures[i], signatures[j]) >= threshold}


def exact_pairs(texts: list[str], threshold: float = 0.7) -> set[tuple[int, int]]:
    """Every pair whose exact shingle Jaccard is at least ``threshold``: the ground truth (O(n²))."""
    sets = [shingles(normalize(t)) for t in texts]
    return {(i, j) for i, j in itertools.combinations(range(len(texts)), 2) if jaccard(sets[i], sets[j]) >= threshold}


def normalize(text: str) -> str:
    """Unicode NFKC, lower case, whitespace collapsed: what exact dedup compares."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).lower()).strip()


def exact_duplicates(texts: list[str]) -> list[list[int]]:
    """Groups (of 2 or more) of documents equal after ``normalize``, by SHA-256."""
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(texts):
        groups.setdefault(hashlib.sha256(normalize(t).encode()).hexdigest(), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def precision_recall(found: set, truth: set) -> tuple[float, float]:
    hits = len(found & truth)
    return (hits / len(found) if found else 1.0), (hits / len(truth) if truth else 1.0)
