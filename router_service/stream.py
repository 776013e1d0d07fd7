"""One request's outputs as they arrive (`RequestStream`) and its result in vLLM's shape (`RequestOutput`,
`CompletionOutput`).

The router creates a stream on admission and pushes every `TokenOutput` of the request into it from its
rank's poller thread; the stream ends with exactly one output whose `finish_reason` is set, which also
sets `done` and fills the final `RequestOutput`. Readers (front doors, `LLM`) iterate it from any thread.

Asyncio readers (the HTTP front door) `attach` the stream to their event loop's `LoopMailbox` instead: the router
then hands the loop all outputs of one rank frame (one engine step, every sequence's new tokens) in one
`call_soon_threadsafe`, not one thread hop and one loop wake-up per token per stream.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.engine.messages import TokenOutput

if TYPE_CHECKING:  # the router imports this module; the stream only calls back into it
    from router_service.router import Router


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sequence in vLLM's shape (`RequestOutput.outputs[0]`): `index`, `text`, `token_ids`,
    `finish_reason`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """Final result of one request: generated `text`, `token_ids` (EOS excluded), `finish_reason`
    (`stop` | `length` | `abort` | `error`), `error` message if any, and timing in seconds. Code written for
    vLLM reads the same through `outputs[0].text` / `.token_ids` / `.finish_reason` and `finished`."""

    request_id: str
    prompt: str | list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list | None = None  # with `SamplingParams.logprobs`: one `TokenLogprob` per token id
    prompt_logprobs: list | None = None  # with `prompt_logprobs`: per prompt token (the first None)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's view: one `CompletionOutput` (one sequence per request here)."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LoopMailbox:
    """The hand-over point from the router's poller threads to one asyncio event loop (one per loop: `of`).

    `post(items)` (any thread) queues (asyncio.Queue, key, output) triples and schedules at most one drain on the
    loop while one is pending; the drain (on the loop) `put_nowait`s `(key, output)` into each queue. Posting a
    whole frame at once costs one loop wake-up per frame, whatever the number of streams in it.
    """

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox]" = weakref.WeakKeyDictionary()
    _by_loop_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple] = []
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopMailbox":
        """The mailbox of `loop` (created on first use)."""
        with cls._by_loop_lock:
            mb = cls._by_loop.get(loop)
            if mb is None:
                mb = cls._by_loop[loop] = cls(loop)
            return mb

    def post(self, items: list[tuple]) -> None:
        """Queue `(asyncio.Queue, key, TokenOutput)` items for the loop (any thread). A closed loop drops them
        (its readers are gone; the front door aborted their requests)."""
        with self._lock:
            self._items.extend(items)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for q, key, o in items:
            q.put_nowait((key, o))


class RequestStream:
    """Outputs of one request as they arrive (thread-safe). Iterate for `TokenOutput`s; `result()`
    waits for the end. `cancel()` aborts it on its rank and frees its KV blocks."""

    def __init__(self, router: "Router", request_id: str, prompt, rank: int, prompt_tokens: int, cost: int):
        self.router, self.request_id, self.rank = router, request_id, rank
        self.out = RequestOutput(request_id=request_id, prompt=prompt, prompt_tokens=prompt_tokens)
        self.q: queue.Queue[TokenOutput] = queue.Queue()
        self.t0 = time.perf_counter()
        self.cost = cost
        self.done = threading.Event()
        # a cancel that arrives while the rank is still taking the request is replayed once it has it
        self.admitted = False
        self.abort_pending = False
        self._sink: tuple | None = None  # (LoopMailbox, asyncio.Queue, key) once `attach`ed; (None, queue.Queue,
        # key) once `attach_queue`d
        self._sink_lock = threading.Lock()

    def attach(self, mailbox: LoopMailbox, q: "asyncio.Queue", key) -> None:
        """Deliver this stream's outputs as `(key, output)` into asyncio queue `q` through `mailbox` (its loop),
        from now on; outputs that arrived before are handed over first, in order. Call once, before reading."""
        with self._sink_lock:
            early = []
            while True:
                try:
                    early.append((q, key, self.q.get_nowait()))
                except queue.Empty:
                    break
            self._sink = (mailbox, q, key)
            if early:  # under the lock: a later output's post cannot overtake them
                mailbox.post(early)

    def attach_queue(self, q: queue.Queue, key) -> None:
        """Deliver this stream's outputs as `(key, output)` into the thread-safe `q` from now on (outputs that
        arrived before first, in order), so one thread can wait on several streams (the gRPC server's batch).
        Call once, before reading."""
        with self._sink_lock:
            while True:
                try:
                    q.put((key, self.q.get_nowait()))
                except queue.Empty:
                    break
            self._sink = (None, q, key)

    def get(self, timeout: float | None = None) -> TokenOutput:
        """The next output (blocking up to `timeout` s). Raises queue.Empty on timeout."""
        return self.q.get(timeout=timeout)

    def _push(self, o: TokenOutput) -> tuple | None:
        """Record `o` (router threads). Returns `(mailbox, item)` for the caller to post (batched per frame) when
        the stream is attached to an event loop; None when `o` went to the thread-safe queue."""
        now = time.perf_counter() - self.t0
        if o.token_ids:
            if self.out.ttft_s is None:
                self.out.ttft_s = now
            self.out.token_times.extend([now] * len(o.token_ids))
        self.out.token_ids.extend(o.token_ids)
        self.out.text += o.text
        if o.logprobs is not None:
            self.out.logprobs = self.out.logprobs or []
            self.out.logprobs.extend(o.logprobs)
        if o.prompt_logprobs is not None:
            self.out.prompt_logprobs = o.prompt_logprobs
        if o.finish_reason is not None:
            self.out.finish_reason = o.finish_reason
            self.out.error = o.error
            self.done.set()
        with self._sink_lock:
            sink = self._sink
            if sink is None:
                self.q.put(o)
                return None
            if sink[0] is None:  # `attach_queue`d
                sink[1].put((sink[2], o))
                return None
        return sink[0], (sink[1], sink[2], o)

    def __iter__(self):
        while True:
            o = self.q.get()
            yield o
            if o.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout}s")
        return self.out

    def cancel(self) -> None:
        self.router.abort(self.request_id)

