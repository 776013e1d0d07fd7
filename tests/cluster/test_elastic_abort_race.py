"""A request aborted (client cancel / disconnect) while the survivors regroup after a rank loss (issue 19).

`EPCluster.shrink` renumbers its rank list (survivors only) before the router renumbers its streams, so in between a
survivor's stream still carries its old index. With the lost rank's channel gone, an abort then takes the actor
path (`cluster.ranks[stream.rank]`): an IndexError for the last survivor, or the wrong rank. The test aborts in
exactly that window (from inside the shrink's final stats call), and again inside a replacement's switch, and checks
each abort reaches the right rank once the streams are renumbered."""
from __future__ import annotations

import os
import signal
import time

from tests.cluster.test_elastic import _greedy, _reference
from tests.router_service.conftest import wait_idle

PROMPTS = [f"prompt number {i} about the sea and the harbour" for i in range(4)]
N = 100


def test_abort_while_the_survivors_regroup(ray_session, tiny_model_dir):
    """2 ranks, rank 0 SIGKILLed: rank 1 is the survivor and becomes rank 0. One of its streams is cancelled inside
    the shrink, after the cluster's rank list changed and before the router's renumbering: it ends "abort" (its KV
    blocks freed), the cancel raises nothing, and the survivor's other streams end with the world-size-1 tokens."""
    from moeray.api import LLM

    model = tiny_model_dir("qwen2_moe")
    ref = _reference(model, PROMPTS, N)
    with LLM(model=model, ranks=2, max_queue=64, kv_cache_bytes=4 * 2**20, max_num_seqs=16,
             redundant_experts=True) as llm:
        router, cluster = llm.router, llm.cluster
        streams = [router.submit(p, _greedy(N)) for p in PROMPTS]
        for s in streams:
            assert s.get(timeout=60).finish_reason is None  # every stream is decoding
        at = [s.rank for s in streams]
        survivors = [i for i, r in enumerate(at) if r == 1]
        assert len(survivors) >= 2 and 0 in at, at
        target, fired, real_stats, real_prepare = streams[survivors[0]], {}, cluster.stats, cluster.prepare_grow
        late = {}

        def cancel_in(stream, key):
            fired[key] = {"world": len(cluster.ranks), "rank": stream.rank, "error": None}
            try:
                stream.cancel()
            except Exception as e:  # noqa: BLE001 - the race: recorded, asserted below
                fired[key]["error"] = repr(e)

        def stats_in_switch():  # shrink / finish_grow call stats() right after they replace `self.ranks`
            if "armed" in fired and "shrink" not in fired:
                cancel_in(target, "shrink")
            elif "grow" not in fired and "stream" in late:
                cancel_in(late["stream"], "grow")
            return real_stats()

        def prepare_then_submit(*a, **k):  # the replacement is loaded; a new stream starts just before its switch
            prepared = real_prepare(*a, **k)
            late["stream"] = router.submit(PROMPTS[0], _greedy(200))
            assert late["stream"].get(timeout=60).finish_reason is None
            return prepared

        cluster.stats, cluster.prepare_grow = stats_in_switch, prepare_then_submit
        pids = [i["pid"] for i in cluster.info]
        fired["armed"] = True
        os.kill(pids[0], signal.SIGKILL)
        outs = [s.result(timeout=60) for s in streams]
        # the window: the launcher's new rank list (1 survivor), the stream's old index (1)
        assert fired["shrink"] == {"world": 1, "rank": 1, "error": None}, fired
        aborted = outs[survivors[0]]
        assert aborted.finish_reason == "abort" and len(aborted.token_ids) < N, \
            (aborted.finish_reason, len(aborted.token_ids))
        for i in survivors[1:]:
            assert (outs[i].finish_reason, outs[i].token_ids) == ("length", ref[i]), (i, outs[i].error)
        assert all(outs[i].finish_reason == "error" for i, r in enumerate(at) if r == 0)
        deadline = time.monotonic() + 90
        while not router.rejoins and time.monotonic() < deadline:  # the replacement joins: 2 ranks again
            time.sleep(0.1)
        assert router.rejoins and len(router.cluster.ranks) == 2, router.health()
        # cancelled during the replacement's switch (it joins as rank 0, ahead of the survivor): deferred, then
        # sent to the survivor once the streams are renumbered
        assert fired["grow"] == {"world": 2, "rank": 0, "error": None}, fired
        out = late["stream"].result(timeout=60)
        assert out.finish_reason == "abort" and len(out.token_ids) < 200, (out.finish_reason, len(out.token_ids))
        cluster.stats, cluster.prepare_grow = real_stats, real_prepare
        s = wait_idle(router)
        assert s["in_flight"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
