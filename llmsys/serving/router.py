"""A router in front of engine replicas: one OpenAI-compatible address, each request sent to the replica
that holds the longest cached prefix of its prompt (``routing``), or round-robin.

    python -m llmsys serve --model target --port 8001 &   python -m llmsys serve --model target --port 8002 &
    python -m llmsys serve-router --replicas http://127.0.0.1:8001 http://127.0.0.1:8002 --port 8000

The router renders each prompt into tokens as the replicas do (same tokenizer and chat format; it learns
the model's name from the replicas' ``/v1/models``) and hashes its full blocks as their prefix caches do.
Bodies are passed through unchanged, a stream event by event.

Failures, and what a client sees:
- a replica that refuses a connection, breaks one or times out a health check is marked down: nothing is
  routed to it, its prefix record is dropped, and a request it failed is sent to another replica. A hung
  replica (it accepts connections and never answers) is found by a health check once a reply has been
  silent a few seconds (``replica_health``: slow answers go on, hung ones do not). A request that has sent
  nothing to the client yet (a non-streaming one, or a stream before its first event) is retried whole,
  so the client never notices; a stream that has already sent events cannot be replayed (the client has
  the first tokens), so it ends as the server ends a failed stream: a last chunk per unfinished choice
  with ``finish_reason: "error"``, an error event, ``[DONE]``. The session's next turn goes to a live
  replica, which recomputes the prefix;
- a replica answering 429 (every slot and queue place taken) or 503 (draining) is tried no more for that
  request; when every replica refused it, the last refusal is passed on with its ``Retry-After``;
- with no replica up: 503 with ``Retry-After``, an OpenAI error object naming each replica's state.
A replica that answers its health check again is routed to again. ``/health`` is 200 while one replica
is up; ``/metrics`` holds the router's counters (requests per replica and reason, prompt tokens and
those it found on record, retries, broken streams).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.concurrency import run_in_threadpool

from llmsys.serving.api import BodyTooLarge, MAX_BODY_BYTES, read_body
from llmsys.serving.protocol import UNAVAILABLE_RETRY_S, ChatBody, CompletionBody, error, parse
from llmsys.serving.replica_health import ReplicaHealth, ReplicaHung, Timeouts
from llmsys.serving.responses import sse
from llmsys.serving.routing import NoReplica, Replica, Router
from llmsys.serving.served import ServedModel

PASSED_HEADERS = ("content-type", "retry-after")


def replica_root(url: str) -> str:
    """``http://host:port`` from a replica URL (a trailing /v1 is allowed), or ValueError saying what is wrong."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path.rstrip("/") not in ("", "/v1"):
        raise ValueError(f"{url!r} is not a replica URL; give one as http://HOST:PORT (a server started with "
                         "python -m llmsys serve)")
    return f"{parsed.scheme}://{parsed.netloc}"


def check_replicas(urls: list[str], timeout: float = 5.0) -> tuple[list[str], str]:
    """(the replicas' roots, the model they all serve), or ValueError naming the replica that does not answer
    or serves another model."""
    roots, models = [replica_root(u) for u in urls], {}
    if len(set(roots)) < len(roots):
        raise ValueError(f"a replica is listed twice in {' '.join(urls)}; list each server once")
    for root in roots:
        try:
            reply = httpx.get(root + "/v1/models", timeout=timeout)
            models[root] = reply.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise ValueError(f"no OpenAI-compatible server answers at {root}/v1/models ({type(e).__name__}: "
                             f"{e}); start one with python -m llmsys serve --port PORT") from None
    if len(set(models.values())) > 1:
        raise ValueError(f"the replicas serve different models ({models}); a router needs copies of one model")
    return roots, models[roots[0]]


def text_side(name: str) -> ServedModel:
    """The model's tokenizer and chat format without its weights: what rendering a prompt needs."""
    from llmsys.core import zoo

    return ServedModel(name, None, zoo.tokenizer() if name in zoo.SPECS else zoo.tokenizer(name), ())


def prompt_tokens(served: ServedModel, raw: bytes, chat: bool) -> list[int]:
    """The prompt's tokens as a replica renders them; [] for a body a replica will refuse with its own 400."""
    try:
        body = parse(raw, ChatBody if chat else CompletionBody)
    except Exception:  # noqa: BLE001 - the replica's answer says what is wrong with it
        return []
    if not chat:
        return served.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    return served.encode_chat(body.chat_messages())


class StreamSeen:
    """What a passed-through stream has said so far: enough to end it properly if its replica dies."""

    def __init__(self, chat: bool):
        self.buffer, self.done, self.chat = b"", False, chat
        self.head = {"id": "unknown", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 0, "model": ""}
        self.finish: dict[int, str | None] = {}

    def feed(self, data: bytes) -> None:
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            payload = event.removeprefix(b"data: ").strip()
            if payload == b"[DONE]":
                self.done = True
            elif payload.startswith(b"{"):
                chunk = json.loads(payload)
                self.head.update({k: chunk[k] for k in self.head if k in chunk})
                for c in chunk.get("choices", []):
                    self.finish[c["index"]] = c.get("finish_reason")

    def error_end(self, message: str) -> bytes:
        """A last chunk for each unfinished choice, an error event, [DONE] (what the server sends itself)."""
        unfinished = [i for i, f in self.finish.items() if f is None] or ([] if self.finish else [0])
        empty = {"delta": {}} if self.chat else {"text": ""}
        choices = [{"index": i, **empty, "finish_reason": "error", "logprobs": None} for i in unfinished]
        text = sse(self.head | {"choices": choices}) if choices else ""
        text += sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
        return (text + "data: [DONE]\n\n").encode()


def build_router_app(router: Router, served: ServedModel, timeouts: Timeouts = Timeouts()) -> FastAPI:
    """The router's HTTP server (see the module docstring; ``timeouts``: how long it waits on a replica)."""
    registry = CollectorRegistry()
    routed = Counter("llmsys_router_requests", "Requests routed, by replica and reason", ["replica", "reason"],
                     registry=registry)
    prompt_total = Counter("llmsys_router_prompt_tokens", "Prompt tokens routed", registry=registry)
    matched_total = Counter("llmsys_router_matched_tokens", "Prompt tokens the chosen replica held, by the record",
                            registry=registry)
    retries = Counter("llmsys_router_retries", "Requests sent again elsewhere, by why", ["why"], registry=registry)
    broken = Counter("llmsys_router_broken_streams", "Streams ended by an error event: their replica failed",
                     registry=registry)
    up = Gauge("llmsys_router_replica_up", "1 while the replica is routed to", ["replica"], registry=registry)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeouts.read, connect=timeouts.connect),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    health = ReplicaHealth(router, client, timeouts)

    @asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.create_task(health.watch())
        yield
        watcher.cancel()
        await client.aclose()

    app = FastAPI(title="llmsys router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(BodyTooLarge)
    async def too_large(request, exc):
        return error(413, f"the body has {exc.args[0]} bytes or more, over the limit of {MAX_BODY_BYTES}; "
                     "send a shorter prompt", "invalid_request_error", headers={"Connection": "close"})

    @app.get("/health")
    async def router_health():
        if any(r.state == "up" for r in router.replicas):
            return {"status": "ok", "replicas": {r.url: r.state for r in router.replicas}}
        return error(503, router.describe(), "server_error", headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        for r in router.replicas:
            up.labels(r.url).set(r.state == "up")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "llmsys"}]}

    async def route(http: HTTPRequest, path: str, chat: bool):
        raw = await read_body(http)
        tokens = await run_in_threadpool(prompt_tokens, served, raw, chat)
        hashes = router.hashes(tokens)
        tried, refusal = [], None
        for _ in range(2 * len(router.replicas)):  # each replica once, and again after a connection it survived
            try:
                choice = router.choose(tokens, hashes, exclude=tried)
            except NoReplica:
                break
            replica = choice.replica
            replica.in_flight += 1
            try:
                reply, body, stream = await health.wait(ask(replica, path, raw), replica, timeouts.first_byte)
            except (httpx.HTTPError, ReplicaHung) as e:
                replica.in_flight -= 1
                if not isinstance(e, ReplicaHung):
                    await health.probe(replica)  # a stale pooled connection, or a dead replica?
                tried += [replica] if replica.state != "up" else []
                retries.labels("hung" if isinstance(e, ReplicaHung) else "down").inc()
                continue
            if reply.status_code in (429, 503):
                replica.in_flight -= 1
                replica.state = "draining" if reply.status_code == 503 else replica.state
                tried.append(replica)
                refusal = Response(body, reply.status_code, headers=passed(reply))
                retries.labels("busy").inc()
                continue
            routed.labels(replica.url, choice.reason).inc()
            prompt_total.inc(len(tokens))
            matched_total.inc(choice.matched_tokens)
            if reply.status_code == 200:
                replica.remember(hashes)
            if "text/event-stream" not in reply.headers.get("content-type", ""):
                replica.in_flight -= 1
                return Response(body, reply.status_code, headers=passed(reply))
            return StreamingResponse(passthrough(reply, stream, replica, chat), headers=passed(reply))
        if refusal is not None:
            return refusal
        return error(503, router.describe(tried), "server_error", headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})

    async def ask(replica: Replica, path: str, raw: bytes):
        """(the reply, its whole body or None, for a stream (its first bytes, its iterator) or None): what the
        client needs before the router answers anything, so a replica that fails before it is retried unseen."""
        reply = await client.send(client.build_request("POST", replica.url + path, content=raw,
                                                       headers={"content-type": "application/json"}), stream=True)
        try:
            if reply.status_code in (429, 503) or "text/event-stream" not in reply.headers.get("content-type", ""):
                return reply, await reply.aread(), None  # a whole answer (or a refusal): read it all first
            chunks = reply.aiter_raw()
            first = await anext(chunks, b"")
            if not first:  # nothing was sent: the request can go elsewhere
                raise httpx.RemoteProtocolError("the replica ended the stream before its first event")
            return reply, None, (first, chunks)
        except BaseException:
            await reply.aclose()
            raise

    def passed(reply: httpx.Response) -> dict:
        return {k: v for k, v in reply.headers.items() if k.lower() in PASSED_HEADERS}

    async def passthrough(reply: httpx.Response, stream: tuple, replica: Replica, chat: bool):
        seen, (data, chunks) = StreamSeen(chat), stream
        try:
            while data:
                seen.feed(data)
                yield data
                data = await health.wait(anext(chunks, b""), replica, timeouts.stream_idle)
            failure = None if seen.done else "the replica closed the stream before its end"
        except (httpx.HTTPError, ReplicaHung) as e:
            failure = f"{type(e).__name__}: {e}"
        finally:
            replica.in_flight -= 1
            await reply.aclose()
        if failure:
            broken.inc()
            await health.probe(replica)
            yield seen.error_end(f"the replica {replica.url} failed during this answer ({failure}); "
                                 "send the request again: it goes to another replica")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await route(http, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await route(http, "/v1/completions", chat=False)

    return app


def make_router(urls: list[str], policy: str = "prefix", replica_blocks: int = 512, timeouts: Timeouts = Timeouts(),
                **router_args):
    """(the Router, its FastAPI app) over running replicas at ``urls``, checked first; ``router_args`` go to
    ``Router`` (block_size, cache_threshold, balance_abs, balance_rel)."""
    roots, model = check_replicas(urls, timeouts.connect + timeouts.health)
    router = Router([Replica(root, replica_blocks) for root in roots], policy, **router_args)
    return router, build_router_app(router, text_side(model), timeouts)


class RouterThread:
    """The router in a thread of this process on a free loopback port, ready when constructed.

        with RouterThread([a.url, b.url], policy="round-robin") as r:
            client = OpenAI(base_url=r.url + "/v1", api_key="none")
    """

    def __init__(self, urls: list[str], policy: str = "prefix", **router_args):
        import time

        import uvicorn

        from llmsys.core.dist import free_port

        self.router, app = make_router(urls, policy, **router_args)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="router", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the router did not start on port {port}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run_router(urls: list[str], host: str, port: int, policy: str, **router_args) -> None:
    """Serve the router until Ctrl-C / SIGTERM (ValueError, before listening, for bad replicas or options)."""
    import uvicorn

    router, app = make_router(urls, policy, **router_args)
    print(f"routing ({policy}) over {', '.join(r.url for r in router.replicas)} at http://{host}:{port}/v1",
          flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
