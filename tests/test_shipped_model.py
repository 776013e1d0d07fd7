"""The CLI contract on the shipped model: 2 ranks == 1 rank == transformers greedy (up to a small margin)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import SHIPPED
from tests.reference import agree_until_small_margin, hf_greedy

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "config.json")),
                                reason="models/tiny-moe is not present")

PROMPTS = ["ROMEO. O, she doth teach the torches to burn bright!", "KING. Good my lord,",
           "def read_config(path):\n    with open(path) as f:", "import os\nimport sys\n\nclass Reader:"]
N = 24


def _generate(address: str, ranks: int) -> list[dict]:
    cmd = [sys.executable, "-m", "moeray.cli", "generate", "--ranks", str(ranks), "--temperature", "0",
           "--max-tokens", str(N), "--json", "--address", address, *PROMPTS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert [x["prompt"] for x in lines] == PROMPTS
    return lines


def test_cli_two_ranks_equal_one_rank_equal_transformers(ray_session):
    from tokenizers import Tokenizer

    from tests.tiny_models import load_hf

    address = ray_session.get_runtime_context().gcs_address
    two = _generate(address, 2)
    one = _generate(address, 1)
    assert [x["token_ids"] for x in two] == [x["token_ids"] for x in one]
    for x in two:
        assert x["finish_reason"] in ("stop", "length") and set(x) >= {"prompt", "text", "token_ids", "finish_reason"}
    hf = load_hf(SHIPPED)
    tok = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    compared = 0
    for p, x in zip(PROMPTS, two):
        ref, margins = hf_greedy(hf, tok.encode(p).ids, len(x["token_ids"]) or 1)
        compared += agree_until_small_margin(x["token_ids"], ref, margins)
        if x["finish_reason"] == "length":
            assert len(x["token_ids"]) == N
    assert compared >= N  # at least a prompt's worth of tokens compared
    # plain text: each completion after a header line naming its prompt
    cmd = [sys.executable, "-m", "moeray.cli", "generate", "--ranks", "1", "--temperature", "0",
           "--max-tokens", str(N), "--address", address, *PROMPTS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = "".join(f"--- prompt {i + 1}/{len(PROMPTS)}: {p!r} ---\n{x['text']}\n"
                   for i, (p, x) in enumerate(zip(PROMPTS, one)))
    assert r.stdout == want


def test_cli_bad_prompt_exit_status(ray_session):
    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "moeray.cli", "generate", "--ranks", "1", "--max-tokens", "5000", "--json",
           "--address", address, "hello"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "max_tokens=5000 exceeds the context window" in r.stderr
