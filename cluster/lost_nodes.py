"""Which nodes of a failed EP group are lost, before Ray says so, and a placement group that avoids them.

A node that is lost without a reset (power cut, network partition) stays "alive" for Ray until its GCS health
checks fail: `health_check_failure_threshold` checks, each `health_check_period_ms` apart with
`health_check_timeout_ms` to answer (5, 3 s, 10 s by default: about a minute). Meanwhile Ray keeps the old
placement group's bundles on that node, and a rebuilt group's rank started there never comes up. So a rebuild
(`EPCluster.restart`) first asks every old rank a trivial call (`health`) with a short deadline, NODE_PROBE_S:
an actor whose process is gone answers at once with an error (Ray knows: its raylet or its node reported it),
a live one answers in milliseconds (the call runs on an actor thread of its own, beside a step thread that may
be blocked in a collective), and one that gives no answer at all is hung or sits on a silent node. A node where
no rank answers, while another node is alive, counts as lost (`lost_among`): the rebuilt placement group excludes
it by Ray's node-id label (`avoid_selector`), so SPREAD packs the ranks onto the survivors at once; STRICT_SPREAD
then waits for a replacement node (it cannot pack).

Elastic EP (`cluster.elastic_group`) asks the same question when the router found one rank silent: the survivors
answer, and if none of them shares the silent rank's node, that node counts as lost, and the replacement rank goes
to a placement group of its own off it (`replacement_selector`) instead of the lost rank's bundle, which Ray keeps
on the lost node until its health checks fail.

A node counted lost by mistake (its ranks too overloaded to answer within NODE_PROBE_S, or one stopped rank alone
on a node) only costs the rebuilt placement group (or the replacement) that node; a one-node cluster never excludes
its only node.
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
    refs, ready = _ask(ranks, timeout_s)
    return [i for i, ref in enumerate(refs) if ref not in ready]


def _ask(ranks: list, timeout_s: float) -> tuple[list, set]:
    """`health` asked of every rank at once: (the call refs in rank order, those answered within `timeout_s`)."""
    refs = [r.health.remote() for r in ranks]
    return refs, set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()


def ask_health(ranks: list, timeout_s: float = NODE_PROBE_S) -> list[dict]:
    """Every rank actor's `health` answer, asked at once with one deadline of `timeout_s` seconds (so a health
    probe takes at most that long however many ranks are silent). A rank without an answer by then gets
    `{rank, ok: False, error}` saying so (busy, hung, or on a lost node); one whose call failed, the error."""
    refs, ready = _ask(ranks, timeout_s)
    out = []
    for i, ref in enumerate(refs):
        if ref not in ready:
            out.append({"rank": i, "ok": False, "error": f"rank {i} gave no answer within {timeout_s:g} s "
                        "(busy, hung, or its node lost)"})
            continue
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - a failed rank is an answer: not ok
            out.append({"rank": i, "ok": False, "error": f"{type(e).__name__}: {e}"})
    return out


def avoid_selector(node_ids: set[str], n_bundles: int) -> list[dict[str, str]] | None:
    """`placement_group(bundle_label_selector=...)` keeping every one of `n_bundles` bundles off `node_ids`
    (None when there is nothing to avoid)."""
    if not node_ids:
        return None
    sel = ",".join(sorted(node_ids))
    return [{NODE_ID_LABEL_KEY: f"!in({sel})"} for _ in range(n_bundles)]


def replacement_selector(avoid: set[str], strategy: str, survivor_nodes: set[str]) -> list[dict[str, str]] | None:
    """`bundle_label_selector` of a replacement rank's own one-bundle placement group: off the nodes in `avoid`
    (lost ones), and under STRICT_SPREAD (one rank or node group per node) off the survivors' nodes too, so the
    strategy's promise holds (with no other node it waits, as a STRICT_SPREAD rebuild does). None: no constraint."""
    return avoid_selector(avoid | survivor_nodes if strategy == "STRICT_SPREAD" else avoid, 1)


def lost_among(node_of_rank: list[str | None], quiet: list[int], alive: set[str]) -> set[str]:
    """The nodes that count as lost: every rank on them is in `quiet` (indices into `node_of_rank`, each rank's
    node id or None if unknown), and some node in `alive` (Ray's alive nodes) stays outside them. One hung rank
    beside a rank that answers on the same node is a rank failure, not a node loss; and a verdict that would leave
    no node to place the group on is no verdict (on one node, a hung rank's node is the only one there is)."""
    heard = {n for i, n in enumerate(node_of_rank) if i not in quiet and n}
    lost = {node_of_rank[i] for i in quiet if node_of_rank[i]} - heard
    return lost if alive - lost else set()


def bundle_nodes(pg, bundles: list) -> list[str | None]:
    """The node id of each bundle in `bundles` (None: not placed): an index into `pg`, or a (placement group,
    index) pair for a rank in a group of its own (a replacement, `cluster.elastic_group`). Raises what Ray's
    `placement_group_table` raises (GCS unreachable)."""
    tables: dict = {}
    out = []
    for b in bundles:
        group, index = b if isinstance(b, tuple) else (pg, b)
        key = getattr(group, "id", group)
        if key not in tables:
            tables[key] = placement_group_table(group).get("bundles_to_node_id", {})
        out.append(tables[key].get(index))
    return out


def silent_nodes(pg, ranks: list, bundles: list, timeout_s: float = NODE_PROBE_S,
                 known: frozenset[int] = frozenset()) -> set[str]:
    """The nodes that count as lost (`lost_among`) after asking `ranks` `health` (`unanswered`), by node id;
    `bundles[i]` is rank i's bundle (`bundle_nodes`: an index into `pg`, or a (placement group, index) pair).
    `known`: ranks already found silent (the router's `RankSilent`), not asked again (their entry in `ranks` is not
    used), so the answer comes as soon as the others have answered. Logs what it finds."""
    others = [i for i in range(len(ranks)) if i not in known]
    quiet = sorted(set(known) | {others[j] for j in unanswered([ranks[i] for i in others], timeout_s)})
    if not quiet:
        return set()
    try:
        where = bundle_nodes(pg, bundles)
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception as e:  # noqa: BLE001 - a diagnosis never blocks the rebuild: Ray's own view then decides
        log.warning("ranks %s gave no answer; their nodes are unknown (%s: %s)", quiet, type(e).__name__, e)
        return set()
    nodes = lost_among(where, quiet, alive)
    log.warning("ranks %s gave no answer within %.1f s: %s", quiet, timeout_s,
                f"their nodes {sorted(n[:12] for n in nodes)} count as lost (new bundles avoid them)"
                if nodes else "not a node loss (a rank on the same node answered, or no other node is alive)")
    return nodes
