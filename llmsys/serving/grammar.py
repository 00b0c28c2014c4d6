"""Constrained decoding: answers that are JSON (``response_format: {"type": "json_object"}``) or that follow a
JSON schema (``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``), as OpenAI's
structured outputs define them.

A schema is compiled once into a grammar by llguidance (Microsoft's grammar engine, the one vLLM and
SGLang offer as a structured-output backend). Each sequence that decodes with it gets its own matcher, the
grammar's parse state after the tokens it has generated; before every draw the matcher says which tokens
may come next and every other logit is set to -inf, so whatever is sampled keeps the text a prefix of some
valid document, and the end-of-turn token is allowed only once the document is complete. Rows of the batch
without a format are never touched.

Whitespace between JSON tokens is fixed (``", "`` and ``": "``, as ``json.dumps`` writes): with free
whitespace a small model can emit newlines until max_tokens and never close the document.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import torch

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}  # what json_object asks for: some JSON object


class FormatError(ValueError):
    """A response_format this server cannot decode with: the message says what to change."""


class Matcher:
    """One sequence's place in the grammar: which tokens may come next, and the tokens it took."""

    def __init__(self, grammar: Grammar):
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)

    def allowed(self, vocab_size: int, device) -> torch.Tensor:
        """(vocab_size,) bool: True for the tokens the grammar accepts next."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = (words[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # token 8·i + j is bit j of byte i
        allowed = bits.flatten().bool()[:vocab_size]
        if len(allowed) < vocab_size:  # the model's vocabulary is padded past the tokenizer's: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab_size - len(allowed))])
        return allowed.to(device)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"the grammar refuses token {token}: {self.matcher.get_error() or 'not allowed here'}")


class Grammar:
    """A compiled response format for one tokenizer; ``matcher()`` starts a sequence at its beginning."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, text: str):
        self.tokenizer, self.text = tokenizer, text

    def matcher(self) -> Matcher:
        return Matcher(self)


class ResponseFormats:
    """Compiles response formats for a model's Hugging Face (fast) tokenizer; ``stop_id`` ends a document."""

    def __init__(self, hf_tokenizer, stop_id: int):
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=stop_id)  # ~0.3 s: once per server

    def compile(self, response_format: dict) -> Grammar | None:
        """The grammar for an OpenAI ``response_format`` (None for plain text); FormatError if it cannot be."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = ANY_OBJECT
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise FormatError('json_schema must be an object with a "name" and a "schema", e.g. '
                                  '{"name": "person", "schema": {"type": "object", ...}}')
            schema = spec.get("schema", {})  # OpenAI's schema is optional: then any JSON value
            if not isinstance(schema, dict):
                raise FormatError(f"json_schema.schema must be a JSON schema (an object), "
                                  f"got {json.dumps(schema)[:80]}")
        else:
            raise FormatError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
        except ValueError as e:
            raise FormatError(f"the schema cannot be compiled: {e}") from None
        problem = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if problem:
            raise FormatError(f"the schema cannot be compiled: {problem[:300]}")
        return Grammar(self.tokenizer, text)
