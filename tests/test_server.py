"""The OpenAI-compatible server, driven by the official ``openai`` client against `python -m llmsys serve`
started on a free loopback port: answers equal the model's own decoding, streams concatenate to the same
text, stop strings, content parts, many concurrent streams, aborts free KV blocks, overload answers 429,
bad requests 400 (strictly typed, as OpenAI error objects), SIGTERM drains.

Most tests serve the zoo's tiny model at a 1024-token context (its steps take about a millisecond, so long
answers keep a request in flight long enough to disconnect or to fill the queue); one serves SmolLM2."""

import asyncio
import json
import re
import signal
import time

import httpx
import openai
import pytest
import torch

from llmsys.serving.api import BackgroundServer
from llmsys.serving.served import load_served

pytestmark = pytest.mark.timeout(180)

TINY = ("--model", "tiny", "--dtype", "fp32", "--context", "1024")
PROMPTS = ["def main():", "import os", "The class", "for x in range(10):"]


@pytest.fixture(scope="module")
def tiny():
    return load_served("tiny", "fp32", 1024, device="cpu")


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(*TINY) as s:
        yield s


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60, **kw)


def greedy_chat(served, content, max_tokens):
    prompt = served.encode_chat([{"role": "user", "content": content}])
    out = served.model.generate(torch.tensor([prompt]), max_tokens)[0, len(prompt):].tolist()
    return served.decode(out)


def metric(server, name) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1))


def test_greedy_chat_completion_equals_generate(server, tiny):
    c = client(server)
    assert [m.id for m in c.models.list()] == ["tiny"]
    reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                      max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == greedy_chat(tiny, PROMPTS[0], 20)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 20
    assert reply.usage.prompt_tokens == len(tiny.encode_chat([{"role": "user", "content": PROMPTS[0]}]))
    text = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0).choices[0].text
    ids = tiny.encode(PROMPTS[1])
    assert text == tiny.decode(tiny.model.generate(torch.tensor([ids]), 8)[0, len(ids):].tolist())


def test_stream_concatenates_to_the_same_text(server, tiny):
    stream = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=30, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert len(pieces) > 2 and "".join(pieces) == greedy_chat(tiny, PROMPTS[2], 30)
    assert chunks[-1].usage.completion_tokens == 30
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_sampling_is_reproducible_by_seed(server):
    c = client(server)
    ask = lambda seed: c.chat.completions.create(  # noqa: E731
        model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=24, temperature=1.0,
        top_p=0.95, seed=seed).choices[0].message.content
    assert ask(1) == ask(1) != ask(2)


def test_32_concurrent_streams_all_finish_correctly(server, tiny):
    expected = {p: greedy_chat(tiny, p, 40) for p in PROMPTS}

    async def one(c, prompt):
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=40, temperature=0, stream=True)
        return prompt, "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(c, PROMPTS[i % 4]) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and all(text == expected[p] for p, text in results)


def test_disconnected_stream_frees_its_blocks(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": True}
    aborted = metric(server, 'llmsys_requests_total{outcome="aborted"}')
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server, "llmsys_kv_blocks_used") > 0  # the request holds blocks while it streams
    deadline = time.monotonic() + 20
    while metric(server, "llmsys_kv_blocks_used") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "llmsys_kv_blocks_used") == 0
    assert metric(server, 'llmsys_requests_total{outcome="aborted"}') == aborted + 1
    assert metric(server, "llmsys_requests_running") == 0


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, words", [
    ({"model": "tiny"}, "messages"),  # a required field missing
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "gpt-9", "messages": HI}, "not served"),
    ({"model": "tiny", "messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": HI, "max_tokens": -3}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 1500}]}, "context"),
    ({"model": "tiny", "messages": HI, "max_tokens": 2000}, "context"),
    ({"model": "tiny", "messages": HI, "temperature": -1}, "temperature"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": HI, "max_tokens": "10"}, "max_tokens"),  # no coercion
    ({"model": "tiny", "messages": HI, "max_tokens": True}, "max_tokens"),
    ({"model": "tiny", "messages": HI, "stream": "yes"}, "stream"),
    ({"model": "tiny", "messages": HI, "temperature": 3}, "temperature"),  # the API's range is 0..2
    ({"model": "tiny", "messages": HI, "temperature": 1.0, "seed": 2**64}, "seed"),  # manual_seed overflows
    ({"model": "tiny", "messages": HI, "n": 17}, "n"),
    ({"model": "tiny", "messages": HI, "top_logprobs": 2}, "logprobs"),  # without logprobs: true
    ({"model": "tiny", "messages": HI, "presence_penalty": 3}, "presence_penalty"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x\ud800y"}]}, "surrogate"),
])
def test_bad_requests_get_400_with_an_error_object(server, body, words):
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(body), timeout=30,  # \ud800 as JSON
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] + str(err["param"]) and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]


@pytest.mark.parametrize("raw, words", [
    (b"{not json", "JSON"), (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}', "UTF-8"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "finite"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
])
def test_malformed_bodies_get_400(server, raw, words):
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="tiny", prompt="x" * 3000, max_tokens=4)


def test_a_refused_seed_leaves_sampling_working(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="seed"):
        c.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=1.0, seed=2**64)
    reply = c.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=1.0, seed=2**64 - 1)
    assert reply.usage.completion_tokens == 4


def test_tiny_temperatures_decode_greedily(server, tiny):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 8,
                                                             "temperature": 1e-45}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy_chat(tiny, "hi", 8)


def test_stop_strings_end_the_answer_streamed_or_not(server, tiny):
    full = greedy_chat(tiny, PROMPTS[0], 40)
    stop = full[12:15]
    expected = full[:full.find(stop)]
    c = client(server)
    reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                      max_tokens=40, temperature=0, stop=[stop, "never seen"])
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    text = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0, stop="\n")
    assert "\n" not in text.choices[0].text


def test_logprobs_and_penalties_through_the_client(server, tiny):
    c = client(server)
    reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=10,
                                      temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == 10 and "".join(t.token for t in content) == reply.choices[0].message.content
    prompt = tiny.encode_chat([{"role": "user", "content": PROMPTS[3]}])
    ids = tiny.model.generate(torch.tensor([prompt]), 10)
    logp = torch.log_softmax(tiny.model(ids)[0, len(prompt) - 1:-1], -1)
    for i, t in enumerate(content):
        assert t.logprob == pytest.approx(logp[i].max().item(), abs=1e-3) == t.top_logprobs[0].logprob
    text = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=1)
    assert len(text.choices[0].logprobs.token_logprobs) == 6
    plain = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}],
                                      max_tokens=30, temperature=0).usage
    penalised = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}],
                                          max_tokens=30, temperature=0, frequency_penalty=2.0, presence_penalty=1.0)
    assert plain.completion_tokens == penalised.usage.completion_tokens == 30  # accepted, not refused
    out = []  # greedy with OpenAI's penalties, written out: logit - 2 * count - 1 * seen
    for _ in range(30):
        logits = tiny.model(torch.tensor([prompt + out]))[0, -1]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
        out.append(int((logits - 2.0 * counts - 1.0 * (counts > 0).float()).argmax()))
    assert penalised.choices[0].message.content == tiny.decode(out) != greedy_chat(tiny, PROMPTS[3], 30)


def test_content_parts_and_model_lookup(server, tiny):
    c = client(server)
    parts = [{"type": "text", "text": PROMPTS[0]}]
    reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=12,
                                      temperature=0)
    assert reply.choices[0].message.content == greedy_chat(tiny, PROMPTS[0], 12)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")
    r = httpx.get(server.url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_overload_answers_429_and_serves_every_accepted_request(tiny):
    with BackgroundServer(*TINY, "--max-num-seqs", "2", "--max-queue", "2") as s:
        expected = greedy_chat(tiny, PROMPTS[0], 300)
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 300,
                "temperature": 0}

        async def main():
            async with httpx.AsyncClient(timeout=120) as h:
                return await asyncio.gather(*(h.post(s.url + "/v1/chat/completions", json=body) for _ in range(12)))

        responses = asyncio.run(main())
        refused = [r for r in responses if r.status_code == 429]
        served = [r for r in responses if r.status_code == 200]
        assert len(refused) + len(served) == 12 and refused and len(served) >= 4
        assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
                   for r in refused)
        assert all(r.json()["choices"][0]["message"]["content"] == expected for r in served)
        assert metric(s, 'llmsys_requests_total{outcome="finished"}') == len(served)


def test_sigterm_drains_a_running_stream():
    with BackgroundServer(*TINY) as s:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 900, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)  # mid-stream
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in "".join(rest)
        assert s.proc.wait(60) == 0 and "Traceback" not in s.output()


def test_sigterm_refuses_new_requests_and_ends_the_rest_properly():
    """One request runs at a time and six wait, each 1,000 tokens long: more than a 1 s drain can finish.
    Every request ends properly (finished, or an error event + finish_reason / a 503 body), and exit 0."""
    with BackgroundServer(*TINY, "--max-num-seqs", "1", "--drain", "1") as s:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}

        async def stream(h):
            async with h.stream("POST", s.url + "/v1/chat/completions", json=body | {"stream": True}) as r:
                return r.status_code, [json.loads(x[6:]) if x != "data: [DONE]" else x async for x in r.aiter_lines()
                                       if x]

        async def main():
            async with httpx.AsyncClient(timeout=120) as h:
                tasks = [asyncio.create_task(stream(h)) for _ in range(3)]
                tasks += [asyncio.create_task(h.post(s.url + "/v1/chat/completions", json=body)) for _ in range(3)]
                while metric(s, "llmsys_requests_running") + metric(s, "llmsys_requests_waiting") < 6:
                    await asyncio.sleep(0.05)
                s.proc.send_signal(signal.SIGTERM)
                while (await h.get(s.url + "/health")).status_code == 200:
                    await asyncio.sleep(0.02)
                late = await h.post(s.url + "/v1/chat/completions", json=body)
                return late, await asyncio.gather(*tasks)

        late, results = asyncio.run(main())
        assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1
        assert "shutting down" in late.json()["error"]["message"]
        cut = 0
        for result in results[:3]:
            status, events = result
            assert status == 200 and events[-1] == "data: [DONE]"
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if "choices" in e and e["choices"]]
            assert finish[-1] in ("length", "error")
            if finish[-1] == "error":
                cut += 1
                assert "shutting down" in events[-2]["error"]["message"]
        for r in results[3:]:
            assert r.status_code in (200, 503)
            if r.status_code == 503:
                cut += 1
                assert r.json()["error"]["type"] == "server_error" and "Retry-After" in r.headers
        assert cut >= 1
        assert s.proc.wait(60) == 0 and "Traceback" not in s.output()


@pytest.mark.timeout(600)  # loads the real model twice (server and reference), slow on a busy machine
def test_real_model_chat_through_the_server():
    """SmolLM2 served in fp32 answers as pretrained.chat decodes alone (greedy)."""
    from llmsys.core import pretrained, zoo

    question = "What is the capital of France?"
    with BackgroundServer("--model", "smollm2", "--dtype", "fp32", "--kv-blocks", "64") as s:
        reply = client(s).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                                  max_tokens=16, temperature=0)
    model, tok = zoo.load(zoo.PRETRAINED, device="cpu"), zoo.tokenizer(zoo.PRETRAINED)
    assert reply.choices[0].message.content.strip() == pretrained.chat(model, tok, question, max_new_tokens=16)
    assert "Paris" in reply.choices[0].message.content


def test_load_generator_measures_the_server(server, tmp_path):
    """benchmarks/serve_load.py end to end: every request served, the shared system prompt hits the prefix cache."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    rows = load.main(["--base-url", server.url + "/v1", "--rates", "8", "--requests", "8", "--max-seconds", "30",
                      "--json", str(tmp_path / "load.json")])
    (row,) = rows
    assert row["ok"] == row["sent"] == 8 and row["failed"] == 0
    assert row["prefix_hit_rate"] > 0 and row["ttft_p50"] <= row["ttft_p99"]
    assert json.loads((tmp_path / "load.json").read_text())["rows"][0]["ok"] == 8
    with pytest.raises(SystemExit) as exit_info:
        load.main(["--base-url", "http://example.com/v1"])
    assert exit_info.value.code == 2


def test_serve_command_rejects_bad_options(capsys):
    from llmsys.__main__ import main

    assert main(["serve", "--port", "0"]) == 2
    assert main(["serve", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "--port must be" in err and "no-such-model" in err
