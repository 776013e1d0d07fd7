"""The decode exchange in the shared-memory segment's slots (`actors.moe.slot_exchange`) over real processes: equal
to world_size == 1 and to the fixed-capacity exchange it replaces (to fp32 rounding), for bf16 experts (the compiled
path) and fp32 ones (run_padded chunk by chunk), with a rank holding no tokens, several layers and steps in a row,
the transport's own all-to-all between steps, and a peer that arrives late."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.experts import LocalExperts
from actors.moe.placement import ExpertPlacement
from actors.rank.rendezvous import host_store, join_store
from kernels.cpu import cpu_kernels_available
from kernels.gating import topk_softmax_ref

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the slot exchange needs the compiled kernels")

E, D, I, K, L, STEPS = 7, 16, 12, 2, 2, 3
TOKENS = (5, 0, 9)  # per rank: rank 1 has none (it only serves its experts)


def _data(wdtype):
    g = torch.Generator().manual_seed(0)
    wgu = [torch.randn(E, 2 * I, D, generator=g).to(wdtype) for _ in range(L)]
    wd = [torch.randn(E, D, I, generator=g).to(wdtype) for _ in range(L)]
    gate = [torch.randn(E, D, generator=g) for _ in range(L)]
    xs = [torch.randn(n, D, generator=g) for n in TOKENS]
    return wgu, wd, gate, xs


def _layers(disp, experts, gate, x, step, world, shm=None, late_rank=None, rank=0):
    """STEPS steps of L layers on x (each layer's input made from the step and layer): the outputs, in order."""
    outs = []
    t_max = max(TOKENS[:world])
    for s in range(step):
        if shm is not None:  # the lockstep loop's agreement between steps: the transport's own all-to-all
            flags = torch.full((world,), rank, dtype=torch.int64)
            got = torch.empty_like(flags)
            shm.all_to_all_single(got, flags, within_step=True)
            assert got.tolist() == list(range(world))
        for layer in range(L):
            xl = x * (s + 1) + 0.1 * layer
            w, ids = topk_softmax_ref(xl @ gate[layer].T, K, False)
            if rank == late_rank and layer == 1:
                time.sleep(0.05)  # the peers wait (spin, then futex) for this rank's rows
            rows, handle = disp.dispatch(layer, xl, ids, may_pad=False, step_max_tokens=t_max)
            outs.append(disp.combine(rows.run(experts[layer], w), handle, w))
    return outs


def _worker(rank, world, port, q, wdtype, late_rank):
    from actors.moe.slot_exchange import SlotExchange
    from actors.rank.shm_collective import ShmAllToAll

    store = join_store("127.0.0.1", port, world, 60.0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    shm = ShmAllToAll.setup(store, rank, world, timeout_s=30.0)
    wgu, wd, gate, xs = _data(wdtype)
    pl = ExpertPlacement.contiguous(L, E, world)
    experts = [LocalExperts(wgu[l][pl.local_experts(l, rank)], wd[l][pl.local_experts(l, rank)]) for l in range(L)]
    disp = AllToAllDispatcher(pl, rank, shm=shm, max_experts_per_token=K)
    assert isinstance(disp._slots, SlotExchange)
    calls = shm.calls
    slots = _layers(disp, experts, gate, xs[rank], STEPS, world, shm, late_rank, rank)
    assert shm.calls - calls == STEPS * (1 + 2 * L)  # the agreement, then a dispatch and a combine per layer
    assert disp.sent_rows.sum().item() == STEPS * L * TOKENS[rank] * K
    disp._slots = None  # the fixed-capacity exchange through the same transport, for comparison
    fixed = _layers(disp, experts, gate, xs[rank], STEPS, world, shm, None, rank)
    shm.close()
    q.put((rank, [o.numpy() for o in slots], [o.numpy() for o in fixed]))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world,wdtype,late_rank", [(2, torch.bfloat16, None), (3, torch.bfloat16, 2),
                                                    (3, torch.float32, None), (2, torch.float32, 0)])
def test_slots_equal_one_rank_and_the_fixed_capacity_exchange(world, wdtype, late_rank):
    wgu, wd, gate, xs = _data(wdtype)
    ref_disp = AllToAllDispatcher(ExpertPlacement.contiguous(L, E, 1), 0)
    ref_experts = [LocalExperts(wgu[l], wd[l]) for l in range(L)]
    refs = [_layers(ref_disp, ref_experts, gate, xs[r], STEPS, 1) for r in range(world)]
    store = host_store(world)  # held until the workers are done
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, q, wdtype, late_rank)) for r in range(world)]
    for p in procs:
        p.start()
    got = {r: (s, f) for r, s, f in (q.get(timeout=120) for _ in range(world))}
    for p in procs:
        p.join(timeout=60)
    for r in range(world):
        slots, fixed = got[r]
        assert len(slots) == len(refs[r]) == STEPS * L
        for s, f, ref in zip(slots, fixed, refs[r]):
            s, f = torch.from_numpy(s), torch.from_numpy(f)
            assert s.shape == ref.shape == (TOKENS[r], D)
            assert torch.allclose(s, f, rtol=1e-5, atol=1e-4), r  # the same kernels, rows grouped by source
            assert torch.allclose(s, ref, rtol=1e-5, atol=1e-4), r
