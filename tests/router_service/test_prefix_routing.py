"""Prefix-aware routing through a real 2-rank cluster: a request sharing a long prefix with an earlier one goes to
that one's rank (not the least-loaded) and hits its prefix cache, unless that rank is busier than the threshold;
its tokens equal a run that neither routes by prefix nor reuses the cache."""
from __future__ import annotations

import time

import pytest

from actors.engine.sampling import SamplingParams
from tests.router_service.conftest import wait_idle

pytestmark = pytest.mark.ray

PREFIX = [(7 * i) % 300 + 10 for i in range(96)]  # 6 full KV blocks (tiny vocab 320)


@pytest.fixture(scope="module")
def llm(ray_session, tiny_moe_dir):
    from moeray.api import LLM

    llm = LLM(model=tiny_moe_dir, ranks=2, kv_cache_bytes=4 * 2**20, max_num_seqs=16,
              prefix_routing_imbalanced_threshold=1)
    yield llm
    llm.shutdown()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def rank_hits(router) -> list[int]:
    return [r["prefix_cache_hits"] for r in router.stats()["ranks"]]


def test_shared_prefix_follows_its_rank_unless_overloaded(llm):
    router = llm.router
    filler = router.submit([5, 6, 7, 8], greedy(200))  # keeps rank 0 the busier one while `a` is placed
    a = router.submit(PREFIX + [11, 12, 13, 14, 15, 16, 17, 18], greedy(2))
    assert (filler.rank, a.rank) == (0, 1)  # least-loaded: nothing matched yet
    a.result()
    router.abort(filler.request_id)
    wait_idle(router)
    hits0, routed0 = rank_hits(router), router.stats()["prefix_routed"]

    b_prompt = PREFIX + [21, 22, 23, 24, 25, 26, 27, 28]
    b = router.submit(b_prompt, greedy(8))
    assert b.rank == 1  # the idle cluster's least-loaded rank is 0: prefix affinity chose 1
    b_out = b.result()
    hits = rank_hits(router)
    assert hits[1] - hits0[1] == 96 and hits[0] == hits0[0]  # the 6 shared blocks were reused on rank 1
    assert router.stats()["prefix_routed"] == routed0 + 1

    # the same prompt, neither routed by prefix nor reusing the cache (prompt_logprobs scores every position)
    ref = router.submit(b_prompt, greedy(8, prompt_logprobs=0))
    assert ref.rank == 0
    assert ref.result().token_ids == b_out.token_ids and len(b_out.token_ids) == 8
    wait_idle(router)
    assert rank_hits(router)[0] == hits[0]

    # threshold 1: rank 1 takes requests of this prefix while it has at most 1 more in flight than rank 0
    long = [router.submit(PREFIX + [30 + i], greedy(100)) for i in range(3)]
    assert [s.rank for s in long] == [1, 1, 0]
    assert router.stats()["prefix_routed"] == routed0 + 3
    for s in long:
        router.abort(s.request_id)
    for s in long:
        assert s.result().finish_reason in ("abort", "length")
    deadline = time.monotonic() + 30
    while router.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router.in_flight == 0 and router._ranks.requests == [0, 0] and router._ranks.costs == [0, 0]
