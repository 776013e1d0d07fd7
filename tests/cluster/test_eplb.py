"""EPLB-style expert placement: the planner, the placement type, replica-aware dispatch (gloo, no Ray),
padding ids, the engine's placement switch, and rebalancing a running 2-rank Ray cluster mid-generation."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.placement import ExpertPlacement, water_fill
from actors.moe.experts import LocalExperts
from actors.rank.rendezvous import host_store, join_store
from cluster.metrics import aggregate_stats, balancedness
from cluster.placement import eplb_placement, expected_rank_load
from kernels.gating import topk_softmax_ref

E, D, I, K = 7, 12, 10, 2
SKEW = [[100, 50, 1, 1, 1, 1, 1], [5, 5, 5, 5, 5, 5, 60]]  # two layers, hot experts 0/1 and 6


# ----------------------------------------------------------------------------- planner
def test_planner_replicates_hot_experts_and_bounds_slots():
    for W, R in [(2, 2), (3, 3), (4, 5)]:
        p = eplb_placement(SKEW, W, R)
        slots = math.ceil((E + R) / W)
        for l in range(2):
            assert all(1 <= p.num_replicas(l, e) <= W for e in range(E))
            for r in range(W):
                held = p.local_experts(l, r)
                assert len(held) <= slots and len(set(held)) == len(held)
            assert p.num_redundant(l) <= R
        assert p.num_replicas(0, 0) > 1 and p.num_replicas(1, 6) > 1  # the hottest expert is replicated
        assert p.num_replicas(0, 0) >= p.num_replicas(0, 2)
        before = expected_rank_load(ExpertPlacement.contiguous(2, E, W), SKEW)
        after = expected_rank_load(p, SKEW)
        for l in range(2):
            assert balancedness(after[l]) > balancedness(before[l])
            assert sum(after[l]) == pytest.approx(sum(SKEW[l]))


def test_planner_edge_cases():
    p = eplb_placement([[0] * E, SKEW[0]], 2, 2, dense_layers=[])
    assert p.replicas[0] == ExpertPlacement.contiguous(1, E, 2).replicas[0]  # no evidence: left alone
    assert eplb_placement(SKEW, 1, 0).replicas == ExpertPlacement.contiguous(2, E, 1).replicas
    assert eplb_placement(SKEW, 2, 0).num_redundant(0) == 0
    with pytest.raises(ValueError, match="num_redundant=8"):
        eplb_placement(SKEW, 2, 8)
    with pytest.raises(ValueError, match="negative"):
        eplb_placement([[1, -1]], 2, 0)


def test_placement_dict_round_trip_and_validation():
    p = eplb_placement(SKEW, 3, 3)
    q = ExpertPlacement.from_dict(p.to_dict())
    assert q.replicas == p.replicas and q.rank_of == p.rank_of and q.local_index == p.local_index
    old = {"num_experts": 2, "world_size": 2, "rank_of": [[0, 1]], "local_index": [[0, 0]]}  # pre-replica format
    assert ExpertPlacement.from_dict(old).replicas == [[[(0, 0)], [(1, 0)]]]
    with pytest.raises(ValueError, match="two replicas on one rank"):
        ExpertPlacement(num_experts=1, world_size=2, replicas=[[[(0, 0), (0, 0)]]])
    with pytest.raises(ValueError, match="no replica"):
        ExpertPlacement(num_experts=2, world_size=2, replicas=[[[(0, 0)], []]])
    with pytest.raises(ValueError, match="not 0..1"):
        ExpertPlacement(num_experts=2, world_size=2, replicas=[[[(0, 0)], [(0, 2)]]])


def test_water_fill_equals_one_row_at_a_time():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        m = int(torch.randint(1, 5, (1,), generator=g))
        loads = torch.randint(0, 10, (m,), generator=g).tolist()
        n = int(torch.randint(0, 30, (1,), generator=g))
        prefer = torch.randperm(m, generator=g).tolist()
        cur, ref = list(loads), [0] * m
        for _ in range(n):
            j = min(range(m), key=lambda j: (cur[j], prefer[j]))
            cur[j] += 1
            ref[j] += 1
        assert water_fill(loads, n, prefer) == ref


def test_route_splits_replicated_expert_to_least_loaded_rank():
    # expert 0 on ranks 0 and 1; expert 1 only on rank 1
    pl = ExpertPlacement(num_experts=2, world_size=2, replicas=[[[(0, 0), (1, 0)], [(1, 1)]]])
    disp = AllToAllDispatcher(pl, rank=0)
    ids = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0, 0])  # 4 rows already go to rank 1
    dest, local = disp._route(0, ids)
    assert dest.tolist() == [1, 1, 1, 1] + [0] * 5 + [1]  # 6 rows of expert 0: 5 to rank 0, 1 to rank 1
    assert local.tolist() == [1, 1, 1, 1] + [0] * 6
    even = disp._route(0, torch.zeros(4, dtype=torch.int64))[0]
    assert even.tolist() == [0, 0, 1, 1]


# ----------------------------------------------------------------------------- dispatch
def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    wgu = torch.randn(E, 2 * I, D, generator=g)
    wd = torch.randn(E, D, I, generator=g)
    gate = torch.randn(E, D, generator=g)
    xs = [torch.randn(n, D, generator=g) for n in (6, 0, 11)]  # tokens per rank (rank 1 has none)
    return wgu, wd, gate, xs


def _routing(x, gate, pad: bool):
    """Top-2 routing, skewed towards experts 0 and 1; with pad, every third token uses one expert (id -1, w 0)."""
    logits = x @ gate.T
    logits[:, 0] += 3.0
    logits[:, 1] += 2.0
    w, ids = topk_softmax_ref(logits, K, False)
    if pad and len(ids):
        ids[::3, 1] = -1
        w[::3, 1] = 0.0
    return w, ids


class _Counting:
    """LocalExperts wrapper that records the local ids it was asked to compute."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, x, lid):
        self.seen.append(lid.clone())
        return self.inner(x, lid)


def _worker(rank, world, port, placement, q):
    try:
        _work(rank, world, port, placement, q)
    except BaseException as e:  # noqa: BLE001 - report to the test instead of dying silently
        q.put((rank, f"{type(e).__name__}: {e}", None, None))


def _work(rank, world, port, placement, q):
    dist.init_process_group("gloo", store=join_store("127.0.0.1", port, world, 60.0), rank=rank, world_size=world)
    try:
        wgu, wd, gate, xs = _data()
        pl = ExpertPlacement.from_dict(placement)
        loc = pl.local_experts(0, rank)
        experts = _Counting(LocalExperts(wgu[loc], wd[loc]))
        disp = AllToAllDispatcher(pl, rank)
        outs = []
        for pad in (False, True):
            w, ids = _routing(xs[rank], gate, pad)
            outs.append(disp.run(0, xs[rank], ids, w, experts))
        # arrays by value: a queued tensor is shared by fd, which is gone once this process exits
        q.put((rank, [o.numpy() for o in outs], disp.sent_rows[0].tolist(), sum(int((s < 0).sum()) for s in experts.seen)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _reference(pad: bool):
    wgu, wd, gate, xs = _data()
    disp = AllToAllDispatcher(ExpertPlacement.contiguous(1, E, 1), 0)
    counting = _Counting(LocalExperts(wgu, wd))
    refs = []
    for x in xs:
        w, ids = _routing(x, gate, pad)
        refs.append(disp.run(0, x, ids, w, counting))
    return refs, counting


def test_padding_ids_are_never_computed_and_contribute_zero():
    refs, counting = _reference(pad=True)
    wgu, wd, gate, xs = _data()
    for x, ref in zip(xs, refs):
        w, ids = _routing(x, gate, True)
        manual = torch.zeros_like(x)
        for t in range(len(x)):
            for k in range(K):
                e = int(ids[t, k])
                if e >= 0:
                    one = LocalExperts(wgu[e:e + 1], wd[e:e + 1])
                    manual[t] += w[t, k] * one(x[t:t + 1], torch.zeros(1, dtype=torch.int64))[0]
        assert torch.allclose(ref, manual, atol=1e-5)
    assert all(int((s < 0).sum()) == 0 for s in counting.seen)
    n_valid = sum(int((_routing(x, gate, True)[1] >= 0).sum()) for x in xs)
    assert sum(len(s) for s in counting.seen) == n_valid


def test_three_ranks_with_replicas_equal_one_rank():
    refs = {pad: _reference(pad)[0] for pad in (False, True)}
    wgu, wd, gate, xs = _data()
    # expert 0 on every rank, expert 1 on two (the routing favours both)
    pl = ExpertPlacement(num_experts=E, world_size=3, replicas=[[
        [(0, 0), (1, 0), (2, 0)], [(0, 1), (2, 1)], [(1, 1)], [(1, 2)], [(2, 2)], [(0, 2)], [(1, 3)]]])
    store = host_store(3)  # held until the workers are done
    port = store.port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 3, port, pl.to_dict(), q)) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(3):
        rank, outs, sent, neg = q.get(timeout=120)
        assert not isinstance(outs, str), f"rank {rank}: {outs}"
        got[rank] = ([torch.from_numpy(o) for o in outs], sent, neg)
    for p in procs:
        p.join(timeout=60)
    for r in range(3):
        for i, pad in enumerate((False, True)):
            assert got[r][0][i].shape == refs[pad][r].shape
            assert torch.allclose(got[r][0][i], refs[pad][r], atol=1e-5), (r, pad)
        assert got[r][2] == 0  # no padding row reached any expert
    valid = sum(int((_routing(x, gate, pad)[1] >= 0).sum()) for x in xs for pad in (False, True))
    assert sum(sum(got[r][1]) for r in range(3)) == valid  # every valid pair sent exactly once


def test_aggregate_stats_splits_replicated_load():
    pl = ExpertPlacement(num_experts=2, world_size=2, replicas=[[[(0, 0), (1, 0)], [(1, 1)]]])
    rank = {"expert_load": [[10, 4]], "kv_blocks_total": 1, "kv_blocks_free": 1, "running": 0, "waiting": 0,
            "dispatch_rows": [[3, 2]]}
    s = aggregate_stats([rank, dict(rank, dispatch_rows=[[4, 5]])], pl)
    assert s["rank_load"] == [[10.0, 18.0]]
    assert s["dispatch_rank_rows"] == [[7, 7]] and s["dispatch_rank_balancedness"] == [1.0]
    assert s["redundant_experts"] == [1]


# ----------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("qwen2_moe", num_layers=3)


@pytest.mark.parametrize("weight_bits", [None, 4])
def test_engine_apply_placement_keeps_logits(model_path, weight_bits):
    from actors.model.config import ModelConfig
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine

    mc = ModelConfig.from_pretrained(model_path)
    cfg = EngineConfig(model=model_path, max_model_len=64, kv_cache_bytes=1 << 20, weight_bits=weight_bits)
    eng = RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    prompt = list(range(5, 25))
    before = eng.prompt_logits(prompt)
    E_ = mc.num_experts  # world size 1: only the local row order can change; reverse it
    rev = ExpertPlacement(num_experts=E_, world_size=1,
                          replicas=[[[(0, E_ - 1 - e)] for e in range(E_)] for _ in range(mc.num_layers)])
    runtime = eng.expert_runtime
    eng.apply_placement(rev)
    assert eng.dispatcher.placement is rev
    if weight_bits is None:
        assert eng.expert_runtime is None and eng.model.experts[0].num_local == E_
    else:  # the packed expert store was rebuilt for the new shard
        assert eng.expert_runtime is not None and eng.expert_runtime is not runtime
        assert eng.expert_runtime.local[0] == rev.local_experts(0, 0)
    after = eng.prompt_logits(prompt)
    assert torch.allclose(before, after, atol=1e-4)


# ----------------------------------------------------------------------------- cluster
def test_rebalance_running_cluster_mid_generation(ray_session, model_path):
    from actors.engine.sampling import SamplingParams
    from moeray import LLM

    prompts = ["def add(a, b):", "import os\nimport sys", "class Foo:\n    def", "for i in range(10):", "x = [",
               "return self"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(model=model_path, ranks=2, max_model_len=128, kv_cache_bytes=4 << 20) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params)]
        mc = llm.cluster.model_config
        skew = [[1000 if e == 0 else 10 * (e + 1) for e in range(mc.num_experts)] if mc.moe_layers[l]
                else [0] * mc.num_experts for l in range(mc.num_layers)]
        streams = [llm.stream(p, params) for p in prompts]
        next(iter(streams[0]))  # generation under way
        res = llm.cluster.rebalance(load=skew, num_redundant=2)
        assert res["epoch"] == 1 and sum(res["redundant"]) > 0
        assert all(a >= b for a, b in zip(res["rank_balance_after"], res["rank_balance_before"]))
        res2 = llm.cluster.rebalance(window_s=60.0)  # the observed sliding window, second epoch
        assert res2["epoch"] == 2 and res2["tokens"] > 0
        outs = [s.result(timeout=120) for s in streams]
        assert [o.token_ids for o in outs] == ref  # no request lost, same greedy tokens
        assert all(o.finish_reason == "length" and o.error is None for o in outs)
        st = llm.stats()
        assert all(r["placement_epoch"] == 2 for r in st["ranks"])
        assert res["step"] < st["ranks"][0]["steps"]  # the switch happened while steps were still to come
        assert st["kv_blocks_free"] == st["kv_blocks_total"]
        assert len(st["dispatch_rank_rows"]) == mc.num_layers
        # the cluster keeps serving after the switch
        assert llm.generate(prompts[:2], params)[0].token_ids == ref[0]
