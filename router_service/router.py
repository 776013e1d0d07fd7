"""Request router: validate, tokenize, pick a rank (prefix-aware, else least-loaded: `router_service.prefix_affinity`),
stream tokens back, aggregate stats.

Each rank's channel (`router_service.rank_channels`: one TCP connection per rank, a poller thread each) brings
its `TokenOutput`s, which the router routes to their requests' streams (`router_service.stream`); requests,
aborts and wakes go the other way on the same connections once every rank's is up, over Ray actor calls before.
A request's stream ends with exactly one output whose `finish_reason` is set.

Rank failure. Every rank joins every all-to-all, so one dead or failed rank stalls the whole EP group. When
any poller finds its rank dead (the actor is gone), failed (its loop raised: a collective timed out after
pg_timeout_s) or silent (node lost without a reset: `RankSilent`), the router (1) refuses new requests: retriable
`EngineError` (HTTP 503 / gRPC UNAVAILABLE), (2) ends every in-flight request at once with
`finish_reason="error"` (retriable: 503 / UNAVAILABLE at the front doors), (3) kills every rank and starts a new
EP group (new actors, new process group: `EPCluster.restart`), retrying until it is up (`router_service.rebuild`;
`health()` names what it waits on), and (4) serves again.
Pollers belong to one cluster generation and exit when it ends. Redundant experts: `router_service.elastic`.
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
from actors.model.config import ModelConfig
from cluster.config import ClusterConfig
from cluster.launcher import EPCluster
from router_service.admission import PromptAdmission, default_max_queue
from router_service.elastic import try_shrink
from router_service.errors import EngineError, InvalidRequestError, OverloadedError
from router_service.prefix_affinity import RankChooser
from router_service.rank_channels import RankChannels
from router_service.rebuild import GroupRebuild
from router_service.stream import RequestOutput, RequestStream

log = logging.getLogger("moeray.router")


class Router(GroupRebuild):
    """Front of the EP cluster: admission and validation at the edge, the rank choice (`RankChooser`: the rank
    likely to hold the longest cached prefix when load allows, else the least-loaded; `cfg.prefix_routing`).

    Args:
        cluster: a running `EPCluster`, or a `ClusterConfig` to build one from in the background: the router
            answers at once, refusing requests with a retriable `EngineError` (HTTP 503 + Retry-After) and
            reporting `health()` status "starting" until the group is up (placement may wait for nodes; a Serve
            replica must not hang meanwhile), retrying failed attempts; a ValueError (bad configuration) or a
            PlacementTimeoutError (not placed in `cfg.placement_timeout_s`) ends them: `health()` "failed".
        max_queue: in-flight requests (running + queued) at most before refusing
            (None: `default_max_queue(max_model_len)`).
    Raises (from `submit`):
        InvalidRequestError: empty prompt, a text prompt over `max_prompt_chars` characters (refused before it is
            tokenized), token ids out of vocab, prompt + max_tokens over max_model_len (the message names the field
            and the limit).
        OverloadedError: more than `max_queue` requests in flight.
    """

    def __init__(self, cluster: EPCluster | ClusterConfig, max_queue: int | None = None):
        built = isinstance(cluster, EPCluster)
        self.cluster: EPCluster | None = cluster if built else None
        self.cfg = cluster.cfg if built else cluster
        self.tokenizer = Tokenizer.from_file(f"{self.cfg.model}/tokenizer.json")
        self.vocab_size = (cluster.model_config if built else ModelConfig.from_pretrained(self.cfg.model)).vocab_size
        self.max_queue = max_queue if max_queue is not None else default_max_queue(self.cfg.max_model_len)
        self.admission = PromptAdmission(self.tokenizer, self.vocab_size, self.cfg)
        self.max_prompt_chars = self.admission.max_prompt_chars
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._ranks = RankChooser.for_cluster(self.cfg)  # per-rank load and prefix index
        self._closed = False
        self._gen = 0  # cluster generation: pollers of an older one exit
        self._recovering: str | None = None  # the failure being recovered from, while the group is rebuilt
        self._blocker: str | None = None  # what that build / rebuild waits on now (`on_stage`)
        self._recovering_since = 0.0  # time.monotonic() when it started
        self.recoveries: list[dict] = []  # one entry per rebuild: reason, failed requests, seconds down
        self.rejoins: list[dict] = []  # elastic EP: one entry per replacement rank switched in
        self._draining = False  # set by drain(): new requests are refused, running ones may finish
        self._channels: RankChannels | None = None
        self._start_error: str | None = None  # a background build that cannot succeed (bad configuration)
        if built:
            self._start_pollers()
        else:  # built like a rebuild (same refusals meanwhile), without failing anything
            self._recovering = f"the EP group is being built ({self.cfg.ranks} ranks)"
            self._recovering_since = time.monotonic()
            threading.Thread(target=self._rebuild, args=(EPCluster, self._recovering, 0, self._recovering_since),
                             daemon=True, name="ep-build").start()

    def _start_pollers(self) -> None:
        gen = self._gen
        self._ranks.reset(self.cluster.kv_blocks_per_rank)  # a new EP group: empty caches, nothing in flight
        self._channels = RankChannels(self.cluster.ranks, lambda: next(self._seq), self._dispatch,
                                      lambda reason, detail, rank: self._on_rank_failure(gen, reason, detail, rank),
                                      silence_s=self.cfg.rank_silence_s)

    @property
    def submit_is_quick(self) -> bool:
        """Whether `submit` returns without waiting on a rank (every rank's channel is up: a request is a frame
        written, not a Ray call); then a front door may call it on its event loop for a small request."""
        return self._channels is not None and self._channels.connected

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, checked against the context window (`PromptAdmission.validate`)."""
        return self.admission.validate(prompt, params)

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        """Token ids of `text`, refused untokenized when too long (`PromptAdmission.encode`)."""
        return self.admission.encode(text, field)

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
               wake: bool = True) -> RequestStream:
        """Hand the request to the least loaded rank. wake=False: wake no rank for it (`generate` wakes once)."""
        ids = self.validate(prompt, params)
        rid = request_id or uuid.uuid4().hex
        cost = len(ids) + params.max_tokens
        hashes = self._ranks.hashes(ids, params)  # outside the lock: one sha256 per block
        with self._lock:
            if self._closed:
                raise EngineError("router is shut down")
            if self._recovering is not None:
                raise EngineError(f"{self._recovering}; retry" if self.cluster is None else
                                  f"the EP group is being rebuilt after a rank failure ({self._recovering}); retry")
            if self._draining:
                raise EngineError("the server is shutting down; retry on another replica")
            if len(self._streams) >= self.max_queue:
                raise OverloadedError(f"{len(self._streams)} requests in flight; the queue limit is {self.max_queue}")
            if rid in self._streams:
                raise InvalidRequestError("request_id", f"request_id={rid!r} is already in flight")
            rank = self._ranks.choose(hashes, len(ids), cost)
            stream = RequestStream(self, rid, prompt, rank, len(ids), cost)
            self._streams[rid] = stream
        msg = GenerateRequest(request_id=rid, prompt_ids=ids, params=params.to_dict(), arrival=time.time()).encode()
        try:
            sent = self._channels.post(rank, REQUEST, msg, wake=wake)
            if not sent:  # the channels are not all up yet: the actor call, which returns once the rank holds it
                ray.get(self.cluster.ranks[rank].add_request.remote(msg), timeout=30)
        except Exception as e:  # noqa: BLE001 - the client gets moeray's words, the log the exception's
            self._finish(rid)
            log.warning("rank %d did not take request %s: %s: %s", rank, rid, type(e).__name__, e)
            raise EngineError(f"rank {rank} did not take the request ({type(e).__name__}); retry") from e
        with self._lock:
            stream.admitted = True
            pending = stream.abort_pending
            # drawn only now that the rank holds the request (an earlier seq could reach the ranks ahead of it)
            seq = None if sent or not wake else next(self._seq)
        if seq is not None:
            self._wake_others(None, seq)
        if pending:
            self.abort(rid)
        return stream

    def _wake_others(self, rank: int | None, seq: int) -> None:
        [r.wake.remote(seq) for i, r in enumerate(self.cluster.ranks) if i != rank]

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream, seq = self._streams.get(request_id), next(self._seq)
            # the rank may not know it yet, or a regroup renumbers the ranks (`elastic`): cancel once it can
            if stream is not None and (not stream.admitted or self._recovering is not None):
                stream.abort_pending = True
                return
        if stream is not None:
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
                self._ranks.release(stream.rank, stream.cost)
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

    def _on_rank_failure(self, gen: int, reason: str, detail: str = "", rank: int | None = None) -> None:
        """First report of a failure in generation `gen`: with redundant experts, rank `rank` alone is dropped
        (`router_service.elastic`); else fail everything in flight, rebuild in the background. Later reports of the
        same generation are ignored. `reason` goes to clients (moeray's words), `detail` to the log only."""
        if rank is not None and try_shrink(self, gen, rank, reason, detail):
            return
        with self._lock:
            if gen != self._gen or self._closed:
                return
            self._gen += 1
            self._channels.close()  # the old generation's channels take no more control frames
            self._recovering, self._blocker = reason, None
            self._recovering_since = t0 = time.monotonic()
        log.error("%s: failing in-flight requests and rebuilding the EP group (%s)", reason, detail or reason)
        n = self._fail_rank(None, f"{reason}; the EP group is being rebuilt, retry the request")
        threading.Thread(target=self._rebuild, args=(EPCluster, reason, n, t0), daemon=True, name="ep-rebuild").start()

    def drain(self, timeout_s: float = 30.0) -> int:
        """Graceful shutdown: refuse new requests (retriable EngineError: HTTP 503 / gRPC UNAVAILABLE), let the
        ones in flight finish for up to `timeout_s` seconds, then end the rest with a retriable error, so every
        stream gets its final output before the front doors go away. Returns how many were ended that way."""
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        for st in self.streams():  # the ranks let go of them (and their KV blocks) at once, or after a regroup
            with self._lock:
                recovering, seq = self._recovering is not None, next(self._seq)
            self.abort(st.request_id) if recovering else self._abort_on_rank(st.rank, st.request_id, seq)
        return self._fail_rank(None, "the server is shutting down; retry the request")

    def get_stream(self, request_id: str) -> RequestStream | None:
        """The in-flight request `request_id`, or None if unknown or finished."""
        with self._lock:
            return self._streams.get(request_id)

    def streams(self) -> list[RequestStream]:
        """A snapshot of the in-flight requests."""
        with self._lock:
            return list(self._streams.values())

    def health(self) -> dict:
        """{ok, status ("ok" | "starting" | "recovering" | "draining" | "failed" | "unhealthy"), ranks: [{rank, ok, error}], recoveries
        (count), recovering_s (seconds since the failure, while recovering)}. Draining (after `drain`): not ok.
        While the EP group is built or rebuilt, `ranks` is empty, `status` is "starting" / "recovering" (the replica
        is alive), `blocker` what it waits on now (`on_stage`, or None) and `error` what started it and that."""
        with self._lock:
            recovering, since, draining = self._recovering, self._recovering_since, self._draining
            starting, start_error, blocker = self.cluster is None, self._start_error, self._blocker
        if start_error is not None:
            return {"ok": False, "status": "failed", "error": start_error, "ranks": [], "recoveries": 0}
        if draining:  # probes (HTTP /health, gRPC Health) must say so: new requests are refused from now on
            return {"ok": False, "status": "draining", "error": "the server is shutting down", "ranks": [],
                    "recoveries": len(self.recoveries)}
        if recovering is not None:
            return {"ok": False, "status": "starting" if starting else "recovering", "ranks": [], "blocker": blocker,
                    "error": recovering if blocker is None else f"{recovering}; now {blocker}",
                    "recovering_s": time.monotonic() - since, "recoveries": len(self.recoveries)}
        ranks = self.cluster.health()
        ok = all(r.get("ok") for r in ranks)
        return {"ok": ok, "status": "ok" if ok else "unhealthy", "ranks": ranks, "recoveries": len(self.recoveries)}

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Submit all, wake the ranks once (idle: all start in one step), wait; a bad prompt: an `error` output."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        streams: list[RequestStream | RequestOutput] = []
        for p, sp in zip(prompts, plist):
            try:
                streams.append(self.submit(p, sp, wake=False))
            except (InvalidRequestError, OverloadedError, EngineError) as e:
                streams.append(RequestOutput(request_id="", prompt=p, finish_reason="error", error=str(e)))
        try:  # over the channels if up (behind the requests written there), else the actor calls
            if not self._channels.wake_all():
                self._wake_others(None, next(self._seq))
        except OSError:  # a broken channel: its rank's poller rebuilds the group and fails the requests
            pass
        return [s.result() if isinstance(s, RequestStream) else s for s in streams]

    @property
    def in_flight(self) -> int:
        return len(self._streams)  # one read of a dict's size: atomic under the GIL

    def stats(self) -> dict:
        """Cluster stats (see `cluster.metrics`) plus `in_flight`, `recoveries` and `prefix_routed` (requests sent
        to a rank by prefix affinity since start, `RankChooser.routed`).
        Raises EngineError while the EP group is being rebuilt."""
        if self._recovering is not None:
            raise EngineError(f"the EP group is being rebuilt ({self._recovering})")
        s = self.cluster.stats()
        s["recoveries"] = len(self.recoveries)
        s["in_flight"] = self.in_flight
        s["prefix_routed"] = self._ranks.routed
        return s

    def close(self) -> None:
        with self._lock:
            self._closed = True
        seq = next(self._seq)
        if self.cluster is not None:
            self.cluster.shutdown(seq)
        if self._channels is not None:
            self._channels.close(join_s=5)
