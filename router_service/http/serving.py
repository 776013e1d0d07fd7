"""OpenAI-style request handling over a `Router`, without an HTTP framework (`OpenAIServer`): model check,
prompt building (chat template), all-or-nothing submission, the merged output stream of a request's
choices, and `usage`. The FastAPI routes over it are in `router_service.http.app`.

Errors: router refusals become `_Reject` carrying the HTTP response (400 bad input, 404 `model_not_found`
for a model not served, 503 queue limit with `Retry-After`, 503 a rank failed); the app's exception handler returns it and counts the rejection.
Leaving `outputs` early (also cancellation: the client went away) aborts every unfinished request on its
rank (KV blocks freed).

Chat template: `chat_template` from the model's tokenizer_config.json (Jinja, rendered in a sandbox
with `messages`, `tools` (the request's tool definitions, or None), `add_generation_prompt=True`, `bos_token`,
`eos_token`), else `DEFAULT_CHAT_TEMPLATE`: the tools as a `System: Tools:` block, one `Role: content` line per
message, then `Assistant:` (plain text, since the shipped model has no chat special tokens).
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse

from actors.engine.messages import TokenOutput
from router_service.chat_template import ChatTemplate, load_chat_template
from router_service.errors import EngineError, InvalidRequestError, ModelNotFoundError, OverloadedError
from router_service.grpc.rpc import served_model_name
from router_service.http.logprobs import ChoiceView, TokenTexts
from router_service.http.models import ChatCompletionRequest, CompletionRequest, SamplingFields
from router_service.http.structured import request_grammar
from router_service.metrics import Metrics
from router_service.request_timeout import RequestTimedOut, check_request_timeout
from router_service.router import Router
from router_service.stream import LoopMailbox, RequestStream

# request bodies up to this size are templated, tokenized and submitted on the event loop (~1 ms of tokenizing
# at most: `tokenizers` encodes about 1 MB/s on one core of the 2-core machine)
INLINE_BODY_BYTES = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   headers: dict | None = None, code: str | int | None = None) -> JSONResponse:
    """OpenAI's error body `{"error": {message, type, param, code}}`; `code` defaults to the status."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status if code is None else code}}, status_code=status, headers=headers)


def model_not_found(e: ModelNotFoundError) -> JSONResponse:
    return error_response(404, str(e), "model", code="model_not_found")


class _Reject(Exception):
    """A refusal: the HTTP `response` to send and the `reason` label it is counted under."""

    def __init__(self, response: JSONResponse, reason: str):
        self.response, self.reason = response, reason


class OpenAIServer:
    """Request handling over a `Router` (no HTTP framework in here, so handlers stay testable).

    request_timeout_s: a request still generating after this many seconds is stopped (aborted on its rank) and
    answered 504 (in-band for a stream): no client waits forever on a server that cannot answer (None: no limit;
    see `router_service.request_timeout`, the rule gRPC shares).
    """

    def __init__(self, router: Router, model_name: str | None = None, api_key: str | None = None,
                 chat_template: ChatTemplate | None = None, request_timeout_s: float | None = None):
        self.request_timeout_s = check_request_timeout(request_timeout_s)
        self.router = router
        self.model_name = served_model_name(router, model_name)
        self.api_key = api_key or None
        self.chat_template = chat_template or load_chat_template(router.cfg.model)
        self.metrics = Metrics(router)
        self.created = int(time.time())

    # -------------------------------------------------------------- admission
    def _check_model(self, req: SamplingFields) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ModelNotFoundError(req.model, self.model_name)

    def _submit_all(self, jobs: list[tuple]) -> list[RequestStream]:
        """Submit (prompt, params, request_id) jobs; all or nothing (a refusal aborts those submitted)."""
        streams: list[RequestStream] = []
        try:
            for prompt, params, rid in jobs:
                streams.append(self.router.submit(prompt, params, rid))
        except BaseException:
            for s in streams:
                self.router.abort(s.request_id)
            raise
        return streams

    async def submit(self, make_jobs, body_bytes: int | None = None) -> list[RequestStream]:
        """Build the jobs (`make_jobs()`: templating and tokenizing, which hold the GIL) and submit them. A body of
        at most `INLINE_BODY_BYTES` (`body_bytes`, None: unknown) is handled on the event loop when the router's
        rank channels are up (then `submit` writes a frame and never waits on a rank): the thread hop would cost
        it more than the work. Anything larger, or the router's actor-call path, runs off the loop, so the loop
        keeps streaming other requests' tokens. Maps router errors to `_Reject` with the HTTP response."""
        try:
            if body_bytes is not None and body_bytes <= INLINE_BODY_BYTES and self.router.submit_is_quick:
                return self._submit_all(make_jobs())
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: self._submit_all(make_jobs()))
        except ModelNotFoundError as e:
            raise _Reject(model_not_found(e), "model_not_found") from e
        except InvalidRequestError as e:
            raise _Reject(error_response(400, str(e), e.field), "invalid") from e
        except OverloadedError as e:
            raise _Reject(error_response(503, str(e), None, "overloaded_error", {"Retry-After": "1"}), "overloaded") from e
        except EngineError as e:
            raise _Reject(error_response(503, str(e), None, "engine_unavailable", {"Retry-After": "1"}), "unavailable") from e

    def prompt_len(self, prompt: str | list[int]) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self.router.encode(prompt))

    def completion_jobs(self, req: CompletionRequest, rid: str) -> list[tuple]:
        self._check_model(req)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        grammar = request_grammar(req, self.router)  # compiled and checked once, for every choice
        jobs = []
        for p_i, prompt in enumerate(req.prompts()):
            for j in range(req.n):
                jobs.append((prompt, req.sampling_params(max_tokens, j, grammar), f"{rid}-{p_i * req.n + j}"))
        return jobs

    def chat_jobs(self, req: ChatCompletionRequest, rid: str) -> list[tuple]:
        self._check_model(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None  # the template shows them
        text = self.chat_template.render([{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                                          for m in req.messages], tools)
        ids = self.router.encode(text, "messages")
        L = self.router.cfg.max_model_len
        if req.output_limit is not None:
            max_tokens = req.output_limit
            if len(ids) < L and len(ids) + max_tokens > L:  # named by the field it came from
                f = req.max_tokens_field
                raise InvalidRequestError(f, f"{f}={max_tokens} exceeds the context window ({L} - {len(ids)} "
                                             f"prompt tokens = {L - len(ids)})")
        elif len(ids) >= L:
            raise InvalidRequestError("messages", f"the templated prompt has {len(ids)} tokens; the context window is {L}")
        else:
            max_tokens = L - len(ids)  # the rest of the context window
        grammar = request_grammar(req, self.router)
        return [(ids, req.sampling_params(max_tokens, j, grammar), f"{rid}-{j}") for j in range(req.n)]

    def views(self, req: SamplingFields, streams: list[RequestStream]) -> list[ChoiceView] | None:
        """Per choice, its echo / logprobs / prompt_logprobs view (`router_service.http.logprobs`); None when the
        request asks for none of them (the plain, fast path)."""
        chat = isinstance(req, ChatCompletionRequest)
        lp = req.logprob_params()
        k = lp["logprobs"]
        echo = bool(getattr(req, "echo", False))
        if k is None and req.prompt_logprobs is None and not echo:
            return None
        tok = self.router.tokenizer
        views = []
        for s in streams:
            p = s.out.prompt
            ids = list(p) if isinstance(p, list) else (tok.encode(p).ids if (k is not None and echo) or
                                                       req.prompt_logprobs is not None else [])
            text = (p if isinstance(p, str) else tok.decode(list(p), skip_special_tokens=False)) if echo else ""
            views.append(ChoiceView(TokenTexts(tok), chat=chat, k=k, echo=echo, prompt_k=req.prompt_logprobs,
                                    prompt_text=text, prompt_ids=ids))
        return views

    # -------------------------------------------------------------- streaming
    async def outputs(self, streams: list[RequestStream], frontend: str = "http") -> AsyncIterator[tuple[int, TokenOutput]]:
        """(choice index, output) of all streams as they arrive. The streams are attached to this loop's
        `LoopMailbox`: the router posts a whole rank frame per loop wake-up, no thread per stream. On exit (also
        cancellation: the client went away) every unfinished request is aborted on its rank. Timed and counted
        under `frontend` ("grpc": the Serve deployment's Generate). Raises RequestTimedOut past
        `request_timeout_s`."""
        mailbox = LoopMailbox.of(asyncio.get_running_loop())
        aq: asyncio.Queue = asyncio.Queue()
        for i, s in enumerate(streams):
            s.attach(mailbox, aq, i)
        left = len(streams)
        timer = self.metrics.observer([s.t0 for s in streams], frontend)  # TTFT, inter-token and end-to-end latency
        # the deadline is one timer per request that puts a marker in the queue (no per-token wait_for)
        T = self.request_timeout_s
        deadline = None if T is None else asyncio.get_running_loop().call_later(T, aq.put_nowait, (-1, None))
        try:
            while left:
                i, o = await aq.get()
                if o is None:
                    raise RequestTimedOut(T)
                timer.observe(i, o.token_ids, o.finish_reason)
                if o.finish_reason is not None:
                    left -= 1
                yield i, o
        finally:
            if deadline is not None:
                deadline.cancel()
            for s in streams:
                if not s.done.is_set():
                    self.router.abort(s.request_id)

    @staticmethod
    def usage(streams: list[RequestStream], completion: list[int], n: int = 1) -> dict:
        """OpenAI `usage`: each prompt counted once (its `n` choices are streams i*n .. i*n+n-1, as OpenAI and
        vLLM count them), completion tokens summed over every choice."""
        p = sum(s.out.prompt_tokens for s in streams[::n])
        c = sum(completion)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
