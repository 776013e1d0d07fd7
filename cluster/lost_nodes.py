"""Which nodes of a failed EP group are lost, before Ray says so, and a placement group that avoids them.

A node that is lost without a reset (power cut, network partition) stays "alive" for Ray until its GCS health
checks fail: `health_check_failure_threshold` checks, each `health_check_period_ms` apart with
`health_check_timeout_ms` to answer (5, 3 s, 10 s by default: about a minute). Meanwhile Ray keeps the old
placement group's bundles on that node, and a rebuilt group's rank started there never comes up. So a rebuild
(`EPCluster.restart`) first asks every old rank a trivial call (`health`) with a short deadline, NODE_PROBE_S:
an actor whose process is gone answers at once with an error (Ray knows: its raylet or its node reported it),
a live one answers in milliseconds (the call runs on an actor thread of its own, beside a step thread that may
be blocked in a collective), and one that gives no answer at all sits on a node that is silent. Those nodes are
suspects: the rebuilt placement group excludes them by Ray's node-id label (`avoid_selector`), so SPREAD packs
the ranks onto the survivors at once; STRICT_SPREAD then waits for a replacement node (it cannot pack).

A node suspected by mistake (a rank too overloaded to answer within NODE_PROBE_S) only costs that placement
group the node; the next one a rebuild makes without suspects may use it again.
"""
from __future__ import annotations

import logging

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group_table

log = logging.getLogger("moeray.cluster")

# seconds an old rank has to answer `health` after its group failed before its node counts as lost
NODE_PROBE_S = 2.0


def unanswered(ranks: list, timeout_s: float = NODE_PROBE_S) -> list[int]:
    """Indices of the rank actors in `ranks` that gave no answer to `health` within `timeout_s` seconds (all
    asked at once). An actor that answers, even with an error (dead, failed), is not in the list."""
    refs = [r.health.remote() for r in ranks]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    return [i for i, ref in enumerate(refs) if ref not in done]


def nodes_of(pg, bundles: list[int]) -> set[str]:
    """Node ids (hex) that placement group `pg` put `bundles` (bundle indices) on; a bundle not placed (Ray
    is rescheduling it) is left out."""
    where = placement_group_table(pg).get("bundles_to_node_id", {})
    return {where[b] for b in bundles if where.get(b)}


def avoid_selector(node_ids: set[str], n_bundles: int) -> list[dict[str, str]] | None:
    """`placement_group(bundle_label_selector=...)` keeping every one of `n_bundles` bundles off `node_ids`
    (None when there is nothing to avoid)."""
    if not node_ids:
        return None
    sel = ",".join(sorted(node_ids))
    return [{NODE_ID_LABEL_KEY: f"!in({sel})"} for _ in range(n_bundles)]


def silent_nodes(pg, ranks: list, bundles: list[int], timeout_s: float = NODE_PROBE_S) -> set[str]:
    """The nodes of the ranks that do not answer within `timeout_s` (`unanswered`), by node id; `bundles[i]` is
    rank i's bundle in `pg`. Logs what it finds."""
    quiet = unanswered(ranks, timeout_s)
    if not quiet:
        return set()
    nodes = nodes_of(pg, [bundles[i] for i in quiet])
    log.warning("ranks %s gave no answer within %.1f s: their nodes %s count as lost (the rebuilt group avoids "
                "them)", quiet, timeout_s, sorted(n[:12] for n in nodes))
    return nodes
