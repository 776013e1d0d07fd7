"""The `balanced` policy's bias is averaged over the EP group every BIAS_SYNC_STEPS engine steps: two ranks that
route different tokens hold the same (non-zero) bias right after a sync step (real gloo group, no Ray)."""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.rank.rendezvous import host_store, join_store


def _worker(rank, world, port, model_dir, q):
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import BIAS_SYNC_STEPS, RankEngine
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=join_store("127.0.0.1", port, world, 60.0), rank=rank, world_size=world)
    mc = ModelConfig.from_pretrained(model_dir)
    eng = RankEngine(EngineConfig(model=model_dir, max_model_len=128, kv_cache_bytes=2**21, gating="balanced",
                                  gating_options={"balance_rate": 0.01}),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, world), rank, dist.group.WORLD)
    prompt = [(7 * rank + 3 * i) % 300 + 1 for i in range(9 + 5 * rank)]  # different tokens per rank
    eng.add_request(GenerateRequest(request_id=f"r{rank}", prompt_ids=prompt, params=SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True).to_dict()))
    biases = []
    for step in range(1, 2 * BIAS_SYNC_STEPS + 1):
        eng.step()  # every rank steps the same number of times (as the lockstep loop guarantees)
        if step in (BIAS_SYNC_STEPS - 1, BIAS_SYNC_STEPS):
            biases.append(eng.model.gating_router.bias.tolist())
    # plain lists, not tensors: a tensor on an mp queue is shared by file descriptor, which the parent may try to
    # open after this process has exited (FileNotFoundError under load)
    q.put((rank, biases))
    dist.barrier()
    dist.destroy_process_group()


def test_balancing_bias_is_averaged_over_ranks(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2_moe")
    store = host_store(2)  # held until the workers are done
    port = store.port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, model_dir, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    before = [torch.tensor(got[r][0]) for r in (0, 1)]  # the step before a sync: each rank's own updates
    after = [torch.tensor(got[r][1]) for r in (0, 1)]  # right after the sync
    assert not torch.equal(before[0], before[1])  # they routed different tokens
    torch.testing.assert_close(after[0], after[1])
    assert after[0].abs().max() > 0
