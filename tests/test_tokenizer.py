"""Byte-level BPE: exact round trips, and merges equal to a naive reference."""

import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydoc_data.topics import topics

from llmsys.core.tokenizer import SPLIT_PATTERN, BPETokenizer

CORPUS = "\n".join(topics[k] for k in sorted(topics))
TRAIN_TEXT = CORPUS[:60_000]
HELD_OUT = CORPUS[-20_000:]

# Any str: st.characters() leaves out lone surrogates, so add them explicitly.
ANY_TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])))


@pytest.fixture(scope="module")
def tok():
    return BPETokenizer.train(TRAIN_TEXT, 512)


def naive_train(text, vocab_size):
    """Recount every pair from scratch after every merge."""
    words = [list(chunk.encode("utf-8")) for chunk in re.findall(SPLIT_PATTERN, text)]
    merges = {}
    for new_id in range(256, vocab_size):
        counts = Counter(pair for w in words for pair in zip(w, w[1:]))
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges[best] = new_id
        words = [naive_merge(w, best, new_id) for w in words]
    return merges


def naive_merge(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if tuple(ids[i : i + 2]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def naive_encode(merges, text):
    """Apply every merge, in training order, to every chunk."""
    words = [list(chunk.encode("utf-8")) for chunk in re.findall(SPLIT_PATTERN, text)]
    for pair, new_id in merges.items():
        words = [naive_merge(w, pair, new_id) for w in words]
    return [i for w in words for i in w]


def test_training_matches_naive_reference():
    text = CORPUS[:8_000]
    assert BPETokenizer.train(text, 330).merges == naive_train(text, 330)


def test_encode_matches_naive_reference(tok):
    text = HELD_OUT[:3_000]
    assert tok.encode(text) == naive_encode(tok.merges, text)


def test_vocab_entries_are_the_merged_bytes(tok):
    for (a, b), new_id in tok.merges.items():
        assert tok.vocab[new_id] == tok.vocab[a] + tok.vocab[b]
    assert tok.vocab_size == 512 == 256 + len(tok.merges)


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT)
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ["", "héllo wörld 👋🏽 日本語のテキスト", "\x00\x1f\x7f\t\r\n  \u2028", "\ud800x\udfff", "a" * 5000])
def test_round_trip_edge_cases(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 511)))
def test_decode_any_in_range_ids(tok, ids):
    assert isinstance(tok.decode(ids), str)


def test_decode_accepts_a_tensor(tok):
    ids = tok.encode("def f(x): return x")
    assert tok.decode(torch.tensor(ids)) == "def f(x): return x"


@pytest.mark.parametrize("bad", [[-1], [512], [3, 10_000], [1.5]])
def test_out_of_range_id_raises(tok, bad):
    with pytest.raises(ValueError, match="not in this tokenizer's vocabulary"):
        tok.decode(bad)


def test_every_merge_shortens_the_training_text(tok):
    # A merge of a pair seen n times removes n tokens, so a tokenizer with the
    # first k + 1 merges encodes the training text strictly shorter than one with k.
    text = TRAIN_TEXT[:10_000]
    prefix = list(tok.merges.items())
    lengths = [len(BPETokenizer(dict(prefix[:k])).encode(text)) for k in (0, 1, 10, 100, len(prefix))]
    assert lengths[0] == len(text.encode())
    assert all(a > b for a, b in zip(lengths, lengths[1:]))


def test_compresses_held_out_text(tok):
    ratio = tok.compression_ratio(HELD_OUT)
    assert ratio == len(HELD_OUT.encode()) / len(tok.encode(HELD_OUT))
    assert ratio > 1.5
    assert BPETokenizer().compression_ratio(HELD_OUT) == 1.0


def test_save_load_equality(tok, tmp_path):
    path = tmp_path / "tok.json"
    tok.save(path)
    loaded = BPETokenizer.load(path)
    assert loaded == tok
    assert loaded.encode(HELD_OUT) == tok.encode(HELD_OUT)


def test_load_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text('{"merges": []}')
    with pytest.raises(ValueError, match="not an llmsys-bpe"):
        BPETokenizer.load(path)


def test_bad_arguments_raise_clear_errors(tok):
    with pytest.raises(ValueError, match="vocab_size must be"):
        BPETokenizer.train("abc", 100)
    with pytest.raises(TypeError, match="takes a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="non-empty"):
        tok.compression_ratio("")


def test_short_text_stops_early():
    tok = BPETokenizer.train("ab ab", 1000)
    assert tok.encode("ab ab") == [256, 257]  # "ab", " ab": nothing left to merge
    assert tok.vocab_size == 258


# ---------------------------------------------------------------- special tokens and streaming

SPECIALS = ["<|endoftext|>", "<|end|>", "<|end|><|pad|>", "<|im_start|>"]


@pytest.fixture(scope="module")
def special_tok(tok):
    return BPETokenizer(tok.merges, special_tokens=SPECIALS)


def naive_special_encode(tok, specials, text):
    """Scan left to right; where special tokens start, take the longest; encode the rest as text."""
    ids, plain, i = [], "", 0
    while i < len(text):
        here = [s for s in specials if text.startswith(s, i)]
        if here:
            best = max(here, key=len)
            ids += tok.encode(plain, special=False) + [tok.special_tokens[best]]
            plain, i = "", i + len(best)
        else:
            plain, i = plain + text[i], i + 1
    return ids + tok.encode(plain, special=False)


SPECIAL_TEXT = st.lists(st.one_of(st.sampled_from(SPECIALS + ["<|", "|>", "<|end", "end|>", " ", "'ll", "\n\n"]),
                                  ANY_TEXT), max_size=12).map("".join)


@settings(max_examples=150, deadline=None)
@given(SPECIAL_TEXT)
def test_special_tokens_equal_the_longest_match_reference_and_round_trip(special_tok, text):
    ids = special_tok.encode(text)
    assert ids == naive_special_encode(special_tok, SPECIALS, text)
    assert special_tok.decode(ids) == text


def test_a_special_token_is_one_id_even_where_merges_would_split_it():
    text = "<|endoftext|> end of text <|endoftext|>" * 50
    merged = BPETokenizer.train(text, 300)
    assert len(merged.encode("<|endoftext|>")) < len("<|endoftext|>")  # merges learned its pieces...
    special = BPETokenizer(merged.merges, special_tokens=["<|endoftext|>"])
    eot = special.special_tokens["<|endoftext|>"]
    assert eot == special.vocab_size - 1 == 256 + len(merged.merges)
    assert special.encode("a<|endoftext|>b") == merged.encode("a") + [eot] + merged.encode("b")  # ...never used
    assert special.encode("<|endoftext|>", special=False) == merged.encode("<|endoftext|>")
    assert special.encode("<|end|><|pad|>x") == merged.encode("<|end|><|pad|>x")  # not registered here
    assert BPETokenizer.from_dict(special.to_dict()) == special
    assert "special_tokens" not in merged.to_dict()  # files without special tokens are unchanged


def test_special_tokens_are_checked():
    for bad in (["<a>", "<a>"], [""], [3]):
        with pytest.raises(ValueError, match="special tokens must be distinct"):
            BPETokenizer(special_tokens=bad)


@settings(max_examples=150, deadline=None)
@given(st.lists(SPECIAL_TEXT, max_size=8))
def test_encode_iterable_equals_encode_of_the_joined_text(special_tok, pieces):
    assert list(special_tok.encode_iterable(pieces)) == special_tok.encode("".join(pieces))


def test_encode_iterable_pieces_cut_anywhere(tok, special_tok):
    """Every text cut into one-character pieces (the worst case for what is held back)."""
    text = HELD_OUT[:3000] + " it'll   be\n\n  <|end|><|pad|><|endoftext|>  x'"
    for t in (tok, special_tok):
        assert list(t.encode_iterable(iter(text))) == t.encode(text)
        assert list(t.encode_iterable([text[:1000], text[1000:1001], text[1001:]])) == t.encode(text)


def test_encode_iterable_streams_a_file_holding_little_text(tok, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS[:200_000])
    held = []

    class Recorder:
        def __iter__(self):
            with open(path) as f:
                for line in f:
                    yield line

    original = tok._units

    def units(text, special):
        held.append(len(text))
        return original(text, special)

    tok._units = units
    try:
        ids = list(tok.encode_iterable(Recorder()))
    finally:
        del tok._units
    assert ids == tok.encode(CORPUS[:200_000])
    assert max(held[:-1]) < 10_000, "only the unsettled tail and one line are held, not the file"
    with pytest.raises(TypeError, match="text mode"):
        list(tok.encode_iterable([b"bytes"]))
