"""``n > 1`` through the official client: the n choices of one prompt (sibling sequences sharing the prompt's
KV blocks copy-on-write; the block accounting itself is checked in test_server_engine) equal the single
answer at temperature 0, differ and reproduce by seed at temperature 1, stream with their index, count the
prompt once, free every block (also when a stream is dropped), and a bad n is a 400 naming it."""

import json
import time

import httpx
import openai
import pytest

from llmsys.serving.protocol import MAX_CHOICES
from test_server import PROMPTS, client, greedy_chat, metric, server, tiny  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(180)


def ask(server, n, **kw):
    return client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                  n=n, **kw)


def blocks_freed(server) -> bool:
    deadline = time.monotonic() + 20
    while metric(server, "llmsys_kv_blocks_used") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return metric(server, "llmsys_kv_blocks_used") == 0


def test_greedy_choices_equal_the_single_answer(server, tiny):
    reply = ask(server, 3, max_tokens=20, temperature=0)
    expected = greedy_chat(tiny, PROMPTS[0], 20)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [expected] * 3
    assert ask(server, 1, max_tokens=20, temperature=0).choices[0].message.content == expected
    prompt_tokens = len(tiny.encode_chat([{"role": "user", "content": PROMPTS[0]}]))
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 3 * 20  # prompt once
    text = client(server).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in text.choices] == [0, 1] and text.choices[0].text == text.choices[1].text
    assert blocks_freed(server)


def test_sampled_choices_differ_and_reproduce_by_seed(server):
    contents = lambda reply: [c.message.content for c in reply.choices]  # noqa: E731
    first = contents(ask(server, 3, max_tokens=24, temperature=1.0, seed=11))
    assert len(set(first)) == 3
    assert contents(ask(server, 3, max_tokens=24, temperature=1.0, seed=11)) == first
    assert contents(ask(server, 1, max_tokens=24, temperature=1.0, seed=11)) == first[:1]  # choice 0 is n = 1's
    assert contents(ask(server, 3, max_tokens=24, temperature=1.0, seed=12)) != first


def test_streamed_choices_carry_their_index(server):
    whole = [c.message.content for c in ask(server, 3, max_tokens=16, temperature=1.0, seed=5).choices]
    chunks = list(ask(server, 3, max_tokens=16, temperature=1.0, seed=5, stream=True,
                      stream_options={"include_usage": True}))
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == whole and finish == ["length"] * 3
    usage = chunks[-1].usage
    assert usage.completion_tokens == 48 and usage.total_tokens == 48 + usage.prompt_tokens
    assert blocks_freed(server)


def test_a_dropped_stream_frees_every_choices_blocks(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 900, "n": 4,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = set()
        while len(seen) < 4:  # every choice has streamed some text
            line = next(lines)
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"] if c["delta"].get("content")}
        assert metric(server, "llmsys_kv_blocks_used") > 0
    assert blocks_freed(server) and metric(server, "llmsys_requests_running") == 0


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1, 2.0, "2", True, -1])
def test_a_bad_n_is_refused_naming_it(server, n):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": n})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n" and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n"):
        ask(server, 0, max_tokens=4)


def test_choices_that_cannot_fit_the_kv_memory_are_refused_naming_n(server):
    with pytest.raises(openai.BadRequestError, match="16 choices need .* KV blocks") as info:
        ask(server, 16, max_tokens=900)  # 16 x 57 blocks of 16 tokens, the cache holds 512
    assert info.value.body["param"] == "n"
    assert ask(server, 4, max_tokens=900, temperature=0, stop="\n").choices[3].index == 3  # 4 fit
    assert len(ask(server, 16, temperature=0, stop="\n").choices) == 16  # no max_tokens: the memory is shared out
