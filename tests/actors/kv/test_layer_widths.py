"""Layer widths by sensitivity (`actors.kv.layer_widths`): the allocation's exact optimum on a hand-computed case,
the budget it keeps, and profiles whose layers differ in value bits and key row bytes paging through the cache."""
import pytest
import torch

from actors.kv.calibration import RECOMMENDED_FIT_OPTIONS, collect_calibration_kv, fit_model_profile
from actors.kv.layer_widths import allocate, fit_allocated_profile, recipe_budget, row_bits
from actors.kv.profiles import load_profile, save_profile
from tests.actors.kv.test_kv_quant_cache import _decode_logits, _engine


def test_allocate_finds_the_exact_optimum_within_the_budget():
    # D = 8: a layer's row costs kb + 8 vb + 16 bits; (2, 16) 48, (2, 24) 56, (3, 16) 56, (3, 24) 64
    key = [{16: 0.5, 24: 0.1}, {16: 0.05, 24: 0.04}]
    val = [{2: 0.2, 3: 0.1}, {2: 0.3, 3: 0.01}]
    # 3.5 bits per element x 2 D x 2 layers = 112 bits: the best pair is layer 0 (2, 24) 0.3 + layer 1 (3, 16) 0.06
    assert allocate(key, val, 8, 3.5) == [(2, 24), (3, 16)]
    # with room for everything, the most bits everywhere
    assert allocate(key, val, 8, 4.0) == [(3, 24), (3, 24)]
    # the cheapest rows only
    assert allocate(key, val, 8, 3.0) == [(2, 16), (2, 16)]
    with pytest.raises(ValueError, match="no layer widths fit"):
        allocate(key, val, 8, 2.9)
    with pytest.raises(ValueError, match="same"):
        allocate(key, val[:1], 8, 3.5)


def test_recipe_budget_and_row_bits():
    assert row_bits(3, 216, 64) == 216 + 192 + 16
    assert recipe_budget(3, 216, 64) == pytest.approx(424 / 128)
    assert recipe_budget(3, None, 64) == pytest.approx((192 + 192 + 16) / 128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model("qwen2_moe", str(tmp_path_factory.mktemp("lw")), num_layers=2)
    eng = _engine(path, max_model_len=128)
    ids = torch.randint(1, eng.model_cfg.vocab_size, (256,), generator=torch.Generator().manual_seed(4)).tolist()
    k, v, qe = collect_calibration_kv(eng, ids, window=128, with_query_energy=True)
    return path, eng, ids, k, v, qe


def test_layers_of_different_widths_page_through_the_cache(tiny, tmp_path):
    """Layer 0 at 2-bit values and a 2.5-bit key row, layer 1 at 4-bit values and 5-bit keys: each layer gets its
    own page bytes for the same tokens per page; prefill equals decode; save / load keeps the widths."""
    path, _, _, k, v, qe = tiny
    d = k[0].shape[-1]
    widths = [(2, 2 * d + d // 2), (4, 5 * d)]
    prof = fit_model_profile(k, v, name="prose", bits=3, query_energy=qe, layer_widths=widths,
                             **RECOMMENDED_FIT_OPTIONS[3])
    assert prof.layer_widths() == widths and [p.bits for p in prof.layers] == [2, 4]
    save_profile(prof, str(tmp_path / "prose-3bit"))
    back = load_profile(str(tmp_path / "prose-3bit"))
    assert back.layer_widths() == widths and back.meta["fit_options"]["layer_widths"] == [list(w) for w in widths]
    eng = _engine(path, kv_bits=3, kv_profile=str(tmp_path), max_model_len=128, kv_cache_bytes=2**21)
    c = eng.cache
    bpt = [p.bytes_per_token() for p in back.layers]
    (tpp,) = c.tokens_per_page.values()
    assert bpt[0] < bpt[1] and c.layer_page_bytes[0] < c.layer_page_bytes[1]
    assert all(tpp * b <= pb < tpp * b + 16 for b, pb in zip(bpt, c.layer_page_bytes))
    assert c.memory_stats()["kv_bytes_pages"] == c.num_pages * sum(c.layer_page_bytes)
    ids = torch.randint(1, 300, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    full = eng.prompt_logits(ids)
    torch.testing.assert_close(_decode_logits(eng, ids, 7), full[6:], atol=2e-4, rtol=1e-4)
    # a second profile of the same width with the widths the other way round shares the pool: each layer's page
    # holds the larger of the two, and the arenas still fit the KV budget they were sized from
    save_profile(fit_model_profile(k, v, name="code", bits=3, query_energy=qe, layer_widths=widths[::-1],
                                   **RECOMMENDED_FIT_OPTIONS[3]), str(tmp_path / "code-3bit"))
    both = _engine(path, kv_bits=3, kv_profile=str(tmp_path), max_model_len=128, kv_cache_bytes=2**21).cache
    assert len(set(both._key.values())) == 2
    assert both.layer_page_bytes == [max(a, b) for a, b in zip(c.layer_page_bytes, c.layer_page_bytes[::-1])]
    assert both.memory_stats()["kv_bytes_reserved"] <= 2**21
    assert torch.equal(_decode_logits(_engine(path, kv_bits=3, kv_profile=str(tmp_path), max_model_len=128,
                                              kv_cache_bytes=2**21), ids, 7, "prose"), _decode_logits(eng, ids, 7))


def test_fit_allocated_profile_keeps_the_recipe_budget(tiny):
    path, eng, ids, k, v, qe = tiny
    d = k[0].shape[-1]
    opts = {**RECOMMENDED_FIT_OPTIONS[3], "k_channel_bits": 3 * d + 8, "v_scale_bits": 8}
    ticks = []
    prof = fit_allocated_profile(eng.model, k, v, [ids[:64], ids[64:128]], name="prose", bits=3, query_energy=qe,
                                 progress=ticks.append, **opts)
    widths = prof.layer_widths()
    # the budget is the uniform recipe's with an fp16 value scale; 8-bit scales leave 8 bits a row to spend
    assert [p.v_scale_bits for p in prof.layers] == [8] * len(widths)
    assert sum(row_bits(vb, kb, d, 8) for vb, kb in widths) <= recipe_budget(3, 3 * d + 8, d) * 2 * d * len(widths)
    sens = prof.meta["layer_sensitivity"]
    assert len(sens["key"]) == len(widths) == len(sens["value"]) and set(sens["value"][0]) == {"2", "3", "4"}
    assert all(x >= -1e-6 for layer in sens["key"] for x in layer.values()) and ticks
    with pytest.raises(ValueError, match="k_channel_bits"):
        fit_allocated_profile(eng.model, k, v, [ids[:64]], name="p", bits=3, **{**opts, "k_channel_bits": None})


def test_one_bit_values_pack_and_quantize_by_hand():
    """1-bit value codes (a layer's values inside a 2-bit profile): code 8j + i at bit i of byte j; each value is
    the nearest of the two codebook levels times the token's max-abs scale, plus the channel mean."""
    from kernels.kv_calibrate import fit_codebook
    from kernels.kv_pack import pack_codes, packed_bytes, unpack_codes
    from kernels.kv_profile import KVQuantProfile
    from kernels.kv_quant import dequantize_values, quantize_kv

    codes = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0]])
    assert packed_bytes(16, 1) == 2
    assert pack_codes(codes, 1).tolist() == [[0b10001101, 0b00000010]]
    assert torch.equal(unpack_codes(pack_codes(codes, 1), 1, 16), codes)
    assert fit_codebook(torch.tensor([-0.9, -0.7, 0.2, 0.6]), 1).tolist() == pytest.approx([-0.8, 0.4])
    h, d = 1, 8
    prof = KVQuantProfile(bits=1, k_scale=torch.ones(h, d), k_zero=torch.zeros(h, d), v_zero=torch.full((h, d), 0.5),
                          k_codebook=torch.tensor([-1.0, 1.0]), v_codebook=torch.tensor([-0.5, 0.25]),
                          k_outlier_idx=torch.zeros(h, 0, dtype=torch.int32),
                          v_outlier_idx=torch.zeros(h, 0, dtype=torch.int32),
                          k_bits=torch.full((h, d), 2, dtype=torch.uint8))
    v = torch.tensor([[[0.5 + x for x in (2.0, -4.0, 1.0, -1.0, 0.0, 3.0, -0.5, 0.5)]]])
    q = quantize_kv(torch.zeros(1, h, d), v, prof)
    assert q.v_codes.shape == (1, h, 1) and float(q.v_scale) == 4.0
    # normalised (v - 0.5) / 4 = .5 -1 .25 -.25 0 .75 -.125 .125; the midpoint of the levels is -0.125 (ties go low)
    assert q.v_codes[0, 0, 0].item() == 0b10110101
    want = torch.tensor([1.0, -2.0, 1.0, -2.0, 1.0, 1.0, -2.0, 1.0]) + 0.5
    torch.testing.assert_close(dequantize_values(q.v_codes, q.v_scale, q.v_outliers, prof)[0, 0], want)


def test_one_bit_value_layer_pages_through_the_cache(tiny, tmp_path):
    """A 2-bit profile with layer 0's values at 1 bit and layer 1's at 3 bits (the 2-bit recipe's value grid,
    `value_bits_grid(2)`): prefill equals decode through the paged cache."""
    from actors.kv.layer_widths import value_bits_grid

    assert value_bits_grid(2) == (1, 2, 3, 4) and value_bits_grid(3) == (2, 3, 4)
    path, _, _, k, v, qe = tiny
    d = k[0].shape[-1]
    widths = [(1, 2 * d), (3, 2 * d + d // 2)]
    prof = fit_model_profile(k, v, name="prose", bits=2, query_energy=qe, layer_widths=widths,
                             **RECOMMENDED_FIT_OPTIONS[2])
    assert [p.bits for p in prof.layers] == [1, 3] and prof.layers[0].v_codebook.shape == (2,)
    save_profile(prof, str(tmp_path / "prose-2bit"))
    assert load_profile(str(tmp_path / "prose-2bit")).layer_widths() == widths
    eng = _engine(path, kv_bits=2, kv_profile=str(tmp_path), max_model_len=128, kv_cache_bytes=2**21)
    ids = torch.randint(1, 300, (45,), generator=torch.Generator().manual_seed(6)).tolist()
    full = eng.prompt_logits(ids)
    torch.testing.assert_close(_decode_logits(eng, ids, 7), full[6:], atol=2e-4, rtol=1e-4)


def test_value_scale_codes_by_hand():
    """8-bit log2 value scales: code c stands for 2 ** ((c - 128) / 16), the least one >= the token's max-abs,
    saturating at 0 and 255; a hand row through quantize / dequantize with such a scale."""
    from kernels.kv_profile import KVQuantProfile
    from kernels.kv_quant import dequantize_values, encode_value_scale, quantize_kv, value_scale_table

    table = value_scale_table()
    assert float(table[128]) == 1.0 and float(table[144]) == 2.0 and float(table[0]) == 2.0 ** -8
    mags = torch.tensor([1.0, 1.01, 2.0 ** (1 / 16), 3.0, 0.0, 2.0 ** -9, 1e6])
    assert encode_value_scale(mags).tolist() == [128, 129, 129, 154, 0, 0, 255]  # 16 log2(3) = 25.4 -> 26
    h, d = 1, 8
    prof = KVQuantProfile(bits=2, k_scale=torch.ones(h, d), k_zero=torch.zeros(h, d), v_zero=torch.zeros(h, d),
                          k_codebook=torch.linspace(-1, 1, 4), v_codebook=torch.tensor([-1.0, -0.25, 0.25, 1.0]),
                          k_outlier_idx=torch.zeros(h, 0, dtype=torch.int32),
                          v_outlier_idx=torch.zeros(h, 0, dtype=torch.int32),
                          k_bits=torch.full((h, d), 2, dtype=torch.uint8), v_scale_bits=8)
    assert prof.bytes_per_token() == h * (2 + 2 + 1)
    v = torch.tensor([[[3.0, -3.0, 0.5, -0.5, 2.0, -2.0, 0.0, 1.2]]])
    q = quantize_kv(torch.zeros(1, h, d), v, prof)
    assert q.v_scale.dtype == torch.uint8 and q.v_scale.item() == 154
    # s = 3.084: v / s = .973 -.973 .162 -.162 .648 -.648 0 .389 -> nearest levels (ties, at 0, go low)
    s = 2.0 ** (26 / 16)
    want = torch.tensor([1.0, -1.0, 0.25, -0.25, 1.0, -1.0, -0.25, 0.25]) * s
    torch.testing.assert_close(dequantize_values(q.v_codes, q.v_scale, q.v_outliers, prof)[0, 0], want)
    back = KVQuantProfile.from_tensors(prof.to_tensors())
    assert back.v_scale_bits == 8
    assert "v_scale_bits" not in KVQuantProfile(**{**{f: getattr(prof, f) for f in (
        "bits", "k_scale", "k_zero", "v_zero", "k_codebook", "v_codebook", "k_outlier_idx", "v_outlier_idx")}}
    ).to_tensors()
    with pytest.raises(ValueError, match="v_scale_bits"):
        KVQuantProfile(**{**{f: getattr(prof, f) for f in ("bits", "k_scale", "k_zero", "v_zero", "k_codebook",
                                                           "v_codebook", "k_outlier_idx", "v_outlier_idx")},
                          "v_scale_bits": 12})


def test_value_scale8_pages_through_the_cache_and_triton(tiny, tmp_path):
    """A 2-bit profile with 8-bit value scales and 1- / 3-bit value layers: one byte less per token and head,
    saved and loaded, prefill equals decode (the compiled CPU kernel), the Triton backend equals the torch one."""
    path, _, _, k, v, qe = tiny
    d = k[0].shape[-1]
    widths = [(1, 2 * d), (3, 2 * d + d // 2)]
    opts = {**RECOMMENDED_FIT_OPTIONS[2], "v_scale_bits": 8}
    prof = fit_model_profile(k, v, name="prose", bits=2, query_energy=qe, layer_widths=widths, **opts)
    ref16 = fit_model_profile(k, v, name="prose", bits=2, query_energy=qe, layer_widths=widths,
                              **{**opts, "v_scale_bits": 16})
    h = prof.layers[0].num_kv_heads
    assert [p.bytes_per_token() for p in prof.layers] == [p.bytes_per_token() - h for p in ref16.layers]
    save_profile(prof, str(tmp_path / "prose-2bit"))
    assert [p.v_scale_bits for p in load_profile(str(tmp_path / "prose-2bit")).layers] == [8, 8]
    ids = torch.randint(1, 300, (45,), generator=torch.Generator().manual_seed(7)).tolist()
    outs = {}
    for backend in ("torch", "triton"):
        eng = _engine(path, kv_bits=2, kv_profile=str(tmp_path), max_model_len=128, kv_cache_bytes=2**21,
                      kernel_backend=backend)
        if backend == "torch":
            full = eng.prompt_logits(ids)
            torch.testing.assert_close(_decode_logits(eng, ids, 7), full[6:], atol=2e-4, rtol=1e-4)
        outs[backend] = _decode_logits(eng, ids, 30)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)
