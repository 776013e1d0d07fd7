"""The compiled causal prefill attention (`kernels.cpu.prefill_attention`) against the PyTorch reference
(`paged_attention_ref`: SDPA over the gathered blocks), on shapes that are not multiples of its tiles; bit-identical
over thread splits and over chunkings of the prompt; `paged_attention` using it beside decode rows; and its mixed
form (the quantized cache's prefill) against that cache's masked SDPA."""
from __future__ import annotations

import pytest
import torch

from actors.model.attention import AttentionMetadata, paged_attention, paged_attention_ref
from kernels.cpu import _build, cpu_kernels_available, parallel, prefill_attention
from kernels.cpu.attention import mixed_prefill_attention


@pytest.fixture
def avx512():
    if not cpu_kernels_available():
        pytest.skip("no C compiler or no AVX2/FMA: the reference path runs")
    if _build.best_isa() < 2:
        pytest.skip("this CPU (or MOERAY_CPU_ISA) has no AVX-512: prefills run the reference")
    yield
    parallel.set_threads(1)


def _case(n, ctx, H, Hkv, Dh, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    NB = -(-ctx // S) + 3
    kc, vc = torch.randn(NB, S, Hkv, Dh, generator=g), torch.randn(NB, S, Hkv, Dh, generator=g)
    table = torch.randperm(NB, generator=g)[: -(-ctx // S)]
    q = torch.randn(n, H, Dh, generator=g) * 2
    return q, kc, vc, table


def _ref(q, kc, vc, table, ctx, scale):
    n = q.shape[0]
    meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.int64), decode_tokens=torch.zeros(0, dtype=torch.int64),
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
                             decode_context_lens=torch.zeros(0, dtype=torch.int64), prefills=[(0, n, ctx, table)])
    return paged_attention_ref(q, kc, vc, meta, scale)


@pytest.mark.parametrize("n,ctx,H,Hkv,Dh,S", [
    (1, 1, 2, 1, 16, 4),        # one token
    (37, 100, 4, 2, 64, 16),    # a later chunk over a cached prefix
    (70, 70, 6, 2, 40, 8),      # 3 heads per KV head (tiles of 2 positions x 3 heads), Dh not a multiple of 16
    (33, 60, 12, 1, 128, 16),   # 12 heads on one KV head: sub-groups of 8 and 4
    (9, 9, 3, 3, 24, 16),       # no GQA
    (130, 130, 4, 2, 64, 16),   # split over threads by KV head
    (130, 130, 4, 1, 64, 16),   # one KV head: split by interleaved tiles
])
def test_prefill_attention_matches_reference_on_any_split(avx512, n, ctx, H, Hkv, Dh, S):
    q, kc, vc, table = _case(n, ctx, H, Hkv, Dh, S)
    ref = _ref(q, kc, vc, table, ctx, Dh ** -0.5)
    outs = []
    for th in (1, 2, 3):
        parallel.set_threads(th)
        out = torch.full_like(q, float("nan"))
        assert prefill_attention(q, kc, vc, table, ctx, Dh ** -0.5, out)
        outs.append(out)
    torch.testing.assert_close(outs[0], ref, atol=5e-6, rtol=1e-5)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_chunks_of_a_prompt_equal_the_whole_prompt_bit_for_bit(avx512):
    """Each (token, head) is computed alone: the rows of a later chunk equal the same rows of the whole prompt."""
    q, kc, vc, table = _case(150, 150, 4, 2, 64, 16, seed=3)
    whole = torch.empty_like(q)
    assert prefill_attention(q, kc, vc, table, 150, 0.125, whole)
    for lo, hi in [(0, 61), (61, 64), (64, 150)]:
        part = torch.empty_like(q[lo:hi])
        assert prefill_attention(q[lo:hi].contiguous(), kc, vc, table, hi, 0.125, part)
        assert torch.equal(part, whole[lo:hi])


def test_declines_what_it_cannot_run(avx512):
    q, kc, vc, table = _case(8, 8, 4, 2, 32, 16)
    out = torch.zeros_like(q)
    assert not prefill_attention(q.double(), kc.double(), vc.double(), table, 8, 0.1, out.double())
    assert not prefill_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, table, 8, 0.1, out)
    assert torch.equal(out, torch.zeros_like(q))  # nothing written
    assert prefill_attention(q[:0], kc, vc, table, 8, 0.1, out[:0])  # no tokens: nothing to do


def test_paged_attention_mixes_decode_rows_and_prefills(avx512):
    """A step with two decode sequences and two prefills (one a later chunk) gives the reference's output."""
    g = torch.Generator().manual_seed(7)
    H, Hkv, Dh, S, NB = 4, 2, 32, 8, 40
    kc, vc = torch.randn(NB, S, Hkv, Dh, generator=g), torch.randn(NB, S, Hkv, Dh, generator=g)
    T = 2 + 20 + 13
    q = torch.randn(T, H, Dh, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(T, dtype=torch.int64), decode_tokens=torch.tensor([0, 1]),
        decode_block_tables=torch.tensor([[5, 6, 0], [9, 10, 11]]), decode_context_lens=torch.tensor([12, 19]),
        prefills=[(2, 20, 20, torch.tensor([1, 2, 3])), (22, 13, 30, torch.tensor([20, 21, 22, 23]))])
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.2), paged_attention_ref(q, kc, vc, meta, 0.2),
                               atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("n,C,lo,S", [(40, 40, 1, 16), (23, 90, 4, 16), (64, 150, 0, 8), (5, 5, 2, 4), (130, 130, 4, 16)])
def test_mixed_prefill_matches_the_masked_reference(avx512, n, C, lo, S):
    """The quantized cache's prefill (`mixed_causal_attention`): query i reads key j dequantized where
    lo <= j < hi_i (the sealed blocks before its own), else in full precision; the kernel equals the masked SDPA
    over both halves, on 1 and 2 threads bit for bit."""
    from actors.kv import quantized

    g = torch.Generator().manual_seed(n + C)
    H, Hkv, Dh = 4, 2, 32
    kq, vq, kf, vf = (torch.randn(C, Hkv, Dh, generator=g) for _ in range(4))
    kq[:lo], vq[:lo] = kf[:lo], vf[:lo]  # the sink: one copy in both (as the cache builds them)
    q = torch.randn(n, H, Dh, generator=g)
    pos = torch.arange(C - n, C)
    hi = torch.clamp(lo + (pos + 1 - lo).clamp(min=0) // S * S, min=min(lo + S, C - n))  # the min: blocks sealed before the chunk
    # the masked SDPA over both halves (mixed_causal_attention's own PyTorch path)
    j = torch.arange(C)
    quant = (j[None, :] >= lo) & (j[None, :] < hi[:, None])
    causal = j[None, :] <= pos[:, None]
    mask = torch.cat([causal & ~quant, causal & quant], dim=1)
    k = torch.cat([kf, kq]).transpose(0, 1)
    v = torch.cat([vf, vq]).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                                           scale=0.3, enable_gqa=True)[0].transpose(0, 1)
    outs = []
    for th in (1, 2):
        parallel.set_threads(th)
        out = torch.full_like(q, float("nan"))
        assert mixed_prefill_attention(q, kq, vq, kf, vf, lo, hi, 0.3, out)  # the kernel ran
        outs.append(out)
    torch.testing.assert_close(outs[0], ref, atol=5e-6, rtol=1e-5)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(quantized.mixed_causal_attention(q, kf, vf, kq, vq, pos, lo, hi, 0.3), outs[0])  # its caller
