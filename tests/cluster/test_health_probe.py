"""The cluster's health probe asks every rank at once under one deadline: a silent rank (its node lost without a
reset, or hung) costs the probe that deadline once, not a timeout per rank, and is named in moeray's words."""
from __future__ import annotations

import time

from cluster.lost_nodes import ask_health


def test_health_asks_all_ranks_at_once_with_one_deadline(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class FakeRank:
        def __init__(self, rank: int, mode: str):
            self.rank, self.mode = rank, mode

        def health(self) -> dict:
            if self.mode == "silent":
                time.sleep(60)
            if self.mode == "failed":
                raise RuntimeError("the step thread failed")
            return {"rank": self.rank, "ok": True, "error": None}

    ranks = [FakeRank.remote(0, "ok"), FakeRank.remote(1, "silent"), FakeRank.remote(2, "silent"),
             FakeRank.remote(3, "failed")]
    try:
        ray.get([r.__ray_ready__.remote() for r in ranks])
        t0 = time.monotonic()
        out = ask_health(ranks, timeout_s=1.0)
        took = time.monotonic() - t0
        assert took < 2.5, took  # one deadline for both silent ranks (one by one: >= 2 s)
        assert out[0] == {"rank": 0, "ok": True, "error": None}
        for i in (1, 2):
            assert out[i] == {"rank": i, "ok": False,
                              "error": f"rank {i} gave no answer within 1 s (busy, hung, or its node lost)"}
        assert out[3]["rank"] == 3 and out[3]["ok"] is False and "the step thread failed" in out[3]["error"]
        assert ask_health([], timeout_s=1.0) == []
    finally:
        for r in ranks:
            ray.kill(r)
