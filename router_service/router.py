"""Request router: validate, tokenize, pick the least-loaded rank, stream tokens back, aggregate stats.

Each rank's channel (`router_service.rank_channels`: one TCP connection per rank, a poller thread each) brings
its `TokenOutput`s, which the router routes to their requests' streams (`router_service.stream`); requests,
aborts and wakes go the other way on the same connections once every rank's is up, over Ray actor calls before.
A request's stream ends with exactly one output whose `finish_reason` is set.

Rank failure. Every rank joins every all-to-all, so one dead or failed rank stalls the whole EP group. When
any poller finds its rank dead (the actor is gone) or failed (its loop raised, e.g. a collective timed out
after the process-group timeout of at most 10 s), the router (1) refuses new requests with a retriable
`EngineError` (HTTP 503 / gRPC UNAVAILABLE), (2) ends every in-flight request at once with
`finish_reason="error"` (retriable: 503 / UNAVAILABLE at the front doors), (3) kills every rank and starts a new
EP group (new actors, new process group: `EPCluster.restart`), retrying until it is up, and (4) serves again.
Pollers belong to one cluster generation and exit when it ends.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid

import ray
from tokenizers import Tokenizer

from actors.engine.messages import GenerateRequest, TokenOutput
from actors.engine.sampling import SamplingParams
from actors.rank.output_channel import ABORT, REQUEST
from cluster.launcher import EPCluster
from router_service.admission import default_max_queue, max_prompt_chars
from router_service.errors import EngineError, InvalidRequestError, OverloadedError
from router_service.rank_channels import RankChannels
from router_service.stream import RequestOutput, RequestStream

log = logging.getLogger("moeray.router")


class Router:
    """Front of the EP cluster: admission and validation at the edge, least-load rank choice.

    Args:
        cluster: a running `EPCluster`. max_queue: in-flight requests (running + queued) at most before refusing
            (None: `default_max_queue(max_model_len)`).
    Raises (from `submit`):
        InvalidRequestError: empty prompt, a text prompt over `max_prompt_chars` characters (refused before it is
            tokenized), token ids out of vocab, prompt + max_tokens over max_model_len (the message names the field
            and the limit).
        OverloadedError: more than `max_queue` requests in flight.
    """

    def __init__(self, cluster: EPCluster, max_queue: int | None = None):
        self.cluster = cluster
        self.cfg = cluster.cfg
        self.tokenizer = Tokenizer.from_file(f"{self.cfg.model}/tokenizer.json")
        self.vocab_size = cluster.model_config.vocab_size
        self.max_queue = max_queue if max_queue is not None else default_max_queue(self.cfg.max_model_len)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.cfg.max_model_len)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._rank_cost = [0] * self.cfg.ranks
        self._closed = False
        self._gen = 0  # cluster generation: pollers of an older one exit
        self._recovering: str | None = None  # the failure being recovered from, while the group is rebuilt
        self._recovering_since = 0.0  # time.monotonic() when it started
        self.recoveries: list[dict] = []  # one entry per rebuild: reason, failed requests, seconds down
        self._draining = False  # set by drain(): new requests are refused, running ones may finish
        self._start_pollers()

    def _start_pollers(self) -> None:
        gen = self._gen
        self._channels = RankChannels(self.cluster.ranks, lambda: next(self._seq), self._dispatch,
                                      lambda reason, detail: self._on_rank_failure(gen, reason, detail))

    @property
    def submit_is_quick(self) -> bool:
        """Whether `submit` returns without waiting on a rank (every rank's channel is up: a request is a frame
        written, not a Ray call); then a front door may call it on its event loop for a small request."""
        return self._channels.connected

    # ------------------------------------------------------------------ validation
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
            ids = self.encode(prompt, "prompt")
        else:
            ids = list(prompt)
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
            if bad:
                raise InvalidRequestError("prompt", f"prompt token id {bad[0]} out of range [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError("prompt", "prompt is empty (0 tokens)")
        L = self.cfg.max_model_len
        if len(ids) >= L:
            raise InvalidRequestError("prompt", f"prompt has {len(ids)} tokens; the context window is {L}")
        if len(ids) + params.max_tokens > L:
            raise InvalidRequestError("max_tokens", f"max_tokens={params.max_tokens} exceeds the context window "
                                                    f"({L} - {len(ids)} prompt tokens = {L - len(ids)})")
        try:  # against the KV profiles the ranks loaded (same model folder and engine options; cached)
            params.check_kv_profile(self.cfg.model, self.cfg.engine_options)
        except ValueError as e:
            raise InvalidRequestError("kv_profile", str(e)) from e
        return ids

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        """Token ids of `text`, refused untokenized when it has more than `max_prompt_chars` characters.

        Raises:
            InvalidRequestError: naming `field`, the length and the limit.
        """
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(field, f"{field} has {len(text)} characters; the context window is "
                                             f"{self.cfg.max_model_len} tokens, which no text over "
                                             f"{self.max_prompt_chars} characters fits")
        return self.tokenizer.encode(text).ids

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        ids = self.validate(prompt, params)
        rid = request_id or uuid.uuid4().hex
        cost = len(ids) + params.max_tokens
        with self._lock:
            if self._closed:
                raise EngineError("router is shut down")
            if self._recovering is not None:
                raise EngineError(f"the EP group is being rebuilt after a rank failure ({self._recovering}); retry")
            if self._draining:
                raise EngineError("the server is shutting down; retry on another replica")
            if len(self._streams) >= self.max_queue:
                raise OverloadedError(f"{len(self._streams)} requests in flight; the queue limit is {self.max_queue}")
            if rid in self._streams:
                raise InvalidRequestError("request_id", f"request_id={rid!r} is already in flight")
            rank = min(range(self.cfg.ranks), key=lambda r: (self._rank_cost[r], r))
            self._rank_cost[rank] += cost
            stream = RequestStream(self, rid, prompt, rank, len(ids), cost)
            self._streams[rid] = stream
        msg = GenerateRequest(request_id=rid, prompt_ids=ids, params=params.to_dict(), arrival=time.time()).encode()
        try:
            sent = self._channels.post(rank, REQUEST, msg)
            if not sent:  # the channels are not all up yet: the actor call, which returns once the rank holds it
                ray.get(self.cluster.ranks[rank].add_request.remote(msg), timeout=30)
        except Exception as e:  # noqa: BLE001 - the client gets moeray's words, the log the exception's
            self._finish(rid)
            log.warning("rank %d did not take request %s: %s: %s", rank, rid, type(e).__name__, e)
            raise EngineError(f"rank {rank} did not take the request ({type(e).__name__}); retry") from e
        with self._lock:
            stream.admitted = True
            pending = stream.abort_pending
            # drawn only now that the rank holds the request: a rank that has seen this seq also sees the request
            # (a seq drawn before could reach the ranks, via another request's wake, ahead of the request itself)
            seq = None if sent else next(self._seq)
        if seq is not None:
            self._wake_others(None, seq)
        if pending:
            self.abort(rid)
        return stream

    def _wake_others(self, rank: int | None, seq: int) -> None:
        for i, r in enumerate(self.cluster.ranks):
            if i != rank:
                r.wake.remote(seq)

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            seq = next(self._seq)
            if stream is not None and not stream.admitted:  # the rank may not know it yet: cancel once it does
                stream.abort_pending = True
                return
        if stream is None:
            return
        self._abort_on_rank(stream.rank, request_id, seq)

    def _abort_on_rank(self, rank: int, request_id: str, seq: int) -> None:
        """Let `rank` end `request_id` (its KV blocks freed): over the channels, else the actor calls with `seq`."""
        try:
            if self._channels.post(rank, ABORT, request_id.encode()):
                return
        except OSError:  # the channel broke: the rank's poller rebuilds the group
            return
        self.cluster.ranks[rank].abort.remote(request_id, seq)
        self._wake_others(rank, seq)

    def _finish(self, rid: str) -> RequestStream | None:
        with self._lock:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._rank_cost[stream.rank] -= stream.cost
        return stream

    def _dispatch(self, outs: list[TokenOutput]) -> None:
        """Route one frame's outputs to their streams: one lock for the lookups, and one post per event loop for
        the streams attached to one (`LoopMailbox`), so a step of N sequences wakes a front door's loop once."""
        with self._lock:
            streams = [self._streams.get(o.request_id) for o in outs]
        posts: dict = {}
        for o, stream in zip(outs, streams):
            if stream is None:
                continue
            sent = stream._push(o)
            if sent is not None:
                posts.setdefault(sent[0], []).append(sent[1])
            if o.finish_reason is not None:
                self._finish(o.request_id)
        for mailbox, items in posts.items():
            mailbox.post(items)

    def _fail_rank(self, rank: int | None, err: str) -> int:
        """End every in-flight request on `rank` (None: on every rank) with `finish_reason="error"`.
        Returns how many were ended."""
        with self._lock:
            victims = [s for s in self._streams.values() if rank is None or s.rank == rank]
        for s in victims:
            sent = s._push(TokenOutput(request_id=s.request_id, finish_reason="error", error=err))
            if sent is not None:
                sent[0].post([sent[1]])
            self._finish(s.request_id)
        return len(victims)

    def _on_rank_failure(self, gen: int, reason: str, detail: str = "") -> None:
        """First report of a failure in generation `gen`: fail everything in flight, rebuild in the background.
        Later reports of the same generation (the other ranks' pollers) are ignored. `reason` goes to clients
        (moeray's words), `detail` (the exception's text) to the log only."""
        with self._lock:
            if gen != self._gen or self._closed:
                return
            self._gen += 1
            self._channels.close()  # the old generation's channels take no more control frames
            self._recovering = reason
            self._recovering_since = t0 = time.monotonic()
        log.error("%s: failing in-flight requests and rebuilding the EP group (%s)", reason, detail or reason)
        n = self._fail_rank(None, f"{reason}; the EP group is being rebuilt, retry the request")
        threading.Thread(target=self._rebuild, args=(reason, n, t0), daemon=True, name="ep-rebuild").start()

    def _rebuild(self, reason: str, failed: int, t0: float) -> None:
        attempt = 0
        while not self._closed:
            attempt += 1
            try:
                self.cluster.restart()
                break
            except Exception as e:  # noqa: BLE001 - keep trying: the alternative is a manual restart
                log.error("EP group rebuild attempt %d failed: %s: %s", attempt, type(e).__name__, e)
                time.sleep(min(2.0 * attempt, 10.0))
        with self._lock:
            if self._closed:
                return
            self._rank_cost = [0] * self.cfg.ranks
            self._recovering = None
            self.recoveries.append({"reason": reason, "failed_requests": failed, "attempts": attempt,
                                    "down_s": time.monotonic() - t0, "generation": self.cluster.generation})
            self._start_pollers()
        log.warning("EP group serving again after %.1f s (%d attempts)", time.monotonic() - t0, attempt)

    def drain(self, timeout_s: float = 30.0) -> int:
        """Graceful shutdown: refuse new requests (retriable EngineError: HTTP 503 / gRPC UNAVAILABLE), let the
        ones in flight finish for up to `timeout_s` seconds, then end the rest with a retriable error, so every
        stream gets its final output before the front doors go away. Returns how many were ended that way."""
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.streams()
        for st in left:  # the ranks let go of them (and their KV blocks) at once
            with self._lock:
                seq = next(self._seq)
            self._abort_on_rank(st.rank, st.request_id, seq)
        return self._fail_rank(None, "the server is shutting down; retry the request")

    # ------------------------------------------------------------------ lookups (front doors, metrics)
    def get_stream(self, request_id: str) -> RequestStream | None:
        """The in-flight request `request_id`, or None if unknown or finished."""
        with self._lock:
            return self._streams.get(request_id)

    def streams(self) -> list[RequestStream]:
        """A snapshot of the in-flight requests."""
        with self._lock:
            return list(self._streams.values())

    def health(self) -> dict:
        """{ok, status ("ok" | "recovering" | "draining" | "unhealthy"), ranks: [{rank, ok, error}], recoveries
        (count), recovering_s (seconds since the failure, while recovering)}. Draining (after `drain`): not ok.
        While the EP group is rebuilt, `ranks` is empty and `status` is "recovering" (the replica is alive)."""
        with self._lock:
            recovering, since, draining = self._recovering, self._recovering_since, self._draining
        if draining:  # probes (HTTP /health, gRPC Health) must say so: new requests are refused from now on
            return {"ok": False, "status": "draining", "error": "the server is shutting down", "ranks": [],
                    "recoveries": len(self.recoveries)}
        if recovering is not None:
            return {"ok": False, "status": "recovering", "error": recovering, "ranks": [],
                    "recovering_s": time.monotonic() - since, "recoveries": len(self.recoveries)}
        ranks = self.cluster.health()
        ok = all(r.get("ok") for r in ranks)
        return {"ok": ok, "status": "ok" if ok else "unhealthy", "ranks": ranks, "recoveries": len(self.recoveries)}

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Submit all prompts, wait for all; a bad prompt yields an `error` output, the rest go on."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        streams: list[RequestStream | RequestOutput] = []
        for p, sp in zip(prompts, plist):
            try:
                streams.append(self.submit(p, sp))
            except (InvalidRequestError, OverloadedError, EngineError) as e:
                streams.append(RequestOutput(request_id="", prompt=p, finish_reason="error", error=str(e)))
        return [s.result() if isinstance(s, RequestStream) else s for s in streams]

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def stats(self) -> dict:
        """Cluster stats (see `cluster.metrics`) plus `in_flight` and `recoveries`.
        Raises EngineError while the EP group is being rebuilt."""
        if self._recovering is not None:
            raise EngineError(f"the EP group is being rebuilt ({self._recovering})")
        s = self.cluster.stats()
        s["recoveries"] = len(self.recoveries)
        s["in_flight"] = self.in_flight
        return s

    def close(self) -> None:
        with self._lock:
            self._closed = True
        seq = next(self._seq)
        self.cluster.shutdown(seq)
        self._channels.close(join_s=5)
