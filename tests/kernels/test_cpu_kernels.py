"""The compiled CPU kernels (`kernels.cpu`) against float64 / PyTorch references over the same
(exactly widened) bf16 weights, on shapes that are not multiples of the kernels' blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels
from kernels.cpu import _build, cpu_kernels_available, linear, packing
from kernels.tuning import MAX_GEMM_ROWS, MAX_KERNEL_ROWS


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.fixture(params=[1, 2], ids=["avx2", "avx512"])
def isa(request):
    """Run the test on the blocked GEMM's AVX2 loops, then its AVX-512 loops (skipped without AVX-512)."""
    if not cpu_kernels_available():
        pytest.skip("no C compiler or no AVX2/FMA: the fallback path runs")
    if request.param > _build.best_isa():
        pytest.skip("this CPU (or MOERAY_CPU_ISA) has no AVX-512")
    prev = _build.set_isa(request.param)
    assert _build.lib().moeray_isa() == request.param
    yield request.param
    _build.set_isa(prev)


@pytest.mark.parametrize("M", [0, 1, 2, 3, 4, 5, 7, 8, 9, MAX_KERNEL_ROWS, 17, 64, 65, 131])
@pytest.mark.parametrize("N,K", [(1, 1), (3, 7), (5, 8), (9, 15), (4, 16), (6, 17), (513, 256), (31, 255)])
def test_kernel_matches_float64_reference(isa, M, N, K):
    """Every row remainder of the GEMMs' tiles (row-major: 4 or 3 rows, 64-row chunks; panels: 8 or 2 rows), every
    weight-block remainder (N mod 4, N mod 32) and K tail (K mod 8 and mod 16), on both instruction sets."""
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g)
    for bias in (None, b):
        for _ in range(2):  # first sight: the row-major kernel; then the packed panel copy (`kernels.cpu.packing`)
            got = linear(x, w, bias)
            assert got.shape == (M, N) and got.dtype == torch.float32
            torch.testing.assert_close(got, _ref(x, w, bias), atol=2e-5 * K ** 0.5, rtol=1e-5)
    assert M == 0 or packing.panels(w) is not None


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler or no AVX2/FMA: the fallback path runs")
@pytest.mark.parametrize("M", [3, 40])
def test_kernel_reads_row_strided_activations_and_weight_views(isa, M):
    """Rows of x that are a column slice of a wider tensor, and a weight that is a row block of a fused
    matrix (how q/k/v and the per-expert views are stored)."""
    x = torch.randn(M, 300)[:, 10:266]
    fused = torch.randn(96, 256).bfloat16()
    w = fused[32:96]
    torch.testing.assert_close(linear(x, w), _ref(x, w, None), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear(x[1], w), _ref(x[1:2], w, None)[0], atol=1e-4, rtol=1e-5)  # 1-D x


@pytest.mark.parametrize("M", [1, 6])
def test_kernel_with_k_over_1024_uses_heap_scratch(isa, M):
    """K > 1024: the GEMM's weight panel no longer fits its stack buffer and is allocated."""
    g = torch.Generator().manual_seed(M)
    x, w, b = torch.randn(M, 1500, generator=g), torch.randn(7, 1500, generator=g).bfloat16(), torch.randn(7, generator=g)
    torch.testing.assert_close(linear(x, w, b), _ref(x, w, b), atol=2e-5 * 1500 ** 0.5, rtol=1e-5)


def test_panel_layout_and_cache_follow_the_weight():
    """pack_panels puts columns j and 16 + j of each 32-column panel in one word (zero-padded past N); the cached
    copy is dropped when the weight changes in place or dies, and is never made for inference tensors."""
    w = torch.randn(40, 3).bfloat16()
    p = packing.pack_panels(w)
    assert p.shape == (2, 3, 16) and p.dtype == torch.int32
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    assert int(p[0, 2, 5]) & 0xFFFF == int(bits[5, 2]) and (int(p[0, 2, 5]) >> 16) & 0xFFFF == int(bits[21, 2])
    assert int(p[1, 1, 7]) & 0xFFFF == int(bits[39, 1]) and int(p[1, 1, 8]) == 0  # padding columns 40.. are 0
    assert packing.pack_panels(torch.stack([w, w])).shape == (2, 2, 3, 16)
    v = torch.randn(64, 32).bfloat16()
    assert packing.panels(v) is None and packing.panels(v) is not None  # packed on the second sight
    used = packing.cache_bytes()
    v.mul_(2)  # in place: the copy is stale
    assert packing.panels(v) is None and packing.cache_bytes() == used - 64 * 32 * 2
    assert packing.panels(v) is not None
    x = torch.randn(3, 32)
    torch.testing.assert_close(linear(x, v), _ref(x, v, None), atol=1e-4, rtol=1e-5)
    del v
    assert packing.cache_bytes() == used - 64 * 32 * 2
    with torch.inference_mode():
        t = torch.randn(8, 8).bfloat16()
        assert packing.panels(t) is None and packing.panels(t) is None


def test_panel_cache_budget(monkeypatch):
    monkeypatch.setenv("MOERAY_PANEL_CACHE_BYTES", "0")
    w = torch.randn(8, 8).bfloat16()
    assert packing.panels(w) is None and packing.panels(w) is None


def test_fallback_paths_equal_the_widened_f_linear(monkeypatch):
    """Batches over MAX_GEMM_ROWS (and machines without the kernel) widen the weight and call F.linear;
    same-dtype weights are plain F.linear."""
    x = torch.randn(MAX_GEMM_ROWS + 3, 40)
    w = torch.randn(12, 40).bfloat16()
    torch.testing.assert_close(linear(x, w), F.linear(x, w.float()), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(_build, "_lib", None)
    monkeypatch.setattr(_build, "_tried", True)
    torch.testing.assert_close(linear(x[:2], w), F.linear(x[:2], w.float()), atol=1e-5, rtol=1e-5)
    wf = torch.randn(12, 40)
    assert torch.equal(linear(x, wf), F.linear(x, wf))


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler or no AVX2/FMA: the fallback path runs")
def test_shape_mismatch_raises():
    with pytest.raises(RuntimeError, match="do not match"):
        linear(torch.randn(2, 8), torch.randn(4, 9).bfloat16())
    with pytest.raises(RuntimeError, match="do not match"):
        linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), torch.randn(5))


needs_kernels = pytest.mark.skipif(not cpu_kernels_available(),
                                   reason="no C compiler or no AVX2/FMA: the PyTorch paths run")


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 256), (5, 13), (3, 4, 24), (0, 8)])
def test_rms_norm_and_fused_residual_match_float64(shape):
    from kernels.cpu import rms_norm

    g = torch.Generator().manual_seed(sum(shape))
    x, r = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)

    def ref(v):
        v = v.double()
        return (w.double() * v / (v.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).float()

    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref(x), atol=1e-5, rtol=1e-5)
    h, y = rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h, r + x, atol=0, rtol=0)
    torch.testing.assert_close(y, ref(r + x), atol=1e-5, rtol=1e-5)
    wide = torch.randn(shape[0] if len(shape) == 2 else 2, 40, generator=g)[:, 3:3 + shape[-1]]  # strided rows
    if wide.shape[-1] == shape[-1] and len(shape) == 2:
        torch.testing.assert_close(rms_norm(wide, w, 1e-6), ref(wide), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("H,Hkv,Dh", [(4, 2, 24), (2, 2, 64), (6, 1, 8), (3, 1, 12)])
def test_decode_attention_matches_reference(isa, H, Hkv, Dh):
    """Three decode sequences (lengths 1, 7 and 23 over blocks of 5, scattered block tables) among prefill
    rows: the kernel writes exactly the decode rows, equal to the reference's (AVX-512: head pairs and a lone
    head of a KV group, head dims not multiples of 16)."""
    from actors.model.attention import AttentionMetadata, paged_attention_ref
    from kernels.cpu import decode_attention

    g = torch.Generator().manual_seed(H * 100 + Dh)
    S, NB, T = 5, 12, 6
    kc, vc = torch.randn(NB, S, Hkv, Dh, generator=g), torch.randn(NB, S, Hkv, Dh, generator=g)
    q = torch.randn(T, H, Dh, generator=g)
    tables = torch.tensor([[3, 0, 0, 0, 0], [7, 2, 0, 0, 0], [1, 9, 4, 11, 5]])
    lens = torch.tensor([1, 7, 23])
    tokens = torch.tensor([4, 1, 5])
    meta = AttentionMetadata(slot_mapping=torch.zeros(T, dtype=torch.int64), decode_tokens=tokens,
                             decode_block_tables=tables, decode_context_lens=lens)
    ref = paged_attention_ref(q, kc, vc, meta, 0.37)
    out = torch.full_like(q, float("nan"))
    assert decode_attention(q, kc, vc, tokens, tables, lens, 0.37, out)
    torch.testing.assert_close(out[tokens], ref[tokens], atol=2e-5, rtol=1e-5)
    assert out[[0, 2, 3]].isnan().all()  # other rows untouched


@needs_kernels
def test_expert_ffn_rows_and_combined_token_match_torch():
    from actors.moe.experts import LocalExperts
    from kernels.cpu import expert_ffn

    g = torch.Generator().manual_seed(0)
    E, I, D = 5, 12, 20  # sizes not multiples of 8 or 16
    gu = (torch.randn(E, 2 * I, D, generator=g) * 0.3).bfloat16()
    dn = (torch.randn(E, D, I, generator=g) * 0.3).bfloat16()
    ref = LocalExperts(gu.float(), dn.float())
    x = torch.randn(4, D, generator=g)
    ids = torch.tensor([3, -1, 0, 3])
    y = expert_ffn(x, gu, dn, ids)
    torch.testing.assert_close(y[[0, 2, 3]], ref(x[[0, 2, 3]], ids[[0, 2, 3]]), atol=1e-5, rtol=1e-5)
    assert torch.equal(y[1], torch.zeros(D))
    w = torch.tensor([[0.7, 0.2, -0.4]])
    k_ids = torch.tensor([4, 1, 4])
    want = w @ ref.run_token(x[:1], k_ids)
    torch.testing.assert_close(expert_ffn(x[:1], gu, dn, k_ids, w), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(LocalExperts(gu, dn).combine_token(x[:1], k_ids, w), want, atol=1e-5, rtol=1e-5)
    assert expert_ffn(x, gu.float(), dn.float(), ids) is None  # fp32 weights: the caller's torch path


@pytest.mark.parametrize("R", [1, 7, 70, 133])
def test_expert_ffn_grouped_rows_match_float64(isa, R):
    """Many rows in any order, several per expert (the grouped GEMM path: counting sort, two GEMMs per active
    expert), padding ids among them, against float64 math over the widened weights; an id >= E raises."""
    from kernels.cpu import expert_ffn

    g = torch.Generator().manual_seed(R)
    E, I, D = 6, 40, 36
    gu = (torch.randn(E, 2 * I, D, generator=g) * 0.3).bfloat16()
    dn = (torch.randn(E, D, I, generator=g) * 0.3).bfloat16()
    x = torch.randn(R, D, generator=g)
    ids = torch.randint(-1, E - 1, (R,), generator=g)  # expert E - 1 never used: an inactive expert

    def f(xr, e):  # float64 SwiGLU expert e on one row
        gate, up = (xr.double() @ gu[e].double().T).chunk(2)
        return (F.silu(gate) * up) @ dn[e].double().T

    want = torch.stack([f(x[r], e) if e >= 0 else torch.zeros(D, dtype=torch.float64)
                        for r, e in enumerate(ids.tolist())])
    for _ in range(2):  # row-major stacks, then their packed panel copies
        y = expert_ffn(x, gu, dn, ids)
        torch.testing.assert_close(y, want.float(), atol=2e-5, rtol=1e-5)
        assert torch.equal(y[ids < 0], torch.zeros(int((ids < 0).sum()), D))
    assert packing.panels(gu) is not None and packing.panels(dn) is not None
    w, k_ids = torch.rand(R, generator=g), ids.clamp(min=0)  # one token through R experts, weighted and summed
    want_1 = (w.double() @ torch.stack([f(x[0], e) for e in k_ids.tolist()]))[None]
    torch.testing.assert_close(expert_ffn(x[:1], gu, dn, k_ids, w), want_1.float(), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="num_experts=6"):
        expert_ffn(x, gu, dn, torch.full((R,), E))


@pytest.mark.parametrize("bf16", [True, False])
def test_local_experts_run_padded_gives_zero_rows_for_padding(bf16):
    """The fixed-capacity exchange's padding rows (id -1) come back as zeros, on the kernel path (bf16 weights)
    and on the PyTorch path (fp32 weights), and real rows equal the plain call."""
    from actors.moe.experts import LocalExperts

    g = torch.Generator().manual_seed(1)
    gu, dn = torch.randn(3, 8, 16, generator=g), torch.randn(3, 16, 4, generator=g)
    if bf16:
        gu, dn = gu.bfloat16(), dn.bfloat16()
    ex, ref = LocalExperts(gu, dn), LocalExperts(gu.float(), dn.float())
    x = torch.randn(6, 17, generator=g)[:, :16]  # a strided view, like the received rows
    ids = torch.tensor([-1, 2, -1, 0, 2, -1])
    y = ex.run_padded(x, ids)
    assert torch.equal(y[ids < 0], torch.zeros(3, 16))
    torch.testing.assert_close(y[ids >= 0], ref(x[ids >= 0].contiguous(), ids[ids >= 0]), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_pack_fixed_rows_matches_the_torch_construction():
    """Pairs grouped by destination in pair order, ids in the last column, -1 on padding rows; a rank given more
    than C pairs is refused."""
    from kernels.cpu import pack_fixed_rows

    g = torch.Generator().manual_seed(3)
    T, D, W, C = 3, 10, 3, 4
    x = torch.randn(T, D, generator=g)
    tok = torch.tensor([0, 0, 1, 1, 2, 2])
    dest = torch.tensor([2, 0, 0, 2, 2, 1])
    local = torch.tensor([5, 1, 3, 0, 2, 7])
    send, slot, counts = pack_fixed_rows(x, tok, dest, local, W, C)
    assert counts.tolist() == [2, 1, 3]
    assert slot.tolist() == [8, 0, 1, 9, 10, 4]
    torch.testing.assert_close(send[slot, :D], x[tok], atol=0, rtol=0)
    assert send[slot, D].tolist() == [5.0, 1.0, 3.0, 0.0, 2.0, 7.0]
    pad = sorted(set(range(W * C)) - set(slot.tolist()))
    assert send[pad, D].tolist() == [-1.0] * len(pad)
    with pytest.raises(ValueError, match="capacity=1"):
        pack_fixed_rows(x, tok, dest, local, W, 1)


@needs_kernels
def test_pack_fixed_ids_equals_pack_fixed_rows_and_weigh_rows_the_torch_sum():
    """From the router's ids and the layer's tables, the same send buffer, slots and counts as `pack_fixed_rows` on
    the pairs it implies; an id outside [0, E) and an overfull rank are refused. `weigh_rows` gives
    sum_k w[t, k] * y[slot[t, k]] (rows of a strided buffer)."""
    from kernels.cpu import pack_fixed_ids, pack_fixed_rows, weigh_rows

    g = torch.Generator().manual_seed(4)
    T, K, D, E, W, C = 5, 2, 12, 8, 3, 10
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    rank_of = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    local_of = torch.tensor([0, 1, 0, 1, 0, 1, 2, 2])
    send, slot, counts = pack_fixed_ids(x, ids, rank_of, local_of, W, C)
    tok = torch.arange(T).repeat_interleave(K)
    want = pack_fixed_rows(x, tok, rank_of[ids.reshape(-1)], local_of[ids.reshape(-1)], W, C)
    assert torch.equal(slot, want[1]) and torch.equal(counts, want[2])
    assert torch.equal(send[:, D], want[0][:, D]) and torch.equal(send[slot], want[0][slot])
    with pytest.raises(ValueError, match="outside"):
        pack_fixed_ids(x, torch.full((T, K), E), rank_of, local_of, W, C)
    with pytest.raises(ValueError, match="capacity=1"):
        pack_fixed_ids(x, ids, rank_of, local_of, W, 1)
    y = torch.randn(W * C, D + 3, generator=g)[:, :D]  # row stride D + 3, like the received rows
    w = torch.rand(T, K, generator=g)
    out = weigh_rows(y, slot, w)
    torch.testing.assert_close(out, (y[slot] * w.reshape(-1, 1)).view(T, K, D).sum(1), atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("codebook", [False, True])
def test_dequant_packed_is_bit_identical_to_the_reference(bits, codebook, monkeypatch):
    """`kernels.packed_weights.dequantize` on CPU runs the compiled pass; it must equal the PyTorch ops exactly,
    for a stack with a tail group (K = 130) and a matrix whose K is not a multiple of 8."""
    from kernels.packed_quantize import quantize
    from kernels.packed_weights import dequantize

    g = torch.Generator().manual_seed(bits * 10 + codebook)
    for shape, gs in (((3, 19, 130), 64), ((37, 75), 32)):
        p = quantize(torch.randn(*shape, generator=g), bits=bits, group_size=gs, codebook=codebook)
        fast = dequantize(p)
        out = torch.empty(shape)
        assert dequantize(p, out=out) is out and torch.equal(out, fast)
        with monkeypatch.context() as m:
            m.setattr(_build, "_lib", None)
            m.setattr(_build, "_tried", True)
            ref = dequantize(p)
        assert torch.equal(fast, ref)


def _swiglu64(x, gu, dn):
    g, u = F.linear(x.double(), gu.double()).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, dn.double()).float()


@needs_kernels
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("codebook", [False, True])
@pytest.mark.parametrize("gs,D,I", [(64, 256, 256), (32, 72, 40), (128, 130, 66), (32, 37, 19)])
def test_packed_expert_ffn_matches_dequantize_then_float64(bits, codebook, gs, D, I):
    """The fused packed SwiGLU (codes unpacked in registers, scale and zero taken out of each group's sum) against
    dequantize-then-float64 matmul: rows of several experts in runs, a -1 row, one token broadcast to K experts,
    tail groups (D = 130, 37) and K % 8 != 0 (37, 19); every bit width and the codebook permutes. Also the worker's
    `PackedFFNArgs.dequantize` (bit-identical) and the fp32 cached-expert kernel `swiglu_f32`."""
    from kernels.packed_quantize import quantize_experts
    from kernels.packed_weights import dequantize

    g = torch.Generator().manual_seed(bits * 100 + codebook * 10 + gs + D)
    E = 4
    pk = quantize_experts(torch.randn(E, I, D, generator=g), torch.randn(E, I, D, generator=g),
                          torch.randn(E, D, I, generator=g), bits=bits, group_size=gs, codebook=codebook,
                          fuse_gate_up=True)
    args = cpu_kernels.PackedFFNArgs(pk.gate_up, pk.down)
    dense = [(dequantize(pk.gate_up[e]), dequantize(pk.down[e])) for e in range(E)]
    x = torch.randn(9, D, generator=g)
    ids = [0, 0, 0, 0, 0, 2, -1, 3, 3]
    y = cpu_kernels.packed_expert_ffn(x, ids, args)
    for r, e in enumerate(ids):
        if e < 0:
            assert torch.equal(y[r], torch.zeros(D))
            continue
        ref = _swiglu64(x[r : r + 1], *dense[e])[0]
        torch.testing.assert_close(y[r], ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)
        torch.testing.assert_close(cpu_kernels.swiglu_f32(x[r : r + 1], *dense[e])[0], ref,
                                   atol=1e-5 * float(ref.abs().max()), rtol=1e-5)
    yb = cpu_kernels.packed_expert_ffn(x[:1], [3, 1], args)  # one token, two experts
    torch.testing.assert_close(yb[0], _swiglu64(x[:1], *dense[3])[0], atol=1e-5 * float(yb.abs().max()), rtol=1e-5)
    assert cpu_kernels.packed_expert_ffn(x[:0], [], args).shape == (0, D)
    too_many = MAX_KERNEL_ROWS + 1
    assert cpu_kernels.packed_expert_ffn(x[:1].expand(too_many, D), [0] * too_many, args) is None
    for e in range(E):
        gu, dn = args.dequantize(e)
        assert torch.equal(gu, dense[e][0]) and torch.equal(dn, dense[e][1])


@needs_kernels
def test_gate_logprobs_matches_torch():
    g = torch.Generator().manual_seed(3)
    gates = [torch.randn(8, 40, generator=g), None, torch.randn(5, 40, generator=g)]
    norms = [torch.rand(40, generator=g) + 0.5, None, None]
    k = cpu_kernels.GateLogprobs(gates, norms, 1e-6)
    h = torch.randn(3, 50, generator=g)[:, 5:45]  # row-strided view
    for layer in (0, 2):
        hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if norms[layer] is not None:
            hn = hn * norms[layer]
        torch.testing.assert_close(k(layer, h), torch.log_softmax(hn @ gates[layer].T, -1), atol=1e-5, rtol=1e-5)
    assert k(1, h) is None  # a dense layer


def test_markov_tables_fall_back_without_kernels(monkeypatch):
    """Without compiled kernels the Markov tables decline (callers keep their Python path) and change nothing."""
    monkeypatch.setattr(_build, "_lib", None)
    monkeypatch.setattr(_build, "_tried", True)
    f, m = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, 4, dtype=torch.float64)
    t = cpu_kernels.MarkovTables(f, m, m.clone())
    assert not t.ok and t.observe(0, [[1, 2]], None, None) is False and t.probs(0, 0.5, [1, 1], None, None, 1) is None
    assert not f.any()
    assert cpu_kernels.packed_expert_ffn(torch.zeros(1, 4), [0], None) is None


@needs_kernels
def test_packed_expert_ffn_and_markov_tables_reject_out_of_range_ids():
    """An expert id past the stack is an error (not a read past the weights); the Markov tables ignore ids
    outside [0, E) as they ignore -1 padding."""
    from kernels.packed_quantize import quantize_experts

    pk = quantize_experts(torch.randn(2, 8, 32), torch.randn(2, 8, 32), torch.randn(2, 32, 8), bits=4,
                          group_size=32, fuse_gate_up=True)
    with pytest.raises(ValueError, match="expert id 2 >= num_experts=2"):
        cpu_kernels.packed_expert_ffn(torch.randn(1, 32), [0, 2], cpu_kernels.PackedFFNArgs(pk.gate_up, pk.down))
    f, m = torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, 4, 4, dtype=torch.float64)
    t = cpu_kernels.MarkovTables(f, m, m.clone())
    assert t.observe(0, [[1, 7, -1]], [[9, 2]], None)
    assert f[0].tolist() == [0, 1, 0, 0] and m[0, 2, 1] == 1 and m.sum() == 1


@needs_kernels
@pytest.mark.parametrize("Dh", [64, 24, 12])
def test_rope_kernel_matches_the_torch_path_and_hf_apply_rope(Dh, monkeypatch):
    """Rotary.apply's one compiled call equals its PyTorch path and `kernels.rope.apply_rope` (HF rotate-half) on
    rows that are a column slice of a fused q/k/v (strided), every half-width tail; out-of-range positions raise."""
    from actors.model.layers import Rotary
    from kernels.rope import apply_rope

    g = torch.Generator().manual_seed(Dh)
    rot = Rotary(Dh, 10000.0, 50, torch.float32)
    fused = torch.randn(7, 3 * Dh + 5, generator=g)
    x = fused[:, 5 : 5 + 3 * Dh].view(7, 3, Dh)  # strided rows, as q after the fused projection's split
    pos = torch.tensor([0, 3, 49, 7, 7, 1, 20])
    got = rot.apply(x, pos)
    assert got.is_contiguous()
    torch.testing.assert_close(got, apply_rope(x, rot.cos[pos], rot.sin[pos]), atol=1e-6, rtol=1e-6)
    with pytest.raises(IndexError):
        rot.apply(x, torch.tensor([0, 1, 2, 3, 4, 5, 50]))
    monkeypatch.setattr(_build, "_lib", None)
    monkeypatch.setattr(_build, "_tried", True)
    torch.testing.assert_close(got, rot.apply(x, pos), atol=1e-6, rtol=1e-6)
