"""2-rank decode across two Ray nodes vs on one node (issue 19's "Cross-node speed"), same run, same driver.

Setup as in tests/cluster/test_two_nodes.py (`bench/two_nodes.py`): a head on 127.0.0.11 and a second raylet on
127.0.0.12, each in its own mount namespace with a private /dev/shm (node B also with its own hostname) where
`unshare` is allowed, else node B with MOERAY_SHM=0. This process is the driver. Two 2-rank groups of the same
model are up at once: "cross" (STRICT_SPREAD: one rank per node, gloo over TCP between them), "one node"
(STRICT_PACK: both ranks on one node, gloo + the same-node shared-memory transport), "one node, gloo" (the same
with `transport="torch"`: gloo for every collective, what the node boundary forces) and "cross, TBO" ("cross" with
two-batch overlap: a decode step's two micro-batches, one's all-to-all over TCP in flight while the other computes). Rounds rotate which group
goes first; in each round each group runs
  - batch 1: one greedy request of `--tokens` forced tokens; TPOT = (t_last - t_first) / (n - 1);
  - batch 8: 8 concurrent greedy requests of `--tokens`; TPOT = the median over the 8 of the same.
A figure is the median over rounds; the ratio is cross / one node. Every request's tokens are compared between
the groups (`tokens_equal`). The rank counters give where a cross-node decode step's time goes (all-to-all,
step agreement) and how many collectives a step makes.

    python bench/multinode.py            # 5 rounds, 128 tokens
    python bench/multinode.py --quick    # 3 rounds, 64 tokens

Last line: RESULT cross_node_ratio_b1=<x> cross_node_ratio_b8=<x> tokens_equal=<0|1> cross_vs_gloo_b1=<x>
cross_vs_gloo_b8=<x> cross_node_ratio_b1_tbo=<x> cross_node_ratio_b8_tbo=<x> (cross / "one node"; targets: <= 2.0 at
batch 1, <= 1.5 at batch 8; cross / "one node, gloo"; "cross, TBO" / "one node": two-batch overlap, which does not
run at batch 1, so its b1 figure only says how noisy the b1 rows are).
"""
from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time

# the two-node cluster uses token auth, which Ray reads when it is imported: set before anything imports ray
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.two_nodes import TwoNodes, wait_alive  # noqa: E402
from cluster.config import DEFAULT_MODEL  # noqa: E402

PROMPTS = ["ROMEO. But soft, what light through yonder window breaks?", "def parse_header(line):\n    ",
           "The history of the river and the town", "Once upon a time, in a land far away,",
           "import numpy as np\n", "JULIET. O Romeo, Romeo! wherefore art thou Romeo?",
           "The weather today is", "class Node:\n    def __init__(self"]
# (name, placement strategy, ClusterConfig.transport, engine options); "one node, gloo" separates what the node
# boundary costs from what the shared-memory transport (one node only) saves; "cross, TBO" is "cross" with two-batch
# overlap (`actors.model.two_batch`), gated here at 4 sequences per rank so that batch 8 (4 per rank, micro-batches
# of 2) runs it: the engine's default gate (tbo_min_batch 8 per rank) would leave both rows unchanged
TBO = {"two_batch_overlap": True, "tbo_min_batch": 4}
GROUPS = (("cross", "STRICT_SPREAD", "auto", {}), ("one node", "STRICT_PACK", "auto", {}),
          ("one node, gloo", "STRICT_PACK", "torch", {}), ("cross, TBO", "STRICT_SPREAD", "auto", TBO))


def tpot_ms(out) -> float:
    t = out.token_times
    assert len(t) >= 2 and out.error is None, (len(t), out.error)
    return (t[-1] - t[0]) / (len(t) - 1) * 1000


def run_batch(llm, prompts: list[str], n: int) -> tuple[float, list[list[int]]]:
    """(median TPOT over the batch's requests in ms, their tokens) for greedy `prompts` run together."""
    from actors.engine.sampling import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert all(len(o.token_ids) == n for o in outs), [o.error for o in outs]
    return statistics.median(tpot_ms(o) for o in outs), [o.token_ids for o in outs]


def step_counters(llm) -> list[dict]:
    return [{k: r[k] for k in ("rank", "steps", "comm_s", "sync_s", "forward_s", "two_batch_steps")}
            for r in llm.stats()["ranks"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    n = args.tokens or (64 if args.quick else 128)

    import ray

    from moeray import LLM

    nodes = TwoNodes(cpus_a=3, cpus_b=3)  # 4 groups of 2 ranks at 0.5 CPU each (logical: the machine has 2 cores)
    llms: dict = {}
    try:
        ray.init(address=nodes.address, log_to_driver=False, logging_level="ERROR")
        wait_alive(2)
        for name, strategy, transport, opts in GROUPS:
            llms[name] = LLM(model=args.model, ranks=2, placement_strategy=strategy, transport=transport,
                             num_threads_per_rank=1, max_num_seqs=16, kv_cache_bytes=32 << 20, engine_options=opts)
        where = {name: sorted(ray.get([r.node_ip.remote() for r in llm.cluster.ranks])) for name, llm in llms.items()}
        transport = {name: "/".join(sorted({i["transport"] for i in llm.cluster.info})) for name, llm in llms.items()}
        for llm in llms.values():
            run_batch(llm, PROMPTS[:1], 8)  # warm-up
        tp: dict = {(g[0], b): [] for g in GROUPS for b in (1, 8)}
        equal, counters, counters8 = True, {}, {}
        for rnd in range(rounds):
            order = GROUPS[rnd % len(GROUPS):] + GROUPS[:rnd % len(GROUPS)]
            toks: dict = {}
            for name, *_ in order:
                llm = llms[name]
                before = step_counters(llm)
                t, toks[(name, 1)] = run_batch(llm, PROMPTS[:1], n)
                tp[(name, 1)].append(t)
                counters.setdefault(name, []).append((before, step_counters(llm)))
                before = step_counters(llm)
                t, toks[(name, 8)] = run_batch(llm, PROMPTS[:8], n)
                tp[(name, 8)].append(t)
                counters8.setdefault(name, []).append((before, step_counters(llm)))
            equal &= all(toks[(g[0], b)] == toks[("one node", b)] for g in GROUPS for b in (1, 8))
            print(f"round {rnd}: " + "  ".join(f"{g[0]} b{b} {tp[(g[0], b)][-1]:.2f} ms" for g in GROUPS for b in (1, 8)),
                  flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        nodes.stop()

    med = {k: statistics.median(v) for k, v in tp.items()}
    ratio = {b: med[("cross", b)] / med[("one node", b)] for b in (1, 8)}
    ratio_gloo = {b: med[("cross", b)] / med[("one node, gloo", b)] for b in (1, 8)}
    ratio_tbo = {b: med[("cross, TBO", b)] / med[("one node", b)] for b in (1, 8)}
    print(f"\nmodel: {args.model}; {n} forced tokens per request, {rounds} interleaved rounds; node namespaces: "
          f"{'private (unshare)' if nodes.isolated else 'shared, node B MOERAY_SHM=0'}")
    print("| group | ranks on | transport | TPOT b1 (ms) | TPOT b8 (ms) |")
    print("|---|---|---|---|---|")
    for g, strategy, *_ in GROUPS:
        print(f"| {g} ({strategy}) | {', '.join(where[g])} | {transport[g]} | {med[(g, 1)]:.2f} | {med[(g, 8)]:.2f} |")
    print(f"| ratio cross / one node | | | {ratio[1]:.2f} | {ratio[8]:.2f} |")
    print(f"| ratio cross / one node, gloo | | | {ratio_gloo[1]:.2f} | {ratio_gloo[8]:.2f} |")
    print(f"| ratio cross, TBO / one node | | | {ratio_tbo[1]:.2f} | {ratio_tbo[8]:.2f} |")
    print(f"| ratio cross, TBO / cross | | | {med[('cross, TBO', 1)] / med[('cross', 1)]:.2f} | "
          f"{med[('cross, TBO', 8)] / med[('cross', 8)]:.2f} |")
    for b, cnt in ((1, counters), (8, counters8)):
        print(f"\nbatch-{b} decode step (ms per step, rank counters summed over the b{b} runs; TBO steps: steps run as two "
              "micro-batches)")
        print("| group | rank | steps | TBO steps | all-to-all | step agreement | forward minus all-to-all |")
        print("|---|---|---|---|---|---|---|")
        for g, *_ in GROUPS:
            for r in range(2):
                steps = sum(a[r]["steps"] - b_[r]["steps"] for b_, a in cnt[g])
                tbo = sum(a[r]["two_batch_steps"] - b_[r]["two_batch_steps"] for b_, a in cnt[g])
                d = {k: sum(a[r][k] - b_[r][k] for b_, a in cnt[g]) * 1000 / max(1, steps)
                     for k in ("comm_s", "sync_s", "forward_s")}
                print(f"| {g} | {r} | {steps} | {tbo} | {d['comm_s']:.2f} | {d['sync_s']:.2f} | "
                      f"{d['forward_s'] - d['comm_s']:.2f} |")
    print(f"RESULT cross_node_ratio_b1={ratio[1]:.3f} cross_node_ratio_b8={ratio[8]:.3f} tokens_equal={int(equal)} "
          f"cross_vs_gloo_b1={ratio_gloo[1]:.3f} cross_vs_gloo_b8={ratio_gloo[8]:.3f} "
          f"cross_node_ratio_b1_tbo={ratio_tbo[1]:.3f} cross_node_ratio_b8_tbo={ratio_tbo[8]:.3f}")


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"(wall {time.monotonic() - t0:.0f} s)", file=sys.stderr)
