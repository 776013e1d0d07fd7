"""`moeray top`: a live terminal view of a running cluster's Prometheus metrics.

    moeray top --url http://host:8000            # refresh every 2 s until Ctrl-C
    moeray top --url http://host:8000 --once     # one snapshot, then exit
    moeray top --file metrics.txt --once         # a saved /metrics text

polls GET <url>/metrics (families in `router_service.metrics`), parses it with prometheus_client's text
parser and prints: the cluster line (queue depth, running / waiting sequences, requests in flight, KV blocks
used / free, failed ranks, generated tokens per second between two polls), the latency quantiles of TTFT,
inter-token latency and end-to-end latency (estimated from the histogram buckets by linear interpolation,
as Prometheus' histogram_quantile does; ms), and one row per MoE layer: routed (token, expert)
assignments, balancedness (mean/max) across experts and across ranks, thrash rate, expert-cache hit rate
and prefetch recall ("-" where the cluster does not report them).
"""
from __future__ import annotations

import math
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

P = "moeray_"
QUANTILES = (0.5, 0.9, 0.99)
HISTOGRAMS = (("TTFT", "time_to_first_token_seconds"), ("ITL", "inter_token_latency_seconds"),
              ("E2E", "e2e_request_latency_seconds"))
LAYER_GAUGES = ("expert_balancedness", "rank_balancedness", "thrash_rate", "expert_cache_hit_rate", "prefetch_recall")
CLUSTER_GAUGES = ("queue_depth", "sequences_running", "sequences_waiting", "requests_in_flight", "kv_blocks_used",
                  "kv_blocks_free", "kv_blocks_total", "ranks_failed")


def add_parser(sub) -> None:
    from moeray.cli import HelpFormatter

    p = sub.add_parser("top", help="live view of a running cluster's metrics (GET /metrics)",
                       formatter_class=HelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (its /metrics is polled)")
    p.add_argument("--file", default=None, help="read this saved metrics text instead of --url")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout per poll (s)")
    p.set_defaults(func=cmd_top)


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class Snapshot:
    """What `moeray top` shows, parsed from one metrics text.

    cluster: gauge name (no prefix) -> value. layers: layer -> {tokens, expert_balancedness, ...}.
    latency: "TTFT" / "ITL" / "E2E" -> {"count", "mean", 0.5, 0.9, 0.99} (seconds; nan without samples).
    generated_tokens: the counter's value (nan if absent). t: time.monotonic() of the parse.
    """

    cluster: dict[str, float] = field(default_factory=dict)
    layers: dict[int, dict[str, float]] = field(default_factory=dict)
    latency: dict[str, dict] = field(default_factory=dict)
    generated_tokens: float = math.nan
    t: float = 0.0


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Quantile q in [0, 1] of a Prometheus histogram from its cumulative buckets [(le, count)], by linear
    interpolation inside the bucket that holds it (the lower edge of the first bucket is 0). nan without
    samples; the largest finite bound when the quantile falls into +Inf.

    Raises:
        ValueError: q outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q} must be in [0, 1]")
    bs = sorted(buckets)
    if not bs or bs[-1][1] <= 0:
        return math.nan
    rank = q * bs[-1][1]
    lo_le, lo_n = 0.0, 0.0
    for le, n in bs:
        if n >= rank:
            if math.isinf(le):
                return lo_le
            if n == lo_n:
                return le
            return lo_le + (le - lo_le) * (rank - lo_n) / (n - lo_n)
        lo_le, lo_n = le, n
    return lo_le


def parse_metrics(text: str) -> Snapshot:
    """A `Snapshot` of one Prometheus exposition text (unknown families are ignored)."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot(t=time.monotonic())
    buckets: dict[str, list] = defaultdict(list)
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name[len(P):] if s.name.startswith(P) else None
            if name is None:
                continue
            if name == "expert_tokens_total":
                row = snap.layers.setdefault(int(s.labels["layer"]), {})
                row["tokens"] = row.get("tokens", 0.0) + s.value
            elif name in LAYER_GAUGES and "layer" in s.labels:
                snap.layers.setdefault(int(s.labels["layer"]), {})[name] = s.value
            elif name in CLUSTER_GAUGES:
                snap.cluster[name] = s.value
            elif name == "generated_tokens_total":  # one sample per front door
                snap.generated_tokens = (0.0 if math.isnan(snap.generated_tokens) else snap.generated_tokens) + s.value
            else:
                for _, h in HISTOGRAMS:
                    if name == h + "_bucket":
                        buckets[h].append((float(s.labels["le"]), s.value))
                    elif name == h + "_sum":
                        sums[h] = s.value
                    elif name == h + "_count":
                        counts[h] = s.value
    for label, h in HISTOGRAMS:
        n = counts.get(h, 0.0)
        d = {"count": n, "mean": sums.get(h, 0.0) / n if n else math.nan}
        for q in QUANTILES:
            d[q] = histogram_quantile(q, buckets.get(h, []))
        snap.latency[label] = d
    return snap


# ------------------------------------------------------------------------------------------------ rendering
def _f(v, fmt: str = "{:.3f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def render(snap: Snapshot, prev: Snapshot | None = None, source: str = "") -> str:
    """The text screen of one snapshot (tokens/s from the generated-token counter against `prev`)."""
    c = snap.cluster
    rate = math.nan
    if prev is not None and snap.t > prev.t and not math.isnan(prev.generated_tokens):
        rate = (snap.generated_tokens - prev.generated_tokens) / (snap.t - prev.t)
    out = [f"moeray top  {source}  {time.strftime('%H:%M:%S')}",
           "queue {} | running {} | waiting {} | in flight {} | KV blocks used {} free {} / {} | failed ranks {} "
           "| gen tok/s {}".format(*(_f(c.get(k), "{:.0f}") for k in CLUSTER_GAUGES), _f(rate, "{:.1f}")),
           "",
           "latency (ms) |  count |   mean |    p50 |    p90 |    p99",
           "-------------|--------|--------|--------|--------|-------"]
    for label, _ in HISTOGRAMS:
        d = snap.latency.get(label) or {"count": 0.0, "mean": math.nan, **{q: math.nan for q in QUANTILES}}
        ms = [_f(d[k] * 1000 if not math.isnan(d[k]) else math.nan, "{:6.1f}") for k in ("mean", *QUANTILES)]
        out.append(f"{label:<12} | {d['count']:6.0f} | " + " | ".join(ms))
    out += ["", "layer |     tokens | bal experts | bal ranks | thrash | hit rate | recall",
            "------|------------|-------------|-----------|--------|----------|-------"]
    for l in sorted(snap.layers):
        r = snap.layers[l]
        out.append(f"{l:5d} | {_f(r.get('tokens'), '{:10.0f}')} | {_f(r.get('expert_balancedness')):>11} | "
                   f"{_f(r.get('rank_balancedness')):>9} | {_f(r.get('thrash_rate')):>6} | "
                   f"{_f(r.get('expert_cache_hit_rate')):>8} | {_f(r.get('prefetch_recall')):>6}")
    if not snap.layers:
        out.append("  (no routed tokens yet)")
    return "\n".join(out)


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(metrics_url(url), timeout=timeout) as r:  # noqa: S310 - the user's own server
        return r.read().decode("utf-8")


def cmd_top(a) -> int:
    if a.interval <= 0:
        print(f"moeray: error: --interval={a.interval} must be > 0", file=sys.stderr)
        return 2
    source = a.file or metrics_url(a.url)
    prev = None
    live = not a.once and sys.stdout.isatty()
    try:
        while True:
            try:
                if a.file:
                    with open(a.file, encoding="utf-8") as f:
                        text = f.read()
                else:
                    text = fetch(a.url, a.timeout)
            except OSError as e:
                print(f"moeray: error: cannot read {source}: {e}", file=sys.stderr)
                if a.once:
                    return 1
                time.sleep(a.interval)
                continue
            snap = parse_metrics(text)
            screen = render(snap, prev, source)
            print(("\x1b[H\x1b[2J" if live else "") + screen + ("" if live else "\n"), flush=True)
            if a.once:
                return 0
            prev = snap
            time.sleep(a.interval)
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C, or piped into `head`
        return 0
