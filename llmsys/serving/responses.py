"""One request's answer as OpenAI's API writes it: the ``n`` choices of a chat completion or a text
completion, whole or as server-sent events, with usage and log-probabilities.

``Choices`` keeps each choice's ``Answer`` as the engine's tokens arrive and writes OpenAI's objects;
``respond`` drives one request from its choices' shared queue to the HTTP response: a body once every
choice has ended, or events as they come (each chunk names its choice's ``index``), then ``[DONE]``.
The prompt is counted once in ``usage`` however many choices share it (its blocks are shared too).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi.responses import Response, StreamingResponse

from llmsys.serving.loop import EngineLoop, Handle
from llmsys.serving.protocol import UNAVAILABLE_RETRY_S, Answer, error, utf8_safe


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Choices:
    """The answers of one request's choices (``requests``, one per choice, one prompt) and their wire format."""

    def __init__(self, served, requests: list, chat: bool, stops: list[str]):
        self.served, self.requests, self.chat = served, requests, chat
        self.answers = [Answer(served.decode, stops) for _ in requests]
        self.finish: list[str | None] = [None] * len(requests)
        self.top = requests[0].logprobs  # alternatives per token, None: no log-probabilities
        self.id = ("chatcmpl-" if chat else "cmpl-") + requests[0].id
        self.kind = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    @property
    def done(self) -> bool:
        return None not in self.finish

    def take(self, index: int, tokens: list[int], token_logprobs, finish: str | None) -> tuple[str, str | None, list]:
        """Choice ``index``'s new tokens: (text to send, its finish reason or None, (token, log-probs) pairs)."""
        answer = self.answers[index]
        entries = list(zip(tokens, token_logprobs or []))
        answer.logprobs += entries
        piece = answer.add(tokens, final=finish is not None)
        self.finish[index] = "stop" if answer.stopped else finish
        return piece, self.finish[index], entries

    def usage(self) -> dict:
        prompt, completion = len(self.requests[0].prompt), sum(len(a.ids) for a in self.answers)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def logprobs(self, index: int, entries) -> dict | None:
        """OpenAI's logprobs object for (token, (log p, top alternatives)) pairs."""
        if self.top is None:
            return None
        text = lambda t: utf8_safe(self.served.decode([t]))  # noqa: E731
        if self.chat:
            item = lambda t, lp: {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}  # noqa: E731
            return {"content": [item(t, lp) | {"top_logprobs": [item(a, v) for a, v in top]}
                                for t, (lp, top) in entries], "refusal": None}
        offsets = [len(self.answers[index].text)] * len(entries)  # approximate: where this event's text starts
        return {"tokens": [text(t) for t, _ in entries], "token_logprobs": [lp for _, (lp, _) in entries],
                "top_logprobs": [{text(a): v for a, v in top} for _, (_, top) in entries], "text_offset": offsets}

    def delta(self, index: int, piece: str, finish: str | None, first: bool = False, entries=()) -> dict:
        """One choice's part of a streamed chunk."""
        if not self.chat:
            return {"index": index, "text": piece, "finish_reason": finish, "logprobs": self.logprobs(index, entries)}
        delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece or first else {})
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": self.logprobs(index, entries)}

    def chunk(self, choices: list[dict], **extra) -> str:
        kind = self.kind + ".chunk" if self.chat else self.kind
        return sse({"id": self.id, "object": kind, "created": self.created, "model": self.served.name,
                    "choices": choices} | extra)

    def body(self) -> dict:
        """The whole response once every choice has ended."""
        choices = []
        for i, answer in enumerate(self.answers):
            text = {"message": {"role": "assistant", "content": answer.text}} if self.chat else {"text": answer.text}
            choices.append({"index": i, "finish_reason": self.finish[i],
                            "logprobs": self.logprobs(i, answer.logprobs)} | text)
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.served.name,
                "choices": choices, "usage": self.usage()}


async def respond(http, loop: EngineLoop, choices: Choices, handles: list[Handle], stream: bool,
                  include_usage: bool):
    """Submit the choices (QueueFull -> 429, Unavailable -> 503) and answer as they end."""
    loop.submit(handles)

    def abort_unfinished() -> None:  # the client went away, or one choice failed the whole body: free the blocks
        for handle, finish in zip(handles, choices.finish):
            if finish is None:
                loop.abort(handle)

    async def next_event():
        """(choice, text to send, finish reason or None, error or None, new (token, log-probs) pairs)."""
        while True:
            index, tokens, token_logprobs, finish, err = await handles[0].queue.get()
            if choices.finish[index] is None:  # after a stop string the engine still reports the abort: not news
                break
        piece, reason, entries = choices.take(index, tokens, token_logprobs, finish)
        if reason == "stop" and finish is None:  # a stop string: the answer is complete, free its blocks now
            loop.abort(handles[index], "finished")
        return index, piece, reason, err, entries

    if stream:
        async def events():
            try:
                if choices.chat:
                    for i in range(len(handles)):
                        yield choices.chunk([choices.delta(i, "", None, first=True)])
                while not choices.done:
                    i, piece, finish, err, entries = await next_event()
                    if piece or finish or (entries and choices.top is not None):
                        yield choices.chunk([choices.delta(i, piece, finish, entries=entries)])
                    if err:
                        yield sse({"error": {"message": err, "type": "server_error", "param": None, "code": None}})
                if include_usage:
                    yield choices.chunk([], usage=choices.usage())
                yield "data: [DONE]\n\n"
            finally:
                abort_unfinished()
        return StreamingResponse(events(), media_type="text/event-stream")

    while not choices.done:
        try:
            _, _, _, err, _ = await asyncio.wait_for(next_event(), 0.5)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                abort_unfinished()
                return Response(status_code=499)
            continue
        if err:
            abort_unfinished()
            status = 503 if loop.stopping or not loop.alive else 500
            headers = {"Retry-After": str(UNAVAILABLE_RETRY_S)} if status == 503 else None
            return error(status, err, "server_error", headers=headers)
    return choices.body()
