"""An OpenAI-compatible HTTP server in front of the engine (FastAPI on uvicorn).

    python -m llmsys serve --model smollm2          # http://127.0.0.1:8000/v1

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events, as OpenAI's API does), ``GET /health`` and
``GET /metrics`` (Prometheus text). Any OpenAI client talks to it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])

Sampling follows OpenAI's defaults (temperature 1, top_p 1; ``seed`` makes a request reproducible),
and chat answers end at the model's end-of-turn token. Errors come back as OpenAI error objects: 400 for a request the server cannot serve
(malformed body, unknown model, max_tokens < 1, a prompt longer than the context),
429 with ``Retry-After`` when every slot and queue place is taken. A client that
disconnects has its request aborted and its KV blocks freed. On Ctrl-C / SIGTERM
uvicorn stops accepting, lets running requests finish (up to ``drain_s``), and the
engine fails whatever is left.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from llmsys.serving.engine import Engine
from llmsys.serving.loop import EngineLoop, Handle, QueueFull
from llmsys.serving.scheduler import SchedulerConfig
from llmsys.serving.served import ServedModel, TextStream
from llmsys.serving.trace import Request


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields OpenAI defines and this server does not use
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatBody(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None


class CompletionBody(Sampling):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(status: int, message: str, kind: str, param: str | None = None, headers=None) -> JSONResponse:
    """An OpenAI-style error object."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(served: ServedModel, num_blocks: int, block_size: int = 16, max_num_seqs: int = 32,
              max_queue: int = 64, token_budget: int = 256) -> FastAPI:
    """The server for ``served``: an engine with chunked prefill and prefix caching, run by an EngineLoop."""
    config = SchedulerConfig(max_batch=max_num_seqs, chunked_prefill=True, token_budget=token_budget,
                             prefix_caching=True)
    engine = Engine(served.model, num_blocks, block_size, config, clock="wall")
    loop = EngineLoop(engine, max_num_seqs, max_queue)

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()  # uvicorn has drained the connections it could; fail the rest

    app = FastAPI(title="llmsys", lifespan=lifespan)
    app.state.loop = loop

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"invalid request: {first.get('msg', 'malformed body')}"
                     + (f" at {where}" if where else ""), "invalid_request_error", where)

    @app.exception_handler(BadRequest)
    async def bad(request, exc):
        return error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(QueueFull)
    async def full(request, exc):
        return error(429, str(exc), "rate_limit_error", headers={"Retry-After": str(exc.retry_after)})

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "llmsys", "max_model_len": engine.max_seq_len}]}

    def make_request(body: Sampling, prompt: list[int], max_tokens: int | None) -> Request:
        if body.model != served.name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {served.name!r}", "model")
        if body.n != 1:
            raise BadRequest("only n=1 is supported", "n")
        if max_tokens is None:  # the rest of the context, as far as the KV memory holds it
            max_tokens = min(engine.max_seq_len, num_blocks * block_size) - len(prompt)
            if max_tokens < 1:
                raise BadRequest(f"the prompt has {len(prompt)} tokens, the context holds {engine.max_seq_len}; "
                                 f"shorten it", "messages")
        request = Request(uuid.uuid4().hex, prompt, max_tokens, arrival=time.perf_counter(),
                          temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop_ids=served.stop_ids)
        reason = engine.check(request)
        if reason:
            raise BadRequest(reason, "max_tokens" if "max_tokens" in reason else None)
        return request

    async def serve(http: HTTPRequest, body: Sampling, request: Request, chat: bool):
        handle = Handle(request, asyncio.get_running_loop())
        loop.submit(handle)  # QueueFull -> 429
        rid, created = ("chatcmpl-" if chat else "cmpl-") + request.id, int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        text = TextStream(served)

        def usage() -> dict:
            return {"prompt_tokens": len(request.prompt), "completion_tokens": len(text.ids),
                    "total_tokens": len(request.prompt) + len(text.ids)}

        def choice(piece: str, finish: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
            delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece or first else {})
            return {"index": 0, "delta": delta, "finish_reason": finish}

        if body.stream:
            async def events():
                try:
                    chunk = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created,
                             "model": served.name}
                    if chat:
                        yield sse(chunk | {"choices": [choice("", None, first=True)]})
                    while True:
                        tokens, finish, err = await handle.queue.get()
                        if err:
                            yield sse({"error": {"message": err, "type": "server_error", "param": None, "code": None}})
                            return
                        piece = text.add(tokens)
                        if piece or finish:
                            yield sse(chunk | {"choices": [choice(piece, finish if finish in ("stop", "length")
                                                                  else None)]})
                        if finish:
                            break
                    if body.stream_options and body.stream_options.include_usage:
                        yield sse(chunk | {"choices": [], "usage": usage()})
                    yield "data: [DONE]\n\n"
                finally:
                    if handle.seq is None or handle.seq.status != "finished":
                        loop.abort(handle)  # the client went away (or the server stops): free its blocks
            return StreamingResponse(events(), media_type="text/event-stream")

        while True:
            try:
                tokens, finish, err = await asyncio.wait_for(handle.queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    loop.abort(handle)
                    return Response(status_code=499)
                continue
            if err:
                return error(503 if "shutting down" in err else 500, err, "server_error")
            text.add(tokens)
            if finish:
                break
        out = {"role": "assistant", "content": text.text} if chat else None
        result = {"index": 0, "finish_reason": finish} | ({"message": out} if chat else
                                                          {"text": text.text, "logprobs": None})
        return {"id": rid, "object": kind, "created": created, "model": served.name, "choices": [result],
                "usage": usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        if not body.messages:
            raise BadRequest("messages is empty; send at least one message", "messages")
        prompt = served.encode_chat([m.model_dump() for m in body.messages])
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await serve(http, body, make_request(body, prompt, max_tokens), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt = served.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        return await serve(http, body, make_request(body, prompt, body.max_tokens), chat=False)

    return app


def run_server(served: ServedModel, host: str = "127.0.0.1", port: int = 8000, drain_s: float = 30.0,
               **engine_args) -> None:
    """Serve until Ctrl-C / SIGTERM; requests in flight get ``drain_s`` seconds to finish."""
    import uvicorn

    app = build_app(served, **engine_args)
    print(f"serving {served.name} at http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_s)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """``python -m llmsys serve ARGS`` in a child process on a free loopback port, ready when constructed.

        with BackgroundServer("--model", "tiny") as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, *args: str, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: an unread pipe would block the server
        cmd = [sys.executable, "-m", "llmsys", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)  # never outlive the process that started it
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout:.0f} s:\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (what Ctrl-C or a process manager sends), then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
