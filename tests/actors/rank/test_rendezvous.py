"""The rendezvous store holds its port from the bind on: the free-port recipe it replaced (bind, read, close,
bind again in rank 0) lost the port to another process in CI, and rank 0 died with EADDRINUSE."""
from __future__ import annotations

import errno
import socket

import pytest

from actors.rank.rendezvous import host_store, join_store


def test_the_store_port_cannot_be_taken_while_the_store_lives():
    store = host_store(2, timeout_s=5.0)
    with socket.socket() as s, pytest.raises(OSError) as e:
        s.bind(("127.0.0.1", store.port))
    assert e.value.errno == errno.EADDRINUSE
    client = join_store("127.0.0.1", store.port, 2, timeout_s=5.0)
    client.set("rank1", "up")
    assert store.get("rank1") == b"up"


def test_only_rank_zero_opens_the_rendezvous():
    from actors.moe.placement import ExpertPlacement
    from actors.rank.worker import RankWorker

    # the constructor loads nothing (weights come in setup)
    w = RankWorker(1, 2, {"model": "unused"}, ExpertPlacement.contiguous(1, 4, 2).to_dict(), num_threads=0)
    with pytest.raises(ValueError, match="rank 0"):
        w.open_rendezvous()
    w0 = RankWorker(0, 2, {"model": "unused"}, ExpertPlacement.contiguous(1, 4, 2).to_dict(), num_threads=0)
    with pytest.raises(ValueError, match="open_rendezvous"):  # rank 0 never binds a port it was handed
        w0.setup("127.0.0.1", 1)


def test_a_request_before_setup_is_refused_by_name():
    """A rank whose group is still being built (a whole-group rebuild: the router's actor-call fallback reaches it
    before `setup`) refuses a request with an error that says so, not an AttributeError on the missing engine."""
    from actors.engine.messages import GenerateRequest
    from actors.moe.placement import ExpertPlacement
    from actors.rank.worker import RankWorker

    w = RankWorker(1, 2, {"model": "unused"}, ExpertPlacement.contiguous(1, 4, 2).to_dict(), num_threads=0)
    msg = GenerateRequest(request_id="r", prompt_ids=[1, 2], params={}, arrival=0.0).encode()
    with pytest.raises(RuntimeError, match="rank 1 is not set up yet"):
        w.add_request(msg)
