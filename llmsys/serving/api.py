"""An OpenAI-compatible HTTP server in front of the engine (FastAPI on uvicorn).

    python -m llmsys serve --model smollm2          # http://127.0.0.1:8000/v1

Endpoints: ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``stream: true`` sends server-sent events, as OpenAI's API does), ``GET /health``
and ``GET /metrics`` (Prometheus text). Any OpenAI client talks to it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])

Sampling follows OpenAI's defaults (temperature 1, top_p 1; ``seed`` makes a request reproducible), with
OpenAI's presence and frequency penalties and ``logprobs``; chat answers end at the model's end-of-turn
token or before a ``stop`` string. ``n`` choices share the prompt's KV blocks and the answer's
``usage`` counts the prompt once (``responses``); ``response_format`` ``json_object`` or ``json_schema``
constrains decoding to JSON (``grammar``; a model with a Hugging Face tokenizer). Bodies are checked
strictly at admission (``protocol``); errors are OpenAI error objects: 400 for a request the server
cannot serve, 404 for an unknown path or model, 413 for a body over ``MAX_BODY_BYTES`` (refused from its
Content-Length before it is read), 429 with ``Retry-After`` when every slot and queue
place is taken, 503 with ``Retry-After`` while shutting down. A request that fails while it runs
ends alone: a stream gets a last chunk with ``finish_reason: "error"``, an error event and
``[DONE]``. A client that disconnects has its request aborted and its KV blocks freed.

On SIGTERM (or Ctrl-C) the server drains: /health turns 503 and new requests get 503, requests in
flight get ``drain_s`` seconds to finish, then each one left is ended as a failure is (its stream's
error event, or a 503 body), and the process exits 0. If the engine thread dies, every request in
flight is failed, /health turns 503 and the process exits 1.
"""

from __future__ import annotations

import asyncio
import atexit
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from llmsys.core.dist import free_port
from llmsys.serving.engine import Engine
from llmsys.serving.grammar import FormatError, ResponseFormats
from llmsys.serving.loop import EngineLoop, Handle, QueueFull, Unavailable
from llmsys.serving.protocol import (SEED_RANGE, UNAVAILABLE_RETRY_S, ChatBody, CompletionBody, InvalidRequest,
                                     Sampling, error, parse)
from llmsys.serving.responses import Choices, respond
from llmsys.serving.scheduler import SchedulerConfig
from llmsys.serving.served import ServedModel
from llmsys.serving.trace import Request

# temperatures this small are argmax in effect, and dividing logits by them overflows to inf (vLLM treats
# temperatures below its _SAMPLING_EPS = 1e-5 as greedy the same way)
GREEDY_BELOW = 1e-5
# the longest context served here is a few thousand tokens (tens of KB of JSON); a body far larger is a mistake
# or an attack, and parsing it would hold the event loop that every client shares
MAX_BODY_BYTES = 4 * 2**20


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index`` of n draws with seed + index (choice 0 is the n = 1 answer), wrapped into torch's range."""
    if seed is None:
        return None
    return seed + index if seed + index <= SEED_RANGE[1] else seed + index - 2**64


class BodyTooLarge(Exception):
    pass


async def read_body(http: HTTPRequest) -> bytes:
    """The request's bytes, refused (413) from its Content-Length before reading, or as soon as more than
    MAX_BODY_BYTES arrive (a chunked body declares no length)."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge(int(declared))
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(size)
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(served: ServedModel, num_blocks: int, block_size: int = 16, max_num_seqs: int = 32,
              max_queue: int = 64, token_budget: int = 256, prefill_cap: int | None = 64) -> FastAPI:
    """The server for ``served``: an engine with chunked prefill (each prompt's share of a step capped at
    ``prefill_cap`` tokens while others wait; None: no cap; a step paused between layers for newcomers'
    prompts) and prefix caching, run by an EngineLoop."""
    config = SchedulerConfig(max_batch=max_num_seqs, chunked_prefill=True, token_budget=token_budget,
                             prefill_cap=prefill_cap, pause_for_arrivals=True, prefix_caching=True)
    engine = Engine(served.model, num_blocks, block_size, config, clock="wall")
    formats = ResponseFormats(served.tokenizer, served.stop_ids[0]) if served.chat_template else None
    loop = EngineLoop(engine, max_num_seqs, max_queue)

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()  # the drain has ended what was left; this only joins the thread

    app = FastAPI(title="llmsys", lifespan=lifespan)
    app.state.loop = loop

    @app.exception_handler(InvalidRequest)
    async def invalid(request, exc):
        return error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_path(request, exc):
        return error(400, f"invalid request: {exc.errors()[0]['msg'] if exc.errors() else exc}",
                     "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        message = f"{request.method} {request.url.path}: {exc.detail}; see /v1/models, /v1/chat/completions"
        return error(exc.status_code, message, "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(BodyTooLarge)
    async def too_large(request, exc):
        return error(413, f"the body has {exc.args[0]} bytes or more, over this server's limit of {MAX_BODY_BYTES}; "
                     "send a shorter prompt", "invalid_request_error", headers={"Connection": "close"})

    @app.exception_handler(ClientDisconnect)
    async def gone(request, exc):  # the client closed the connection while sending its body: nobody to answer
        return Response(status_code=499)

    @app.exception_handler(QueueFull)
    async def full(request, exc):
        return error(429, str(exc), "rate_limit_error", headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(Unavailable)
    async def unavailable(request, exc):
        return error(503, str(exc), "server_error", headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})

    @app.exception_handler(Exception)
    async def bug(request, exc):  # never a traceback to the client (the log has it)
        return error(500, f"internal error ({type(exc).__name__}); the server log has the details", "server_error")

    @app.get("/health")
    async def health():
        if loop.alive and not loop.draining:
            return {"status": "ok"}
        state = "draining" if loop.alive else "engine stopped"
        return error(503, f"the server is {state}", "server_error", headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "llmsys",
            "max_model_len": engine.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served.name:
            return error(404, f"model {model_id!r} is not served here; this server serves {served.name!r}",
                         "invalid_request_error", "model")
        return card

    def make_requests(body: Sampling, prompt: list[int], max_tokens: int | None, where: str) -> list[Request]:
        """The request's n choices as engine requests (choice i draws with seed + i), checked as one group."""
        if body.model != served.name:
            raise InvalidRequest(f"model {body.model!r} is not served here; this server serves {served.name!r}",
                                 "model")
        n = body.n or 1
        if max_tokens is None:  # the rest of the context, as far as the KV memory holds it for every choice
            # (each choice beyond the first also holds its own copy of the prompt's last, partial block)
            room = (num_blocks * block_size - len(prompt)) // n - (2 * block_size if n > 1 else 0)
            max_tokens = min(engine.max_seq_len - len(prompt), room)
            if max_tokens < 1:
                raise InvalidRequest(f"the prompt has {len(prompt)} tokens, the context holds {engine.max_seq_len}; "
                                     f"shorten it", where)
        if n > max_num_seqs:
            raise InvalidRequest(f"n={n} choices run as {n} sequences at once, more than this server runs "
                                 f"(--max-num-seqs {max_num_seqs}); lower n or send several requests", "n")
        grammar = response_format(body.response_format.model_dump() if body.response_format else None)
        temperature = 1.0 if body.temperature is None else body.temperature
        arrival, rid = time.perf_counter(), uuid.uuid4().hex
        requests = [Request(f"{rid}-{i}" if i else rid, prompt, max_tokens, arrival=arrival,
                            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, seed=choice_seed(body.seed, i),
                            stop_ids=served.stop_ids, presence_penalty=body.presence_penalty or 0.0,
                            frequency_penalty=body.frequency_penalty or 0.0, logprobs=body.alternatives,
                            grammar=grammar) for i in range(n)]
        reason = engine.check_group(requests)
        if reason:
            param = "n" if "choices" in reason else "max_tokens" if "max_tokens" in reason else where
            raise InvalidRequest(reason, param)
        return requests

    def response_format(spec: dict | None):
        """The compiled grammar of a response format (None: plain text)."""
        if spec is None or spec["type"] == "text":
            return None
        if formats is None:
            raise InvalidRequest(f"response_format {spec['type']!r} needs a model with a Hugging Face tokenizer "
                                 f"(e.g. smollm2); {served.name!r} has none", "response_format")
        try:
            return formats.compile(spec)
        except FormatError as e:
            raise InvalidRequest(str(e), "response_format") from None

    async def serve(http: HTTPRequest, body: Sampling, requests: list[Request], chat: bool):
        queue = asyncio.Queue()  # the choices' tokens, tagged with their index
        handles = [Handle(r, asyncio.get_running_loop(), queue, i) for i, r in enumerate(requests)]
        return await respond(http, loop, Choices(served, requests, chat, body.stop_strings), handles,
                             bool(body.stream), bool(body.stream_options and body.stream_options.include_usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body, prompt = await run_in_threadpool(chat_prompt, await read_body(http))  # parsing is off the event loop
        requests = await run_in_threadpool(make_requests, body, prompt, body.output_limit, "messages")  # a grammar
        return await serve(http, body, requests, chat=True)

    def chat_prompt(raw: bytes) -> tuple[ChatBody, list[int]]:
        body = parse(raw, ChatBody)
        try:
            return body, served.encode_chat(body.chat_messages())
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise InvalidRequest(f"the messages cannot be rendered with the model's chat template: {e}",
                                 "messages") from None

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body, prompt = await run_in_threadpool(completion_prompt, await read_body(http))
        requests = await run_in_threadpool(make_requests, body, prompt, body.max_tokens, "prompt")
        return await serve(http, body, requests, chat=False)

    def completion_prompt(raw: bytes) -> tuple[CompletionBody, list[int]]:
        body = parse(raw, CompletionBody)
        return body, served.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt

    return app


class DrainingServer:
    """uvicorn whose SIGTERM / Ctrl-C drains first (see the module docstring); a second signal stops at once."""

    def __init__(self, app: FastAPI, host: str, port: int, drain_s: float):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(server, sig, frame):
                if self.draining:
                    return super().handle_exit(sig, frame)
                self.draining = True
                threading.Thread(target=self.drain, name="drain", daemon=True).start()

        self.loop, self.drain_s, self.draining = app.state.loop, drain_s, False
        # after the drain, uvicorn's own graceful shutdown only waits for the last events to be written
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)
        self.server = Server(config)
        self.loop.on_death = self.stop

    def drain(self) -> None:
        self.loop.drain()
        deadline = time.monotonic() + self.drain_s
        while self.loop.in_flight and self.loop.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        self.loop.stop()  # ends what is left: error events and 503 bodies
        self.stop()

    def stop(self) -> None:
        self.server.should_exit = True

    def run(self) -> int:
        """Serve until drained (0) or until the engine dies (1)."""
        self.server.run()
        return 0 if self.loop.death is None else 1


def run_server(served: ServedModel, host: str = "127.0.0.1", port: int = 8000, drain_s: float = 30.0,
               **engine_args) -> None:
    """Serve until SIGTERM / Ctrl-C; requests in flight get ``drain_s`` seconds to finish.
    Exits with status 1 if the engine died."""
    server = DrainingServer(build_app(served, **engine_args), host, port, drain_s)
    print(f"serving {served.name} at http://{host}:{port}/v1", flush=True)
    code = server.run()
    if code:
        raise SystemExit(code)


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
