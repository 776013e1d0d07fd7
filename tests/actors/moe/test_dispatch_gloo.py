"""All-to-all dispatch over a real gloo group (no Ray): N ranks equal world_size == 1, including an
expert count that does not divide by the rank count and ranks with zero tokens, with counts exchanged and
with the fixed-capacity (decode) exchange, in fp32 and bf16 (ids in their own collective), over gloo alone and
with the shared-memory transport."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.placement import ExpertPlacement
from actors.moe.experts import LocalExperts
from actors.rank.rendezvous import host_store, join_store
from kernels.gating import topk_softmax_ref

E, D, I, K = 7, 12, 10, 2


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    wgu = torch.randn(E, 2 * I, D, generator=g)
    wd = torch.randn(E, D, I, generator=g)
    gate = torch.randn(E, D, generator=g)
    xs = [torch.randn(n, D, generator=g) for n in (5, 0, 9)]  # tokens per rank (rank 1 has none)
    return wgu, wd, gate, xs


def _worker(rank, world, port, q, fixed=False, dtype=torch.float32, shm=False):
    from actors.rank.shm_collective import ShmAllToAll

    store = join_store("127.0.0.1", port, world, 60.0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    wgu, wd, gate, xs = _data()
    pl = ExpertPlacement.contiguous(1, E, world)
    loc = pl.local_experts(0, rank)
    experts = LocalExperts(wgu[loc], wd[loc])
    experts = LocalExperts(experts.w_gate_up.to(dtype), experts.w_down.to(dtype))
    # shm: the same-node transport of every exchange (an int: its slot bytes, small enough to need pieces); then
    # torch.distributed's all-to-all is never called (no uneven gloo all-to-all: `AgreedCapacityExchange`)
    kw = {} if shm is True else {"slot_bytes": shm}
    transport = ShmAllToAll.setup(store, rank, world, timeout_s=30.0, **kw) if shm else None
    if shm:
        def no_gloo(*a, **k):
            raise AssertionError("torch.distributed all_to_all_single called with a same-node transport")
        dist.all_to_all_single = no_gloo
    disp = AllToAllDispatcher(pl, rank, shm=transport, max_experts_per_token=K)
    # fixed: what the lockstep loop agrees on, the largest token count of the step on any rank
    step_max_tokens = max(len(t) for t in xs) if fixed else None
    x = xs[rank]
    w, ids = topk_softmax_ref(x @ gate.T, K, False)
    for _ in range(3):  # several layers/steps in a row keep the collectives paired
        out = disp.run(0, x.to(dtype), ids, w, experts, step_max_tokens=step_max_tokens).float()
    if fixed:
        assert disp.sent_rows.sum().item() == 3 * ids.numel()
    if shm:
        assert disp.shm.calls >= 3  # it carried the exchanges (fixed: rows and results; else: the counts)
        disp.shm.close()
    q.put((rank, out.numpy()))  # by value: a queued tensor is shared by fd, gone once this process exits
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("fixed,dtype,shm", [(False, torch.float32, False), (True, torch.float32, False),
                                             (True, torch.bfloat16, False), (True, torch.float32, True),
                                             (False, torch.float32, True), (False, torch.float32, 120),
                                             (False, torch.bfloat16, 120), (True, torch.float32, 120)])
def test_three_ranks_equal_one_rank(fixed, dtype, shm):
    wgu, wd, gate, xs = _data()
    pl1 = ExpertPlacement.contiguous(1, E, 1)
    ref_disp = AllToAllDispatcher(pl1, 0)
    ref_experts = LocalExperts(wgu, wd)
    refs = []
    for x in xs:
        w, ids = topk_softmax_ref(x @ gate.T, K, False)
        refs.append(ref_disp.run(0, x, ids, w, ref_experts))
    store = host_store(3)  # held until the workers are done
    port = store.port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 3, port, q, fixed, dtype, shm)) for r in range(3)]
    for p in procs:
        p.start()
    got = {r: torch.from_numpy(a) for r, a in (q.get(timeout=120) for _ in range(3))}
    for p in procs:
        p.join(timeout=60)
    for r in range(3):
        assert got[r].shape == refs[r].shape
        tol = 1e-5 if dtype == torch.float32 else 0.1 * (refs[r].abs().max().item() if refs[r].numel() else 0.0)
        assert torch.allclose(got[r], refs[r], atol=tol), r


def test_uneven_contiguous_placement():
    pl = ExpertPlacement.contiguous(2, 60, 8)
    sizes = [len(pl.local_experts(0, r)) for r in range(8)]
    assert sum(sizes) == 60 and set(sizes) == {7, 8}
    assert sorted(e for r in range(8) for e in pl.local_experts(1, r)) == list(range(60))
