"""Byte-level BPE: the tokenizer the course trains for its embedded models.

Text becomes UTF-8 bytes, so the 256 byte values are the first 256 tokens and
any string can be encoded. Training then repeats one step: find the most
frequent adjacent pair of tokens and give it a new id (a *merge*). Encoding
replays the merges in the order they were learned; decoding concatenates the
bytes each id stands for.

Before counting pairs, text is split into chunks (a run of letters, of digits,
of punctuation, of whitespace, each with an optional leading space, GPT-2
style), and merges never cross a chunk boundary. That keeps "dog." and "dog!"
sharing the token for " dog" instead of learning "g." and "g!".

Training counts pairs once per *distinct* chunk, weighted by how often the chunk
occurs, and after each merge updates only the chunks that contained the merged
pair, so it runs in seconds in pure Python.

Special tokens (``"<|endoftext|>"``, chat markers) get the ids after the merges.
``encode`` finds them first, leftmost and, where two overlap at one position,
the longest; the text between them is encoded as usual, so no merge ever splits
one. ``encode_iterable`` encodes a stream of text (a file, line by line) whose
whole does not fit in memory, with exactly the ids ``encode`` gives the joined text.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from llmsys.core.cache import atomic_write_json

# Python's `re` has no \p{L}; [^\W\d_] is "a word character that is not a digit
# or underscore", i.e. a letter. Underscore counts as punctuation so that
# identifiers like __init__ split into "__", "init", "__". The last two
# alternatives keep a run of spaces before a word apart from the space that
# the word takes as its prefix. Together the alternatives match every
# character, so the chunks always concatenate back to the text.
SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""

# Lone surrogates (e.g. "\ud800") are valid Python str but not valid UTF-8.
# "surrogatepass" encodes them as their 3-byte form, so every str round-trips.
_ENCODING_ERRORS = "surrogatepass"

_FORMAT = "llmsys-bpe"
_FORMAT_VERSION = 1


class BPETokenizer:
    """A byte-level BPE tokenizer: 256 byte tokens plus one token per merge.

    ``merges`` maps a pair of ids to the id it merges into, in training order
    (ids 256, 257, ...). ``vocab[i]`` is the bytes token ``i`` stands for.
    """

    def __init__(self, merges: dict[tuple[int, int], int] | None = None, pattern: str = SPLIT_PATTERN,
                 special_tokens: Iterable[str] = ()):
        self.merges: dict[tuple[int, int], int] = dict(merges or {})
        self.pattern = pattern
        self._split = re.compile(pattern)
        self.vocab: list[bytes] = [bytes([b]) for b in range(256)]
        for expected_id, ((a, b), new_id) in enumerate(self.merges.items(), start=256):
            if new_id != expected_id or not (0 <= a < new_id and 0 <= b < new_id):
                raise ValueError(
                    f"merge {(a, b)} -> {new_id} is out of order: merge number k must create id 256 + k "
                    "from ids that already exist"
                )
            self.vocab.append(self.vocab[a] + self.vocab[b])
        special_tokens = list(special_tokens)
        if any(not isinstance(t, str) or not t for t in special_tokens) or len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"special tokens must be distinct, non-empty strings, got {special_tokens!r}")
        self.special_tokens: dict[str, int] = {t: len(self.vocab) + i for i, t in enumerate(special_tokens)}
        self.vocab += [t.encode("utf-8", _ENCODING_ERRORS) for t in special_tokens]
        # longest first: at one position the regex takes the first alternative that matches
        by_length = sorted(special_tokens, key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, by_length))) if special_tokens else None
        # how far past its end more text can still change a unit (chunk or special token): a
        # chunk's match reads up to 2 characters beyond it (contractions, the whitespace
        # lookahead), and a special token still incomplete at the end can start a new segment
        self._lookahead = 3 + max((len(t) for t in special_tokens), default=0)
        self._chunk_cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    # ---------------------------------------------------------------- training

    @classmethod
    def train(cls, text: str, vocab_size: int, progress: bool = False) -> BPETokenizer:
        """Learn ``vocab_size - 256`` merges from ``text``.

        Stops early (with a smaller vocabulary) if every chunk is already a
        single token, which only happens on very short texts.
        """
        if not isinstance(vocab_size, int) or vocab_size < 256:
            raise ValueError(f"vocab_size must be an int >= 256 (the byte tokens), got {vocab_size!r}")
        tok = cls()
        chunk_counts = Counter(tok._split.findall(text))
        words = [list(chunk.encode("utf-8", _ENCODING_ERRORS)) for chunk in chunk_counts]
        freqs = list(chunk_counts.values())

        # pair -> weighted count, and pair -> indices of words that (may) contain it.
        # The index sets are only ever added to; a stale index is harmless because
        # merging a word that no longer holds the pair changes nothing.
        pair_counts: dict[tuple[int, int], int] = defaultdict(int)
        pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
        for w, (word, freq) in enumerate(zip(words, freqs)):
            for pair in zip(word, word[1:]):
                pair_counts[pair] += freq
                pair_words[pair].add(w)

        merges: dict[tuple[int, int], int] = {}
        steps = range(256, vocab_size)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="BPE merges")
        for new_id in steps:
            if not pair_counts:
                break
            # Most frequent pair; a tie goes to the smallest pair, so the result
            # does not depend on the order pairs were counted in.
            best = min(pair_counts, key=lambda p: (-pair_counts[p], p))
            merges[best] = new_id
            for w in pair_words.pop(best):
                old = words[w]
                new = _merge(old, best, new_id)
                if len(new) == len(old):
                    continue
                freq = freqs[w]
                for pair in zip(old, old[1:]):
                    pair_counts[pair] -= freq
                    if pair_counts[pair] == 0:
                        del pair_counts[pair]
                for pair in zip(new, new[1:]):
                    pair_counts[pair] += freq
                    pair_words[pair].add(w)
                words[w] = new
        return cls(merges)

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids for ``text``; ``decode(encode(text)) == text`` for every str.

        With ``special`` (the default) the special tokens in ``text`` become their ids;
        without, their text is encoded like any other."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}; decode bytes to str first")
        ids: list[int] = []
        for start, end, special_id in self._units(text, special):
            ids.extend([special_id] if special_id is not None else self._encode_text_chunk(text[start:end]))
        return ids

    def encode_iterable(self, texts: Iterable[str], special: bool = True) -> Iterator[int]:
        """The ids of ``"".join(texts)``, yielded while ``texts`` is read (e.g. an open file, line
        by line), holding only the text whose tokens are not yet certain: equal to ``encode``
        of the joined text, in memory that does not grow with it."""
        buffer = ""
        for piece in texts:
            if not isinstance(piece, str):
                raise TypeError(f"encode_iterable takes str pieces, got {type(piece).__name__}; "
                                f"open files in text mode")
            buffer += piece
            settled = len(buffer) - self._lookahead  # a unit that ends by here is final
            cut = 0
            for start, _, _ in self._units(buffer, special):
                if start > settled:
                    break
                cut = start  # every unit before this one ends by here
            if cut:
                yield from self.encode(buffer[:cut], special)
                buffer = buffer[cut:]
        yield from self.encode(buffer, special)

    def _units(self, text: str, special: bool) -> Iterator[tuple[int, int, int | None]]:
        """(start, end, special token id or None) of every special token and chunk of ``text``."""
        position = 0
        if special and self._special is not None:
            for match in self._special.finditer(text):
                for chunk in self._split.finditer(text, position, match.start()):
                    yield chunk.start(), chunk.end(), None
                yield match.start(), match.end(), self.special_tokens[match.group()]
                position = match.end()
        for chunk in self._split.finditer(text, position, len(text)):
            yield chunk.start(), chunk.end(), None

    def _encode_text_chunk(self, chunk: str) -> list[int]:
        cached = self._chunk_cache.get(chunk)
        if cached is None:
            cached = self._encode_chunk(chunk.encode("utf-8", _ENCODING_ERRORS))
            if len(self._chunk_cache) < 100_000:  # bound memory on adversarial input
                self._chunk_cache[chunk] = cached
        return cached

    def _encode_chunk(self, data: bytes) -> list[int]:
        ids = list(data)
        while len(ids) >= 2:
            # The earliest-learned merge present must be applied first, as in training.
            pair = min(zip(ids, ids[1:]), key=lambda p: self.merges.get(p, float("inf")))
            if pair not in self.merges:
                break
            ids = _merge(ids, pair, self.merges[pair])
        return ids

    def decode(self, ids) -> str:
        """The text for ``ids`` (a list, tuple or 1-D tensor of ints).

        Any sequence of in-range ids decodes: a byte sequence that is not valid
        UTF-8 (a model may emit one) becomes U+FFFD. Out-of-range ids raise.
        """
        data = self.decode_bytes(ids)
        try:  # the output of `encode` always takes this path, lone surrogates included
            return data.decode("utf-8", _ENCODING_ERRORS)
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace")

    def decode_bytes(self, ids) -> bytes:
        """The raw bytes ``ids`` stand for."""
        if hasattr(ids, "tolist"):  # torch tensors and numpy arrays
            ids = ids.tolist()
        vocab, n = self.vocab, len(self.vocab)
        parts = []
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
                raise ValueError(f"token id {i!r} is not in this tokenizer's vocabulary (ids 0..{n - 1})")
            parts.append(vocab[i])
        return b"".join(parts)

    def compression_ratio(self, text: str) -> float:
        """Bytes of UTF-8 per token on ``text`` (1.0 means no compression)."""
        ids = self.encode(text)
        if not ids:
            raise ValueError("compression_ratio needs a non-empty text")
        return len(text.encode("utf-8", _ENCODING_ERRORS)) / len(ids)

    # ---------------------------------------------------------------- persistence

    def to_dict(self) -> dict:
        d = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "pattern": self.pattern,
            "merges": [[a, b] for a, b in self.merges],
        }
        if self.special_tokens:  # absent otherwise: files without special tokens stay as they were
            d["special_tokens"] = list(self.special_tokens)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> BPETokenizer:
        if not isinstance(d, dict) or d.get("format") != _FORMAT or d.get("version") != _FORMAT_VERSION:
            raise ValueError(f"not an {_FORMAT} v{_FORMAT_VERSION} tokenizer file; train or save it again")
        merges = {(int(a), int(b)): 256 + k for k, (a, b) in enumerate(d["merges"])}
        if len(merges) != len(d["merges"]):
            raise ValueError("tokenizer file has a repeated merge; it is corrupted")
        return cls(merges, d["pattern"], d.get("special_tokens", ()))

    def save(self, path) -> None:
        atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path) -> BPETokenizer:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __eq__(self, other) -> bool:
        if not isinstance(other, BPETokenizer):
            return NotImplemented
        return (self.pattern == other.pattern and list(self.merges.items()) == list(other.merges.items())
                and self.special_tokens == other.special_tokens)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair`` (left to right) by ``new_id``."""
    out = []
    i, n = 0, len(ids)
    a, b = pair
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
