"""Front-door pieces without a cluster: the loop mailbox (ordering, one wake-up per post), the admission bound,
the untokenized prompt-length bound, and the replica HTTP listener's shared port."""
from __future__ import annotations

import asyncio
import threading
import urllib.request

from tokenizers import Tokenizer

from actors.engine.messages import TokenOutput
from router_service.admission import MIN_MAX_QUEUE, default_max_queue, max_prompt_chars
from router_service.stream import LoopMailbox, RequestStream


class _Router:
    def abort(self, rid):
        pass


def test_attach_hands_over_early_outputs_in_order_then_batches():
    async def main():
        loop = asyncio.get_running_loop()
        mb = LoopMailbox.of(loop)
        assert LoopMailbox.of(loop) is mb
        s = RequestStream(_Router(), "r", "p", 0, 3, 10)
        assert s._push(TokenOutput(request_id="r", token_ids=[1], text="a")) is None  # not attached: its queue
        q: asyncio.Queue = asyncio.Queue()
        s.attach(mb, q, 7)
        first = await asyncio.wait_for(q.get(), 5)
        posts = []
        for t in (2, 3):
            sent = s._push(TokenOutput(request_id="r", token_ids=[t], text="b"))
            assert sent[0] is mb
            posts.append(sent[1])
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
        threading.Thread(target=mb.post, args=(posts,)).start()
        got = [first] + [await asyncio.wait_for(q.get(), 5) for _ in range(2)]
        assert [(k, o.token_ids) for k, o in got] == [(7, [1]), (7, [2]), (7, [3])]
        assert len(wakes) == 1  # one wake-up for the whole post
        assert s.out.token_ids == [1, 2, 3] and s.out.text == "abb"

    asyncio.run(main())


def test_default_max_queue_follows_memory():
    assert default_max_queue(1024) == 4096
    assert default_max_queue(4096) == 1024
    assert default_max_queue(10**6) == MIN_MAX_QUEUE


def test_prompt_char_bound_is_safe(tiny_model_dir):
    """No text within the bound's ratio can hold fewer tokens than chars / (bound / max_model_len / 2)."""
    tok = Tokenizer.from_file(f"{tiny_model_dir('qwen2_moe')}/tokenizer.json")
    per_token = max_prompt_chars(tok, 1) // 2
    for text in ("    " * 300, "abc" * 500, "\n\n\t" * 200, "é漢字" * 100, "x" * 5000):
        assert len(text) <= per_token * len(tok.encode(text).ids)


def test_replica_listeners_share_a_port():
    from fastapi import FastAPI

    from router_service.serve.listener import HTTPListener

    app = FastAPI()

    @app.get("/ping")
    async def ping():
        return {"pong": True}

    a = HTTPListener(app, "127.0.0.1", 0).start()
    b = HTTPListener(app, "127.0.0.1", a.port).start()  # SO_REUSEPORT: a second replica on the same node
    try:
        url = f"http://127.0.0.1:{a.port}/ping"
        assert urllib.request.urlopen(url, timeout=10).read() == b'{"pong":true}'
        a.stop()
        assert not a._thread.is_alive()
        assert urllib.request.urlopen(url, timeout=10).read() == b'{"pong":true}'  # b still serves
    finally:
        a.stop()
        b.stop()
