"""Autoscaling of the `MoerayServer` Ray Serve deployment (one replica = one expert-parallel cluster) from
three signals: queue depth, inter-token latency (ITL) p95 against a target, and rank balancedness.

Signals (each replica reports them through Serve's `record_autoscaling_stats` hook, see `ReplicaSignals`;
Serve averages each over `look_back_period_s` per replica):
  `moeray_requests_in_flight` queue depth in Serve's sense (its default policy's "replica queue length"):
                              requests in flight in the replica's router, running or waiting on a rank.
  `moeray_itl_p95_ms`         p95 of the gaps between consecutive tokens of in-flight requests emitted in
                              the last `window_s` seconds (ms; 0 = no two tokens in the window).
  `moeray_rank_balancedness`  sum_l mean_r(load[l][r]) / sum_l max_r(load[l][r]) over the (token, expert)
                              assignments of the last interval, in (0, 1]; 1 = perfectly balanced.

The rule (`desired_replicas`; n = running replicas, one decision per Serve control-loop tick):
  Q = max(sum_r in_flight_r, Serve's total_num_requests)     # the latter also counts requests queued at handles
  B = mean_r balancedness_r                                  # 1.0 when no replica reported it
  L = max_r itl_p95_ms_r                                     # the worst replica's p95; 0 when none reported
  by_queue   = Q / (target_queue_depth * B)
  by_latency = n * L / itl_target_ms   if L > itl_target_ms   else 0
  desired    = ceil(max(by_queue, by_latency))
  if desired < n and L > downscale_itl_fraction * itl_target_ms:  desired = n   # no downscale near the target
  desired    = clamp(desired, min_replicas, max_replicas)
`by_queue` is Ray Serve's default rule (ongoing requests over `target_ongoing_requests` per replica) with the
target derated by balancedness: ranks run in lockstep and every layer's all-to-all waits for the most loaded
rank, so a step costs sum_l max_r(load) instead of sum_l mean_r(load) and a replica at balancedness B serves
about B of its balanced throughput (the load-imbalance cost that auxiliary-loss-free balancing and EPLB
address, DeepSeek-V3 technical report, arXiv:2412.19437, section 3.4). `by_latency` scales in proportion to
the latency excess, so an ITL over target asks for at least one more replica.

Delays (`step`): a change takes effect once the same direction (up or down) has been wanted on every tick for
`upscale_delay_s` (resp. `downscale_delay_s`) since the first such tick; a tick that wants no change, or the
other direction, restarts the clock. This is Ray Serve's own delay rule (`_apply_delay_logic` in
ray/serve/autoscaling_policy.py). Under Serve (2.60) every custom policy is wrapped in that rule and in the
min/max bounds, so the Serve hook `MoerayAutoscalingPolicy` returns the undelayed `desired_replicas` and
the delays are the deployment's `upscale_delay_s` / `downscale_delay_s`; `step` applies the same rule
outside Serve (simulations, tests) so both agree tick for tick.

This module imports only the standard library: Serve pickles it by value into the controller.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

IN_FLIGHT = "moeray_requests_in_flight"
ITL_P95_MS = "moeray_itl_p95_ms"
BALANCEDNESS = "moeray_rank_balancedness"
STATE_KEY = "moeray"  # our part of Serve's policy_state (the rest belongs to Serve's delay logic)

_EPS = 1e-9  # 2.0000000001 replicas' worth of load is 2 replicas, not 3 (float sums of averaged metrics)


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """Parameters of the rule (see the module docstring).

    Args:
        min_replicas, max_replicas: bounds of the replica count (EP clusters).
        target_queue_depth: requests in flight per replica at which a balanced replica is full
            (Serve's `target_ongoing_requests`).
        itl_target_ms: inter-token latency p95 target (ms).
        downscale_itl_fraction: no downscale while the ITL p95 is above this fraction of the target.
        upscale_delay_s, downscale_delay_s: how long (s) a direction must persist before it is applied.
    Raises:
        ValueError: a bound, target or delay out of range (names the field and the value).
    """

    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_depth: float = 64.0
    itl_target_ms: float = 100.0
    downscale_itl_fraction: float = 0.7
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0

    def __post_init__(self):
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas={self.min_replicas} must be >= 0")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas={self.max_replicas} must be >= max(1, min_replicas={self.min_replicas})")
        if not self.target_queue_depth > 0:
            raise ValueError(f"target_queue_depth={self.target_queue_depth} must be > 0")
        if not self.itl_target_ms > 0:
            raise ValueError(f"itl_target_ms={self.itl_target_ms} must be > 0 (ms)")
        if not 0 < self.downscale_itl_fraction <= 1:
            raise ValueError(f"downscale_itl_fraction={self.downscale_itl_fraction} must be in (0, 1]")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (s)")


@dataclass(kw_only=True, slots=True)
class Signals:
    """The deployment-wide inputs of one decision.

    Args:
        queue_depth: requests in flight over all replicas (plus those queued at Serve handles).
        itl_p95_ms: worst replica's inter-token latency p95 (ms); 0 = unknown / no decoding.
        balancedness: mean rank balancedness in (0, 1]; 1 = balanced or unknown.
    Raises:
        ValueError: negative queue depth or latency, balancedness outside (0, 1].
    """

    queue_depth: float
    itl_p95_ms: float = 0.0
    balancedness: float = 1.0

    def __post_init__(self):
        if self.queue_depth < 0:
            raise ValueError(f"queue_depth={self.queue_depth} must be >= 0")
        if self.itl_p95_ms < 0:
            raise ValueError(f"itl_p95_ms={self.itl_p95_ms} must be >= 0 (ms)")
        if not 0 < self.balancedness <= 1:
            raise ValueError(f"balancedness={self.balancedness} must be in (0, 1]")


def desired_replicas(sig: Signals, current: int, cfg: PolicyConfig) -> int:
    """The undelayed replica count for `sig` with `current` replicas running (the rule in the module
    docstring), clamped to [cfg.min_replicas, cfg.max_replicas]."""
    by_queue = sig.queue_depth / (cfg.target_queue_depth * sig.balancedness)
    over = sig.itl_p95_ms > cfg.itl_target_ms
    by_latency = max(current, 1) * sig.itl_p95_ms / cfg.itl_target_ms if over else 0.0
    want = math.ceil(max(by_queue, by_latency) - _EPS)
    if want < current and sig.itl_p95_ms > cfg.downscale_itl_fraction * cfg.itl_target_ms:
        want = current
    return max(cfg.min_replicas, min(cfg.max_replicas, want))


def step(sig: Signals, current: int, target: int, now: float, state: dict[str, Any] | None,
         cfg: PolicyConfig) -> tuple[int, dict[str, Any]]:
    """One tick of the policy with delays, outside Serve.

    Args:
        current: replicas running. target: the replica count last decided (what the delays compare to).
        now: time of this tick (s, any monotonic clock). state: the dict this function returned last
            tick (None or {} at first).
    Returns:
        (replica count to aim for, new state). The count moves to `desired_replicas` only once its
        direction has persisted for the delay; otherwise it stays `target` (clamped to the bounds).
    """
    st = dict(state or {})
    want = desired_replicas(sig, current, cfg)
    direction = (want > target) - (want < target)
    if direction == 0:
        st["direction"], st["since"] = 0, None
        return max(cfg.min_replicas, min(cfg.max_replicas, target)), st
    if st.get("direction") != direction or st.get("since") is None:
        st["direction"], st["since"] = direction, now
    delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
    if now - st["since"] + 1e-6 >= delay:
        st["direction"], st["since"] = 0, None
        return want, st
    return max(cfg.min_replicas, min(cfg.max_replicas, target)), st


# ---------------------------------------------------------------------------------------------- Serve hook
def signals_from_context(ctx) -> Signals:
    """`Signals` from a Serve `AutoscalingContext`: the replicas' custom metrics (averaged by Serve over
    `look_back_period_s`) where reported, else Serve's own request count (`total_num_requests`)."""
    m = ctx.aggregated_metrics or {}
    queue = sum(m.get(IN_FLIGHT, {}).values())
    total = ctx.total_num_requests or 0.0
    itl = max(m.get(ITL_P95_MS, {}).values(), default=0.0)
    bal = list(m.get(BALANCEDNESS, {}).values())
    b = sum(bal) / len(bal) if bal else 1.0
    return Signals(queue_depth=max(float(queue), float(total), 0.0), itl_p95_ms=max(float(itl), 0.0),
                   balancedness=min(1.0, max(b, 0.05)))  # floor: one bad report must not ask for 20x


class MoerayAutoscalingPolicy:
    """Ray Serve custom autoscaling policy (`autoscaling_config.policy.policy_function:
    router_service.autoscaling:MoerayAutoscalingPolicy`; Serve builds it once with `policy_kwargs` and
    calls it each control-loop tick with an `AutoscalingContext`).

    Args:
        itl_target_ms: ITL p95 target (ms). downscale_itl_fraction: see `PolicyConfig`.
        target_queue_depth: requests in flight per replica; default: the deployment's
            `target_ongoing_requests`.
    Returns (from a call): (undelayed replica count, policy state). Serve applies the bounds and the
        upscale / downscale delays (see the module docstring).
    Raises:
        ValueError: a parameter out of range (at construction, so a bad config fails the deploy).
    """

    def __init__(self, itl_target_ms: float = 100.0, downscale_itl_fraction: float = 0.7,
                 target_queue_depth: float | None = None):
        PolicyConfig(itl_target_ms=itl_target_ms, downscale_itl_fraction=downscale_itl_fraction,  # validates
                     target_queue_depth=1.0 if target_queue_depth is None else target_queue_depth)
        self.itl_target_ms = float(itl_target_ms)
        self.downscale_itl_fraction = float(downscale_itl_fraction)
        self.target_queue_depth = target_queue_depth

    def config(self, ctx) -> PolicyConfig:
        c = ctx.config
        return PolicyConfig(
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=max(1, ctx.capacity_adjusted_max_replicas, ctx.capacity_adjusted_min_replicas),
            target_queue_depth=float(self.target_queue_depth if self.target_queue_depth is not None
                                     else c.get_target_ongoing_requests()),
            itl_target_ms=self.itl_target_ms, downscale_itl_fraction=self.downscale_itl_fraction,
            upscale_delay_s=c.upscale_delay_s, downscale_delay_s=c.downscale_delay_s)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        n = ctx.current_num_replicas
        if n == 0:  # starting (or scaled to zero): Serve's cold-start path owns 0 -> 1
            return ctx.target_num_replicas, {}
        sig = signals_from_context(ctx)
        want = desired_replicas(sig, n, self.config(ctx))
        return want, {STATE_KEY: {"queue_depth": sig.queue_depth, "itl_p95_ms": sig.itl_p95_ms,
                                  "balancedness": sig.balancedness, "desired": want}}


# ---------------------------------------------------------------------------------------------- replica side
def itl_p95_ms(streams: Iterable[tuple[float, list[float]]], now: float, window_s: float) -> float:
    """p95 of inter-token gaps (ms) whose later token came within `window_s` before `now`.

    Args:
        streams: (t0, token_times) per request: `time.perf_counter()` at submit and each token's
            arrival in seconds after t0. A chunk of k tokens (one time repeated k times) after a gap g
            counts k gaps of g / k, as `moeray_inter_token_latency_seconds` does.
        now: `time.perf_counter()` now. window_s: look-back (s).
    Returns:
        the nearest-rank p95 in ms, 0.0 when the window holds no gap.
    """
    gaps = []
    for t0, times in streams:
        prev, i = None, 0
        while i < len(times):
            j = i
            while j < len(times) and times[j] == times[i]:
                j += 1
            if prev is not None and t0 + times[i] >= now - window_s:
                gaps += [(times[i] - prev) / (j - i)] * (j - i)
            prev, i = times[i], j
    if not gaps:
        return 0.0
    gaps.sort()
    return 1000.0 * gaps[min(len(gaps) - 1, math.ceil(0.95 * len(gaps)) - 1)]


def rank_balancedness(rank_load: list[list[float]]) -> float:
    """sum_l mean_r(load) / sum_l max_r(load) of a [layers][ranks] load table, in (0, 1]; 1.0 if empty."""
    num = sum(sum(row) / len(row) for row in rank_load if row)
    den = sum(max(row) for row in rank_load if row)
    return num / den if den > 0 else 1.0


class ReplicaSignals:
    """What one `MoerayServer` replica reports to Serve (`collect`, run off the event loop).

    Balancedness is over the expert-load increments since the previous call (the ranks' counters are
    cumulative), so it follows the current traffic rather than the replica's whole life.

    Args:
        window_s: ITL look-back (s); the replica's calls come every look_back_period_s / 5.
    """

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._prev: list[list[float]] | None = None
        self._balancedness = 1.0

    def _balance(self, rank_load: list[list[float]]) -> float:
        prev = self._prev
        self._prev = [list(r) for r in rank_load]
        if prev is None or len(prev) != len(rank_load):
            delta = rank_load
        else:
            delta = [[c - p for c, p in zip(cur, old)] for cur, old in zip(rank_load, prev)]
        if any(sum(r) for r in delta):  # an idle interval keeps the last value
            self._balancedness = rank_balancedness(delta)
        return self._balancedness

    def collect(self, router) -> dict[str, float]:
        """{IN_FLIGHT, ITL_P95_MS, BALANCEDNESS} of `router` (a `router_service.router.Router`). A failed
        rank-stats call keeps the last balancedness."""
        streams = router.streams()
        depth = len(streams)
        # the tail is enough for the window and bounds the copy (256 streams x 1024 tokens otherwise)
        itl = itl_p95_ms([(s.t0, s.out.token_times[-256:]) for s in streams], time.perf_counter(), self.window_s)
        bal = self._balancedness
        try:
            bal = self._balance(router.stats()["rank_load"])
        except Exception:  # noqa: BLE001 - a slow or failed rank must not stop the other two signals
            pass
        return {IN_FLIGHT: float(depth), ITL_P95_MS: float(itl), BALANCEDNESS: float(bal)}
