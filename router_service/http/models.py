"""Pydantic models of the OpenAI-style HTTP API and of the Serve application's arguments.

Every sampling field is validated here, at the edge; a violation becomes HTTP 400 whose message names
the field, the value and the limit (see `router_service.http.app`). Checks that need the tokenizer
(prompt + max_tokens over the context window) or the served model (unknown `model`: 404 `model_not_found`)
are made by the app and the router, with the same kind of message. A JSON `null` for an optional field means
its default, as in OpenAI's API (the SDKs and many gateways send nulls).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.engine.sampling import (LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS, PENALTY_LIMIT,
                                    SamplingParams, check_kv_profile_name, parse_logit_bias)
from actors.moe.gating import POLICIES
from router_service.errors import InvalidRequestError
from router_service.http.structured import StructuredFields, ToolFields
from router_service.request_timeout import REQUEST_TIMEOUT_S

MAX_N = 8  # completions per prompt at most (`n`, and `best_of`, which must equal it)
MAX_PROMPTS = 256  # prompts in one /v1/completions call at most
MAX_SEED = 2**63
# OpenAI / vLLM request fields that change the output and are not implemented yet -> the values that are no-ops
# (`response_format`, `tools`, `tool_choice`: `router_service.http.structured`)
NOT_YET_SUPPORTED = {
    "functions": ([],), "function_call": ("none",), "min_p": (0, 0.0), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
}
PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def check_n(n: int) -> int:
    """`n` (choices per prompt) of either front door. Raises ValueError: n outside 1..MAX_N."""
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n={n} is out of range: 1 to {MAX_N} choices per prompt (moeray's limit)")
    return n


class NullIsDefault(BaseModel):
    """A request model in which a JSON `null` for a field means the field's default (OpenAI's API)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data


class StreamOptions(NullIsDefault):
    """`include_usage` (default false, as in OpenAI and vLLM): the last SSE event before `[DONE]` carries
    `usage` with `choices: []`. Off by default because clients that read `chunk.choices[0]` of every chunk
    fail on that event."""

    include_usage: bool = False


class SamplingFields(NullIsDefault):
    """Fields shared by completions and chat completions (OpenAI names; vLLM-style extensions
    `top_k`, `ignore_eos`, `stop_token_ids`; moeray's `gating`: this request's gating policy, and `kv_profile`:
    its KV quantization profile). Unknown fields are ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _not_yet(cls, data: Any):
        """Fields that would change the output and are not implemented yet: a 400 naming the field unless the
        value is the no-op one (never accepted and ignored)."""
        if isinstance(data, dict):
            for field, noop in NOT_YET_SUPPORTED.items():
                v = data.get(field)
                if v is not None and v not in noop:
                    only = f" (only {' or '.join(map(repr, noop))})" if noop else ""
                    raise ValueError(f"{field}: {v!r} is not supported yet{only}")
        return data

    model: str | None = Field(None, description="served model id (GET /v1/models); None = the served model")
    max_tokens: int | None = Field(None, ge=1, description="output tokens at most; prompt + max_tokens <= context window")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="nucleus mass, in (0, 1]")
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    n: Annotated[int, AfterValidator(check_n)] = Field(1, description=f"choices per prompt, 1 to {MAX_N}")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOP_STRINGS} non-empty strings")
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    ignore_eos: bool = False
    gating: str | None = Field(None, description=f"gating policy ({', '.join(POLICIES)}); null = the deployment's")
    kv_profile: str | None = Field(None, description="KV quantization profile of this request (a served profile name "
                                   "such as prose or code, or auto: chosen from the prompt); null = the deployment's "
                                   "default. A name needs a quantized KV cache (--kv-bits); unknown names get 400")
    # logit controls, applied on the rank (`actors.engine.penalties`); logprobs stay those of the raw logits
    presence_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False,
                                    description="logit -= presence_penalty if the token was generated (OpenAI)")
    frequency_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False,
                                     description="logit -= frequency_penalty * times the token was generated (OpenAI)")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="vLLM's: a prompt or output "
                                      "token's logit is divided by it if > 0, else multiplied; 1 = off")
    logit_bias: dict[int, float] | None = Field(None, description=f"token id -> bias in [-{LOGIT_BIAS_LIMIT:g}, "
                                                f"{LOGIT_BIAS_LIMIT:g}] added to its logit; {MAX_LOGIT_BIAS} at most")
    min_tokens: int = Field(0, ge=0, description="EOS, stop_token_ids and stop strings end nothing before this many "
                            "output tokens (vLLM's); <= max_tokens")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's extension: logprobs of "
                                        "every prompt token and its top-k (`router_service.http.logprobs`)")
    user: str | None = None

    @model_validator(mode="after")
    def _prompt_logprobs(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true (as in vLLM)")
        return self

    def logprob_params(self) -> dict:
        """`SamplingParams.logprobs` / `prompt_logprobs` of this request (completions and chat differ)."""
        return {"prompt_logprobs": self.prompt_logprobs}

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        return parse_logit_bias(v)  # JSON keys are strings ("50256"); ids vs the vocabulary: the router's check

    @field_validator("gating")
    @classmethod
    def _gating(cls, v):
        if v is not None and v not in POLICIES:
            raise ValueError(f"gating={v!r} must be one of {', '.join(POLICIES)}")
        return v

    @field_validator("kv_profile")
    @classmethod
    def _kv_profile(cls, v):
        check_kv_profile_name(v)  # the form only; whether it is served is checked by the router
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(v)} strings; at most {MAX_STOP_STRINGS}")
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options.include_usage if self.stream_options else False

    def sampling_params(self, max_tokens: int, index: int = 0, grammar: str | None = None) -> SamplingParams:
        """SamplingParams of choice `index` (a seed is offset by the index so n > 1 choices differ), with `grammar`
        (`structured.request_grammar`). Raises InvalidRequestError naming the field (`min_tokens` over `max_tokens`)."""
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=max_tokens,
                seed=None if self.seed is None else (self.seed + index) % MAX_SEED, stop=list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos, gating=self.gating,
                kv_profile=self.kv_profile, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=self.logit_bias or None, min_tokens=self.min_tokens, grammar=grammar, **self.logprob_params())
        except ValueError as e:
            raise InvalidRequestError(re.match(r"\w*", str(e)).group(0) or "sampling", str(e)) from e


def _token_ids(v: list, what: str) -> list[int]:
    """`v` as token ids (ints >= 0; bools and floats refused). Raises ValueError naming `what`."""
    if not v:
        raise ValueError(f"prompt: {what} is empty (no token ids)")
    bad = next((t for t in v if type(t) is not int or t < 0), None)
    if bad is not None:
        raise ValueError(f"prompt: {what} holds {bad!r}; token ids are integers >= 0 ({PROMPT_FORMS})")
    return list(v)


def parse_prompt(v: Any) -> list[str | list[int]]:
    """OpenAI's `prompt` forms -> the batch of prompts: "text" -> ["text"], [1, 2] -> [[1, 2]], ["a", "b"] and
    [[1], [2, 3]] as they are. Raises ValueError (message starting `prompt`) for an empty string or list, an empty
    element, other element types, mixed forms, or more than MAX_PROMPTS prompts."""
    if isinstance(v, str):
        if not v:
            raise ValueError("prompt is empty")
        return [v]
    if not isinstance(v, list):
        raise ValueError(f"prompt must be {PROMPT_FORMS}; got {type(v).__name__}")
    if not v:
        raise ValueError("prompt is empty (an empty list)")
    if all(type(t) is int for t in v):
        return [_token_ids(v, "the token-id list")]
    if len(v) > MAX_PROMPTS:
        raise ValueError(f"prompt has {len(v)} prompts; at most {MAX_PROMPTS} in one request")
    if all(isinstance(p, str) for p in v):
        if not all(v):
            raise ValueError(f"prompt: text {v.index('')} of the batch is empty")
        return list(v)
    if all(isinstance(p, list) for p in v):
        return [_token_ids(p, f"token-id list {i} of the batch") for i, p in enumerate(v)]
    kinds = sorted({type(p).__name__ for p in v})
    raise ValueError(f"prompt must be {PROMPT_FORMS} (one form, not mixed); got a list of {', '.join(kinds)}")


class CompletionRequest(SamplingFields, StructuredFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, a list of strings or a list of token-id
    lists (a batch: choice `i * n + j` is the j-th of prompt i, as OpenAI orders them); `max_tokens` defaults to
    16 as in OpenAI's API."""

    prompt: Any = Field(..., description=PROMPT_FORMS)
    max_tokens: int | None = Field(None, ge=0, description="output tokens at most (0 only with echo: the prompt "
                                   "alone); prompt + max_tokens <= context window")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="logprobs of each token and its top-k")
    echo: bool = Field(False, description="the prompt (and with logprobs its logprobs) before the output")
    suffix: None = Field(None, description="not supported")
    best_of: int | None = Field(None, description=f"only equal to n (or unset), so at most {MAX_N}")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        parse_prompt(v)
        return v

    def logprob_params(self) -> dict:
        """Echo with logprobs k scores the prompt with k alternatives too (and vLLM's prompt_logprobs, if more)."""
        pk = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            pk = max(self.logprobs, pk or 0)
        return {"logprobs": self.logprobs, "prompt_logprobs": pk}

    @model_validator(mode="after")
    def _best_of(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo=true (otherwise nothing would be returned)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} must equal n={self.n}: best_of > n (server-side best-of "
                             f"sampling) is not supported; n is at most {MAX_N}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (see `parse_prompt`)."""
        return parse_prompt(self.prompt)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(NullIsDefault):
    """One chat turn; `content` is text or a list of text parts (joined). Images are not supported."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields, ToolFields):
    """POST /v1/chat/completions. `max_completion_tokens` (OpenAI's name) or the deprecated `max_tokens`; when
    both are given `max_completion_tokens` wins, as in vLLM. Unset: the rest of the context window after the
    templated prompt."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(False, description="logprobs of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: top-k per token")

    def logprob_params(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None, "prompt_logprobs": self.prompt_logprobs}

    @model_validator(mode="after")
    def _messages(self):
        if not any(m.text() for m in self.messages):
            raise ValueError("messages: every message is empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        return self

    @property
    def max_tokens_field(self) -> str:
        """The field the output length comes from (named in errors)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeray"
    max_model_len: int


class ServeAppArgs(BaseModel):
    """Arguments of the Serve application (`args:` in deploy/serve_config.yaml; `moeray serve` flags).

    model: model folder (None: $MOERAY_MODEL, else the shipped models/tiny-moe).
    ranks: EP world size of the cluster each replica owns.
    num_gpus_per_rank / num_cpus_per_rank: the rank bundle of the placement group (None: $MOERAY_NUM_GPUS_PER_RANK
        / $MOERAY_NUM_CPUS_PER_RANK, else 1 GPU per rank when the Ray cluster has GPUs, else 0 GPU and 0.5 CPU).
        Pods set these through the environment, so one config serves a laptop and a GPU cluster.
    max_queue: requests in flight (running + queued) per replica before HTTP 503 / RESOURCE_EXHAUSTED (None:
        `router_service.admission.default_max_queue`, 4096 at max_model_len 1024).
    api_key: required bearer key (None: $MOERAY_API_KEY; unset or empty: no key).
    grpc_port: if set, the replica also serves gRPC on grpc_host:grpc_port (127.0.0.1 unless told otherwise).
    http_port: if set, the replica serves the HTTP app itself on http_host:http_port (`router_service.serve.
        listener`: uvicorn in the replica, SO_REUSEPORT, so replicas of one node share the port), besides
        answering through Serve's HTTP proxy; `moeray serve` uses it and starts no proxy (`--http-via replica`).
    max_body_bytes: HTTP request bodies above this get 413 before they are parsed (default 4 MiB).
    request_timeout_s: a request still generating after this many seconds is aborted on its rank: HTTP 504, gRPC
        DEADLINE_EXCEEDED, proxied or on the replica's own server (default 600; None: no limit).
    cluster_options: any other `cluster.config.ClusterConfig` field (dtype, placement_strategy, ranks_per_node, ...).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    served_model_name: str | None = None
    ranks: int = Field(2, ge=1)
    num_gpus_per_rank: float | None = Field(None, ge=0)
    num_cpus_per_rank: float | None = Field(None, gt=0)
    max_queue: int | None = Field(None, ge=1)
    api_key: str | None = None
    grpc_port: int | None = Field(None, ge=0, le=65535)
    grpc_host: str = "127.0.0.1"
    http_port: int | None = Field(None, ge=0, le=65535)
    max_body_bytes: int = Field(4 << 20, ge=0)
    request_timeout_s: float | None = Field(REQUEST_TIMEOUT_S, gt=0)
    http_host: str = "127.0.0.1"
    cluster_options: dict = Field(default_factory=dict)
