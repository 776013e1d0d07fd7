"""Elastic EP after a node loss without a reset (issue 19), on two Ray nodes (`bench/two_nodes.py`): 2 ranks with
redundant experts and SPREAD (one per node), then every process of node B SIGSTOPped (`bench/node_loss.py`). The
lost rank's streams end with a retriable error, the survivor's complete, none hangs; and the replacement rank
comes up on the surviving node, in a placement group of its own (Ray keeps the lost rank's bundle on node B until
its health checks fail, about a minute; the prepare timeout is 120 s), well within the bound asserted here; at
shutdown every placement group, the replacement's included, is removed.

The cluster is this test's own, the driver a subprocess (as in `tests/cluster/test_two_nodes.py`). Nothing here
skips: a missing prerequisite fails the test.
"""
from __future__ import annotations

import os

import pytest

from bench.node_loss import NODE_B_PID_ENV, kill_node
from bench.two_nodes import HEAD_IP, NODE_B_IP, TwoNodes
from tests.cluster.node_driver import report_and_exit, run_driver

pytestmark = pytest.mark.ray

REJOIN_BOUND_S = 40.0  # from the stop: the silence verdict (2 x 2 s) + the replacement's start and weight read


def drive(model: str) -> None:
    """The driver (subprocess, RAY_ADDRESS = the two-node cluster): prints `REPORT <json>` with the trial and the
    states of the placement groups after the cluster's shutdown."""
    import ray
    from ray.util.placement_group import placement_group_table

    from bench.node_loss import node_loss_trial
    from bench.two_nodes import wait_alive

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    wait_alive(2)
    report = node_loss_trial(model, int(os.environ[NODE_B_PID_ENV]), streams=4, timeout_s=60,
                             redundant_experts=True, max_tokens=160, max_model_len=256, rank_silence_s=2.0)
    report["groups_after_shutdown"] = sorted({t["state"] for t in placement_group_table().values()})
    report_and_exit(report)


def test_replacement_rank_comes_up_on_the_surviving_node(tiny_model_dir):
    model = tiny_model_dir("qwen2_moe")
    nodes = TwoNodes(cpus_a=2, cpus_b=2)
    try:
        nl = run_driver(nodes, "tests.cluster.test_elastic_node_loss", model, timeout_s=150)
    finally:
        kill_node(nodes.procs["b"].pid)  # its stopped workers too (they run in process groups of their own)
        nodes.stop()
    assert sorted(nl["ranks_before"]) == [HEAD_IP, NODE_B_IP] and nl["stopped"] >= 2, nl
    # the lost rank's streams ended retriably, the survivor's completed, none hung, and the survivor served alone
    assert nl["hung"] == 0 and nl["errors"] == 0 and nl["survived"] >= 1, nl
    assert all("retry" in reason for reason in nl["reasons"]) and nl["recoveries"][0]["elastic"], nl
    assert nl["ranks_after"] == [HEAD_IP] and nl["serving_s"] < 30, nl
    # the replacement: on the survivor's node (not node B, whose bundle Ray still holds), soon, the group whole
    lost = nl["lost_node_id"]
    survivor = next(n for n in nl["node_ids_before"] if n != lost)
    assert nl["rejoin_s"] < REJOIN_BOUND_S and nl["world_size_end"] == 2, nl
    assert nl["node_ids_after"] == [survivor, survivor], nl
    # the group's two bundles (its rank 1 bundle still reserved on node B) and the replacement's own one; all
    # removed at shutdown
    assert nl["placement_groups"] == [["CREATED", 1], ["CREATED", 2]], nl
    assert nl["groups_after_shutdown"] == ["REMOVED"], nl
