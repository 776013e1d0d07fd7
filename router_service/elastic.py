"""The router's side of elastic EP: one rank lost, the survivors go on serving (redundant experts only).

With `ClusterConfig.redundant_experts` every routed expert lives on >= 2 ranks, so when one rank's channel reports
it dead or failed, the router (1) ends that rank's in-flight requests with a retriable error (HTTP 503 +
Retry-After / gRPC UNAVAILABLE), (2) refuses new requests with a retriable error for the short regroup, (3) has
the launcher form a new group over the survivors (`EPCluster.shrink`: no actor restarted, the survivors' sequences
and KV caches kept), (4) renumbers the survivors' streams, load accounting and channels, and serves again. The
survivors' streams stall for the regroup and lose no token. When the regroup fails, or a second failure arrives
meanwhile, the router falls back to the whole-group rebuild (`router_service.router`).

Aborts meanwhile (a client cancels or disconnects): the launcher renumbers its rank list before the router renumbers
its streams, so a stream's rank index means nothing during a regroup or a replacement's switch. `Router.abort`
defers them (`abort_pending`) while the router is recovering, and `resend_aborts` sends them once the streams are
renumbered; the survivors' streams make no step meanwhile, so the deferral costs no token.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("moeray.router")

# a replacement not placed in time (no room off the lost node, e.g. STRICT_SPREAD with no spare node) is tried again
# after this many seconds, doubling up to the second figure, for as long as the smaller group is the current one
REJOIN_RETRY_S = (10.0, 60.0)


def try_shrink(router, gen: int, rank: int, reason: str, detail: str) -> bool:
    """First report of rank `rank`'s loss in generation `gen`: start the elastic path and return True, or return
    False when it does not apply (no redundant experts, one rank left, a regroup already under way: the caller
    rebuilds the whole group). A stale report (older generation, router closed) returns True: nothing to do."""
    with router._lock:
        if gen != router._gen or router._closed:
            return True
        if not (router.cfg.redundant_experts and router.cluster is not None and len(router.cluster.ranks) >= 2
                and router._recovering is None):
            return False
        router._recovering = f"{reason}; the surviving ranks are forming a new group"
        router._recovering_since = t0 = time.monotonic()
    log.error("%s: failing its requests, the survivors regroup (%s)", reason, detail or reason)
    n = router._fail_rank(rank, f"{reason}; its requests end, the other ranks go on serving: retry the request")
    threading.Thread(target=_shrink, args=(router, gen, rank, reason, n, t0), daemon=True,
                     name="ep-shrink").start()
    return True


def _shrink(router, gen: int, rank: int, reason: str, failed: int, t0: float) -> None:
    try:
        # silent (no frame, no health answer) rather than gone: its node may be lost (`EPCluster.prepare_grow`)
        info = router.cluster.shrink(rank, silent=rank in router._channels.silent)
    except Exception as e:  # noqa: BLE001 - the survivors could not regroup: rebuild the whole group
        log.error("elastic regroup after %s failed (%s: %s): rebuilding the whole group", reason, type(e).__name__, e)
        with router._lock:
            if gen != router._gen:
                return
            router._recovering = None
        router._on_rank_failure(gen, f"{reason}; the surviving ranks could not regroup", f"{type(e).__name__}: {e}")
        return
    with router._lock:
        if gen != router._gen or router._closed:  # a whole-group rebuild took over meanwhile
            return
        for s in router._streams.values():
            if s.rank > rank:
                s.rank -= 1
        router._ranks.drop(rank)
        # only now: until the survivors are renumbered the channels keep the old indices (the lost rank's
        # connection is gone, so control frames take the actor calls meanwhile)
        router._channels.drop(rank)
        router._recovering = None
        pending = _pending_aborts(router)
        router.recoveries.append({"reason": reason, "failed_requests": failed, "attempts": 1, "elastic": True,
                                  "down_s": time.monotonic() - t0, "generation": router.cluster.generation,
                                  "world_size": info["world_size"], "regroup_s": info["regroup_s"]})
    log.warning("serving again on %d ranks after %.2f s (elastic)", info["world_size"], time.monotonic() - t0)
    resend_aborts(router, pending)
    rejoin(router, gen)


def rejoin(router, gen: int) -> dict | None:
    """A replacement for the lost rank: started and loaded while the survivors serve (`EPCluster.prepare_grow`),
    then switched in between steps (`finish_grow`: new requests refused with a retriable error meanwhile), the
    streams, load accounting and channels renumbered. Returns the launcher's report (+ `rejoin_s`, seconds from
    the start to serving on the whole group), or None when it could not (logged; the smaller group keeps serving,
    or a failed switch rebuilds the whole group). A replacement not placed or loaded in time (TimeoutError) is
    tried again after `REJOIN_RETRY_S` (a node may join later) while generation `gen` lasts."""
    t0, pause = time.monotonic(), REJOIN_RETRY_S[0]
    while True:
        try:
            prepared = router.cluster.prepare_grow()
            break
        except Exception as e:  # noqa: BLE001 - no replacement now: the survivors go on alone
            again = isinstance(e, TimeoutError)
            log.error("no replacement rank (%s: %s): serving on %d ranks%s", type(e).__name__, e,
                      len(router.cluster.ranks), f"; trying again in {pause:.0f} s" if again else "")
            if not again or not _wait_in_generation(router, gen, pause):
                return None
            pause = min(2 * pause, REJOIN_RETRY_S[1])
    with router._lock:
        if gen != router._gen or router._closed or router._recovering is not None:
            router.cluster.abandon_grow(prepared)  # its actor killed, its own placement group (if any) removed
            return None
        router._recovering = "a replacement rank is joining the EP group"
        router._recovering_since = time.monotonic()
    try:
        info = router.cluster.finish_grow(prepared)
    except Exception as e:  # noqa: BLE001 - the group is in an unknown state: rebuild it whole
        with router._lock:
            router._recovering = None
        router._on_rank_failure(gen, "a replacement rank could not join", f"{type(e).__name__}: {e}")
        return None
    with router._lock:
        if gen != router._gen or router._closed:
            return None
        b = info["rank"]
        for s in router._streams.values():
            if s.rank >= b:
                s.rank += 1
        router._ranks.insert(b)
        router._channels.add(b, router.cluster.ranks[b])
        router._recovering = None
        pending = _pending_aborts(router)
        info["rejoin_s"] = time.monotonic() - t0
        router.rejoins.append(info)
        seq = next(router._seq)
    router._wake_others(None, seq)  # the new rank has seen no wake yet: all agree on this one
    resend_aborts(router, pending)
    log.warning("serving on the whole group again (%d ranks), %.2f s after the replacement started",
                info["world_size"], info["rejoin_s"])
    return info


def _wait_in_generation(router, gen: int, seconds: float) -> bool:
    """Sleep `seconds`; False as soon as generation `gen` is over (a rebuild, a regroup) or the router closes."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if gen != router._gen or router._closed:
            return False
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return gen == router._gen and not router._closed


def _pending_aborts(router) -> list[str]:
    """Under `router._lock`, once the streams are renumbered: the requests whose abort was deferred."""
    return [rid for rid, s in router._streams.items() if s.abort_pending and s.admitted]


def resend_aborts(router, request_ids: list[str]) -> None:
    """Abort on their (renumbered) ranks the requests `Router.abort` deferred during a regroup or a switch; ones
    finished meanwhile are skipped (`Router.abort` finds nothing)."""
    for rid in request_ids:
        router.abort(rid)
