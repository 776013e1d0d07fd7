"""Where an elastic replacement rank goes (`cluster.elastic_group`), with Ray's placement calls faked: the lost
rank's own bundle after a SIGKILL (or a silent rank beside an answering survivor on its node), a one-bundle
placement group of its own off the lost node when the router found the rank silent and no survivor shares its node
(off the survivors' nodes too under STRICT_SPREAD), and every such group removed again: on a failed placement, an
abandoned or failed switch, a second replacement of the same rank, a whole-group rebuild and shutdown. The real
two-node case (node B SIGSTOPped) is `tests/cluster/test_elastic_node_loss.py`."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

import cluster.elastic_group as eg
import cluster.launcher as launcher
from cluster.config import ClusterConfig
from cluster.lost_nodes import bundle_nodes, replacement_selector
from cluster.placement import redundant_placement


class _PG:
    def __init__(self, name, bundles=None, selector=None):
        self.name, self.bundles, self.selector = name, bundles, selector

    def ready(self):
        return ("ready", self.name)

    def __repr__(self):
        return f"PG({self.name})"


class _Actor:
    """A rank actor handle whose calls return None (`ray.get` is faked)."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *a, **k: (self.name, method))


class _Ray:
    """What the module under test calls on Ray: records actor placements, kills, new and removed groups."""

    def __init__(self, monkeypatch, placed: bool = True, lost: set[str] = frozenset(),
                 nodes: dict | None = None):
        self.homes, self.killed, self.made, self.removed, self.asked = [], [], [], [], []
        self.placed, self.lost, self.nodes = placed, set(lost), nodes or {}
        test = self

        class Remote:
            def options(self, scheduling_strategy, **_):
                test.homes.append((scheduling_strategy.placement_group,
                                   scheduling_strategy.placement_group_bundle_index))
                return self

            def remote(self, *a, **k):
                return _Actor(f"new{len(test.homes)}")

        def placement_group(bundles, strategy, bundle_label_selector=None):
            pg = _PG(f"own{len(self.made)}", bundles, bundle_label_selector)
            self.made.append(pg)
            return pg

        def silent_nodes(pg, ranks, bundles, timeout_s=2.0, known=frozenset()):
            self.asked.append((list(ranks), list(bundles), set(known)))
            return set(self.lost)

        monkeypatch.setattr(eg.ray, "remote", lambda cls: Remote())
        def get(x, timeout=None):  # x: a list of calls, or one call (actor name, method)
            return [{}] * len(x) if isinstance(x, list) else ("127.0.0.1", 0) if x[1] == "open_regroup_store" else {}

        monkeypatch.setattr(eg.ray, "get", get)
        monkeypatch.setattr(eg.ray, "wait", lambda refs, timeout=None: (refs, []) if self.placed else ([], refs))
        monkeypatch.setattr(eg.ray, "kill", lambda a, no_restart=True: self.killed.append(a))
        monkeypatch.setattr(eg, "placement_group", placement_group)
        monkeypatch.setattr(eg, "remove_placement_group", self.removed.append)
        monkeypatch.setattr(launcher, "remove_placement_group", self.removed.append)
        monkeypatch.setattr(eg, "silent_nodes", silent_nodes)
        monkeypatch.setattr(eg, "bundle_nodes", lambda pg, bundles: [self.nodes.get(b) for b in bundles])


def _cluster(strategy: str = "SPREAD", ranks: int = 2, lost_slot: int = 1, silent: bool = True):
    """An EPCluster after a `shrink` of `lost_slot` (silent: the router found it silent), built without Ray."""
    cl = launcher.EPCluster.__new__(launcher.EPCluster)
    cl.cfg = ClusterConfig(ranks=ranks, redundant_experts=True, placement_strategy=strategy)
    cl.pg, cl._own, cl._avoid = _PG("group"), {}, set()
    cl.placement = cl._whole_placement = redundant_placement(2, 8, ranks)
    cl.slots = [s for s in range(ranks) if s != lost_slot]
    cl.ranks = [_Actor(f"rank{s}") for s in cl.slots]
    cl.info = [{"rank": i} for i in range(len(cl.slots))]
    cl.generation, cl._load_snaps = 1, deque()
    cl._lost_silently = lost_slot if silent else None
    cl.stats = lambda: {}
    return cl


def test_a_sigkilled_ranks_replacement_goes_back_to_its_own_bundle(monkeypatch):
    fake = _Ray(monkeypatch, lost={"B"})
    cl = _cluster(silent=False)  # the channel saw the actor gone: its node is alive
    prepared = cl.prepare_grow(timeout_s=5)
    assert fake.homes == [(cl.pg, 1)] and prepared["pg"] is None
    assert fake.asked == [] and fake.made == []  # nobody asked, no new group


def test_a_silent_rank_beside_an_answering_survivor_goes_back_to_its_own_bundle(monkeypatch):
    fake = _Ray(monkeypatch, lost=set())  # lost_among: a rank on its node answered, or no other node
    cl = _cluster()
    prepared = cl.prepare_grow(timeout_s=5)
    assert fake.homes == [(cl.pg, 1)] and prepared["pg"] is None and fake.made == []
    survivors, bundles, known = fake.asked[0]
    assert survivors[:1] == cl.ranks and bundles == [0, 1] and known == {1}  # the survivor asked, rank 1 not


def test_a_replacement_for_a_lost_node_gets_a_group_of_its_own_off_it(monkeypatch):
    fake = _Ray(monkeypatch, lost={"B"}, nodes={0: "A"})
    cl = _cluster()
    prepared = cl.prepare_grow(timeout_s=5)
    own = fake.made[0]
    assert own.bundles == [{"CPU": 0.5}] and own.selector == [{"ray.io/node-id": "!in(B)"}]
    assert fake.homes == [(own, 0)] and prepared["pg"] is own and cl._avoid == {"B"}
    out = cl.finish_grow(prepared)
    assert out["world_size"] == 2 and cl.slots == [0, 1] and cl._own == {1: own}
    assert cl.home(1) == (own, 0) and cl.home(0) == (cl.pg, 0) and fake.removed == []
    # the replacement is lost with its node too: a second group of its own, the first one removed at the switch
    cl.slots, cl.ranks, cl._lost_silently = [0], cl.ranks[:1], 1
    fake.lost = {"C"}
    second = cl.prepare_grow(timeout_s=5)
    assert fake.asked[-1][1] == [0, (own, 0)]  # its node is looked up in its own group
    assert fake.made[1].selector == [{"ray.io/node-id": "!in(B,C)"}]
    cl.finish_grow(second)
    assert cl._own == {1: fake.made[1]} and fake.removed == [own]
    # a whole-group rebuild or a shutdown removes it, and the group's placement group
    cl.shutdown(seq=1)
    assert fake.removed == [own, fake.made[1], cl.pg] and cl._own == {}


def test_strict_spread_keeps_the_replacement_off_the_survivors_nodes_too(monkeypatch):
    fake = _Ray(monkeypatch, lost={"B"}, nodes={0: "A"})
    cl = _cluster(strategy="STRICT_SPREAD")
    cl.prepare_grow(timeout_s=5)
    assert fake.made[0].selector == [{"ray.io/node-id": "!in(A,B)"}]


def test_no_room_off_the_lost_node_removes_the_new_group_and_says_why(monkeypatch):
    fake = _Ray(monkeypatch, lost={"B"}, placed=False)
    cl = _cluster()
    with pytest.raises(TimeoutError, match=r"replacement rank within 5s \(placement_strategy=SPREAD\)"):
        cl.prepare_grow(timeout_s=5)
    assert fake.removed == fake.made and len(fake.made) == 1 and fake.homes == []  # no actor started


def test_an_abandoned_or_failed_switch_leaves_no_actor_and_no_group(monkeypatch):
    fake = _Ray(monkeypatch, lost={"B"})
    cl = _cluster()
    prepared = cl.prepare_grow(timeout_s=5)
    cl.abandon_grow(prepared)  # the router rebuilt the whole group meanwhile
    assert fake.killed == [prepared["actor"]] and fake.removed == [prepared["pg"]]
    prepared = cl.prepare_grow(timeout_s=5)

    def fail(x, timeout=None):
        raise TimeoutError("a survivor did not switch")

    monkeypatch.setattr(eg.ray, "get", fail)
    with pytest.raises(TimeoutError):
        cl.finish_grow(prepared)
    assert fake.killed[-1] is prepared["actor"] and fake.removed[-1] is prepared["pg"] and cl._own == {}


def test_a_rebuild_after_a_replacement_off_a_lost_node_makes_the_group_anew(monkeypatch):
    fake = _Ray(monkeypatch, lost={"B"}, nodes={0: "A"})
    cl = _cluster()
    cl.finish_grow(cl.prepare_grow(timeout_s=5))
    own, old = cl._own[1], cl.pg
    made = []
    monkeypatch.setattr(launcher, "silent_nodes", lambda pg, ranks, bundles, known=frozenset(): set())
    monkeypatch.setattr(launcher, "placement_group", lambda b, strategy, bundle_label_selector=None:
                        made.append(_PG("group2", b, bundle_label_selector)) or made[-1])
    monkeypatch.setattr(launcher.ray, "wait", lambda refs, timeout=None: (refs, []))
    cl.model_config = SimpleNamespace(num_experts=8, num_layers=2)
    cl._initial_placement = cl.placement
    cl._spawn = lambda timeout_s: None
    cl.restart(timeout_s=5)
    # its bundle of the old group sits on the lost node: both old groups go, the new one avoids node B
    assert fake.removed == [own, old] and cl._own == {} and cl.pg is made[0]
    assert made[0].selector == [{"ray.io/node-id": "!in(B)"}] * 2


def test_replacement_selector_and_bundle_nodes(monkeypatch):
    import cluster.lost_nodes as ln
    from ray._private.label_utils import validate_label_selector

    assert replacement_selector(set(), "PACK", {"A"}) is None
    assert replacement_selector({"B"}, "SPREAD", {"A"}) == [{"ray.io/node-id": "!in(B)"}]
    sel = replacement_selector({"b" * 56}, "STRICT_SPREAD", {"a" * 56})
    assert sel == [{"ray.io/node-id": f"!in({'a' * 56},{'b' * 56})"}] and validate_label_selector(sel[0]) is None
    tables = {"group": {0: "A", 1: "B"}, "own": {0: "C"}}
    monkeypatch.setattr(ln, "placement_group_table", lambda pg: {"bundles_to_node_id": tables[pg]})
    assert bundle_nodes("group", [0, ("own", 0), 1, 2]) == ["A", "C", "B", None]
