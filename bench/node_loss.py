"""A node lost without a TCP reset (issue 19), on the two-node setup of `bench/two_nodes.py`.

How the node is lost: every process of node B (its `ray start`, raylet, agents, and the rank workers the raylet
forks, in process groups of their own: the whole process tree) gets SIGSTOP. The kernel keeps its sockets open
and acknowledges what peers send, so nobody sees a reset, a FIN or a refused connection: packets are just never
answered, as after a power cut or a network partition. (Dropping node B's packets with iptables does not work
on one machine: connections node B opens to 127.0.0.11 leave with source 127.0.0.1, indistinguishable from node
A's own.) Ray itself declares node B dead only after its GCS health checks fail (`health_check_*`: ~60 s with
Ray's defaults), so everything before that is moeray's own detection.

`node_loss_trial` (a driver connected to the two-node cluster): a 2-rank group with SPREAD (one rank per node),
`streams` long greedy generations in flight, then node B stopped; it measures
  - fail_s: seconds from the stop until every in-flight request has ended (each must end with
    finish_reason "error", the retriable 503 / UNAVAILABLE at the front doors);
  - serving_s: seconds from the stop until a new request completes (the group rebuilt on the surviving node:
    SPREAD packs both ranks onto it);
  - hung: requests not ended within `timeout_s`; errors: in-flight requests that did not end with an error;
  - with redundant experts (elastic EP, the survivor serving alone meanwhile) rejoin_s: seconds from the stop until
    a replacement rank has joined and the whole group serves again (nan: not within `timeout_s`), and the node
    each rank of that group runs on (`rank_node_ids`: the replacement belongs on a surviving node).
"""
from __future__ import annotations

import os
import signal
import time

NODE_B_PID_ENV = "MOERAY_BENCH_NODE_B_PID"  # the driver subprocess learns node B's `ray start` pid from here


def node_pids(root: int) -> list[int]:
    """Pids of `root` and all its descendants (node B: `ray start`, raylet, agents, and the
    workers the raylet forks, which run in process groups of their own, so a `killpg` misses them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the command: state, ppid
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def stop_node(root: int) -> int:
    """SIGSTOP `root` and every descendant (scanned twice, for a process forked during the first pass); returns
    how many were stopped. `TwoNodes.stop` SIGKILLs node B's group later; the workers, stopped and orphaned, get
    SIGKILL from `kill_node`."""
    stopped: set[int] = set()
    for _ in range(2):
        for pid in node_pids(root):
            if pid not in stopped:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.add(pid)
                except ProcessLookupError:
                    pass
    return len(stopped)


def kill_node(root: int) -> None:
    """SIGKILL `root` and every descendant (the end of a trial: stopped processes never exit by themselves)."""
    for pid in node_pids(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rank_node_ids(ranks: list) -> list[str]:
    """The Ray node id each rank actor in `ranks` runs on (asked inside the actor; 30 s deadline)."""
    import ray

    def node_id(self):  # runs inside the rank actor
        import ray

        return ray.get_runtime_context().get_node_id()

    return ray.get([r.__ray_call__.remote(node_id) for r in ranks], timeout=30)


def node_loss_trial(model: str, root: int, streams: int = 4, timeout_s: float = 90.0,
                    redundant_experts: bool = False, max_tokens: int = 400, max_model_len: int = 512,
                    **cluster_kw) -> dict:
    """In a driver connected (ray.init done) to a `TwoNodes` cluster whose node B is the process tree under pid
    `root`: the trial of the module docstring. Returns {fail_s, serving_s (nan: not serving within timeout_s),
    hung, errors, stopped (processes stopped), reasons (distinct client error texts), ranks_before / ranks_after
    (node IPs of the ranks before the loss / of the rebuilt group), recoveries}. redundant_experts: the elastic path (the survivor's own streams go on, only the
    lost rank's end; `errors` then counts the lost rank's streams that did not end with an error, `survived` the
    survivor's streams that completed, `survivor_stall_s` their longest wait for a token after the stop; then
    rejoin_s, the seconds from the stop until the replacement rank joined (nan: not within `timeout_s` of the
    stop), node_ids_before / node_ids_after, the ranks' Ray node ids before the loss and once it joined, lost_node_id
    (node B's), world_size_end (the group's size at the end of the trial), placement_groups ((state, bundle count)
    of every placement group of the cluster once it joined).
    max_tokens: each stream's length (long enough to be decoding when the node goes); max_model_len: the group's.
    cluster_kw: more `ClusterConfig` fields (e.g. rank_silence_s)."""
    import ray
    from ray.util.placement_group import placement_group_table

    from actors.engine.sampling import SamplingParams
    from bench.two_nodes import NODE_B_IP
    from moeray.api import LLM
    from router_service.errors import EngineError

    llm = LLM(model=model, ranks=2, placement_strategy="SPREAD", max_model_len=max_model_len, kv_cache_bytes=8 << 20,
              redundant_experts=redundant_experts, **cluster_kw)
    try:
        router = llm.router
        ips = ray.get([r.node_ip.remote() for r in llm.cluster.ranks], timeout=60)
        ids_before = rank_node_ids(llm.cluster.ranks)
        long = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ss = [router.submit(f"Prompt {i}: the history of the river and the town", long) for i in range(streams)]
        for s in ss:
            s.get(timeout=60)  # every stream is decoding
        owner = [s.rank for s in ss]  # before the loss: an elastic regroup renumbers the survivors
        t0, t_stop = time.monotonic(), time.perf_counter()
        stopped = stop_node(root)
        hung = errors = 0
        reasons = set()
        lost_rank = ips.index(NODE_B_IP)
        survived, stall = 0, float("nan")  # elastic: the surviving rank's streams that completed, their stall
        for s, rank in zip(ss, owner):
            try:
                out = s.result(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            except TimeoutError:
                hung += 1
                continue
            if redundant_experts and rank != lost_rank:
                survived += out.finish_reason == "length"
                after = [t_stop - s.t0] + [t for t in out.token_times if t > t_stop - s.t0]
                if len(after) > 1:  # the longest wait for a token after the stop, not only for the first one
                    gap = max(b - a for a, b in zip(after, after[1:]))
                    stall = max(gap, stall if stall == stall else 0.0)
                continue
            errors += out.finish_reason != "error"
            reasons.add(out.error)
        fail_s = time.monotonic() - t0
        serving_s = float("nan")
        probe = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        while time.monotonic() - t0 < timeout_s:
            try:
                left = max(1.0, timeout_s - (time.monotonic() - t0))
                out = router.submit("are you back?", probe).result(timeout=left)
                if out.finish_reason == "length":
                    serving_s = time.monotonic() - t0
                    break
            except EngineError:
                pass
            except TimeoutError:
                hung += 1
                break
            time.sleep(0.1)
        after = ray.get([r.node_ip.remote() for r in llm.cluster.ranks], timeout=30) if serving_s == serving_s else []
        rejoin_s, ids_after, groups = float("nan"), [], []
        if redundant_experts:  # the replacement rank: started in the background, then switched in
            while not router.rejoins and time.monotonic() - t0 < timeout_s:
                time.sleep(0.1)
            if router.rejoins:
                rejoin_s = time.monotonic() - t0  # within 0.1 s of the switch
                ids_after = rank_node_ids(llm.cluster.ranks)
                groups = sorted((t["state"], len(t["bundles"])) for t in placement_group_table().values())
        return {"fail_s": fail_s, "survived": survived, "survivor_stall_s": stall, "serving_s": serving_s,
                "rejoin_s": rejoin_s, "node_ids_before": ids_before, "node_ids_after": ids_after,
                "lost_node_id": ids_before[lost_rank], "world_size_end": len(llm.cluster.ranks),
                "placement_groups": groups,
                "hung": hung, "errors": errors, "stopped": stopped,
                "reasons": sorted(str(r) for r in reasons), "ranks_before": ips, "ranks_after": after,
                "recoveries": router.recoveries}
    finally:
        llm.shutdown()


def drive(model: str, redundant_experts: bool = False) -> None:
    """Driver subprocess entry (env: `TwoNodes.env` plus NODE_B_PID_ENV): prints `NODELOSS <json>`."""
    import json

    import ray

    from bench.two_nodes import wait_alive

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
    wait_alive(2)
    r = node_loss_trial(model, int(os.environ[NODE_B_PID_ENV]), redundant_experts=redundant_experts)
    print("NODELOSS " + json.dumps(r, default=str), flush=True)
    os._exit(0)  # not ray.shutdown(): it would wait on the stopped node


def run(model: str, timeout_s: float = 240.0, redundant_experts: bool = False) -> dict:
    """Start a `TwoNodes` cluster, run `drive` in a subprocess, stop everything; returns the trial's dict (or
    {"error": ...} with the driver's stderr tail)."""
    import json
    import subprocess
    import sys

    from bench.two_nodes import REPO, TwoNodes

    nodes = TwoNodes(cpus_a=2, cpus_b=2)
    try:
        env = {**nodes.env, NODE_B_PID_ENV: str(nodes.procs["b"].pid)}
        try:
            code = f"from bench.node_loss import drive; drive({model!r}, {redundant_experts})"
            p = subprocess.run([sys.executable, "-c", code],
                               env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            return {"error": f"driver did not finish within {timeout_s}s", "stderr": str(e.stderr)[-3000:]}
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("NODELOSS ")]
        if not lines:
            return {"error": f"driver exited {p.returncode}", "stderr": p.stderr[-3000:]}
        return json.loads(lines[-1][len("NODELOSS "):])
    finally:
        kill_node(nodes.procs["b"].pid)
        nodes.stop()


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cluster.config import DEFAULT_MODEL

    r = run(DEFAULT_MODEL, redundant_experts="--redundant-experts" in sys.argv)
    print(r)
    if "error" not in r:
        print(f"RESULT fail_s={r['fail_s']:.2f} serving_s={r['serving_s']:.2f} hung={r['hung']} "
              f"survivor_stall_s={r['survivor_stall_s']:.2f} rejoin_s={r['rejoin_s']:.2f} "
              f"world_size_end={r['world_size_end']} on_lost_node={r['node_ids_after'].count(r['lost_node_id'])}")
