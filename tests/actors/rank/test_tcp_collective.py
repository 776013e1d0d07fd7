"""The TCP all-to-all (`actors.rank.tcp_collective`), the cross-node transport of the step's small collectives:
every chunk lands where `all_to_all_single` puts it (the right value: the permutation by hand), over many calls
of changing sizes and dtypes; a peer that exits or stays silent raises instead of hanging; a rank that cannot
join makes every rank fall back together. Ranks are threads of this process (sockets release the GIL)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from actors.rank.tcp_collective import TcpAllToAll


def _run_ranks(world: int, fn, store=None) -> list:
    """fn(rank, store) on `world` threads; returns their results in rank order (re-raises the first error)."""
    store = store or dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    out: list = [None] * world
    errs: list = []

    def body(r):
        try:
            out[r] = fn(r, store)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errs.append(e)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    if errs:
        raise errs[0]
    return out


def _chunks(rank: int, world: int, rows: int, dtype) -> torch.Tensor:
    """Rank `rank`'s send buffer: chunk d holds value 1000 * rank + 10 * d + column (exact in every dtype)."""
    x = torch.empty(world, rows, 3)
    for d in range(world):
        x[d] = 100 * rank + 10 * d + torch.arange(3.0)
    return x.view(world * rows, 3).to(dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_chunks_land_where_all_to_all_puts_them(world):
    def rank_fn(r, store):
        t = TcpAllToAll.setup(store, r, world, "127.0.0.1", timeout_s=20.0)
        assert t is not None
        bad = 0
        for i in range(200):  # many calls in a row, sizes and dtypes changing every call
            rows = 1 + (i * 7) % 13
            dtype = (torch.float32, torch.int64, torch.bfloat16)[i % 3]
            inp = _chunks(r, world, rows, dtype)
            got = torch.empty_like(inp)
            t.all_to_all_single(got, inp)
            # chunk s of the output is rank s's chunk for this rank
            want = torch.cat([_chunks(s, world, rows, dtype).view(world, rows, 3)[r] for s in range(world)])
            bad += int(not torch.equal(got, want))
        with pytest.raises(ValueError, match="max_bytes"):
            big = torch.zeros(world * (t.max_bytes // 8 + 1), dtype=torch.int64)
            t.all_to_all_single(torch.empty_like(big), big)
        with pytest.raises(ValueError, match="divisible"):
            t.all_to_all_single(torch.empty(world * 2 + 1), torch.zeros(world * 2 + 1))
        calls = t.calls
        t.close()
        assert not t.fits(8)
        return bad, calls

    assert _run_ranks(world, rank_fn) == [(0, 200)] * world


@pytest.mark.parametrize("mode", ["closed", "silent"])
def test_a_peer_that_closes_or_stays_silent_raises(mode):
    def rank_fn(r, store):
        t = TcpAllToAll.setup(store, r, 2, "127.0.0.1", timeout_s=1.0)
        x = torch.zeros(2 * 2, 4)
        t.all_to_all_single(torch.empty_like(x), x)
        if r == 1:
            if mode == "silent":  # alive but never calls again: rank 0 waits until the timeout
                store.wait(["moeray/test/done"])
            t.close()  # "closed": its sockets close at once, as when the process exits
            return None
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            t.all_to_all_single(torch.empty_like(x), x)
        store.set("moeray/test/done", "1")
        t.close()
        return str(e.value), time.monotonic() - t0

    (msg, waited), _ = _run_ranks(2, rank_fn)
    if mode == "silent":
        assert "rank 1 was silent for 1.0 s" in msg and 0.9 < waited < 10, (msg, waited)
    else:  # the peer's end of stream, or a reset if the send raced the close
        assert "rank 1 closed its connection" in msg or "Connection" in msg or "Pipe" in msg, msg
        assert waited < 1.0, waited  # at once, not at the timeout


def test_every_rank_falls_back_together_when_one_cannot_listen():
    def rank_fn(r, store):
        host = "192.0.2.77" if r == 1 else "127.0.0.1"  # TEST-NET: no local interface has it, bind fails
        return TcpAllToAll.setup(store, r, 2, host, timeout_s=5.0, connect_timeout_s=1.0)

    assert _run_ranks(2, rank_fn) == [None, None]


@pytest.mark.parametrize("world", [2, 3])
def test_posted_calls_complete_in_post_order_at_most_two_outstanding(world):
    """Two-batch overlap's pattern: two calls posted before either completes (of different sizes and dtypes, at
    max_bytes each so both sit unread in the socket buffers), completed oldest first, each chunk where
    `all_to_all_single` puts it; a third post, an out-of-order complete and a one-call all-to-all while calls are
    outstanding are refused."""
    def rank_fn(r, store):
        t = TcpAllToAll.setup(store, r, world, "127.0.0.1", timeout_s=20.0)
        bad = 0
        for i in range(50):
            rows_a, rows_b = (t.max_bytes // 12, 1 + i % 5) if i % 2 else (1 + i % 7, t.max_bytes // 24)  # 12, 24 B/row
            a, b = _chunks(r, world, rows_a, torch.float32), _chunks(r, world, rows_b, torch.int64)
            ta, tb = t.post(a), t.post(b)
            assert t.outstanding == 2 and tb == ta + 1
            if i == 0:
                with pytest.raises(RuntimeError, match="MAX_POSTED"):
                    t.post(a)
                with pytest.raises(ValueError, match="oldest"):
                    t.complete(tb, torch.empty_like(b))
                with pytest.raises(RuntimeError, match="outstanding"):
                    t.all_to_all_single(torch.empty_like(a), a)
            got_a, got_b = torch.empty_like(a), torch.empty_like(b)
            t.complete(ta, got_a)
            t.complete(tb, got_b)
            for got, rows, dt in ((got_a, rows_a, torch.float32), (got_b, rows_b, torch.int64)):
                want = torch.cat([_chunks(s, world, rows, dt).view(world, rows, 3)[r] for s in range(world)])
                bad += int(not torch.equal(got, want))
        assert t.outstanding == 0
        calls = t.calls
        t.close()
        return bad, calls

    assert _run_ranks(world, rank_fn) == [(0, 100)] * world
