"""The router's whole-group build and rebuild loop, in a background thread (`Router`'s "starting" / "recovering").

The first build makes the EP group (`EPCluster(cfg)`); a rebuild after a rank failure tears it down and brings up a
new one (`EPCluster.restart`). Failed attempts are retried with a growing pause (2 s per attempt, at most 10 s),
except what no attempt can fix on a first build (a bad configuration, a placement timeout: `health()` "failed").
Meanwhile the router refuses requests with a retriable error, and `health()` names what the group waits on now
(`GroupRebuild.on_stage`: the launcher's current stage, or the last failed attempt), not only what started it.
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


class GroupRebuild:
    """The build / rebuild loop of `router_service.router.Router` (a mixin: it runs on the router's state, as
    `cluster.elastic_group.ElasticGroup` does on `EPCluster`'s). Reads and sets the router's `cluster`, `_closed`,
    `_lock`, `_start_error`, `_recovering`, `_blocker`, `recoveries`, `_channels`; calls `_start_pollers`."""

    def on_stage(self, what: str) -> None:
        """What the EP group's build or rebuild waits on now (the launcher's stages, a failed attempt): `health()`
        names it beside what started the outage. Called from the build thread."""
        with self._lock:
            self._blocker = what

    def _rebuild(self, make_cluster, reason: str, failed: int, t0: float) -> None:
        """Build (`cluster` None: `make_cluster(cfg, on_stage=...)`) or rebuild (`cluster.restart`) the EP group
        until it is up or the router closes, then start the new generation's pollers. `reason`: what started it;
        `failed`: the requests it ended; `t0`: when (time.monotonic())."""
        attempt, first = 0, self.cluster is None
        while not self._closed:
            attempt += 1
            try:
                if first:
                    cluster = make_cluster(self.cfg, on_stage=self.on_stage)
                    with self._lock:
                        self.cluster = cluster
                        if self._closed:  # closed while it was being built
                            break
                else:  # the old generation's silent ranks are not asked again
                    self.cluster.restart(silent=self._channels.silent, on_stage=self.on_stage)
                break
            except (ValueError, PlacementTimeoutError) as e:  # no attempt can place it: say so, stop trying
                if not first:
                    raise
                log.error("EP group cannot be built: %s", e)
                with self._lock:
                    self._start_error = f"the EP group cannot be built: {e}"
                return
            except Exception as e:  # noqa: BLE001 - keep trying: the alternative is a manual restart
                log.error("EP group %s attempt %d failed: %s: %s", "build" if first else "rebuild", attempt,
                          type(e).__name__, e)
                pause = min(2.0 * attempt, 10.0)
                self.on_stage(attempt_failed(attempt, e, pause))
                time.sleep(pause)
        with self._lock:
            if self._closed:
                return
            self._recovering = self._blocker = None
            if not first:
                self.recoveries.append({"reason": reason, "failed_requests": failed, "attempts": attempt,
                                        "down_s": time.monotonic() - t0, "generation": self.cluster.generation})
            self._start_pollers()
        log.warning("EP group %s after %.1f s (attempts: %d)", "up" if first else "up again", time.monotonic() - t0,
                    attempt)
