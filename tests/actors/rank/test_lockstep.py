"""The lockstep loop's sleep rule, driven round by round: rank 0 of a 2-rank group runs its real loop thread
while the step agreement's all-to-all is replaced by a scripted peer, so the interleaving that once left a
request queued on a sleeping rank (a hung `generate` in tests/cluster/test_cluster.py) is replayed exactly."""
from __future__ import annotations

import queue
import threading

import torch

from actors.moe.placement import ExpertPlacement
from actors.engine.engine import RankEngine
from actors.engine.messages import GenerateRequest
from actors.rank.worker import RankWorker
from actors.engine.sampling import SamplingParams
from tests.tiny_models import build_tiny_model


class ScriptedPeer:
    """Stands in for the shared-memory all-to-all of the step agreement: records this rank's flag row, runs an
    optional action while the exchange is "in flight" (the peer's turn), and answers with the peer's row, built
    from this rank's own row (so the script does not depend on how the seen seq is signed in the flags)."""

    def __init__(self):
        self.rows: queue.Queue = queue.Queue()  # (own row -> peer row, action or None) per round
        self.sent: queue.Queue = queue.Queue()  # this rank's row per round

    def fits(self, nbytes_per_peer: int) -> bool:
        return True

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, within_step: bool = False) -> None:
        n = inp.numel() // 2  # a row: the flags, then the `balanced` load counters (zeros here)
        own = inp[:5].tolist()
        self.sent.put(own)
        peer, action = self.rows.get(timeout=30)
        if action is not None:
            action()
        out[:n] = inp[:n]
        out[n:] = 0
        out[n:n + 5] = torch.tensor(peer(own), dtype=out.dtype)

    def close(self) -> None:
        pass


def _request(rid: str) -> bytes:
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_ids=[3, 4, 5], params=p.to_dict()).encode()


def test_a_request_landing_after_the_work_check_is_not_slept_on(tmp_path):
    path = build_tiny_model("qwen2_moe", str(tmp_path / "m"))
    from actors.model.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    w = RankWorker(0, 2, {"model": path, "max_model_len": 64, "kv_cache_bytes": 1 << 20},
                   ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 2).to_dict())
    peer = ScriptedPeer()
    w.shm = peer
    w.engine = RankEngine(w.engine_cfg, w.placement, 0, None, shm=peer)
    w._thread = threading.Thread(target=w._loop, daemon=True)
    w._thread.start()
    # round 1: woken for seq 1 with nothing queued here; while the exchange is in flight the request lands on
    # this rank (after its work check) and the router's wake for seq 2 reaches the peer first: the peer
    # reports seq 2 seen and no work
    w.wake(1)
    peer.rows.put((lambda own: [0, 2 * own[1], 0, 0, 0], lambda: w.add_request(_request("late"), 2)))
    first = peer.sent.get(timeout=30)
    assert first[0] == 0 and abs(first[1]) == 1
    # round 2: this rank has seen seq 2 but its last work check missed the request, so the group must not count
    # seq 2 as agreed: the rank runs another round and offers its request (has_work 1, the prompt's 3 tokens)
    # instead of sleeping on it
    peer.rows.put((lambda own: [0, own[1], 1, 0, 0], None))  # the peer asks to stop: the loop ends after this
    try:
        row = peer.sent.get(timeout=10)
    except queue.Empty:
        raise AssertionError("rank 0 went to sleep with a request queued") from None
    assert row[0] == 1 and abs(row[1]) == 2 and row[4] == 3
    w._thread.join(timeout=10)
    assert not w._thread.is_alive() and w._failed is None
