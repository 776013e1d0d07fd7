"""Fixtures for the front-door tests: one tiny random EP cluster per test module."""
from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_model_dir):
    """A tiny random Qwen2-MoE checkpoint (vocab 320, context 256) with its tokenizer."""
    return tiny_model_dir("qwen2_moe")


@pytest.fixture(scope="module")
def client(llm):
    """An HTTP test client of the OpenAI-style app over the test module's `llm` fixture."""
    from fastapi.testclient import TestClient

    from router_service.http.app import create_app

    with TestClient(create_app(llm.router)) as c:
        yield c


def start_llm(model_dir: str, ranks: int, max_queue: int = 64):
    from moeray.api import LLM

    # small KV budget: enough for a few sequences, keeps bring-up light on a 2-core machine
    return LLM(model=model_dir, ranks=ranks, max_queue=max_queue, kv_cache_bytes=4 * 2**20, max_num_seqs=16)


def wait_idle(router, timeout_s: float = 30.0) -> dict:
    """Wait until nothing is in flight and every KV block is free again; returns the last stats."""
    deadline = time.monotonic() + timeout_s
    s = router.stats()
    while time.monotonic() < deadline:
        s = router.stats()
        if s["in_flight"] == 0 and s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
            return s
        time.sleep(0.05)
    return s
