"""`moeray generate`'s command line. A failed prompt is reported on one short stderr line: its position and its first
57 characters, not the whole prompt (a 4,096-token prompt echoed back was one line of ~20 kB); the others are still
printed. `--prefetch` offers every predictor."""
from __future__ import annotations

import moeray.api
from moeray import cli
from router_service.stream import RequestOutput


class FakeLLM:
    def __init__(self, **kw):
        pass

    def generate(self, prompts, params):
        return [RequestOutput(request_id="0", prompt=prompts[0], finish_reason="error",
                              error="prompt has 4100 tokens; the context window is 4096"),
                RequestOutput(request_id="1", prompt=prompts[1], text=" world", finish_reason="length")]

    def shutdown(self):
        pass


def test_a_failed_long_prompt_is_one_short_line(monkeypatch, capsys):
    monkeypatch.setattr(moeray.api, "LLM", FakeLLM)
    long = "THE TEMPEST\n\n" + "word " * 4000
    assert cli.main(["generate", long, "hello", "--max-tokens", "4"]) == 1
    out, err = capsys.readouterr()
    want = f"moeray: prompt 1/2 ({long[:57] + '...'!r}) failed: prompt has 4100 tokens; the context window is 4096\n"
    assert err == want and len(err) < 200
    assert out == "--- prompt 2/2: 'hello' ---\n world\n"


def test_a_kv_profile_the_ranks_cannot_load_exits_2_before_ray(monkeypatch, capsys):
    """`--kv-bits 3 --kv-extra-bits 2 --kv-profile prose-2bit` (an extra width as the deployment default) failed in
    the ranks' setup with a Ray traceback; it is refused at the edge, exit 2, naming the flag."""
    def no_cluster(**kw):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(moeray.api, "LLM", no_cluster)
    assert cli.main(["generate", "hi", "--kv-bits", "3", "--kv-extra-bits", "2", "--kv-profile", "prose-2bit"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeray: error: --kv-profile: kv_profile='prose-2bit' not found among the 3-bit profiles")
    assert cli.main(["generate", "hi", "--kv-bits", "3", "--kv-profile", "nope.safetensors"]) == 2
    assert "--kv-profile" in capsys.readouterr().err


def test_prefetch_offers_every_predictor():
    """`--prefetch` takes every predictor `make_predictor` builds (the README's `pre_attention_prev` was refused as an
    invalid choice), plus auto."""
    import argparse

    from actors.prefetch.predictors import PREDICTORS

    p = argparse.ArgumentParser()
    cli.add_engine_args(p)
    action = next(a for a in p._actions if a.dest == "prefetch")
    assert set(action.choices) == {"auto", *PREDICTORS}
