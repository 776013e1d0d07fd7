"""Rank failure and recovery: kill one rank actor mid-generation and time what the clients see.

On the shipped model served by `--ranks` Ray ranks (default 2), each trial:
  1. starts `--streams` greedy generations (long, ignore_eos) and waits until tokens flow;
  2. kills one rank actor (`ray.kill`, the rank chosen round-robin) and starts a clock;
  3. fail_s: seconds until every in-flight request has ended with a retriable error (finish_reason "error",
     which the front doors send as HTTP 503 / gRPC UNAVAILABLE); the issue's limit is 15 s;
  4. serve_s: seconds until a new request is accepted and completed (the router tore the EP group down and
     started new actors in a new process group); the issue's limit is 30 s;
  5. checks that every KV block of the new group is free once idle (leaked blocks are counted).
The rebuild time is dominated by starting the new actor processes (Python, torch import, weight load); it
grows with machine load, so run this alone.

Elastic case (`--redundant-experts`, one trial on a fresh group of `--ranks` ranks): 2 greedy streams per rank
run, one rank's process is SIGKILLed; its streams must end with a retriable error, every other stream must
complete with the tokens of an undisturbed run of the same prompts. survivor_stall_s: seconds from the SIGKILL to
the survivors' next token (the slowest survivor stream); survivor_lost: survivor streams that did not complete
with those tokens; elastic_rejoin_s: seconds from the SIGKILL until a replacement rank (started in the
background, experts read while the survivors serve) has joined and the whole group serves; hung: requests of
either case not finished within the trial's timeout.

Node-loss case (`bench/node_loss.py`, after the others, on its own two-node cluster: `bench/two_nodes.py`'s head
on 127.0.0.11 and node B on 127.0.0.12): 2 ranks with SPREAD, one per node, 4 long streams, then every process of
node B is SIGSTOPped (a node lost without a TCP reset or FIN: power cut, partition). node_loss_serving_s: seconds
from the stop to the first completed new request (the group rebuilt on node A, `cluster.lost_nodes`); its
in-flight requests must end with a retriable error (else they count in `lost`), and unfinished ones in `hung`.
Without --quick the case is run again under `--redundant-experts` and printed (the survivor's streams go on after
the detection bound; not part of the RESULT line).

    python bench/failover.py            # 4 trials
    python bench/failover.py --quick    # 2 trials

Last line: RESULT fail_s_max=<x> serve_s_max=<x> serve_s_mean=<x> rebuild_s_mean=<x> lost=<n>
leaked_blocks=<n> survivor_stall_s=<x> survivor_lost=<n> elastic_rejoin_s=<x> node_loss_serving_s=<x> hung=<n>
(`lost`: in-flight requests that did not end with an error, or a new request not served; -1 means not measured:
the elastic keys with --no-elastic or --ranks 1, node_loss_serving_s with --no-node-loss; nan: not serving again
within the trial's timeout).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.config import DEFAULT_MODEL  # noqa: E402


def trial(llm, victim: int, streams: int, timeout_s: float = 180.0) -> dict:
    import ray

    from actors.engine.sampling import SamplingParams
    from router_service.errors import EngineError

    router = llm.router
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ss = [router.submit(f"Prompt {i}: the history of the river and the town", long) for i in range(streams)]
    ss[0].get(timeout=timeout_s)  # tokens are flowing
    n_rec = len(router.recoveries)
    t0 = time.monotonic()
    ray.kill(router.cluster.ranks[victim], no_restart=True)
    lost = hung = 0
    for s in ss:
        try:
            out = s.result(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            lost += out.finish_reason != "error"
        except TimeoutError:
            lost += 1
            hung += 1
    fail_s = time.monotonic() - t0
    serve_s = None
    probe = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    while time.monotonic() - t0 < timeout_s:
        try:
            if router.submit("are you back?", probe).result(timeout=timeout_s).finish_reason == "length":
                serve_s = time.monotonic() - t0
                break
        except EngineError:
            time.sleep(0.1)
    if serve_s is None:
        lost += 1
        serve_s = float("nan")
    leaked = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = router.stats()
        leaked = st["kv_blocks_total"] - st["kv_blocks_free"]
        if st["in_flight"] == 0 and leaked == 0:
            break
        time.sleep(0.1)
    rebuild_s = router.recoveries[-1]["down_s"] if len(router.recoveries) > n_rec else float("nan")
    return {"victim": victim, "fail_s": fail_s, "serve_s": serve_s, "rebuild_s": rebuild_s, "lost": lost,
            "leaked": leaked, "hung": hung}


def elastic_trial(model: str, ranks: int, n: int = 200, timeout_s: float = 120.0, victim: int | None = None) -> dict:
    """One SIGKILLed rank (`victim`, default the last) under `--redundant-experts` (see the module docstring)."""
    import signal

    from actors.engine.sampling import SamplingParams
    from moeray.api import LLM

    llm = LLM(model=model, ranks=ranks, redundant_experts=True)
    try:
        router = llm.router
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        prompts = [f"Prompt {i}: the history of the river and the town" for i in range(2 * ranks)]
        ref = [o.token_ids for o in router.generate(prompts, sp)]
        ss = [router.submit(p, sp) for p in prompts]
        for s in ss:
            s.get(timeout=timeout_s)  # every stream is decoding
        victim = ranks - 1 if victim is None else victim
        pid = router.cluster.info[victim]["pid"]
        t_kill = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        hung = lost = victim_ok = 0
        stalls = []
        for i, s in enumerate(ss):
            try:
                out = s.result(timeout=timeout_s)
            except TimeoutError:
                hung += 1
                continue
            if s.rank == victim and out.finish_reason == "error":  # its stream ended retriably (s.rank: at submit)
                victim_ok += 1
                continue
            if out.finish_reason != "length" or out.token_ids != ref[i]:
                lost += 1
                continue
            after = [t for t in out.token_times if t > t_kill - s.t0]
            if after:
                stalls.append(after[0] - (t_kill - s.t0))
        rec = router.recoveries[-1] if router.recoveries else {}
        deadline = time.monotonic() + timeout_s  # the replacement rank: started, loaded, switched in
        while not router.rejoins and time.monotonic() < deadline:
            time.sleep(0.05)
        rejoin_s = time.perf_counter() - t_kill if router.rejoins else -1.0
        switch_s = router.rejoins[-1]["switch_s"] if router.rejoins else -1.0
        st = router.stats()
        leaked = st["kv_blocks_total"] - st["kv_blocks_free"] if st["in_flight"] == 0 else -1
        return {"stall_s": max(stalls) if stalls else -1.0, "lost": lost, "hung": hung,
                "victim_errors": victim_ok, "elastic": bool(rec.get("elastic")), "down_s": rec.get("down_s", float("nan")),
                "leaked": leaked, "survivor_streams": len(stalls), "rejoin_s": rejoin_s, "switch_s": switch_s}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--trials", type=int, default=None, help="default 4 (2 with --quick)")
    ap.add_argument("--streams", type=int, default=4, help="in-flight generations when the rank is killed")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-elastic", action="store_true", help="skip the elastic (--redundant-experts) case")
    ap.add_argument("--no-node-loss", action="store_true", help="skip the two-node case (node B SIGSTOPped)")
    args = ap.parse_args()
    trials = args.trials or (2 if args.quick else 4)

    import ray

    from moeray.api import LLM

    ray.init(address="local", num_cpus=max(4, args.ranks + 2), include_dashboard=False, log_to_driver=False)
    llm = LLM(model=args.model, ranks=args.ranks)
    rows = []
    try:
        for i in range(trials):
            r = trial(llm, i % args.ranks, args.streams)
            rows.append(r)
            print(f"trial {i}: killed rank {r['victim']}: errors after {r['fail_s']:.2f} s, serving after "
                  f"{r['serve_s']:.2f} s (rebuild {r['rebuild_s']:.2f} s), lost {r['lost']}, leaked blocks "
                  f"{r['leaked']}", flush=True)
    finally:
        llm.shutdown()
    el = None
    try:
        if not args.no_elastic and args.ranks >= 2:
            el = elastic_trial(args.model, args.ranks)
            print(f"elastic: killed rank {args.ranks - 1} (SIGKILL): survivors' stall {el['stall_s']:.3f} s over "
                  f"{el['survivor_streams']} streams, survivor streams lost {el['lost']}, victim streams ended with a "
                  f"retriable error {el['victim_errors']}, elastic path {el['elastic']}, refusing new requests for "
                  f"{el['down_s']:.3f} s, hung {el['hung']}, leaked blocks {el['leaked']}; replacement rank serving "
                  f"{el['rejoin_s']:.2f} s after the kill (switch-in {el['switch_s']:.3f} s)", flush=True)
    finally:
        ray.shutdown()
    nl = None
    if not args.no_node_loss:  # its own two-node cluster, after this process's Ray is down (one Ray at a time)
        from bench.node_loss import run as node_loss

        nl = node_loss(args.model)
        if "error" in nl:
            print(f"node loss: {nl['error']}\n{nl.get('stderr', '')}", flush=True)
            nl = {"serving_s": float("nan"), "fail_s": float("nan"), "hung": 1, "errors": 1}
        else:
            print(f"node loss (node B SIGSTOPped, {nl['stopped']} processes): in-flight requests ended after "
                  f"{nl['fail_s']:.2f} s ({nl['errors']} not with an error: {nl['reasons']}), serving again after "
                  f"{nl['serving_s']:.2f} s on {nl['ranks_after']}, hung {nl['hung']}", flush=True)
        if not args.quick and not args.no_elastic:  # the same under --redundant-experts (not part of RESULT)
            ne = node_loss(args.model, redundant_experts=True)
            print(f"node loss, elastic: {ne}", flush=True)

    print()
    print("| trial | killed rank | errors after (s) | serving after (s) | rebuild (s) | lost | leaked blocks |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['victim']} | {r['fail_s']:.2f} | {r['serve_s']:.2f} | {r['rebuild_s']:.2f} | {r['lost']} "
              f"| {r['leaked']} |")
    fail = [r["fail_s"] for r in rows]
    serve = [r["serve_s"] for r in rows]
    rebuild = [r["rebuild_s"] for r in rows]
    lost = sum(r["lost"] for r in rows) + (nl["errors"] + nl["hung"] + (nl["serving_s"] != nl["serving_s"]) if nl else 0)
    hung = sum(r["hung"] for r in rows) + (el["hung"] if el else 0) + (nl["hung"] if nl else 0)
    print(f"RESULT fail_s_max={max(fail):.3f} serve_s_max={max(serve):.3f} serve_s_mean={statistics.mean(serve):.3f} "
          f"rebuild_s_mean={statistics.mean(rebuild):.3f} lost={lost} "
          f"leaked_blocks={sum(r['leaked'] for r in rows)} "
          f"survivor_stall_s={el['stall_s'] if el else -1:.3f} survivor_lost={el['lost'] if el else -1} "
          f"elastic_rejoin_s={el['rejoin_s'] if el else -1:.3f} "
          f"node_loss_serving_s={nl['serving_s'] if nl else -1:.3f} hung={hung}")


if __name__ == "__main__":
    main()
