"""KV quantization (KVQuant arXiv 2401.18079; KIVI arXiv 2402.02750 baseline): packing, round trip, bits,
outlier isolation, profile serialisation, paged storage.

Shape legend: N = tokens, H = KV heads, D = head_dim, Q = queries.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.kivi import kivi_dequantize, kivi_quantize  # noqa: E402
from kernels.kv_calibrate import allocate_channel_bits, fit_codebook, fit_kv_profile  # noqa: E402
from kernels.kv_pack import (  # noqa: E402
    channel_bit_offsets,
    pack_codes,
    pack_codes_var,
    packed_bytes,
    unpack_codes,
    unpack_codes_var,
)
from kernels.kv_pages import KVPages  # noqa: E402
from kernels.kv_profile import KVQuantProfile, effective_bits  # noqa: E402
from kernels.kv_quant import dequantize_kv, nearest_level, quantize_kv  # noqa: E402

OUTLIER_CHANNELS = [3, 17, 40]


def _rel_err(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return ((x_hat - x).norm() / x.norm()).item()


def _kv(n: int, h: int = 2, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_roundtrip_and_size(bits):
    codes = torch.randint(0, 1 << bits, (5, 3, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, 3, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, 64), codes)


def test_three_bit_codes_cost_three_eighths_byte():
    assert packed_bytes(64, 3) == 24  # 64 codes * 3/8 byte
    assert packed_bytes(128, 3) == 48
    # LSB-first bitstream: 8 codes -> 3 bytes; code 2 straddles bytes 0 and 1.
    packed = pack_codes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0]), 3)
    assert packed.tolist() == [1 | (2 << 3) | ((3 & 3) << 6), (3 >> 2) | (4 << 1) | (5 << 4) | ((6 & 1) << 7),
                               (6 >> 1) | (7 << 2) | (0 << 5)]
    with pytest.raises(ValueError, match="head_dim=12"):
        packed_bytes(12, 3)
    with pytest.raises(ValueError, match="bits=5"):
        pack_codes(torch.zeros(8, dtype=torch.long), 5)


def test_roundtrip_error_shrinks_with_bits():
    k_cal, v_cal = _kv(512, seed=1)
    k, v = _kv(128, seed=2)
    errs = {}
    for bits in (2, 3, 4):
        prof = fit_kv_profile(k_cal, v_cal, bits=bits, n_outlier=2)
        k_hat, v_hat = dequantize_kv(quantize_kv(k, v, prof), prof)
        errs[bits] = (_rel_err(k_hat, k), _rel_err(v_hat, v))
    for i in range(2):
        assert errs[4][i] < errs[3][i] < errs[2][i], errs
    assert errs[4][0] < 0.12 and errs[4][1] < 0.12, errs


def test_kmeans_codebook_beats_uniform_on_gaussian():
    x = (torch.randn(20000, generator=torch.Generator().manual_seed(0)) / 3).clamp(-1, 1)
    mse = {}
    for method in ("kmeans", "uniform"):
        cb = fit_codebook(x, 3, method=method)
        assert cb.shape == (8,) and bool((cb[1:] > cb[:-1]).all())
        mse[method] = ((cb[nearest_level(x, cb)] - x) ** 2).mean().item()
    assert mse["kmeans"] < 0.8 * mse["uniform"], mse
    assert torch.equal(fit_codebook(x, 3), fit_codebook(x, 3))  # deterministic init


def test_effective_bits_head_dim_64():
    k_cal, v_cal = _kv(256, h=4)
    for bits in (2, 3, 4):
        prof = fit_kv_profile(k_cal, v_cal, bits=bits, n_outlier=2)
        # codes + fp16 V scale (0.125) + 2 fp16 key outliers (0.25) + amortised profile
        eb = effective_bits(prof, num_tokens=4096)
        assert bits + 0.375 < eb < bits + 0.4, (bits, eb)
        # sealed blocks round up, fp16 sink / tail tokens cost 16 bits each
        assert effective_bits(prof, num_tokens=4090, block_size=16) > eb
        eb_fp = effective_bits(prof, num_tokens=4096 - 32, num_full_precision_tokens=32)
        assert eb < eb_fp < eb + 32 * 16 / 4096 + 0.01
    with pytest.raises(ValueError, match="must be > 0"):
        effective_bits(prof, num_tokens=0)


def _attention(q_QHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> torch.Tensor:
    scale = q_QHD.shape[-1] ** -0.5
    p = torch.einsum("qhd,nhd->qhn", q_QHD, k_NHD).mul(scale).softmax(-1)
    return torch.einsum("qhn,nhd->qhd", p, v_NHD)


def test_outlier_channels_isolated_keep_attention():
    """A few key channels 100x larger: per-channel + isolated outliers stays > 0.99 cosine at 4 and 3 bits.

    Values share a per-channel mean (as with Qwen2's v_proj bias); with iid Gaussian values a 3-bit
    per-token scalar code caps the cosine near 0.98 whatever the keys do.
    """
    g = torch.Generator().manual_seed(0)
    n, h, d = 256, 2, 64
    mu_HD = torch.randn(h, d, generator=g)

    def sample(m):
        k = torch.randn(m, h, d, generator=g)
        k[..., OUTLIER_CHANNELS] *= 100.0
        return k, mu_HD + 0.5 * torch.randn(m, h, d, generator=g)

    k_cal, v_cal = sample(512)
    k, v = sample(n)
    q = torch.randn(16, h, d, generator=g)
    ref = _attention(q, k, v)
    for bits in (4, 3):
        cos = {}
        for n_outlier in (4, 0):
            prof = fit_kv_profile(k_cal, v_cal, bits=bits, n_outlier=n_outlier)
            assert (n_outlier == 0) or set(OUTLIER_CHANNELS) <= set(prof.k_outlier_idx[0].tolist())
            k_hat, v_hat = dequantize_kv(quantize_kv(k, v, prof), prof)
            cos[n_outlier] = torch.cosine_similarity(_attention(q, k_hat, v_hat), ref, dim=-1).min().item()
        kivi_k, kivi_v = kivi_dequantize(kivi_quantize(k, v, bits=bits, group_size=32))
        cos["kivi"] = torch.cosine_similarity(_attention(q, kivi_k, kivi_v), ref, dim=-1).min().item()
        assert cos[4] > 0.99, (bits, cos)
        assert cos[0] < cos[4] - 0.05, (bits, cos)
        assert cos["kivi"] < cos[4], (bits, cos)


def test_bypass_with_all_channels_outliers_is_fp16_exact():
    k, v = _kv(32)
    k, v = k.half().float(), v.half().float()
    prof = fit_kv_profile(k, v, bits=2, n_outlier=64, n_outlier_v=64)
    k_hat, v_hat = dequantize_kv(quantize_kv(k, v, prof), prof)
    assert torch.equal(k_hat, k) and torch.equal(v_hat, v)


def test_profile_tensors_roundtrip_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    k_cal, v_cal = _kv(64)
    prof = fit_kv_profile(k_cal, v_cal, bits=3, n_outlier=2, n_outlier_v=1, percentile=0.99)
    path = tmp_path / "layer0.safetensors"
    safetensors_torch.save_file(prof.to_tensors(), str(path))
    back = KVQuantProfile.from_tensors(safetensors_torch.load_file(str(path)))
    assert back.bits == 3
    for name, t in prof.to_tensors().items():
        assert torch.equal(getattr(back, name) if name != "bits" else torch.tensor(back.bits, dtype=torch.int32), t)
    k, v = _kv(8, seed=5)
    a, b = quantize_kv(k, v, prof), quantize_kv(k, v, back)
    assert torch.equal(a.k_codes, b.k_codes) and torch.equal(a.v_codes, b.v_codes)


def test_profile_validation_names_field():
    k_cal, v_cal = _kv(64)
    good = fit_kv_profile(k_cal, v_cal, bits=2).to_tensors()
    bad = dict(good, k_codebook=good["k_codebook"].flip(0))
    with pytest.raises(ValueError, match="k_codebook"):
        KVQuantProfile.from_tensors(bad)
    bad = dict(good, bits=torch.tensor(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="k_codebook.shape"):
        KVQuantProfile.from_tensors(bad)
    bad = dict(good, k_outlier_idx=torch.tensor([[1, 1], [0, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_outlier_idx"):
        KVQuantProfile.from_tensors(bad)
    with pytest.raises(ValueError, match="missing"):
        KVQuantProfile.from_tensors({"bits": good["bits"]})
    with pytest.raises(ValueError, match="n_outlier=65"):
        fit_kv_profile(k_cal, v_cal, bits=2, n_outlier=65)
    with pytest.raises(ValueError, match="bits=5"):  # 1 bit is a layer's value width (actors.kv.layer_widths)
        fit_kv_profile(k_cal, v_cal, bits=5)


def test_pages_write_read_scattered_blocks():
    k_cal, v_cal = _kv(64)
    prof = fit_kv_profile(k_cal, v_cal, bits=3, n_outlier=2, n_outlier_v=1)
    pages = KVPages.empty(prof, num_blocks=6, block_size=4)
    assert pages.k_codes.shape == (6, 2, 4, 24) and pages.v_scale.shape == (6, 4, 2)
    assert pages.k_outliers.shape == (6, 4, 2, 2) and pages.v_outliers.shape == (6, 4, 2, 1)
    k, v = _kv(10, seed=3)
    q = quantize_kv(k, v, prof)
    table = torch.tensor([5, 0, 3])
    t = torch.arange(10)
    pages.write(table[t // 4], t % 4, q)
    back = pages.read(table[t // 4], t % 4)
    for name in ("k_codes", "v_codes", "v_scale", "k_outliers", "v_outliers"):
        assert torch.equal(getattr(back, name), getattr(q, name)), name
    assert prof.bytes_per_token() == 2 * (2 * 24 + 2 + 2 * 2 + 2 * 1)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kivi_baseline(bits):
    k, v = _kv(64)
    q = kivi_quantize(k, v, bits=bits, group_size=32)
    k_hat, v_hat = kivi_dequantize(q)
    assert k_hat.shape == k.shape and v_hat.shape == v.shape
    assert _rel_err(k_hat, k) < {2: 0.6, 3: 0.25, 4: 0.12}[bits]
    assert q.effective_bits() == pytest.approx(bits + 1.0)  # fp16 scale + zero per 32 elements, K and V
    with pytest.raises(ValueError, match="group_size=48"):
        kivi_quantize(k, v, bits=bits, group_size=48)


@pytest.mark.parametrize("bits", [5, 6, 8])
def test_kivi_wide_codes(bits):
    """5-8 bit codes (the fidelity ladder's rows) are stored one per byte but counted at their width; the error
    halves with each bit (a uniform grid's step)."""
    k, v = _kv(64)
    q = kivi_quantize(k, v, bits=bits, group_size=32)
    assert q.k_codes.shape == k.shape and int(q.k_codes.max()) == (1 << bits) - 1
    assert q.effective_bits() == pytest.approx(bits + 1.0)
    k_hat, v_hat = kivi_dequantize(q)
    k4, v4 = kivi_dequantize(kivi_quantize(k, v, bits=4, group_size=32))
    assert _rel_err(k_hat, k) < _rel_err(k4, k) / 2 ** (bits - 4) * 1.3
    assert _rel_err(v_hat, v) < _rel_err(v4, v) / 2 ** (bits - 4) * 1.3
    with pytest.raises(ValueError, match="bits=9"):
        kivi_quantize(k, v, bits=9, group_size=32)


def test_kivi_matched_bits_groups():
    """Key groups of 128 tokens and value groups of 64 channels: bits + 16/128/2 + 16/64/2 = bits + 0.375."""
    k, v = _kv(256)
    q = kivi_quantize(k, v, bits=2, group_size=128, v_group_size=64)
    assert q.effective_bits() == pytest.approx(2.375)
    k_hat, v_hat = kivi_dequantize(q)
    assert _rel_err(k_hat, k) < 0.7 and _rel_err(v_hat, v) < 0.7
    with pytest.raises(ValueError, match="v_group_size=48"):
        kivi_quantize(k, v, bits=2, group_size=128, v_group_size=48)


def test_mse_key_range_lowers_key_error_and_keeps_format():
    """k_range="mse" shrinks per-channel ranges where that lowers the squared error (uniform grid, heavy-tailed
    keys); the stored layout is the same as with min/max ranges (calibration-only change)."""
    g = torch.Generator().manual_seed(7)
    # heavy-tailed keys: a few large values stretch min/max far beyond where the mass is
    k_cal = torch.randn(2048, 2, 64, generator=g) * torch.rand(2048, 2, 64, generator=g).pow(4).mul(6).add(1)
    v_cal = torch.randn(2048, 2, 64, generator=g)
    k, v = k_cal[:512], v_cal[:512]
    err = {}
    for rng in ("minmax", "mse"):
        prof = fit_kv_profile(k_cal, v_cal, bits=2, n_outlier=0, k_range=rng, codebook="uniform")
        q = quantize_kv(k, v, prof)
        assert q.k_codes.shape == (512, 2, 16) and prof.bytes_per_token() == 2 * (2 * 16 + 2)
        err[rng] = _rel_err(dequantize_kv(q, prof)[0], k)
        if rng == "mse":
            assert bool((prof.k_scale <= fit_kv_profile(k_cal, v_cal, bits=2, n_outlier=0,
                                                        k_range="minmax").k_scale + 1e-6).all())
    # a uniform 2-bit grid has no level at 0: over a min/max range most keys land far from any level
    assert err["mse"] < 0.5 * err["minmax"], err
    with pytest.raises(ValueError, match="k_range='max'"):
        fit_kv_profile(k_cal, v_cal, bits=2, k_range="max")


def test_separate_value_codebook_method():
    k_cal, v_cal = _kv(256)
    prof = fit_kv_profile(k_cal, v_cal, bits=2, codebook="uniform", codebook_v="kmeans")
    assert torch.equal(prof.k_codebook, torch.linspace(-1, 1, 4))
    assert not torch.allclose(prof.v_codebook, torch.linspace(-1, 1, 4))
    with pytest.raises(ValueError, match="codebook_v='lloyd'"):
        fit_kv_profile(k_cal, v_cal, bits=2, codebook_v="lloyd")


# --- per-channel key widths (k_bits) ------------------------------------------------------------------------


def test_pack_codes_var_roundtrip_matches_fixed_width_layout():
    g = torch.Generator().manual_seed(0)
    widths = torch.tensor([[1, 8, 3, 2, 5, 2, 3, 4], [2, 2, 2, 2, 2, 2, 8, 8]], dtype=torch.uint8)  # 28 bits each
    codes = (torch.rand(5, 2, 8, generator=g) * (1 << widths.long()).float()).long()
    packed = pack_codes_var(codes, widths)
    assert packed.shape == (5, 2, 4) and packed.dtype == torch.uint8  # ceil(28 / 8) bytes
    assert torch.equal(unpack_codes_var(packed, widths), codes)
    assert channel_bit_offsets(widths)[0].tolist() == [0, 1, 9, 12, 14, 19, 21, 24]
    # equal widths give exactly the fixed-width layout of pack_codes
    for b in (2, 3, 4):
        w = torch.full((2, 16), b, dtype=torch.uint8)
        c = torch.randint(0, 1 << b, (3, 2, 16), generator=g)
        assert torch.equal(pack_codes_var(c, w), pack_codes(c, b))
    with pytest.raises(ValueError, match="same bits per head"):
        pack_codes_var(codes, torch.tensor([[2] * 8, [3] * 8], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        pack_codes_var(codes, torch.tensor([[0, 4] + [2] * 6, [2] * 8], dtype=torch.uint8))


def test_pack_codes_var_compiled_pass_equals_the_pytorch_reference(monkeypatch):
    """kernels/csrc/kv_bits.c writes the reference's bytes and reads its codes back, for rows that end mid-byte and
    widths of 1 to 8, and the fixed-width `pack_codes` / `unpack_codes` that run through it (the reference: the same
functions with the compiled pass turned off)."""
    from kernels import kv_pack
    from kernels.cpu import cpu_kernels_available

    if not cpu_kernels_available():
        pytest.skip("no C compiler or no AVX2/FMA: only the reference runs")
    g = torch.Generator().manual_seed(1)
    # rows of 29 bits: 4 bytes, the last one 5/8 used
    widths = torch.tensor([[1, 8, 3, 2, 5, 2, 3, 4, 1], [2, 2, 2, 2, 2, 2, 8, 8, 1], [6, 8, 8, 1, 1, 1, 1, 1, 2]])
    codes = (torch.rand(37, 3, 9, generator=g) * (1 << widths).float()).long()
    fast = pack_codes_var(codes, widths)
    fast_codes = unpack_codes_var(fast, widths)
    fixed = {b: torch.randint(0, 1 << b, (4, 3, 16), generator=g) for b in (2, 3, 4)}  # pack_codes: the same pass
    fast_fixed = {b: pack_codes(c, b) for b, c in fixed.items()}
    monkeypatch.setattr(kv_pack, "_cpu_lib", lambda t: None)
    assert torch.equal(fast, pack_codes_var(codes, widths))
    assert torch.equal(fast_codes, unpack_codes_var(fast, widths)) and torch.equal(fast_codes, codes)
    for b, c in fixed.items():
        assert torch.equal(fast_fixed[b], pack_codes(c, b))
        monkeypatch.undo()
        assert torch.equal(unpack_codes(fast_fixed[b], b, 16), c)
        monkeypatch.setattr(kv_pack, "_cpu_lib", lambda t: None)


def test_allocate_channel_bits_follows_weighted_error():
    # err halves per bit (6 dB/bit): the bit goes where weight * err is largest
    err = torch.stack([torch.full((1, 4), 4.0 ** -b) for b in range(9)])
    bits = allocate_channel_bits(err, torch.tensor([[1.0, 1.0, 16.0, 256.0]]), 2 * 4 + 6)
    assert bits.tolist() == [[2, 2, 4, 6]] and bits.dtype == torch.uint8
    with pytest.raises(ValueError, match="k_channel_bits=7"):
        allocate_channel_bits(err, torch.ones(1, 4), 7)


def test_per_channel_key_bits_mse_clip():
    """k_range="mse" with per-channel widths: each channel's range is shrunk by the clip factor with the least
    squared error at the width it was given. Heavy-tailed channels (a few 30x spikes) get a clipped range; the
    min/max fit keeps the calibrated range; the clipped fit's key error on fresh keys of the same law is lower;
    the stored format (widths budget, bytes) is the same."""
    g = torch.Generator().manual_seed(5)

    def keys(n):
        k = torch.randn(n, 2, 64, generator=g)
        spikes = torch.rand(n, 2, 64, generator=g) < 0.002
        return torch.where(spikes, k * 30.0, k)

    k_cal, v_cal = keys(4096), torch.randn(4096, 2, 64, generator=g)
    kw = dict(bits=3, n_outlier=0, codebook="uniform", codebook_v="kmeans", k_channel_bits=192)
    mm = fit_kv_profile(k_cal, v_cal, k_range="minmax", **kw)
    ms = fit_kv_profile(k_cal, v_cal, k_range="mse", **kw)
    assert ms.k_bits.long().sum(1).tolist() == [192, 192] and ms.k_packed_bytes == mm.k_packed_bytes == 24
    assert bool((ms.k_scale <= mm.k_scale * (1 + 1e-6)).all()) and bool((ms.k_scale < 0.9 * mm.k_scale).any())
    assert torch.equal(ms.k_zero, mm.k_zero)
    k, v = keys(2048), torch.randn(2048, 2, 64, generator=g)
    err = [((dequantize_kv(quantize_kv(k, v, p), p)[0] - k) ** 2).mean().item() for p in (mm, ms)]
    assert err[1] < 0.8 * err[0], err


def test_per_channel_key_bits_fit_format_and_error():
    """Query-energy-weighted widths: a 100x channel and the high-energy channels get the bits; the key row is
    ceil(B / 8) bytes; error on the weighted channels beats the uniform 2-bit grid with an fp16 outlier at
    about the same bytes; the profile round-trips through tensors (older files without k_bits load too)."""
    k_cal, v_cal = _kv(2048)
    k_cal[:, :, OUTLIER_CHANNELS] *= 100.0
    energy = torch.ones(2, 64)
    energy[:, 8:16] = 50.0
    prof = fit_kv_profile(k_cal, v_cal, bits=2, n_outlier=0, codebook="uniform", codebook_v="kmeans",
                          k_range="minmax", k_channel_bits=152, query_energy=energy)
    assert prof.per_channel_keys and prof.k_bits.shape == (2, 64) and prof.k_bits.dtype == torch.uint8
    assert prof.k_bits.long().sum(1).tolist() == [152, 152] and prof.k_packed_bytes == 19
    assert bool((prof.k_bits[:, OUTLIER_CHANNELS] >= 6).all()) and bool((prof.k_bits[:, 8:16] >= 3).all())
    assert prof.bytes_per_token() == 2 * (19 + 16 + 2)
    k, v = _kv(256, seed=9)
    k[:, :, OUTLIER_CHANNELS] *= 100.0
    q = quantize_kv(k, v, prof)
    assert q.k_codes.shape == (256, 2, 19) and q.v_codes.shape == (256, 2, 16)
    k_hat, _ = dequantize_kv(q, prof)
    old = fit_kv_profile(k_cal, v_cal, bits=2, n_outlier=1, codebook="uniform", codebook_v="kmeans",
                         k_range="minmax")  # 18 bytes per key row
    k_old, _ = dequantize_kv(quantize_kv(k, v, old), old)
    w = energy[None]
    assert ((k_hat - k) ** 2 * w).sum() < 0.7 * ((k_old - k) ** 2 * w).sum()
    t = prof.to_tensors()
    assert "k_bits" in t and "k_bits" not in old.to_tensors()
    back = KVQuantProfile.from_tensors(t)
    assert torch.equal(back.k_bits, prof.k_bits) and torch.equal(quantize_kv(k, v, back).k_codes, q.k_codes)
    assert not KVQuantProfile.from_tensors(old.to_tensors()).per_channel_keys
    pages = KVPages.empty(prof, num_blocks=3, block_size=4)
    assert pages.k_codes.shape == (3, 2, 4, 19) and pages.v_codes.shape == (3, 2, 4, 16)
    assert effective_bits(prof, num_tokens=1024) == pytest.approx(
        (1024 * prof.bytes_per_token() + sum(x.numel() * x.element_size() for x in t.values())) * 8 / (1024 * 256))
    with pytest.raises(ValueError, match="k_bits rows"):
        KVQuantProfile.from_tensors(dict(t, k_bits=torch.cat([t["k_bits"][:1], t["k_bits"][:1] + 1])))
    with pytest.raises(ValueError, match="k_channel_bits=600"):
        fit_kv_profile(k_cal, v_cal, bits=2, k_channel_bits=600)
    with pytest.raises(ValueError, match="query_energy.shape"):
        fit_kv_profile(k_cal, v_cal, bits=2, k_channel_bits=152, query_energy=torch.ones(64))


@pytest.mark.parametrize("case", ["grid-fp16", "grid-8bit", "codebook", "1bit-values"])
def test_compiled_quantizer_is_bit_identical_to_the_reference(case, monkeypatch):
    """kernels/csrc/kv_quantize.c against quantize_kv's PyTorch ops: every code, scale and outlier equal, on
    per-channel key widths and codebook keys, fp16 and 8-bit value scales, outliers, rows of zeros, values on
    codebook midpoints and beyond fp16's range."""
    import dataclasses

    from kernels import kv_quant
    from kernels.cpu import cpu_kernels_available

    if not cpu_kernels_available():
        pytest.skip("the compiled CPU kernels are not built")
    g = torch.Generator().manual_seed(3)
    k_cal, v_cal = torch.randn(64, 2, 32, generator=g) * 3, torch.randn(64, 2, 32, generator=g)
    energy = (4.0 ** torch.linspace(0, 7, 32)).repeat(2, 1)
    kw = dict(bits=2, k_channel_bits=96, query_energy=energy, n_outlier=0) if case.startswith("grid") else dict(
        bits=3, n_outlier=2)
    prof = fit_kv_profile(k_cal, v_cal, n_outlier_v=1, **kw)
    if case == "grid-8bit":
        prof = dataclasses.replace(prof, v_scale_bits=8)
    if case == "1bit-values":
        prof = fit_kv_profile(k_cal, v_cal, bits=1, n_outlier=1, n_outlier_v=1)
    k, v = torch.randn(40, 2, 32, generator=g) * 3, torch.randn(40, 2, 32, generator=g)
    v[3] = 0.0  # a row of zeros: scale 1
    v[4, 0, :4] = 1e6  # beyond fp16
    mids = (prof.v_codebook[1:] + prof.v_codebook[:-1]) * 0.5
    v[5, 1, :mids.numel()] = mids  # exactly on a midpoint (bucketize: the lower level)
    got = quantize_kv(k, v, prof)
    monkeypatch.setattr(kv_quant, "_compiled_quantize", lambda *a: None)
    want = quantize_kv(k, v, prof)
    for f in ("k_codes", "v_codes", "v_scale", "k_outliers", "v_outliers"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float16 else a,
                           b.view(torch.uint8) if b.dtype == torch.float16 else b), f


def test_key_widths_are_checked_once_per_tensor_and_again_after_an_in_place_change():
    """`_check_widths` remembers a widths tensor's result (profiles ask for their packed key bytes on every decode
    call), and checks again once the tensor is modified in place."""
    from kernels import kv_pack

    w = torch.tensor([[3, 2, 4, 3], [2, 3, 3, 4]])
    assert kv_pack._check_widths(w) == (12, 2)
    calls = []
    real = kv_pack._widths_of
    kv_pack._widths_of = lambda t: calls.append(1) or real(t)
    try:
        assert kv_pack._check_widths(w) == (12, 2) and not calls  # remembered
        w[0, 0] = 9  # in place: past MAX_CHANNEL_BITS
        with pytest.raises(ValueError, match="k_bits values"):
            kv_pack._check_widths(w)
        assert calls == [1]
        assert kv_pack._check_widths(torch.tensor([[4, 4]])) == (8, 1)  # another tensor, its own result
        with torch.inference_mode():  # an inference tensor has no version counter: compared by contents
            wi = torch.tensor([[2, 2]])
            assert kv_pack._check_widths(wi) == (4, 1) and kv_pack._check_widths(wi) == (4, 1)
            wi[0, 1] = 0
            with pytest.raises(ValueError, match="k_bits values"):
                kv_pack._check_widths(wi)
    finally:
        kv_pack._widths_of = real
