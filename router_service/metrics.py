"""Prometheus metrics of the serving front door (prometheus_client, one registry per app, prefix `moeray_`).

Two kinds of families live in one `CollectorRegistry`:
  - request-side, updated as requests pass, each counter labelled by the front door (`frontend`: "http" or
    "grpc", so one /metrics covers both protocols):
      moeray_requests_total{frontend,endpoint,code}   HTTP: path and status code; gRPC: `Generate` and the status
                                                      the call ended with (OK, INVALID_ARGUMENT, CANCELLED, ...)
      moeray_rejections_total{frontend,reason}        refused before generation (invalid, model_not_found,
                                                      unauthorized, overloaded, unavailable)
      moeray_prompt_tokens_total{frontend}, moeray_generated_tokens_total{frontend}
    and the latency histograms (`Metrics.observer`, both front doors together)
      moeray_time_to_first_token_seconds   submit -> first token of a request
      moeray_inter_token_latency_seconds   gap between consecutive tokens of a request (an output carrying
                                           k tokens after a gap g counts k gaps of g / k)
      moeray_e2e_request_latency_seconds   submit -> last output (finished, stopped or aborted; not errors)
  - cluster-side, read from the last `Router.stats()` snapshot (`Metrics.refresh`, on every GET /metrics) by
    `ClusterCollector`, so label sets always match the snapshot (no stale expert/layer series):
      moeray_expert_tokens_total{layer,expert}   (token, expert) assignments since start (counter)
      moeray_rank_tokens_total{layer,rank}       the same, summed over the experts each rank holds (counter)
      moeray_expert_balancedness{layer}          mean/max expert load in (0, 1], 1 = balanced (MoE layers)
      moeray_rank_balancedness{layer}            mean/max rank load in (0, 1]
      moeray_expert_max_mean{layer}, moeray_rank_max_mean{layer}   max/mean (>= 1), the inverse view
      moeray_dispatch_rank_rows_total{layer,rank}, moeray_dispatch_rank_balancedness{layer}   rows each
                                                 rank's experts received as measured by the dispatchers
                                                 (when the ranks report them; rank_* above are computed from
                                                 the placement)
      moeray_thrash_rate{layer}                  mean Jaccard distance of consecutive tokens' expert sets
      moeray_prefetch_recall{layer}, moeray_expert_cache_hit_rate{layer}   packed-expert runs only
      moeray_queue_depth                         requests admitted but not running: max(in flight - running,
                                                 waiting on ranks) (the router hands requests to a rank at
                                                 once, so its own queue is the in-transit part)
      moeray_sequences_running, moeray_sequences_waiting, moeray_requests_in_flight
      moeray_kv_blocks_used, moeray_kv_blocks_free, moeray_kv_blocks_total (used + free = total)
      moeray_ranks_failed
      moeray_prefix_cache_queries_total, moeray_prefix_cache_hits_total   prompt tokens looked up in the ranks'
                                                 prefix caches at admission, and of those found cached (tokens)
      moeray_prefix_routed_total                 requests the router sent to a rank by prefix affinity (the rank
                                                 with the longest cached prefix, router_service/prefix_affinity.py)
The routing families are exported only for layers with a finite value (ranks without the packed-expert
path report no hit rate or recall). Balancedness follows `cluster.metrics`.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "moeray_"
FRONTENDS = ("http", "grpc")  # the `frontend` label of the request counters
# seconds; TTFT includes prefill of up to a context window, ITL is one decode step (ms on GPU, ~10 ms on CPU)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# routing key in cluster stats -> (family suffix, help)
ROUTING_FAMILIES = {
    "thrash": ("thrash_rate", "router thrashing: mean Jaccard distance between consecutive tokens' expert sets"),
    "recall": ("prefetch_recall", "expert prefetch recall: |predicted and used| / |used|"),
    "hit_rate": ("expert_cache_hit_rate", "expert cache hits / lookups"),
}


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


class ClusterCollector:
    """Prometheus collector over the last cluster stats snapshot (`Router.stats()`; see
    `cluster.metrics.aggregate_stats`). Before the first `update` it yields nothing.

    Args:
        in_flight: live count of requests in the router (read at scrape time; else the snapshot's `in_flight`).
    """

    def __init__(self, in_flight: Callable[[], int] | None = None):
        self._in_flight = in_flight
        self._stats: dict | None = None
        self._lock = threading.Lock()

    def update(self, stats: dict) -> None:
        with self._lock:
            self._stats = stats

    def collect(self):
        with self._lock:
            s = self._stats
        if s is None:
            return
        g = lambda name, doc, labels=(): GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))  # noqa: E731

        load = s.get("expert_load") or []
        tok = CounterMetricFamily(PREFIX + "expert_tokens", "(token, expert) assignments per layer and expert",
                                  labels=["layer", "expert"])
        for l, row in enumerate(load):
            if any(row):  # dense layers route nothing
                for e, n in enumerate(row):
                    tok.add_metric([str(l), str(e)], n)
        yield tok
        rtok = CounterMetricFamily(PREFIX + "rank_tokens", "(token, expert) assignments per layer on the experts "
                                   "each rank holds", labels=["layer", "rank"])
        for l, row in enumerate(s.get("rank_load") or []):
            if any(row):
                for r, n in enumerate(row):
                    rtok.add_metric([str(l), str(r)], n)
        yield rtok

        fams = {k: g(k, doc, ["layer"]) for k, doc in (
            ("expert_balancedness", "mean/max expert load of a layer, in (0, 1] (1 = balanced)"),
            ("rank_balancedness", "mean/max rank load of a layer, in (0, 1] (1 = balanced)"),
            ("expert_max_mean", "max/mean expert load of a layer (1 = balanced)"),
            ("rank_max_mean", "max/mean rank load of a layer (1 = balanced)"))}
        for row in s.get("balance", []):
            for k in ("expert_balancedness", "rank_balancedness"):
                fams[k].add_metric([str(row["layer"])], row[k])
        for row in s.get("layers", []):
            for k in ("expert_max_mean", "rank_max_mean"):
                fams[k].add_metric([str(row["layer"])], row[k])
        yield from fams.values()

        # measured by the dispatchers (rows each rank's experts received), when the ranks report it
        rows = s.get("dispatch_rank_rows") or []
        if rows:
            rr = CounterMetricFamily(PREFIX + "dispatch_rank_rows", "rows the experts of each rank received, per "
                                     "layer (measured at dispatch)", labels=["layer", "rank"])
            db = g("dispatch_rank_balancedness", "mean/max of the rows each rank's experts received, in (0, 1]",
                   ["layer"])
            for l, row in enumerate(rows):
                if any(row):
                    for r, n in enumerate(row):
                        rr.add_metric([str(l), str(r)], n)
                    db.add_metric([str(l)], (sum(row) / len(row)) / max(row))
            yield rr
            yield db

        moe_layers = {row["layer"] for row in s.get("layers", [])}
        for key, vals in (s.get("routing") or {}).items():
            if key not in ROUTING_FAMILIES:
                continue
            name, doc = ROUTING_FAMILIES[key]
            f = g(name, doc, ["layer"])
            for l, v in enumerate(vals):
                if _finite(v) and (not moe_layers or l in moe_layers):
                    f.add_metric([str(l)], v)
            yield f

        in_flight = self._in_flight() if self._in_flight is not None else s.get("in_flight", 0)
        for name, doc, v in (
                ("queue_depth", "requests admitted but not running (router in transit + waiting on ranks)",
                 max(in_flight - s["running"], s["waiting"])),
                ("requests_in_flight", "requests in flight in the router", in_flight),
                ("sequences_running", "sequences running over all ranks", s["running"]),
                ("sequences_waiting", "sequences waiting over all ranks", s["waiting"]),
                ("kv_blocks_used", "KV blocks in use over all ranks", s["kv_blocks_total"] - s["kv_blocks_free"]),
                ("kv_blocks_free", "free KV blocks over all ranks", s["kv_blocks_free"]),
                ("kv_blocks_total", "KV blocks over all ranks", s["kv_blocks_total"]),
                ("ranks_failed", "ranks reporting a failure", sum(1 for r in s.get("ranks", []) if r.get("failed"))),
                ("expert_bytes", "routed expert weights held over all ranks, replicas included (bytes)",
                 s.get("expert_bytes", 0)),
                ("redundant_expert_bytes", "routed expert weights beyond one copy of each expert: the memory cost "
                 "of --redundant-experts / EPLB replicas (bytes)", s.get("redundant_expert_bytes", 0))):
            f = g(name, doc)
            f.add_metric([], v)
            yield f
        for name, doc in (("prefix_cache_queries", "prompt tokens looked up in the prefix cache (tokens)"),
                          ("prefix_cache_hits", "prompt tokens found in the prefix cache (tokens)"),
                          ("prefix_routed", "requests routed to the rank with their longest cached prefix")):
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], s.get(name, 0))
            yield c


class RequestObserver:
    """Times the outputs of one group of request streams (one HTTP request) into `Metrics`' histograms and
    counts their tokens under `frontend`.

    Args:
        metrics: the app's Metrics. t0: per stream, its submit time (`time.perf_counter()` seconds).
        frontend: "http" or "grpc".
    """

    def __init__(self, metrics: "Metrics", t0: list[float], clock: Callable[[], float] = time.perf_counter,
                 frontend: str = "http"):
        self.m, self.t0, self.clock = metrics, list(t0), clock
        self.last: list[float | None] = [None] * len(t0)
        self.generated = metrics.generated_tokens.labels(frontend)

    def observe(self, i: int, token_ids, finish_reason: str | None) -> None:
        """One output of stream i: `token_ids` new tokens, `finish_reason` None until its last output."""
        now = self.clock()
        k = len(token_ids)
        if k:
            if self.last[i] is None:
                self.m.ttft.observe(now - self.t0[i])
            else:
                gap = (now - self.last[i]) / k
                for _ in range(k):
                    self.m.itl.observe(gap)
            self.last[i] = now
            self.generated.inc(k)
        if finish_reason is not None and finish_reason != "error":
            self.m.e2e.observe(now - self.t0[i])


class Metrics:
    """Prometheus metrics of one app, in its own registry (so several apps can live in one process).

    `refresh(stats)` takes a `Router.stats()` snapshot (cluster families, see the module docstring);
    `observer(t0s, frontend)` times one request's streams. `router` (optional): its live `in_flight` is exported.
    The request counters take the front door as their first label: `requests.labels(frontend, endpoint, code)`,
    `rejections.labels(frontend, reason)`, `prompt_tokens.labels(frontend)`, `generated_tokens.labels(frontend)`.
    """

    def __init__(self, router=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "requests by front door, endpoint and status code",
                                ["frontend", "endpoint", "code"], registry=r)
        self.rejections = Counter(PREFIX + "rejections", "requests refused before generation, by front door and "
                                  "reason", ["frontend", "reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of admitted requests, by front door",
                                     ["frontend"], registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "tokens generated, by front door", ["frontend"],
                                        registry=r)
        for frontend in FRONTENDS:  # both series exist (at 0) from the start
            self.prompt_tokens.labels(frontend)
            self.generated_tokens.labels(frontend)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time to first token (s)", registry=r,
                              buckets=TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "time between consecutive tokens of a "
                             "request (s)", registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "submit to last output of a request (s)",
                             registry=r, buckets=E2E_BUCKETS)
        self.cluster = ClusterCollector((lambda: router.in_flight) if router is not None else None)
        r.register(self.cluster)

    def refresh(self, stats: dict) -> None:
        """Take a cluster stats snapshot (`Router.stats()`: `cluster.metrics.aggregate_stats` + in_flight)."""
        self.cluster.update(stats)

    def observer(self, t0: list[float], frontend: str = "http") -> RequestObserver:
        return RequestObserver(self, t0, frontend=frontend)
