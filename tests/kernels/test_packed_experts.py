"""Packed sub-4-bit expert weights: format, quantization quality, and reference vs Triton ops.

Shape legend: E = experts, T = tokens, D = hidden, I = expert intermediate, K = input dim, N = output dim.
Triton runs under TRITON_INTERPRET=1 on CPU (fp32 / fp16 only: the interpreter is wrong for bf16), so the
shapes are tiny and deliberately not multiples of the block sizes or of the packing factor.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import packed_weights as ref  # noqa: E402
from kernels import packed_weights_triton as tri  # noqa: E402
from kernels.packed_format import PackedExperts, PackedWeight, pack_codes  # noqa: E402
from kernels.packed_quantize import quantize, quantize_experts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 1e-4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_rel_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    """max |got - want| <= rtol * max |want| (elementwise rtol is meaningless for outputs near 0)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel() == 0:
        return
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= rtol * max(scale, 1e-12), f"max abs err {err:.3g} > {rtol} * {scale:.3g}"


def _rel_mse(pw: PackedWeight, w: torch.Tensor) -> float:
    return ((ref.dequantize(pw) - w).pow(2).mean() / w.pow(2).mean()).item()


def _split(t: int, e: int, seed: int) -> torch.Tensor:
    """Random tokens per expert `[E]` summing to T; expert 1 (if any) always gets 0 tokens."""
    g = _gen(seed)
    if t == 0:
        return torch.zeros(e, dtype=torch.int64)
    cuts = torch.sort(torch.randint(0, t + 1, (e - 1,), generator=g)).values
    counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([t])]))
    if e > 2:
        counts[0] += counts[1]
        counts[1] = 0
    return counts


# ---------------------------------------------------------------- packing and format


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 10, 11, 31, 32, 100, 129])
def test_pack_unpack_round_trip(bits, k):
    codes = torch.randint(0, 1 << bits, (3, 5, k), generator=_gen(k))
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 5, (k * bits + 31) // 32)
    assert torch.equal(ref.unpack_codes(words, bits, k).long(), codes)
    assert torch.equal(tri.unpack_codes(words.to(DEV), bits, k).cpu().long(), codes)


def test_bit_layout_is_little_endian_stream():
    # 3-bit codes 0..10: code 10 occupies stream bits 30..32, straddling words 0 and 1.
    codes = torch.arange(11) % 8
    words = pack_codes(codes, 3)
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    w0 = stream & 0xFFFFFFFF
    assert words.tolist() == [w0 - (1 << 32) if w0 >= 1 << 31 else w0, stream >> 32]


def test_triton_unpack_and_dequantize_match_reference():
    w = torch.randn(3, 37, 100, generator=_gen(0))
    for bits, codebook in [(2, False), (3, True), (4, False)]:
        pw = quantize(w, bits=bits, group_size=32, codebook=codebook).to(DEV)
        assert torch.equal(tri.unpack_codes(pw.codes, bits, 100).cpu(), ref.unpack_codes(pw.codes, bits, 100).cpu())
        assert torch.equal(tri.dequantize(pw).cpu(), ref.dequantize(pw).cpu())


def test_validation_errors_name_the_field():
    with pytest.raises(ValueError, match="bits=5"):
        quantize(torch.randn(4, 32), bits=5)
    with pytest.raises(ValueError, match="group_size=48"):
        quantize(torch.randn(4, 32), group_size=48)
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_codes(torch.tensor([8]), 3)
    pw = quantize(torch.randn(4, 100), bits=3, group_size=32)
    with pytest.raises(ValueError, match="scales.shape"):
        PackedWeight(codes=pw.codes, scales=pw.scales[:, :3], zeros=pw.zeros, bits=3, group_size=32, shape=(4, 100))
    with pytest.raises(ValueError, match="codes.dtype"):
        PackedWeight(codes=pw.codes.to(torch.uint8), scales=pw.scales, zeros=pw.zeros, bits=3, group_size=32,
                     shape=(4, 100))
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=99"):
        ref.gemv(torch.randn(99), pw)
    stack = quantize(torch.randn(2, 4, 32), bits=2, group_size=32)
    with pytest.raises(ValueError, match="cover 5 tokens but x has T=4"):
        ref.grouped_gemm(torch.randn(4, 32), torch.tensor([2, 3]), stack)
    with pytest.raises(ValueError, match=">= 0"):
        tri.grouped_gemm(torch.randn(4, 32), torch.tensor([0, 5, 4]), stack)
    with pytest.raises(ValueError, match="either both gate and up"):
        PackedExperts(down=stack, gate=stack)


# ---------------------------------------------------------------- quantization quality and cost


@pytest.mark.parametrize("codebook", [False, True])
def test_round_trip_error_decreases_with_bits(codebook):
    w = torch.randn(64, 100, generator=_gen(1)) * 0.02
    errs = [_rel_mse(quantize(w, bits=b, group_size=32, codebook=codebook), w) for b in (2, 3, 4)]
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.01  # 4-bit g=32: step ~ range / 15, relative MSE ~ 0.5%


@pytest.mark.parametrize("bits", [2, 3])
def test_codebook_beats_uniform_on_gaussian(bits):
    w = torch.randn(128, 256, generator=_gen(2)) * 0.02
    uniform = _rel_mse(quantize(w, bits=bits, group_size=64), w)
    book = _rel_mse(quantize(w, bits=bits, group_size=64, codebook=True), w)
    assert book < 0.9 * uniform, (book, uniform)


def test_effective_bits_exact():
    # bits=3, g=64, K a multiple of 64: codes 3 + fp16 scale 16/64 + fp16 zero 16/64 = 3.5 bits per weight.
    w = torch.randn(16, 128, generator=_gen(3))
    assert quantize(w, bits=3, group_size=64).effective_bits() == 3.5
    # + fp16 codebook of 8 levels over 16*128 weights: 8*16 / 2048 = 0.0625.
    assert quantize(w, bits=3, group_size=64, codebook=True).effective_bits() == 3.5625
    # K=100, g=32, bits=3: W = ceil(300/32) = 10 words = 320 bits, G = 4 groups * 32 bits = 128 -> 448/100.
    assert quantize(w[:, :100], bits=3, group_size=32).effective_bits() == pytest.approx(4.48, rel=1e-12)
    # bits=4, g=128: 4 + 32/128 = 4.25; bits=2, g=128: 2.25.
    assert quantize(w, bits=4, group_size=128).effective_bits() == 4.25
    assert quantize(w, bits=2, group_size=128).effective_bits() == 2.25
    experts = quantize_experts(torch.randn(2, 64, 128), torch.randn(2, 64, 128), torch.randn(2, 128, 64),
                                   bits=3, group_size=64)
    assert experts.effective_bits() == 3.5


def test_3bit_codes_cost_three_eighths_byte_per_weight():
    n, k = 64, 1024
    pw = quantize(torch.randn(n, k, generator=_gen(4)), bits=3, group_size=128)
    assert pw.codes.numel() * pw.codes.element_size() == n * k * 3 // 8
    # A tail that does not fill a word costs < 32 bits per row, never a whole extra code slot per word.
    pw = quantize(torch.randn(n, 100, generator=_gen(4)), bits=3, group_size=32)
    assert pw.codes.numel() * 4 == n * 40  # ceil(300 / 32) = 10 words = 40 bytes for 37.5 bytes of codes


def test_save_load_round_trip(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    w = torch.randn(37, 100, generator=_gen(5))
    pw = quantize(w, bits=3, group_size=32, codebook=True)
    experts = quantize_experts(torch.randn(2, 8, 40), torch.randn(2, 8, 40), torch.randn(2, 40, 8),
                                   bits=2, group_size=32, fuse_gate_up=True)
    path = tmp_path / "packed.safetensors"
    safetensors.save_file({**pw.to_tensors("layers.0.w"), **experts.to_tensors("layers.0.experts")}, str(path))
    loaded = safetensors.load_file(str(path))
    pw2 = PackedWeight.from_tensors(loaded, "layers.0.w")
    assert pw2.shape == (37, 100) and pw2.bits == 3 and pw2.codebook is not None
    assert torch.equal(ref.dequantize(pw2), ref.dequantize(pw))
    ex2 = PackedExperts.from_tensors(loaded, "layers.0.experts")
    assert ex2.fused and ex2.num_experts == 2 and ex2.intermediate_size == 8 and ex2.hidden_size == 40
    assert torch.equal(ref.dequantize(ex2.gate_up), ref.dequantize(experts.gate_up))
    with pytest.raises(ValueError, match="missing"):
        PackedWeight.from_tensors(loaded, "layers.1.w")


# ---------------------------------------------------------------- GEMV and grouped GEMM


@pytest.mark.parametrize("bits,codebook", [(2, False), (3, False), (3, True), (4, True)])
@pytest.mark.parametrize("n,k,group", [(37, 100, 32), (5, 129, 64), (64, 256, 128)])
def test_gemv_matches_dense(bits, codebook, n, k, group):
    pw = quantize(torch.randn(n, k, generator=_gen(n + k)), bits=bits, group_size=group,
                      codebook=codebook).to(DEV)
    x = torch.randn(k, generator=_gen(7)).to(DEV)
    want = x @ ref.dequantize(pw).T
    _assert_rel_close(ref.gemv(x, pw), want)
    _assert_rel_close(tri.gemv(x, pw), want)


def _dense_grouped(x, offsets, pw):
    w = ref.dequantize(pw)  # [E, N, K]
    out = torch.zeros(x.shape[0], pw.out_features, device=x.device)
    for e in range(pw.num_experts):
        out[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]] @ w[e].T
    return out


@pytest.mark.parametrize("t", [0, 1, 3, 17, 33, 64, 70])
@pytest.mark.parametrize("e", [1, 5])
def test_grouped_gemm_matches_dense(t, e):
    n, k = 37, 100
    pw = quantize(torch.randn(e, n, k, generator=_gen(e)), bits=3, group_size=32,
                      codebook=t % 2 == 1).to(DEV)
    x = torch.randn(t, k, generator=_gen(t)).to(DEV)
    counts = _split(t, e, seed=t + e)
    offsets = F.pad(torch.cumsum(counts, 0), (1, 0))
    want = _dense_grouped(x, offsets.tolist(), pw)
    for impl in (ref, tri):
        _assert_rel_close(impl.grouped_gemm(x, counts.to(DEV), pw), want)
        _assert_rel_close(impl.grouped_gemm(x, offsets.to(DEV), pw), want)


@pytest.mark.parametrize("bits", [2, 4])
def test_grouped_gemm_other_bits_and_empty_experts(bits):
    pw = quantize(torch.randn(4, 19, 40, generator=_gen(bits)), bits=bits, group_size=32).to(DEV)
    x = torch.randn(33, 40, generator=_gen(8)).to(DEV)
    counts = torch.tensor([0, 33, 0, 0])  # every token on one expert, the rest idle
    want = _dense_grouped(x, [0, 0, 33, 33, 33], pw)
    _assert_rel_close(ref.grouped_gemm(x, counts, pw), want)
    _assert_rel_close(tri.grouped_gemm(x, counts.to(DEV), pw), want)


def test_triton_grouped_gemm_fp16():
    pw = quantize(torch.randn(2, 37, 64, generator=_gen(9)), bits=4, group_size=32).to(DEV)
    x = torch.randn(20, 64, generator=_gen(10)).half().to(DEV)
    counts = torch.tensor([7, 13]).to(DEV)
    got = tri.grouped_gemm(x, counts, pw)
    assert got.dtype == torch.float16
    _assert_rel_close(got, ref.grouped_gemm(x, counts, pw), rtol=1e-2)


# ---------------------------------------------------------------- expert FFN


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("t", [0, 1, 17])
def test_packed_expert_ffn_matches_dense(fuse, t):
    e, d, i = 3, 40, 24
    g = _gen(11)
    gate, up = torch.randn(e, i, d, generator=g), torch.randn(e, i, d, generator=g)
    down = torch.randn(e, d, i, generator=g)
    experts = quantize_experts(gate, up, down, bits=4, group_size=32, codebook=fuse, fuse_gate_up=fuse).to(DEV)
    x = torch.randn(t, d, generator=_gen(t)).to(DEV)
    counts = _split(t, e, seed=t)
    offsets = F.pad(torch.cumsum(counts, 0), (1, 0)).tolist()
    if fuse:
        wg, wu = ref.dequantize(experts.gate_up).split(i, dim=1)
    else:
        wg, wu = ref.dequantize(experts.gate), ref.dequantize(experts.up)
    wd = ref.dequantize(experts.down)
    want = torch.zeros(t, d, device=DEV)
    for j in range(e):
        xs = x[offsets[j]:offsets[j + 1]]
        want[offsets[j]:offsets[j + 1]] = (F.silu(xs @ wg[j].T) * (xs @ wu[j].T)) @ wd[j].T
    _assert_rel_close(ref.packed_expert_ffn(x, counts.to(DEV), experts), want)
    _assert_rel_close(tri.packed_expert_ffn(x, counts.to(DEV), experts), want)
