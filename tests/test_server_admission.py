"""What the server admits, without a server: request bodies parsed strictly with the OpenAI API's types
and ranges (no coercion), and answer text that streams safely (stop strings across token boundaries,
never half a UTF-8 character)."""

import json
import math

import pytest

from llmsys.serving.protocol import (MAX_CHOICES, SEED_RANGE, Answer, ChatBody, CompletionBody, InvalidRequest,
                                     held_back, parse)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> bytes:
    return json.dumps(CHAT | fields).encode()


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "10"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"),
    ({"temperature": 3}, "temperature"), ({"temperature": -0.1}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"seed": SEED_RANGE[1] + 1}, "seed"), ({"seed": SEED_RANGE[0] - 1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"n": 0}, "n"), ({"n": MAX_CHOICES + 1}, "n"), ({"n": 2.0}, "n"), ({"n": "2"}, "n"), ({"n": True}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"), ({"presence_penalty": "1"}, "presence_penalty"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"), ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "person"}}, "response_format.json_schema"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop.0"), ({"stop": 3}, "stop"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x\ud800y"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"model": 7}, "model"),
])
def test_wrong_types_and_ranges_are_refused_with_their_parameter(fields, param):
    with pytest.raises(InvalidRequest) as info:
        parse(chat(**fields), ChatBody)
    assert info.value.param is not None and info.value.param.startswith(param.split(".")[0]), info.value.param
    assert param in (info.value.param or "") or param.split(".")[0] == info.value.param


@pytest.mark.parametrize("raw, words", [
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}', "UTF-8"),
    (b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "finite"),
    (b"[" * 100_000, "JSON"),
])
def test_bodies_that_are_not_json_objects_are_refused(raw, words):
    with pytest.raises(InvalidRequest, match=words):
        parse(raw, ChatBody)


def test_valid_bodies_keep_their_values():
    body = parse(chat(max_tokens=5, temperature=0, top_p=0.5, seed=SEED_RANGE[1], stop="##", stream=False, n=1,
                      presence_penalty=0, logprobs=False, response_format={"type": "text"}, user="u", extra=1),
                 ChatBody)
    assert (body.max_tokens, body.temperature, body.top_p, body.seed, body.stop_strings) == (5, 0.0, 0.5,
                                                                                              SEED_RANGE[1], ["##"])
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert parse(chat(messages=[parts]), ChatBody).messages[0].text() == "a\nb"
    assert parse(b'{"model": "tiny", "prompt": [1, 2]}', CompletionBody).max_tokens == 16
    assert math.isclose(parse(chat(temperature=1), ChatBody).temperature, 1.0)  # a JSON integer is a number


def test_held_back_is_the_longest_suffix_that_starts_a_stop_string():
    assert held_back("abc <|e", ["<|end|>"]) == 3 and held_back("abc", ["<|end|>"]) == 0
    assert held_back("xx#", ["##", "#!"]) == 1 and held_back("a", ["a"]) == 0


def by_char(text: str):
    """A decoder over 'token ids' that are single UTF-8 bytes, as a byte-level tokenizer's can be."""
    data = text.encode()
    return list(data), lambda ids: bytes(ids).decode("utf-8", errors="replace")


def stream(answer: Answer, ids, final_at=None) -> list[str]:
    pieces = [answer.add([t]) for t in ids[:final_at][:-1]]
    return pieces + [answer.add(ids[:final_at][-1:], final=True)]


@pytest.mark.parametrize("text, stops, expected", [
    ("hello ##world", ["##"], "hello "), ("hello world", ["##"], "hello world"),
    ("ab<|end|>cd", ["<|x|>", "<|end|>"], "ab"), ("one. two. three", ["two", "."], "one"),
    ("a#b#c", ["##"], "a#b#c"),
])
def test_stop_strings_cut_across_token_boundaries(text, stops, expected):
    ids, decode = by_char(text)
    answer = Answer(decode, stops)
    pieces = stream(answer, ids)
    assert "".join(pieces) == answer.text == expected
    assert answer.stopped == (expected != text)
    sent = ""
    for piece in pieces:  # no piece ever showed part of a stop string that later matched
        sent += piece
        assert all(s not in sent for s in stops)


def test_streaming_never_sends_half_a_character():
    ids, decode = by_char("é€𝄞 ok")
    answer = Answer(decode, [])
    pieces = stream(answer, ids)
    assert "".join(pieces) == "é€𝄞 ok" and all("\ufffd" not in p for p in pieces)
    cut = Answer(decode, [])  # max_tokens ends inside the 4-byte clef
    assert "".join(stream(cut, ids, final_at=7)) == cut.text == "é€"


def test_bytes_that_are_no_utf8_never_reach_the_client_as_surrogates():
    answer = Answer(lambda ids: "ok\udce9 fine", [])  # a tokenizer decoding with surrogatepass / surrogateescape
    assert answer.add([1], final=True) == "ok\ufffd fine"
    answer.text.encode("utf-8")


def test_more_than_four_stop_strings_are_refused_in_the_apis_words():
    with pytest.raises(InvalidRequest, match="stop takes at most 4 strings") as info:
        parse(chat(stop=["a", "b", "c", "d", "e"]), ChatBody)
    assert info.value.param == "stop"
    assert parse(chat(stop=["a", "b", "c", "d"]), ChatBody).stop_strings == ["a", "b", "c", "d"]


def test_max_tokens_and_max_completion_tokens_must_agree():
    with pytest.raises(InvalidRequest, match="max_tokens .* max_completion_tokens"):
        _ = parse(chat(max_tokens=5, max_completion_tokens=7), ChatBody).output_limit
    assert parse(chat(max_tokens=5, max_completion_tokens=5), ChatBody).output_limit == 5
    assert parse(chat(max_tokens=5), ChatBody).output_limit == 5
    assert parse(chat(max_completion_tokens=7), ChatBody).output_limit == 7
    assert parse(chat(), ChatBody).output_limit is None
