"""The router's whole-group build and rebuild loop, in a background thread (`Router`'s "starting" / "recovering").

The first build makes the EP group (`EPCluster(cfg)`); a rebuild after a rank failure tears it down and brings up a
new one (`EPCluster.restart`). Failed attempts are retried with a growing pause (2 s per attempt, at most 10 s),
except what no attempt can fix on a first build (a bad configuration, a placement timeout: `health()` "failed").
Meanwhile the router refuses requests with a retriable error, and `health()` names what the group waits on now
(`Router.on_stage`: the launcher's current stage, or the last failed attempt), not only what started it.
"""
from __future__ import annotations

import logging
import time

from cluster.node_groups import PlacementTimeoutError

log = logging.getLogger("moeray.router")


def attempt_failed(attempt: int, exc: BaseException, pause_s: float) -> str:
    """What `health()` says after failed attempt `attempt`, in moeray's words: the exception's own text only for
    the timeouts moeray raises itself (a placement group or the ranks not ready), else its type (Ray's text carries
    actor ids and node addresses: it goes to the log)."""
    why = f"{exc}" if type(exc) in (TimeoutError, PlacementTimeoutError) else type(exc).__name__
    return f"attempt {attempt} failed ({why}); retrying in {pause_s:.0f} s"


def rebuild(router, make_cluster, reason: str, failed: int, t0: float) -> None:
    """Build (router.cluster None: `make_cluster(cfg, on_stage=...)`) or rebuild (`router.cluster.restart`) the EP
    group until it is up or the router closes, then start the new generation's pollers. `reason`: what started it;
    `failed`: the requests it ended; `t0`: when (time.monotonic())."""
    attempt, first = 0, router.cluster is None
    while not router._closed:
        attempt += 1
        try:
            if first:
                cluster = make_cluster(router.cfg, on_stage=router.on_stage)
                with router._lock:
                    router.cluster = cluster
                    if router._closed:  # closed while it was being built
                        break
            else:  # the old generation's silent ranks are not asked again
                router.cluster.restart(silent=router._channels.silent, on_stage=router.on_stage)
            break
        except (ValueError, PlacementTimeoutError) as e:  # no attempt can place it: say so, stop trying
            if not first:
                raise
            log.error("EP group cannot be built: %s", e)
            with router._lock:
                router._start_error = f"the EP group cannot be built: {e}"
            return
        except Exception as e:  # noqa: BLE001 - keep trying: the alternative is a manual restart
            log.error("EP group %s attempt %d failed: %s: %s", "build" if first else "rebuild", attempt,
                      type(e).__name__, e)
            pause = min(2.0 * attempt, 10.0)
            router.on_stage(attempt_failed(attempt, e, pause))
            time.sleep(pause)
    with router._lock:
        if router._closed:
            return
        router._recovering = router._blocker = None
        if not first:
            router.recoveries.append({"reason": reason, "failed_requests": failed, "attempts": attempt,
                                      "down_s": time.monotonic() - t0, "generation": router.cluster.generation})
        router._start_pollers()
    log.warning("EP group %s after %.1f s (attempts: %d)", "up" if first else "up again", time.monotonic() - t0,
                attempt)
