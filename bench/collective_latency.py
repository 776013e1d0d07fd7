"""Latency of the small torch.distributed collectives one decode step makes, between 2 local processes.

Measures what the 2-rank decode step pays per collective on this machine: the MoE dispatch's all-to-all of a
few rows (fp32, D + 1 columns) and the step agreement (5 int64 per rank) done as an all_reduce(MAX) or as an
all-to-all of the replicated flags, over torch.distributed and (gloo only) over the same-node shared-memory
transport that `actors.rank.worker` uses for both (`actors.rank.shm_collective`).

    python bench/collective_latency.py            # 2000 iterations per row
    python bench/collective_latency.py --quick    # 300
    python bench/collective_latency.py --backend nccl   # on a 2-GPU machine

Last line: RESULT a2a_rows_us=<x> allreduce_flags_us=<x> a2a_flags_us=<x> shm_a2a_rows_us=<x> shm_a2a_flags_us=<x>
(wall microseconds per call, rank 0; the shm keys are nan with --backend nccl)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, backend: str, iters: int, q) -> None:
    torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    from actors.rank.rendezvous import join_store
    from actors.rank.shm_collective import ShmAllToAll

    store = join_store("127.0.0.1", port, 2, 60.0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
    shm = ShmAllToAll.setup(store, rank, 2, timeout_s=30.0) if backend == "gloo" else None
    rows = torch.zeros(2 * 4, 257, device=dev)  # 4 rows of D + 1 = 257 fp32 to each rank
    rows_out = torch.empty_like(rows)
    flags = torch.zeros(5, dtype=torch.int64, device=dev)
    flags_rep, flags_in = torch.zeros(10, dtype=torch.int64, device=dev), torch.zeros(10, dtype=torch.int64, device=dev)
    cases = {
        "a2a_rows_us": lambda: dist.all_to_all_single(rows_out, rows),
        "allreduce_flags_us": lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX),
        "a2a_flags_us": lambda: dist.all_to_all_single(flags_in, flags_rep),
    }
    if shm is not None:
        cases["shm_a2a_rows_us"] = lambda: shm.all_to_all_single(rows_out, rows)
        cases["shm_a2a_flags_us"] = lambda: shm.all_to_all_single(flags_in, flags_rep)
    out = {}
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t) / iters * 1e6
    if rank == 0:
        q.put(out)
    if shm is not None:
        shm.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()
    iters = 300 if args.quick else 2000
    from actors.rank.rendezvous import host_store
    store = host_store(2)  # held until the workers are done
    port = store.port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args.backend, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for k in ("shm_a2a_rows_us", "shm_a2a_flags_us"):  # every key always present
        res.setdefault(k, float("nan"))
    for p in procs:
        p.join(timeout=60)
    print(f"backend {args.backend}, 2 processes, {iters} calls each, wall us per call (rank 0)")
    print("| collective | us |")
    print("|---|---|")
    for k, v in res.items():
        print(f"| {k[:-3]} | {v:.1f} |")
    print("RESULT " + " ".join(f"{k}={v:.1f}" for k, v in res.items()))


if __name__ == "__main__":
    main()
