"""A rank that falls silent without a reset (its node lost to a power cut or a partition; here: SIGSTOP of its
process, whose sockets stay open and keep acknowledging): the router declares it lost within 2 x rank_silence_s
(`router_service.rank_channels`), ends every in-flight request with a retriable error naming the silent rank, and
rebuilds the group; no request waits forever. The rebuild's node verdict (`cluster.lost_nodes`) and the busy
rank's heartbeat are unit-tested here too; the two-node case with a whole node stopped is `bench/failover.py`'s.
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import time

import pytest

from cluster.lost_nodes import avoid_selector, lost_among


def test_lost_among_needs_every_rank_of_the_node_quiet_and_another_node_alive():
    where = ["A", "B", "B", None]
    assert lost_among(where, [1, 2], {"A", "B"}) == {"B"}  # both ranks of B silent, A answers
    assert lost_among(where, [1], {"A", "B"}) == set()  # rank 2 on B answered: a hung rank, not a lost node
    assert lost_among(where, [0, 1, 2], {"A", "B"}) == set()  # nothing would be left to place the group on
    assert lost_among(["A", "A"], [1], {"A"}) == set()  # one node: never exclude it
    assert lost_among(where, [3], {"A", "B"}) == set()  # unknown node: nothing to exclude
    assert lost_among(where, [1, 2], {"A", "B", "C"}) == {"B"}


def test_avoid_selector_is_a_valid_ray_label_selector():
    from ray._private.label_utils import validate_label_selector

    assert avoid_selector(set(), 2) is None
    ids = {"a" * 56, "b" * 56}
    sel = avoid_selector(ids, 3)
    assert sel == [{"ray.io/node-id": f"!in({'a' * 56},{'b' * 56})"}] * 3
    assert validate_label_selector(sel[0]) is None  # None: valid


def test_rank_silence_is_validated_and_named_to_clients(tiny_model_dir):
    from cluster.config import ClusterConfig
    from router_service.rank_channels import RankSilent, client_reason

    with pytest.raises(ValueError, match="rank_silence_s=0"):
        ClusterConfig(model=tiny_model_dir("qwen2_moe"), rank_silence_s=0)
    assert client_reason(1, RankSilent(10.0)) == "rank 1 is unreachable (silent for 10 s: its node may be lost)"


def test_rank_silence_must_come_before_the_collective_timeout(tiny_model_dir):
    """The router's verdict on a silent rank (<= 2 x rank_silence_s) must come before a survivor's collective gives
    up (pg_timeout_s), else clients read that the survivor failed: the combination is refused at config time."""
    from cluster.config import ClusterConfig

    model = tiny_model_dir("qwen2_moe")
    with pytest.raises(ValueError) as e:
        ClusterConfig(model=model, ranks=2, rank_silence_s=3.0, pg_timeout_s=5.0)
    assert str(e.value).startswith("rank_silence_s=3.0 must be < pg_timeout_s / 2 = 2.5 (pg_timeout_s=5.0)")
    with pytest.raises(ValueError, match="rank_silence_s=5.0 must be < pg_timeout_s / 2 = 5 "):
        ClusterConfig(model=model, ranks=2, rank_silence_s=5.0)  # equal: a race, refused too
    assert ClusterConfig(model=model, ranks=2, rank_silence_s=2.4, pg_timeout_s=5.0).rank_silence_s == 2.4
    assert ClusterConfig(model=model, ranks=1, rank_silence_s=6.0).rank_silence_s == 6.0  # no collective


def test_a_busy_rank_without_outputs_still_heartbeats():
    from actors.rank.output_channel import HEARTBEAT_S, OutputChannel, read_frame

    ch = OutputChannel(0, host=lambda: "127.0.0.1", wake=lambda: None, loop_alive=lambda: True,
                       failure=lambda: None)
    a, b = socket.socketpair()
    try:
        ch._conn = a
        ch._last_send = time.monotonic() - HEARTBEAT_S  # a heartbeat is due
        ch.emit([])  # a step that produced nothing on this rank
        b.settimeout(2)
        assert read_frame(b, lambda: None) == b""
        ch.emit([])  # just sent: no second heartbeat
        b.settimeout(0.2)
        with pytest.raises(TimeoutError):
            b.recv(4)
    finally:
        a.close()
        b.close()


@pytest.mark.usefixtures("ray_session")
def test_a_stopped_rank_is_declared_lost_and_the_group_rebuilt(tiny_model_dir):
    from actors.engine.sampling import SamplingParams
    from moeray.api import LLM
    from router_service.errors import EngineError

    silence = 1.5
    llm = LLM(model=tiny_model_dir("qwen2_moe"), ranks=2, kv_cache_bytes=4 << 20, max_num_seqs=8,
              rank_silence_s=silence)
    pid = None
    try:
        router = llm.router
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        ss = [router.submit(f"prompt {i} about the sea", long) for i in range(3)]
        for s in ss:
            assert s.get(timeout=60).finish_reason is None  # decoding
        pid = router.cluster.info[1]["pid"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        outs = [s.result(timeout=30) for s in ss]  # TimeoutError here would be a hung request
        fail_s = time.monotonic() - t0
        assert all(o.finish_reason == "error" and "retry" in o.error for o in outs), [o.error for o in outs]
        # the router's silence bound (2 x silence, + slack for a loaded machine), before the collective timeout
        # (pg_timeout_s = 10 s) could have ended them
        assert fail_s < 2 * silence + 4, fail_s
        assert any("rank 1 is unreachable (silent for" in o.error for o in outs), [o.error for o in outs]
        probe = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        while True:
            try:
                if router.submit("are you back?", probe).result(timeout=30).finish_reason == "length":
                    break
            except EngineError:
                pass
            assert time.monotonic() - t0 < 60, router.health()
            time.sleep(0.2)
        assert len(router.recoveries) == 1 and pid not in {i["pid"] for i in router.cluster.info}
        deadline = time.monotonic() + 20  # the stopped process was killed by the rebuild, not left behind
        while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", f"stopped rank {pid} left running"
    finally:
        _resume_and_shut_down(pid, llm)


def _resume_and_shut_down(pid: int | None, llm) -> None:
    """SIGCONT the stopped rank (if it still exists), then shut the cluster down."""
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    llm.shutdown()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_silent_nodes_does_not_ask_the_ranks_already_found_silent(monkeypatch):
    import cluster.lost_nodes as ln

    asked = []

    def unanswered(ranks, timeout_s):
        asked.append(list(ranks))
        return []  # every rank asked answers

    monkeypatch.setattr(ln, "unanswered", unanswered)
    monkeypatch.setattr(ln, "placement_group_table", lambda pg: {"bundles_to_node_id": {0: "A", 1: "B"}})
    monkeypatch.setattr(ln.ray, "nodes", lambda: [{"NodeID": "A", "Alive": True}, {"NodeID": "B", "Alive": True}])
    assert ln.silent_nodes(None, ["r0", "r1"], [0, 1], known=frozenset({1})) == {"B"}
    assert asked == [["r0"]]  # rank 1 was not asked again: no wait for its deadline
    assert ln.silent_nodes(None, ["r0", "r1"], [0, 1]) == set()  # both answer: nothing lost


@pytest.mark.usefixtures("ray_session")
def test_elastic_survivors_of_a_stopped_rank_go_on_before_the_collective_timeout(tiny_model_dir):
    """Redundant experts: the stopped rank's streams end with the retriable error, the survivor's complete with the
    tokens of an undisturbed run, and they wait for the router's silence bound, not for the 10 s collective timeout (the regroup order interrupts it)."""
    from actors.engine.sampling import SamplingParams
    from moeray.api import LLM

    silence = 1.5
    llm = LLM(model=tiny_model_dir("qwen2_moe"), ranks=2, kv_cache_bytes=4 << 20, max_num_seqs=8,
              rank_silence_s=silence, redundant_experts=True, pg_timeout_s=10.0)
    pid = None
    try:
        router = llm.router
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        prompts = [f"prompt {i} about the sea" for i in range(4)]
        ref = [o.token_ids for o in router.generate(prompts, long)]  # undisturbed
        ss = [router.submit(p, long) for p in prompts]
        for s in ss:
            assert s.get(timeout=60).finish_reason is None  # decoding
        owner = [s.rank for s in ss]
        assert set(owner) == {0, 1}, owner
        pid = router.cluster.info[1]["pid"]
        t_stop = time.perf_counter()
        os.kill(pid, signal.SIGSTOP)
        outs = [s.result(timeout=60) for s in ss]
        stalls = []
        for s, o, rank, want in zip(ss, outs, owner, ref):
            if rank == 1:
                assert o.finish_reason == "error" and "retry" in o.error, o.error
            else:  # every token, none lost or changed by the interrupted step's re-run
                assert o.finish_reason == "length" and o.token_ids == want, o.error
                after = [t for t in o.token_times if t > t_stop - s.t0]
                stalls.append(after[0] - (t_stop - s.t0))
        assert router.recoveries and router.recoveries[0].get("elastic"), router.recoveries
        assert max(stalls) < 2 * silence + 4 < 10, stalls  # the router's bound, well before pg_timeout_s
    finally:
        _resume_and_shut_down(pid, llm)


def test_silent_nodes_never_blocks_the_rebuild_when_ray_cannot_say_where(monkeypatch):
    import cluster.lost_nodes as ln

    monkeypatch.setattr(ln, "unanswered", lambda ranks, timeout_s: [0])

    def table(pg):
        raise RuntimeError("GCS unreachable")

    monkeypatch.setattr(ln, "placement_group_table", table)
    assert ln.silent_nodes(None, ["r0", "r1"], [0, 1]) == set()
