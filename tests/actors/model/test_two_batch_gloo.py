"""Two-batch overlap (`actors.model.two_batch`) over real 2-rank groups (no Ray): the tokens of engines with
`two_batch_overlap` on equal those with it off and those of one engine holding every request (fp32, greedy), and the
router thrash metric is the same with it on and off, over gloo alone (transport "torch": async_op all-to-alls) and
over the TCP transport (post / complete), at batch 8 and 9 (odd halves), with the ranks holding different numbers of
sequences, a rank with one sequence (its second micro-batch empty) and one with none, with a padding gating policy
(`dynamic`), a per-sequence one (`sticky`), fully replicated experts (no collective) and a 4-bit KV cache (the
shipped model and its profiles; prompts that fill a block during the TBO steps, so blocks seal there). The tiny
model has a shared expert and a dense layer between MoE layers."""
from __future__ import annotations

import torch

import torch.distributed as dist

from actors.rank.rendezvous import join_store
from tests.spawn import spawn_ranks

MAX_TOKENS = 5
# (sequences on rank 0, on rank 1, gating policy, redundant experts, kv_bits: None = the tiny model, full precision)
CASES = {"torch": [(8, 3, "exact", False, None), (9, 0, "dynamic", False, None), (9, 4, "exact", True, None),
                   (9, 2, "exact", False, 4)],
         "tcp": [(9, 1, "exact", False, None), (8, 0, "sticky", False, None)]}


def _prompt(rank: int, i: int, base: int) -> list[int]:
    return [(11 * rank + 7 * i + 3 * j) % 300 + 1 for j in range(base + (i + rank) % 5)]


def _model(tiny_dir: str, kv_bits) -> str:
    from cluster.config import DEFAULT_MODEL

    return tiny_dir if kv_bits is None else DEFAULT_MODEL


def _cfg(model_dir: str, gating: str, tbo: bool, kv_bits=None):
    from actors.engine.config import EngineConfig

    return EngineConfig(model=model_dir, max_model_len=64, kv_cache_bytes=2**22, gating=gating, max_num_seqs=16,
                        two_batch_overlap=tbo, kv_bits=kv_bits)


def _placement(model_dir: str, world: int, redundant: bool):
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from cluster.placement import redundant_placement

    mc = ModelConfig.from_pretrained(model_dir)
    if redundant:
        return redundant_placement(mc.num_layers, mc.num_experts, world)
    return ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, world)


def _add(eng, rank: int, n: int, base: int) -> None:
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams

    for i in range(n):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True).to_dict()
        eng.add_request(GenerateRequest(request_id=f"r{rank}.{i}", prompt_ids=_prompt(rank, i, base), params=params))


def _collect(outs, toks: dict) -> None:
    for o in outs:
        assert o.error is None, o.error
        toks.setdefault(o.request_id, []).extend(o.token_ids)


def _worker(rank, world, port, model_dir, transport, q):
    from actors.engine.engine import RankEngine
    from actors.rank.tcp_collective import TcpAllToAll

    torch.set_num_threads(1)
    store = join_store("127.0.0.1", port, world, 60.0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    tcp = TcpAllToAll.setup(store, rank, world, "127.0.0.1", timeout_s=30.0) if transport == "tcp" else None
    assert (tcp is not None) == (transport == "tcp")
    results = []
    for counts0, counts1, gating, redundant, kv_bits in CASES[transport]:
        model = _model(model_dir, kv_bits)
        for tbo in (False, True):
            eng = RankEngine(_cfg(model, gating, tbo, kv_bits), _placement(model, world, redundant), rank,
                             dist.group.WORLD, shm=tcp)
            _add(eng, rank, (counts0, counts1)[rank], 3 if kv_bits is None else 13)
            toks: dict = {}
            while True:  # the lockstep loop's agreement: any work, the largest step, any prefill
                plan = eng.plan()
                flags = torch.tensor([int(eng.has_work or plan.num_tokens > 0), plan.num_tokens,
                                      int(bool(plan.meta.prefills))])
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                work, t_max, prefill = flags.tolist()
                if not work:
                    break
                _collect(eng.run(plan, t_max, decode_only=not prefill), toks)
            thrash = [round(t, 9) if t == t else None for t in eng.model.gating_router.stats()["thrash"]]
            results.append((tbo, toks, eng.model.two_batch_steps, thrash))
    if tcp is not None:
        assert tcp.calls > 0 and tcp.outstanding == 0
        tcp.close()
    q.put((rank, results))  # plain lists: a queued tensor is shared by fd, gone once this process exits
    dist.barrier()
    dist.destroy_process_group()


def _one_rank(model_dir: str, counts: tuple[int, int], gating: str, kv_bits) -> dict:
    from actors.engine.engine import RankEngine

    model = _model(model_dir, kv_bits)
    eng = RankEngine(_cfg(model, gating, False, kv_bits), _placement(model, 1, False), 0, None)
    for r, n in enumerate(counts):
        _add(eng, r, n, 3 if kv_bits is None else 13)
    toks: dict = {}
    while eng.has_work:
        _collect(eng.step(), toks)
    return toks


def _run(model_dir: str, transport: str) -> None:
    got = spawn_ranks(_worker, 2, model_dir, transport)
    for i, (c0, c1, gating, _, kv_bits) in enumerate(CASES[transport]):
        ref = _one_rank(model_dir, (c0, c1), gating, kv_bits)
        assert len(ref) == c0 + c1 and all(len(t) == MAX_TOKENS for t in ref.values())
        for rank in (0, 1):
            (off, toks_off, steps_off, th_off), (on, toks_on, steps_on, th_on) = got[rank][2 * i], got[rank][2 * i + 1]
            assert not off and on
            assert steps_off == 0 and steps_on == MAX_TOKENS - 1, (rank, steps_on)  # every decode step, every rank
            mine = {k: v for k, v in ref.items() if k.startswith(f"r{rank}.")}
            assert toks_off == mine, (transport, i, rank, "no TBO vs one rank")
            assert toks_on == toks_off, (transport, i, rank, "TBO vs no TBO")
            assert th_on == th_off, (transport, i, rank, "router thrash, TBO vs no TBO")  # both halves accounted


def test_two_batch_overlap_over_gloo_equals_one_batch_and_one_rank(tiny_model_dir):
    _run(tiny_model_dir("qwen2_moe", num_layers=3), "torch")


def test_two_batch_overlap_over_tcp_equals_one_batch_and_one_rank(tiny_model_dir):
    _run(tiny_model_dir("qwen2_moe", num_layers=3), "tcp")
