"""Engines driven directly (`RankEngine.step`) with a group sum the `balanced` load over it every step: two ranks
that route different tokens hold the same (non-zero) bias after every step, the bias one engine holds after
routing both ranks' tokens (real gloo group, no Ray; the lockstep loop's path is tests/cluster/test_balanced_ranks.py)."""
from __future__ import annotations


import torch

import torch.distributed as dist

from actors.rank.rendezvous import join_store
from tests.spawn import spawn_ranks


STEPS = 12


def _prompt(rank: int) -> list[int]:
    return [(7 * rank + 3 * i) % 300 + 1 for i in range(9 + 5 * rank)]  # different tokens per rank


def _worker(rank, world, port, model_dir, q):
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=join_store("127.0.0.1", port, world, 60.0), rank=rank, world_size=world)
    mc = ModelConfig.from_pretrained(model_dir)
    eng = RankEngine(EngineConfig(model=model_dir, max_model_len=128, kv_cache_bytes=2**21, gating="balanced",
                                  gating_options={"balance_rate": 0.01}),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, world), rank, dist.group.WORLD)
    eng.add_request(GenerateRequest(request_id=f"r{rank}", prompt_ids=_prompt(rank), params=SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True).to_dict()))
    biases = []
    for _ in range(STEPS):
        eng.step()  # every rank steps the same number of times (as the lockstep loop guarantees)
        biases.append(eng.model.gating_router.bias.tolist())
    # plain lists, not tensors: a tensor on an mp queue is shared by file descriptor, which the parent may try to
    # open after this process has exited (FileNotFoundError under load)
    q.put((rank, biases))
    dist.barrier()
    dist.destroy_process_group()


def test_balancing_bias_is_the_same_on_every_rank_after_every_step(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2_moe")
    got = spawn_ranks(_worker, 2, model_dir)
    per_rank = [torch.tensor(got[r]) for r in (0, 1)]  # [STEPS, L, E] each
    assert torch.equal(per_rank[0], per_rank[1])  # the same bias after every step
    assert float(per_rank[0][-1].abs().max()) > 0
    # one engine routing both prompts in the same steps holds the same bias (greedy tokens agree too)
    import numpy as np

    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams

    mc = ModelConfig.from_pretrained(model_dir)
    eng = RankEngine(EngineConfig(model=model_dir, max_model_len=128, kv_cache_bytes=2**21, gating="balanced",
                                  gating_options={"balance_rate": 0.01}),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1), 0, None)
    for r in (0, 1):
        eng.add_request(GenerateRequest(request_id=f"r{r}", prompt_ids=_prompt(r), params=SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True).to_dict()))
    alone = []
    for _ in range(STEPS):
        eng.step()
        alone.append(eng.model.gating_router.bias.tolist())
    np.testing.assert_allclose(np.array(alone), per_rank[0].numpy(), rtol=0, atol=1e-6)
