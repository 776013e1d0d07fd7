"""lm-eval-harness, unmodified, against moeray's HTTP app: per-document loglikelihoods and greedy generations of
the local tasks in bench/lm_eval_tasks equal lm-eval's own `hf` model on the shipped checkpoint (fp32, < 1e-4).

moeray side: `--model local-completions` with its defaults (`tokenized_requests=True`: prompts are batches of
token-id lists; loglikelihood requests are `echo` + `logprobs: 1` + `max_tokens: 1`; generate_until sends `stop`
with the EOS text), over a real uvicorn server on the in-process `EngineRouter` of `test_http_logprobs` (one
RankEngine, full-precision KV), with automatic prefix caching on and off. The multiple-choice task's 4 choices of a
doc share its context, so with caching on they hit the cache (checked). The full comparison against `moeray serve`
is bench/lm_eval_parity.py."""
from __future__ import annotations

import socket
import threading
import time

import lm_eval  # the `test` extra installs it (lm-eval[api,hf])
import pytest

from router_service.http.app import create_app
from tests.actors.engine.test_chunked_prefill import _engine
from tests.conftest import REPO, SHIPPED
from tests.router_service.test_http_logprobs import EngineRouter

TASKS = ["moeray_next_line_mc", "moeray_next_line_gen"]  # mc first: its requests leave the contexts in the cache
DOCS = 4  # the first docs of each task: two prose, two code
TOL = 1e-4


def _evaluate(model: str, model_args: str, batch_size: int) -> dict:
    """lm-eval's simple_evaluate on the two local tasks; returns {task: [sample dicts ordered by doc_id]}."""
    from lm_eval.tasks import TaskManager

    # include_defaults=False: indexing lm-eval's ~10k built-in task files would cost ~10 s of CPU per call
    tm = TaskManager(include_path=f"{REPO}/bench/lm_eval_tasks", include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, limit=DOCS, batch_size=batch_size,
                                  log_samples=True, bootstrap_iters=0, task_manager=tm, device="cpu")
    return {t: sorted(out["samples"][t], key=lambda s: s["doc_id"]) for t in TASKS}


class _Server:
    """The HTTP app over an EngineRouter, served by uvicorn on a free loopback port."""

    def __init__(self, prefix_caching: bool):
        import uvicorn

        self.router = EngineRouter(_engine(enable_prefix_caching=prefix_caching))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.router), host="127.0.0.1", log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, "uvicorn did not start"
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1/completions"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.router.close()


@pytest.fixture(scope="module")
def hf_samples(monkeypatch_module):
    return _evaluate("hf", f"pretrained={SHIPPED},dtype=float32", batch_size=4)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.chdir(REPO)  # the task YAMLs name their data files relative to the repository root
    yield mp
    mp.undo()


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache_on", "cache_off"])
def test_lm_eval_local_completions_equals_hf(hf_samples, monkeypatch_module, prefix_caching):
    srv = _Server(prefix_caching)
    try:
        got = _evaluate("local-completions", f"model=tiny-moe,base_url={srv.url},tokenizer={SHIPPED},"
                        f"tokenized_requests=True", batch_size=4)
        stats = srv.router.engine.stats()
    finally:
        srv.close()
    ref = hf_samples
    # multiple_choice: one (loglikelihood, is_greedy) per choice, 4 choices a doc
    mc, mc_ref = got["moeray_next_line_mc"], ref["moeray_next_line_mc"]
    assert [s["doc_id"] for s in mc] == [s["doc_id"] for s in mc_ref] == list(range(DOCS))
    worst = 0.0
    for s, r in zip(mc, mc_ref):
        assert len(s["filtered_resps"]) == len(r["filtered_resps"]) == 4
        for (ll, greedy), (ll_ref, greedy_ref) in zip(s["filtered_resps"], r["filtered_resps"]):
            worst = max(worst, abs(float(ll) - float(ll_ref)))
            assert greedy == greedy_ref
        assert s["acc"] == r["acc"] and s["acc_norm"] == r["acc_norm"]
    assert worst < TOL, worst
    assert all(float(ll) < -1.0 for s in mc for ll, _ in s["filtered_resps"])  # real sums, not zeros
    # generate_until: greedy to the first newline, the same text
    gen, gen_ref = got["moeray_next_line_gen"], ref["moeray_next_line_gen"]
    texts = [s["filtered_resps"][0] for s in gen]
    assert texts == [s["filtered_resps"][0] for s in gen_ref]
    assert sum(len(t) for t in texts) > 20 and all("\n" not in t for t in texts)
    if prefix_caching:  # the choices of a doc share its context: cached blocks were reused
        assert stats["prefix_cache_hits"] > 0, stats
    else:
        assert "prefix_cache_hits" not in stats
