"""Structured output at the HTTP edge: `response_format` (both endpoints) and `tools` + `tool_choice` (chat) as
pydantic fields, compiled once per request into the llguidance grammar the ranks enforce
(`actors.engine.grammar`), and the tool-call shape of a chat response.

- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object), or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` (an object of that schema;
  no `schema`: any JSON object). Enforced whatever `strict` says (as vLLM). Whitespace between JSON tokens is
  fixed (`actors.engine.grammar.JSON_OPTIONS`), so a schema whose strings, numbers and arrays are bounded ends
  within a bounded number of tokens.
- `tool_choice` naming a function: the output is that function's arguments, an object of its `parameters`
  schema (no `parameters`: `{}`, OpenAI's empty parameter list); `"required"`: one call of any tool, as
  `{"name": ..., "arguments": {...}}`. The response carries `message.tool_calls` (`arguments` a JSON string),
  `content: null` and finish_reason "tool_calls" (vLLM's named / required tool choice). `"none"`: the tools are
  not used. `"auto"` (OpenAI's default when tools are given): 400, since no tool-call parser exists for this
  model. Tool calls are not streamed (400 with `stream: true`).
A schema that does not compile (an unknown type, a bad `$ref` or `pattern`, an unsupported keyword) is a 400
naming `response_format` or `tools`, before anything reaches a rank.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.engine.grammar import check_grammar, json_schema_grammar, load_tokenizer
from router_service.errors import InvalidRequestError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
ANY_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(..., pattern=_NAME.pattern, description="1-64 letters, digits, _ or -")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema; null: any JSON object")
    strict: bool | None = Field(None, description="accepted; the schema is enforced either way")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _spec(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs json_schema: {name, schema}")
        return self

    def output_schema(self) -> dict | None:
        """The JSON schema the output must follow, or None (text)."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return ANY_OBJECT
        return self.json_schema.schema_


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(..., pattern=_NAME.pattern)
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON schema of the arguments; null: no arguments")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class StructuredFields(BaseModel):
    """`response_format` (both endpoints); `tools` / `tool_choice` only where the model declares them (chat)."""

    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_only(cls, data: Any):
        if isinstance(data, dict) and "tools" not in cls.model_fields:
            for f, noop in (("tools", []), ("tool_choice", "none")):
                if data.get(f) not in (None, noop):
                    raise ValueError(f"{f}: tools are only taken by /v1/chat/completions")
        return data


class ToolFields(StructuredFields):
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _tool_choice(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if names else "none")
        if choice == "auto":
            raise ValueError("tool_choice: 'auto' (the default when tools are given) is not supported: this model has "
                             "no tool-call parser; name a function ({\"type\": \"function\", \"function\": {\"name\": "
                             "...}}), or use 'required' or 'none'")
        if choice == "none":
            return self
        if not names:
            raise ValueError(f"tool_choice: {self.tool_choice!r:.80} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: function {choice.function.name!r:.80} is not among the tools "
                             f"({', '.join(names)})")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with a tool call (tool_choice)")
        if getattr(self, "stream", False):
            raise ValueError("stream: tool calls (tool_choice naming a function or 'required') are not streamed "
                             "yet; send stream=false")
        return self


def tool_mode(req) -> str | None:
    """The tool call a request makes: the named function, "required" (any of the tools), or None (no call)."""
    choice = getattr(req, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return "required" if choice == "required" else None


def _tool_schema(req, mode: str) -> dict:
    tools = {t.function.name: t.function.parameters for t in req.tools}
    args = lambda p: NO_ARGUMENTS if p is None else p  # noqa: E731
    if mode != "required":
        return args(tools[mode])
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": args(p)},
              "required": ["name", "arguments"], "additionalProperties": False} for n, p in tools.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def request_grammar(req, router) -> str | None:
    """The llguidance grammar of a request's `response_format` / tool call, checked against the model's tokenizer
    (`router.cfg.model`, `router.vocab_size`); None: unconstrained.

    Raises:
        InvalidRequestError: naming `response_format` or `tools`, with the library's words for the schema's fault.
    """
    mode = tool_mode(req)
    if mode is not None:
        field, schema = "tools", _tool_schema(req, mode)
    else:
        field, schema = "response_format", req.response_format.output_schema() if req.response_format else None
    return None if schema is None else schema_grammar(schema, field, router)


def schema_grammar(schema: dict, field: str, router) -> str:
    """The llguidance grammar of a JSON schema (an object), checked against the model's tokenizer
    (`router.cfg.model`, `router.vocab_size`): one helper for every front door (HTTP `response_format` / `tools`,
    gRPC `SamplingParams.json_schema` / `json_object`).

    Raises:
        InvalidRequestError: naming `field`, with the library's words for the schema's fault.
    """
    tokenizer = load_tokenizer(f"{router.cfg.model}/tokenizer.json", router.vocab_size)
    try:
        grammar = json_schema_grammar(schema)
        check_grammar(grammar, tokenizer)
    except ValueError as e:
        raise InvalidRequestError(field, f"{field}: the JSON schema does not compile: {e}") from e
    return grammar


def tool_call_choice(choice: dict, mode: str) -> dict:
    """A chat choice (`message.content` = the constrained text) as a tool call: `message.tool_calls` = [{id, type,
    function: {name, arguments (a JSON string)}}], `content` null, finish_reason "tool_calls". A named call cut
    short by max_tokens is still the call, with its partial `arguments` and finish_reason "length" (as vLLM
    answers a named tool choice: a client reads `tool_calls` either way). A "required" output cut short (by
    max_tokens or a stop string) names no function that can be read: it stays as text."""
    text, msg = choice["message"]["content"], choice["message"]
    finish = "tool_calls"
    if choice["finish_reason"] != "stop":
        if mode == "required" or choice["finish_reason"] != "length":
            return choice
        finish = "length"
    if mode == "required":
        try:
            call = json.loads(text)
            name, args = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError):  # a stop string cut it: not a call
            return choice
    else:
        name, args = mode, text
    msg = {**msg, "content": None, "tool_calls": [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}]}
    return {**choice, "message": msg, "finish_reason": finish}
