"""Faults inside the server, provoked in-process (a server thread on a loopback port, a small random model):
a failure while sampling one request ends that request alone, and an engine thread that dies makes /health
fail and the server exit non-zero, with every client told, instead of hanging."""

import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

import llmsys.serving.sampling as sampling_module
from llmsys.core import zoo
from llmsys.core.dist import free_port
from llmsys.core.model import ModelConfig, Transformer
from llmsys.serving.api import MAX_BODY_BYTES, DrainingServer, build_app
from llmsys.serving.served import ServedModel

pytestmark = pytest.mark.timeout(120)


class ServerThread:
    """A server for a random model, in a thread of this process (so a test can break its engine)."""

    def __init__(self):
        torch.manual_seed(0)
        tok = zoo.tokenizer()
        model = Transformer(ModelConfig(vocab_size=len(tok.vocab), dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                        max_seq_len=512)).eval()
        self.app = build_app(ServedModel("rand", model, tok, ()), num_blocks=256)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.server = DrainingServer(self.app, "127.0.0.1", int(self.url.rsplit(":", 1)[1]), drain_s=5)
        self.code = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)

    def run(self):
        self.code = self.server.run()

    def stop(self):
        self.server.drain()
        self.thread.join(30)


@pytest.fixture
def server():
    s = ServerThread()
    yield s
    if s.thread.is_alive():
        s.stop()


def chat(max_tokens, **kw):
    return {"model": "rand", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens} | kw


def events(response) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in response.iter_lines() if line]


def test_a_failed_draw_ends_its_own_stream_and_no_other(server, monkeypatch):
    real = sampling_module.sample

    def faulty(logits, temperature, *args, **kwargs):
        if temperature == 0.7:
            raise RuntimeError("probability tensor contains inf")
        return real(logits, temperature, *args, **kwargs)

    monkeypatch.setattr(sampling_module, "sample", faulty)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    expected = c.chat.completions.create(**chat(480, temperature=0)).choices[0].message.content
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/chat/completions",
                                                 json=chat(480, temperature=0, stream=True)) as healthy:
        lines = healthy.iter_lines()
        next(lines)
        with h.stream("POST", server.url + "/v1/chat/completions",
                      json=chat(50, temperature=0.7, stream=True)) as broken:
            failed = events(broken)
        rest = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x]
    assert failed[-3]["choices"][0]["finish_reason"] == "error" and "inf" in failed[-2]["error"]["message"]
    assert failed[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in rest[:-1] if e["choices"])
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
    assert expected.endswith(text) and len(text) > 0  # the healthy stream went on to its end, unchanged
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(5, temperature=0.7), timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "Traceback" not in r.text
    assert c.chat.completions.create(**chat(480, temperature=0)).choices[0].message.content == expected


def test_a_dead_engine_fails_health_and_exits_non_zero(server, monkeypatch):
    loop = server.app.state.loop
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/chat/completions",
                                                 json=chat(400, temperature=0, stream=True)) as r:
        lines = r.iter_lines()
        next(lines)
        assert h.get(server.url + "/health").status_code == 200

        def broken():
            raise RuntimeError("a bug in the engine thread")

        assert loop.on_death == server.server.stop  # a dead engine stops the server...
        died = threading.Event()
        loop.on_death = died.set  # ...which waits here until /health has been seen failing
        monkeypatch.setattr(loop.engine, "has_work", broken)
        rest = [x for x in lines if x]
        assert died.wait(10)
        health = h.get(server.url + "/health")
        refused = h.post(server.url + "/v1/chat/completions", json=chat(5))
    assert '"finish_reason": "error"' in "".join(rest) and "a bug in the engine thread" in "".join(rest)
    assert rest[-1] == "data: [DONE]"
    assert health.status_code == 503 and refused.status_code == 503 and "engine" in refused.json()["error"]["message"]
    server.server.stop()
    server.thread.join(30)
    assert not server.thread.is_alive() and server.code == 1


def raw_post(url: str, head: str, body_parts=(), close_early=False) -> bytes:
    """POST /v1/chat/completions over a plain socket: ``head`` holds the framing headers; the answer's bytes."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:  # a server that waits fails the test here
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"{head}\r\n".encode())
        for part in body_parts:
            s.sendall(part)
        if close_early:
            return b""
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            answer += data
        return answer


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    answer = raw_post(server.url, f"Content-Length: {200 * 2**20}\r\n")  # and no body at all
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    chunk = b"x" * 2**20  # a chunked body declares no length: refused once more than the limit has arrived
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (MAX_BODY_BYTES // len(chunk) + 1)
    answer = raw_post(server.url, "Transfer-Encoding: chunked\r\n", parts)
    assert answer.startswith(b"HTTP/1.1 413") and b"limit" in answer, answer[:200]
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(2), timeout=60)
    assert r.status_code == 200  # the server goes on serving


def test_a_client_gone_mid_body_leaves_no_traceback(server):
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        raw_post(server.url, "Content-Length: 1000\r\n", [b'{"model": "rand", '], close_early=True)
        time.sleep(1)  # the server notices the closed connection on its own time
        assert httpx.post(server.url + "/v1/chat/completions", json=chat(2), timeout=60).status_code == 200
    finally:
        logger.removeHandler(handler)
    assert not [r for r in seen if r.levelno >= logging.ERROR], [r.getMessage() for r in seen]


def test_conflicting_output_limits_get_a_400_naming_both(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(2, max_completion_tokens=3), timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.text and "max_completion_tokens" in r.text
