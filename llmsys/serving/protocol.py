"""The OpenAI API's request bodies, checked strictly at admission, its error objects, and answer text.

A body is parsed from raw bytes (strict UTF-8, strict JSON: no NaN or Infinity) and validated
with the API's types and ranges without coercion: ``max_tokens: "10"`` or ``true`` is refused,
as is ``stream: "yes"`` or ``temperature: 3``. Fields OpenAI defines and this server cannot honour
(``tools``, ``logit_bias``, ...: ``UNSUPPORTED``) are refused with a message naming them, never silently
ignored; fields that do not change the answer
(``user``, ``metadata``) are ignored. Every refusal is an ``InvalidRequest`` carrying the
parameter at fault, sent back as an OpenAI error object.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # how some tokenizers decode bytes that are no UTF-8
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 4  # OpenAI's API reference: "Up to 4 sequences"
UNAVAILABLE_RETRY_S = 5  # Retry-After while the server shuts down
MAX_CHOICES = 16  # n: each choice is a running sequence, so n is also capped by the server's --max-num-seqs


class InvalidRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(status: int, message: str, kind: str, param: str | None = None, headers=None) -> Response:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    # ASCII JSON: a message quoting the client's input can never fail to encode
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


def encodable(text: str) -> str:
    """Refuse lone surrogates (``"\\ud800"`` is valid JSON but no UTF-8 text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (\\ud800-\\udfff), which is not text; send valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(encodable)]
StopText = Annotated[str, Field(min_length=1), AfterValidator(encodable)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        """Text parts are joined by newlines, as vLLM's chat endpoint does."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class StreamOptions(Strict):
    include_usage: bool = False


class ResponseFormat(Strict):
    """OpenAI's structured outputs: ``json_schema`` holds {"name", "schema", "strict"}, compiled by ``grammar``."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias", "echo", "best_of", "suffix",
               "audio", "modalities", "prediction")
NO_TOOLS = " (no tool calling here; response_format json_schema constrains an answer to a schema)"


class Sampling(Strict):
    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Text | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    response_format: ResponseFormat | None = None
    user: Text | None = None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) and self.stop else list(self.stop or [])


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def chat_messages(self) -> list[dict]:
        """The messages as the chat template takes them: text only, a developer message as a system one."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) or max_tokens (its older one); both must agree."""
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest(f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                 f"({self.max_completion_tokens}) differ; send one of them", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def alternatives(self) -> int | None:
        """How many top log-probabilities to report per token (None: no log-probabilities)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(Sampling):
    prompt: Text | list[Annotated[int, Field(ge=0)]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)

    @property
    def alternatives(self) -> int | None:
        return self.logprobs


def reject_constant(name: str):
    raise ValueError(f"{name} is not JSON; send a finite number")


def parse(raw: bytes, kind: type[Sampling]) -> Sampling:
    """A validated body from the request's bytes, or InvalidRequest saying what to change."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON") from None
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"the body must be a JSON object, got {type(data).__name__}")
    if isinstance(data.get("stop"), list) and len(data["stop"]) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(data['stop'])}", "stop")
    for name in UNSUPPORTED:
        if data.get(name) not in (None, False):
            hint = NO_TOOLS if name in ("tools", "tool_choice", "functions", "function_call") else ""
            raise InvalidRequest(f"{name} is not supported by this server; remove it{hint}", name)
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise invalid(e.errors()) from None


def invalid(errors: list[dict]) -> InvalidRequest:
    """The most specific of pydantic's errors (for a union, the member that got furthest), as the API's error."""
    first = max(errors, key=lambda err: len(err["loc"]))
    path = [str(p) for p in first["loc"] if isinstance(p, int) or p.isidentifier()]  # drop union members' tags
    where = ".".join(path) or None
    shown = f", got {repr(first.get('input'))[:80]}" if first["type"] != "missing" else ""
    return InvalidRequest(f"invalid {where or 'body'}: {first['msg']}{shown}", where)


def utf8_safe(text: str) -> str:
    """``text`` with lone surrogates (bytes a tokenizer decoded though they are no UTF-8) as U+FFFD."""
    return LONE_SURROGATE.sub("\ufffd", text)


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could be the start of a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class Answer:
    """One answer's text as its tokens arrive: pieces safe to send, cut before the first stop string.

    A piece never ends inside a multi-byte character (its bytes decode to U+FFFD until complete)
    nor with what could be the start of a stop string; ``finish`` releases what was held back and
    drops a character that max_tokens cut in the middle."""

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False
        self.logprobs: list = []  # (token, (log p, top alternatives)) per token, when asked for

    def add(self, tokens: list[Any], final: bool = False) -> str:
        """The new text to send; ``stopped`` turns True when a stop string appeared."""
        self.ids += tokens
        # bytes that are no UTF-8 become U+FFFD (a byte-level model can emit any); at the end they may be an
        # incomplete character: wait for its next bytes
        text = utf8_safe(self.decode(self.ids)).rstrip("\ufffd")
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        elif not final:
            text = text[:len(text) - held_back(text, self.stops)]
        self.text = text
        piece, self.sent = text[self.sent:], max(self.sent, len(text))
        return piece
