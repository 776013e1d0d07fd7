"""`moeray quantize` writes a packed checkpoint that `moeray generate --kernel-backend triton` serves end to end
(TRITON_INTERPRET=1 on CPU, tiny model, 2 Ray ranks); `bench/gpu_experts.py --tiny` runs its code path."""
from __future__ import annotations

import json
import os

import pytest

from actors.experts.checkpoint import is_packed_checkpoint, packed_layer_names, read_quant_config
from moeray.cli import main
from actors.prefetch.transitions import TRANSITIONS_FILE
from tests.bench_runner import run_bench_result


@pytest.fixture(scope="module")
def packed_dir(tiny_model_dir, tmp_path_factory):
    src = tiny_model_dir("qwen2_moe", num_layers=3)
    dst = str(tmp_path_factory.mktemp("packed") / "q3")
    rc = main(["quantize", "--bits", "3", "--group-size", "64", "--calib-tokens", "256", "--calib-chunk", "64",
               src, dst])
    assert rc == 0
    return src, dst


def test_quantize_writes_packed_checkpoint(packed_dir, capsys):
    src, dst = packed_dir
    assert is_packed_checkpoint(dst) and not is_packed_checkpoint(src)
    qc = read_quant_config(dst)
    assert qc["bits"] == 3 and qc["group_size"] == 64 and qc["codebook"] is False
    # gate_up [64, 64]: 3 + 32 / 64 = 3.5 bits; down [64, 32]: one 32-wide group per row, 3 + 32 / 32 = 4 bits;
    # weighted by their sizes (2 : 1): 11 / 3.
    assert qc["effective_bits"] == pytest.approx(11 / 3)
    for f in ("config.json", "tokenizer.json", "model.safetensors", TRANSITIONS_FILE):
        assert os.path.isfile(os.path.join(dst, f)), f
    for f in ("model.safetensors", TRANSITIONS_FILE):  # readable by ranks running as another user
        assert os.stat(os.path.join(dst, f)).st_mode & 0o777 == 0o644, f
    names = packed_layer_names(dst)
    assert any(n.endswith("layers.0.mlp.experts.packed.gate_up.qcodes") for n in names)
    assert not any("layers.1.mlp.experts" in n for n in names)  # layer 1 is dense


def test_quantize_rejects_bad_arguments(packed_dir, capsys):
    src, _ = packed_dir
    with pytest.raises(SystemExit):
        main(["quantize", "--bits", "5", src, "/tmp/unused"])
    assert main(["quantize", "--no-calibrate", src, src]) == 2
    assert "must differ from src" in capsys.readouterr().err


@pytest.mark.ray
def test_generate_serves_packed_model_with_triton(packed_dir, ray_session, capsys):
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine

    _, dst = packed_dir
    prompt = "def add(a, b):"
    rc = main(["generate", "--model", dst, "--ranks", "2", "--kernel-backend", "triton", "--expert-cache", "4",
               "--max-tokens", "4", "--max-model-len", "64", "--json", prompt])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, out
    got = json.loads(out[-1])
    assert got["finish_reason"] in ("stop", "length") and 1 <= len(got["token_ids"]) <= 4
    # Same tokens as one in-process rank with the PyTorch reference kernels and every expert cached.
    mc = ModelConfig.from_pretrained(dst)
    eng = RankEngine(EngineConfig(model=dst, max_model_len=64, kv_cache_bytes=4 << 20),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    ids = eng.tokenizer.encode(prompt).ids
    ref = []
    for _ in range(len(got["token_ids"])):
        ref.append(int(eng.prompt_logits(ids + ref)[-1].argmax()))
    assert got["token_ids"] == ref


def test_gpu_bench_tiny_runs_under_interpreter():
    keys = set(run_bench_result("gpu_experts.py", "--tiny"))
    assert {"bw_frac_3b_b1", "bw_frac_4b_b16", "ms_3b_b1", "fp16_ms_b16"} <= keys


def test_quantize_keeps_the_kv_profiles(tiny_model_dir, tmp_path):
    """A packed copy of a model with KV quantization profiles keeps them (attention is not quantized), so
    `--kv-bits` works on it as on the source."""
    import shutil

    from actors.experts.checkpoint import write_packed_checkpoint

    src = str(tmp_path / "src")
    shutil.copytree(tiny_model_dir("qwen2_moe", num_layers=3), src)
    os.makedirs(os.path.join(src, "kv_profiles"))
    with open(os.path.join(src, "kv_profiles", "prose-3bit.json"), "w") as f:
        f.write("{}")
    dst = str(tmp_path / "dst")
    write_packed_checkpoint(src, dst, bits=4, group_size=32)
    assert os.path.isfile(os.path.join(dst, "kv_profiles", "prose-3bit.json"))


def test_generate_rejects_expert_flags_before_starting_ray(packed_dir, capsys):
    """Bad expert-cache flags fail at the edge (exit 2, the flag named, no Ray started): a negative cache, and cache
    or prefetch flags on a model that is not packed; a packed --model takes them. A predictor asked for with the
    CPU default cache of 0 gets a warning."""
    import argparse

    import ray

    from moeray.cli import add_engine_args, engine_kwargs

    src, dst = packed_dir
    started = ray.is_initialized()
    assert main(["generate", "--model", src, "--weight-bits", "4", "--expert-cache", "-1", "hi"]) == 2
    assert "--expert-cache=-1 must be >= 0" in capsys.readouterr().err
    assert main(["generate", "--model", src, "--expert-cache", "4", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--expert-cache apply to packed experts: add --weight-bits" in err and "prefetch" not in err
    assert main(["generate", "--model", src, "--prefetch", "markov", "hi"]) == 2
    assert "--prefetch markov apply to packed experts" in capsys.readouterr().err
    assert main(["generate", "--model", src, "hi", ""]) == 2
    assert "prompt 2 of 2 is empty" in capsys.readouterr().err
    assert ray.is_initialized() == started  # nothing reached the cluster
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--model", dst, "--expert-cache", "2", "--prefetch", "hybrid"]))
    assert kw["engine_options"]["expert_cache_capacity"] == 2 and capsys.readouterr().err == ""
    engine_kwargs(p.parse_args(["--model", dst, "--prefetch", "hybrid"]))
    assert "without --expert-cache" in capsys.readouterr().err


def test_stats_show_thrash_cache_and_prefetch():
    """`--stats` prints the per-layer thrash / hit rate / recall columns and each rank's packed-expert line."""
    import io

    from moeray.cli import print_stats

    nan = float("nan")
    s = {"layers": [{"layer": 0, "tokens": 10, "expert_max_mean": 1.5, "rank_max_mean": 1.2}],
         "routing": {"thrash": [0.625], "hit_rate": [0.0], "recall": [nan]},
         "ranks": [{"expert_cache": {"predictor": "none", "policy": "lru", "hit_rate": 0.0, "recall": nan,
                                     "wasted_prefetch_frac": nan}}, {}],
         "kv_blocks_free": 3, "kv_blocks_total": 4}
    out = io.StringIO()
    print_stats(s, out)
    text = out.getvalue()
    assert "thrash  hit_rate    recall" in text and "0.625" in text
    assert "rank 0 packed experts: prefetch none, eviction lru, expert-cache hit rate 0.000" in text
    assert "rank 1" not in text and "KV blocks free 3/4" in text


@pytest.mark.parametrize("cmd", ["generate", "serve", "quantize", "calibrate", "top"])
def test_help_shows_defaults_but_not_unset_ones(cmd, capsys):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: [])" not in out and "(default: False)" not in out
    assert "(default: " in out


def test_run_calibration_trains_the_mlps_on_the_extra_texts_too(tiny_model_dir, monkeypatch):
    """pre_attention_texts reach the MLPs' chunks (an equal share with `texts`), never the counts' chunks."""
    import router_service.routing.calibration as calibration
    from moeray.cli_quantize import calibration_chunks, run_calibration

    seen = {}

    def fake_calibrate(engine, chunks, path, meta=None, *, pre_attention_chunks=None, pre_attention=True):
        seen["counts"], seen["mlp"] = list(chunks), list(pre_attention_chunks or [])

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    model = tiny_model_dir("qwen2_moe", num_layers=3)
    a, b = "the quick brown fox jumps over the lazy dog. " * 60, "def f(x):\n    return x + 1\n" * 60
    run_calibration(model, [a], max_tokens=64, chunk=32, pre_attention_tokens=512,
                    pre_attention_texts=[b], progress=False)
    assert seen["counts"] == calibration_chunks(model, [a], 64, 32)
    want = [c for c in calibration_chunks(model, [a, b], 512, 32) if c not in seen["counts"]]
    assert seen["mlp"] == want and any(c in calibration_chunks(model, [b], 256, 32) for c in want)


def test_stdlib_code_sample_is_training_side_and_split():
    """Slices from across the stdlib, in `parts` texts, never from the held-out packages."""
    import sysconfig

    from moeray.cli_quantize import HELDOUT_CODE_PACKAGES, stdlib_code_sample

    texts = stdlib_code_sample(300, 3)
    assert len(texts) == 3 and all(texts)
    root = sysconfig.get_paths()["stdlib"]
    with open(os.path.join(root, HELDOUT_CODE_PACKAGES[0], "decoder.py"), encoding="utf-8") as f:
        held = f.read()
    mid = held[len(held) // 2 - 150 : len(held) // 2 + 150]
    assert not any(mid in t for t in texts)
    with pytest.raises(ValueError, match="parts=0"):
        stdlib_code_sample(300, 0)
