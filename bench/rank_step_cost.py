"""What a decode step costs each rank of a 2-rank group, without Ray or a front door: where a second rank's CPU goes.

Spawns plain processes (no Ray; a rendezvous store, gloo and the same-node shared-memory transport, as a rank
actor has) and steps real `RankEngine`s the way the lockstep loop does: each step every rank plans, the ranks
agree the step's largest token count over the transport (one all-to-all of a few int64, like
`actors.rank.lockstep`), then run it. Configurations, in interleaved rounds:

- `1rank_B`: one rank, B sequences (the whole load), one compute thread (a decode batch below 128 rows runs on
  one thread anyway: `tuning.PARALLEL_ROWS`);
- `1rank_B/2`: one rank with half of them (what each rank of a 2-rank group holds);
- `2ranks`: two ranks, experts sharded (per MoE layer a dispatch and a combine exchange), B/2 sequences each;
- `2ranks_replicated`: two ranks, every expert on both (`--redundant-experts`: no per-layer exchange, the step
  agreement only);
- `2lone`: two independent one-rank engines of B/2 sequences each, in two processes stepping at once (no group, no
  agreement, no exchange): what two busy cores cost each other on this machine, apart from the lockstep;
- `1rank_1`, `2ranks_1`, `2ranks_replicated_1`: one sequence, on one rank, or on rank 0 of a 2-rank group whose
  rank 1 has none and only serves its experts (one stream through a 2-rank server: the wall ms per step is its
  inter-token latency without the front door).

Per configuration: each rank's CPU ms per step (`time.thread_time` of its stepping thread), wall ms per step, and
for the 2-rank groups the exchange's wall ms per step (`AllToAllDispatcher.comm_s`). Ratios: total CPU per token of
2 ranks over 1 rank (`cpu_2v1`), tok/s of 2 ranks over 1 rank (`tps_2v1`, from wall time), and the split of the
2-rank excess into the per-step cost that a second rank repeats (`2 x 1rank_B/2 - 1rank_B`) and the rest
(exchange, agreement, two busy cores); `lone_2v1` (2lone's CPU over twice 1rank_B/2's) is the two-busy-cores share
of it, `lockstep_2v1` (2ranks' CPU over 2lone's) what the exchange, the agreement and the lockstep add to two engines
(`lockstep_2v1_replicated`: 2ranks_replicated's). Fixed per-step cost = the intercept of the 1-rank line through B/2
and B.

    python bench/rank_step_cost.py --quick          # B = 64, 2 rounds (~2 min)
    python bench/rank_step_cost.py                  # B = 64, 4 rounds

Last line: RESULT cpu_2v1=.. cpu_2v1_replicated=.. tps_2v1=.. tps_2v1_replicated=.. fixed_ms=.. per_seq_ms=..
repeat_share=.. exchange_ms=.. step1_2v1=.. step1_2v1_replicated=.. lone_2v1=.. lockstep_2v1=..
lockstep_2v1_replicated=.. (medians over rounds; repeat_share: the fraction of the sharded 2-rank CPU excess that
the repeated per-step cost explains; step1_2v1: the one-sequence wall ms per step of 2 ranks over 1 rank).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "bench"))
MODEL = os.path.join(HERE, "models", "tiny-moe")
WARMUP = 30


def _placement(world: int, replicated: bool):
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from cluster.placement import redundant_placement

    mc = ModelConfig.from_pretrained(MODEL)
    if replicated:
        return redundant_placement(mc.num_layers, mc.num_experts, world)
    return ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, world)


def _steps(eng, world: int, shm, steps: int) -> tuple[float, float, float]:
    """(CPU ms, wall ms, exchange ms) per step over `steps` lockstep decode steps after the prefill and a warm-up."""
    import numpy as np
    import torch

    flags = np.zeros((world, 2), dtype=np.int64)
    got = np.zeros((world, 2), dtype=np.int64)
    flags_t, got_t = torch.from_numpy(flags).view(-1), torch.from_numpy(got).view(-1)

    def one() -> None:
        plan = eng.plan()
        if world > 1:  # the lockstep agreement: the largest token count and whether any rank prefills
            flags[:] = (plan.num_tokens, int(bool(plan.meta.prefills)))
            shm.all_to_all_single(got_t, flags_t)
            t_max, prefill = got.max(0).tolist()
        else:
            t_max, prefill = plan.num_tokens, int(bool(plan.meta.prefills))
        eng.run(plan, t_max, decode_only=not prefill)

    for _ in range(WARMUP):  # the prompts' prefill, then decode
        one()
    comm0 = eng.dispatcher.comm_s
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        one()
    c, w = time.thread_time() - c0, time.perf_counter() - w0
    return c / steps * 1e3, w / steps * 1e3, (eng.dispatcher.comm_s - comm0) / steps * 1e3


def _rank(rank: int, world: int, port: int, batch: int, replicated: bool, steps: int, q) -> None:
    import torch
    import torch.distributed as dist

    from actors.rank.rendezvous import join_store
    from actors.rank.shm_collective import ShmAllToAll
    from decode_step import build

    try:
        torch.set_num_threads(1)
        store = join_store("127.0.0.1", port, world, 60.0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        shm = ShmAllToAll.setup(store, rank, world, 30.0, slot_bytes=1 << 20)
        if shm is None:
            raise RuntimeError("no shared-memory transport (not x86-64, or MOERAY_SHM=0)")
        eng = build(MODEL, batch, WARMUP + steps + 40, placement=_placement(world, replicated), rank=rank,
                    group=dist.group.WORLD, shm=shm, first=rank * batch)
        q.put((rank, _steps(eng, world, shm, steps)))
        dist.barrier()
        shm.close()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported by the parent
        q.put((rank, repr(e)))


def _spawn_pair(target, args_of) -> list:
    """Runs `target(*args, q)` in two spawned processes, args = args_of(ctx)[i]; each puts (i, its result, or the
    repr of its error) on q. Returns the results by i. Raises RuntimeError naming the processes that failed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    # `args` stays referenced until the children are done: start() drops a process's own reference to its args
    # while the child may still be unpickling them (a Barrier among them would be gone)
    q, args = ctx.Queue(), args_of(ctx)
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    bad = {i: v for i, v in got.items() if isinstance(v, str)}
    if bad:
        raise RuntimeError(f"process failed: {bad}")
    return [got[i] for i in range(len(procs))]


def run_group(batch_per_rank: int, replicated: bool, steps: int, one_sided: bool = False
              ) -> list[tuple[float, float, float]]:
    """Two spawned ranks of `batch_per_rank` sequences each (one_sided: rank 0 holds them, rank 1 none, as one
    stream through a 2-rank server): [(CPU ms, wall ms, exchange ms) per step] by rank."""
    from actors.rank.rendezvous import host_store

    store = host_store(2)  # held until the ranks are done
    return _spawn_pair(_rank, lambda ctx: [(r, 2, store.port, 0 if one_sided and r else batch_per_rank, replicated,
                                            steps) for r in range(2)])


def _lone(i: int, batch: int, steps: int, barrier, q) -> None:
    """Independent world-size-1 engine i (the `2lone` configuration): builds, waits for its twin, steps."""
    import torch

    from decode_step import build

    try:
        torch.set_num_threads(1)
        eng = build(MODEL, batch, WARMUP + steps + 40)
        barrier.wait(timeout=600)
        q.put((i, _steps(eng, 1, None, steps)))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        q.put((i, repr(e)))


def run_lone(batch: int, steps: int) -> list[tuple[float, float, float]]:
    """Two independent one-rank engines of `batch` sequences each, stepping at the same time (a barrier after
    both built theirs): [(CPU ms, wall ms, 0) per step] by process."""
    def args_of(ctx):
        barrier = ctx.Barrier(2)
        return [(i, batch, steps, barrier) for i in range(2)]

    return _spawn_pair(_lone, args_of)


def run_one(batch: int, steps: int) -> tuple[float, float, float]:
    """One rank of `batch` sequences in a subprocess (a fresh process, like the ranks): (CPU ms, wall ms, 0)."""
    import subprocess

    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(batch), "--steps", str(steps)],
                         capture_output=True, text=True, check=True).stdout
    return tuple(float(x) for x in out.split("ONE ")[1].split())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64, help="sequences in all (even)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per configuration")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    steps = a.steps or (100 if a.quick else 200)
    if a.one is not None:
        from decode_step import build

        eng = build(MODEL, a.one, WARMUP + steps + 40)
        print("ONE " + " ".join(f"{x:.4f}" for x in _steps(eng, 1, None, steps)))
        return
    if a.batch % 2:
        raise SystemExit(f"--batch {a.batch} must be even (half on each rank)")
    rounds = a.rounds or (2 if a.quick else 4)
    B, h = a.batch, a.batch // 2
    res: dict[str, list] = {"1rank_B": [], "1rank_B/2": [], "2ranks": [], "2ranks_replicated": [], "2lone": [],
                            "1rank_1": [], "2ranks_1": [], "2ranks_replicated_1": []}
    for rnd in range(rounds):
        runs = [("1rank_B", lambda: [run_one(B, steps)]), ("1rank_B/2", lambda: [run_one(h, steps)]),
                ("2ranks", lambda: run_group(h, False, steps)), ("2ranks_replicated", lambda: run_group(h, True, steps)),
                ("2lone", lambda: run_lone(h, steps)),
                ("1rank_1", lambda: [run_one(1, steps)]), ("2ranks_1", lambda: run_group(1, False, steps, True)),
                ("2ranks_replicated_1", lambda: run_group(1, True, steps, True))]
        for name, fn in runs if rnd % 2 == 0 else runs[::-1]:
            r = fn()
            res[name].append(r)
            print(f"# round {rnd + 1}/{rounds} {name}: " + ", ".join(
                f"rank {i} CPU {c:.2f} ms/step, wall {w:.2f}, exchange {x:.2f}" for i, (c, w, x) in enumerate(r)),
                flush=True)

    def med(name: str, f) -> float:
        return statistics.median(f(r) for r in res[name])

    cpu = {n: med(n, lambda r: sum(c for c, _, _ in r)) for n in res}  # CPU ms per step, every rank
    wall = {n: med(n, lambda r: max(w for _, w, _ in r)) for n in res}
    exch = med("2ranks", lambda r: statistics.mean(x for _, _, x in r))
    toks = {"1rank_B": B, "1rank_B/2": h, "2ranks": B, "2ranks_replicated": B, "2lone": B, "1rank_1": 1,
            "2ranks_1": 1, "2ranks_replicated_1": 1}
    print(f"\nmachine: {os.cpu_count()} cores; {B} sequences in all; {steps} decode steps per run; rounds: {rounds}; "
          "medians; one compute thread per rank\n")
    print("| config | sequences per rank | CPU ms/step (all ranks) | wall ms/step | CPU ms/token | tok/s |")
    print("|---|---|---|---|---|---|")
    for n in res:
        per = B if n == "1rank_B" else 1 if n.endswith("_1") else h
        print(f"| {n} | {per} | {cpu[n]:.2f} | {wall[n]:.2f} | {cpu[n] / toks[n]:.4f} | {toks[n] / wall[n] * 1e3:.0f} |")
    per_seq = (cpu["1rank_B"] - cpu["1rank_B/2"]) / (B - h)
    fixed = cpu["1rank_B"] - per_seq * B
    repeat = 2 * cpu["1rank_B/2"] - cpu["1rank_B"]  # what a second rank's own step costs beyond the first's
    excess = cpu["2ranks"] - cpu["1rank_B"]
    out = {"cpu_2v1": cpu["2ranks"] / cpu["1rank_B"], "cpu_2v1_replicated": cpu["2ranks_replicated"] / cpu["1rank_B"],
           "tps_2v1": wall["1rank_B"] / wall["2ranks"], "tps_2v1_replicated": wall["1rank_B"] / wall["2ranks_replicated"],
           "fixed_ms": fixed, "per_seq_ms": per_seq, "repeat_share": repeat / excess if excess > 0 else 0.0,
           "exchange_ms": exch, "step1_2v1": wall["2ranks_1"] / wall["1rank_1"],
           "step1_2v1_replicated": wall["2ranks_replicated_1"] / wall["1rank_1"],
           "lone_2v1": cpu["2lone"] / (2 * cpu["1rank_B/2"]), "lockstep_2v1": cpu["2ranks"] / cpu["2lone"],
           "lockstep_2v1_replicated": cpu["2ranks_replicated"] / cpu["2lone"]}
    print(f"\nper-step cost of one rank: {fixed:.2f} ms fixed + {per_seq:.4f} ms per sequence; a 2-rank group's CPU "
          f"excess over 1 rank {excess:.2f} ms/step, of which the second rank's repeated per-step cost {repeat:.2f}; "
          f"sharded exchange wall {exch:.2f} ms/step per rank")
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
