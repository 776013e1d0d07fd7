"""`moeray calibrate` writes a KV quantization profile the engine can load; the `auto` profile rule."""
import json

import pytest
import torch

from actors.kv.calibration import K_CHANNEL_BITS_3, RECOMMENDED_FIT_OPTIONS, model_effective_bits
from actors.kv.profile_choice import CODE_CHAR_THRESHOLD, choose_profile, code_fraction
from actors.kv.profiles import load_profile, load_profiles
from moeray.cli import main

PROSE = "Full fathom five thy father lies; of his bones are coral made. " * 8
CODE = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n" * 8


@pytest.fixture(scope="module")
def model_and_data(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("calib")
    (d / "prose.txt").write_text(PROSE)
    (d / "code.txt").write_text(CODE)
    return tiny_model_dir("qwen2_moe"), d


def test_calibrate_writes_profile_the_engine_loads(model_and_data, capsys):
    model, d = model_and_data
    out = d / "kv_profiles"
    rc = main(["calibrate", "--domain", "code", "--data", str(d / "code.txt"), "--bits", "3", "--model", model,
               "--tokens", "150", "--window", "64", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    assert "calibrate code 3-bit" in cap.err  # tqdm progress bar on stderr
    st = out / "code-3bit.safetensors"
    assert cap.out.strip() == str(st) and st.is_file()
    meta = json.loads((out / "code-3bit.json").read_text())
    assert meta["domain"] == "code" and meta["bits"] == 3 and meta["n_outlier_k"] == 0
    # no fit flags: the shipped 3-bit recipe (finalize_model.sh relies on it)
    fit = {k: meta["fit_options"][k] for k in RECOMMENDED_FIT_OPTIONS[3]}
    from actors.model.config import ModelConfig

    head_dim = ModelConfig.from_pretrained(model).head_dim  # the key row budget scales with it
    assert fit == {**RECOMMENDED_FIT_OPTIONS[3], "k_channel_bits": round(K_CHANNEL_BITS_3 * head_dim / 64)}
    assert meta["calibration_files"] == ["code.txt"] and 0 < meta["calibration_tokens"] <= 150
    assert 3.0 < meta["effective_bits_1024"] < 4.5  # codes, fp16 V scales, profile tensors over 1024 tokens
    prof = load_profile(str(st))
    assert prof.num_layers == 2 and prof.bits == 3 and prof.name == "code"
    assert model_effective_bits(prof, 1024) == pytest.approx(meta["effective_bits_1024"], abs=1e-4)
    # a folder of profiles resolves by name, and the engine builds its cache from it
    # codebook / key-range flags override the recipe and reach the fit and its metadata (the outlier count stays
    # the recipe's: profiles of one width in one folder must share a layout)
    rc = main(["calibrate", "--domain", "prose", "--data", str(d / "prose.txt"), "--bits", "3", "--model", model,
               "--tokens", "150", "--window", "64", "--codebook", "kmeans", "--codebook-v", "uniform",
               "--k-range", "mse", "--k-channel-bits", "0", str(out)])
    assert rc == 0
    fit = json.loads((out / "prose-3bit.json").read_text())["fit_options"]
    assert (fit["codebook"], fit["codebook_v"], fit["k_range"], fit.get("k_channel_bits")) == (
        "kmeans", "uniform", "mse", None)
    prose = load_profile(str(out / "prose-3bit")).layers[0]
    assert not prose.per_channel_keys and not torch.equal(prose.k_codebook, torch.linspace(-1, 1, 8))
    assert torch.equal(prose.v_codebook, torch.linspace(-1, 1, 8))
    assert load_profile(str(st)).layers[0].per_channel_keys  # the recipe's code profile: per-channel key widths
    profiles, default = load_profiles(model, 3, str(out))
    assert sorted(profiles) == ["code", "prose"] and default == "auto"
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine

    mc = ModelConfig.from_pretrained(model)
    eng = RankEngine(EngineConfig(model=model, kv_bits=3, kv_profile=str(out), max_model_len=64,
                                  kv_cache_bytes=2**21), ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    logits = eng.prompt_logits(list(range(1, 40)))
    assert torch.isfinite(logits).all()
    assert eng.cache.choose_profile("auto", CODE) == "code"
    assert eng.cache.choose_profile(None, PROSE) == "prose"


def test_calibrate_errors(model_and_data, capsys):
    model, d = model_and_data
    assert main(["calibrate", "--domain", "x", "--data", str(d / "missing.txt"), "--bits", "2", "--model", model,
                 str(d / "o")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["calibrate", "--domain", "x", "--data", str(d / "code.txt"), "--bits", "2", "--model", model,
                 "--n-outlier", "999", str(d / "o")]) == 2
    assert "n_outlier=999" in capsys.readouterr().err


def test_auto_rule():
    assert code_fraction(PROSE) < CODE_CHAR_THRESHOLD <= code_fraction(CODE)
    assert choose_profile("auto", ["code", "prose"], "auto", CODE) == "code"
    assert choose_profile("auto", ["code", "prose"], "auto", PROSE) == "prose"
    assert choose_profile(None, ["code", "prose"], "code", PROSE) == "code"  # engine default wins over auto
    assert choose_profile("auto", ["prose"], "auto", CODE) == "prose"  # no code profile: fall back
    with pytest.raises(ValueError, match="kv_profile='math' is not loaded"):
        choose_profile("math", ["code", "prose"], "auto", PROSE)


def test_calibrate_per_channel_key_bits(model_and_data, tmp_path):
    """`--k-channel-bits B` (the 2-bit recipe) collects query energies and writes per-channel key widths."""
    model, d = model_and_data
    rc = main(["calibrate", "--domain", "prose", "--data", str(d / "prose.txt"), "--bits", "2", "--model", model,
               "--tokens", "150", "--window", "64", "--n-outlier", "0", "--codebook-v", "kmeans", "--k-range",
               "minmax", "--k-channel-bits", "40", "--layer-widths", "uniform", str(tmp_path)])
    assert rc == 0
    meta = json.loads((tmp_path / "prose-2bit.json").read_text())
    assert meta["fit_options"]["k_channel_bits"] == 40 and meta["fit_options"]["query_energy"] is True
    prof = load_profile(str(tmp_path / "prose-2bit"))
    for layer in prof.layers:
        assert layer.per_channel_keys and layer.k_bits.long().sum(1).tolist() == [40] * layer.num_kv_heads
        assert layer.k_packed_bytes == 5
    assert main(["calibrate", "--domain", "prose", "--data", str(d / "prose.txt"), "--bits", "2", "--model", model,
                 "--tokens", "150", "--window", "64", "--k-channel-bits", "1000", str(tmp_path)]) == 2
    # no flags: the shipped 2-bit recipe, its 152-bit key row for 64 channels scaled to this model's D=16 (38)
    assert main(["calibrate", "--domain", "code", "--data", str(d / "code.txt"), "--bits", "2", "--model", model,
                 "--tokens", "150", "--window", "64", str(tmp_path)]) == 0
    fit = json.loads((tmp_path / "code-2bit.json").read_text())["fit_options"]
    assert fit["k_channel_bits"] == 38 and fit["n_outlier"] == 0 and fit["codebook"] == "uniform"
    assert fit["codebook_v"] == "kmeans" and fit["k_range"] == "minmax" and fit["query_energy"] is True
    # and each layer's widths allocated by sensitivity within the recipe's bits (2-bit values + 38 key bits + an
    # fp16 scale per head row of D=16 channels), the recipe's scales being 8-bit codes
    widths = fit["layer_widths"]
    assert fit["v_scale_bits"] == 8
    assert len(widths) == len(prof.layers) and sum(kb + vb * 16 + 8 for vb, kb in widths) <= len(widths) * (38 + 48)
    alloc = load_profile(str(tmp_path / "code-2bit"))
    assert [list(w) for w in alloc.layer_widths()] == widths
