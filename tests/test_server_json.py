"""``response_format`` through the official client against SmolLM2: constrained decoding (llguidance's grammar
from a JSON schema, its mask applied to each constrained row's logits) gives JSON that parses and validates
against the schema at temperature 0 and 1, also for n > 1 streamed choices; ``json_object`` gives an object;
a schema that cannot be compiled is a 400 naming response_format; a request without a format that shares
the batch is token for token what it is alone; tools and logit_bias stay refused."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from llmsys.serving.api import BackgroundServer
from test_server import client

pytestmark = pytest.mark.timeout(600)  # the real model on a busy machine

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "country"],
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer", "minimum": 0},
                       "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Other"]}}}
ASK = [{"role": "user", "content": "Describe Paris as JSON: its name, population and country."}]
AS_CITY = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


@pytest.fixture(scope="module")
def smollm2():
    with BackgroundServer("--model", "smollm2", "--dtype", "fp32", "--kv-blocks", "96") as s:
        yield s


def chat(server, max_tokens=60, **kw):
    return client(server).chat.completions.create(model="smollm2", messages=ASK, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_answers_follow_the_schema(smollm2, temperature):
    reply = chat(smollm2, temperature=temperature, seed=3, response_format=AS_CITY)
    assert reply.choices[0].finish_reason == "stop"  # the document closed, then the end-of-turn token
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


def test_streamed_choices_follow_the_schema(smollm2):
    texts = ["", ""]
    for chunk in chat(smollm2, temperature=1.0, seed=8, n=2, stream=True, response_format=AS_CITY):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), CITY)


def test_json_object_is_an_object(smollm2):
    reply = chat(smollm2, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    plain = chat(smollm2, temperature=0).choices[0].message.content  # unconstrained, the model writes prose
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "json_schema", "json_schema": {"schema": CITY}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "yaml"}, "type"),
])
def test_a_bad_format_is_a_400_naming_response_format(smollm2, response_format, words):
    r = httpx.post(smollm2.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smollm2", "messages": ASK, "response_format": response_format})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("response_format") and words in err["message"], err


def test_an_unconstrained_neighbour_decodes_as_alone(smollm2):
    alone = chat(smollm2, temperature=0, max_tokens=40).choices[0].message.content

    async def main():
        c = openai.AsyncOpenAI(base_url=smollm2.url + "/v1", api_key="none", max_retries=0, timeout=300)
        constrained = c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                                response_format=AS_CITY)
        plain = c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, temperature=0)
        return await asyncio.gather(constrained, plain)

    constrained, plain = asyncio.run(main())
    assert plain.choices[0].message.content == alone
    jsonschema.validate(json.loads(constrained.choices[0].message.content), CITY)


@pytest.mark.parametrize("field, value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                          ("logit_bias", {"1": 5})])
def test_tools_and_logit_bias_stay_refused(smollm2, field, value):
    with pytest.raises(openai.BadRequestError, match=f"{field} is not supported"):
        chat(smollm2, temperature=0, **{field: value})
