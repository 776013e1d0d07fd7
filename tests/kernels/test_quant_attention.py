"""The compiled decode attention over the quantized paged cache (`kernels.cpu.quant_attention`) against the
PyTorch reference (`kernels.paged_attention.paged_decode_attention_ref`), on the cases of
tests/kernels/test_paged_attention.py: fixed widths 2-4 bits, per-channel key widths up to 8 bits, outliers, sinks,
tails, empty sequences, and the cache's own arena views."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import cpu_kernels_available
from kernels.cpu.quant_attention import quant_decode_attention
from kernels.paged_attention import paged_decode_attention_ref
from tests.kernels.test_paged_attention import _case

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the compiled CPU kernels are not built")


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_matches_reference_fixed_widths(bits):
    args, kwargs, _, _ = _case(ctx_lens=[7, 13, 4, 0], sink_lens=[2, 1, 2, 0], tail_lens=[3, 0, 1, 2], bits=bits,
                               n_outlier=2, n_outlier_v=1, seed=bits)
    out = quant_decode_attention(*args, **kwargs)
    assert out is not None
    torch.testing.assert_close(out, paged_decode_attention_ref(*args, **kwargs), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("budget,n_outlier", [(76, 0), (96, 1)])
def test_matches_reference_per_channel_key_widths(budget, n_outlier):
    energy = (4.0 ** torch.linspace(0, 7, 32)).repeat(2, 1)  # uneven: some key channels get 5-8 bits
    args, kwargs, _, _ = _case(ctx_lens=[7, 13, 4], sink_lens=[2, 1, 2], tail_lens=[3, 0, 1], bits=2,
                               n_outlier=n_outlier, n_outlier_v=1, seed=11, k_channel_bits=budget, query_energy=energy)
    assert args[4].per_channel_keys and int(args[4].k_bits.max()) > 3
    out = quant_decode_attention(*args, **kwargs)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args, **kwargs), atol=2e-5, rtol=1e-5)


def test_matches_reference_without_sink_or_tail_and_empty_sequences():
    args, kwargs, _, _ = _case(ctx_lens=[5, 0, 9], sink_lens=[0, 0, 0], hq=2, h=2, block_size=16, bits=3,
                               n_outlier=0, seed=7)
    out = quant_decode_attention(*args)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=2e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no tokens at all -> zero output


def test_position_beyond_rope_table_raises_like_the_reference():
    args, kwargs, _, _ = _case(ctx_lens=[7], sink_lens=[2], bits=3)
    args = list(args)
    args[5], args[6] = args[5][:5], args[6][:5]
    with pytest.raises(ValueError, match="exceeds the RoPE table"):
        quant_decode_attention(*args, **kwargs)


def test_engine_decode_with_quantized_cache_runs_the_kernel(tmp_path, monkeypatch):
    """Through the cache's arena views: a kv_bits=3 engine's greedy tokens equal those with the reference path."""
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from cluster.config import DEFAULT_MODEL
    from kernels.cpu import quant_attention

    calls = []
    real = quant_attention.quant_decode_attention
    monkeypatch.setattr(quant_attention, "quant_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))

    def greedy():
        mc = ModelConfig.from_pretrained(DEFAULT_MODEL)
        eng = RankEngine(EngineConfig(model=DEFAULT_MODEL, max_model_len=512, kv_bits=3, kv_cache_bytes=8 << 20),
                         ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True).to_dict()
        for i in range(3):
            eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=list(range(10 + i, 90 + 7 * i)), params=p))
        out = {str(i): [] for i in range(3)}
        for _ in range(200):
            for o in eng.step():
                out[o.request_id] += o.token_ids
            if all(len(v) == 24 for v in out.values()):
                return out
        raise AssertionError(out)
    fast = greedy()
    assert calls
    monkeypatch.setattr(quant_attention, "quant_decode_attention", lambda *a, **k: None)  # the reference runs
    assert greedy() == fast


@pytest.mark.parametrize("isa", [1, 2])
@pytest.mark.parametrize("d", [24, 32, 128])
def test_every_dequantization_path_matches_reference(isa, d):
    """The kernel's three ways to unpack a token: per element (D % 16 != 0: d=24), 8 channels a gather (AVX2, or
    D % 32 != 0) and 16 channels a byte permute (AVX-512 with VBMI; at d=128 the key rows exceed 64 bytes, so two
    registers): each equals the reference, keys with per-channel widths up to 8 bits and fixed-width codebooks."""
    from kernels.cpu import _build

    energy = (4.0 ** torch.linspace(0, 7, d)).repeat(2, 1)
    prev = _build.set_isa(isa)
    try:
        for kw in (dict(bits=3, k_channel_bits=5 * d, query_energy=energy, n_outlier=0), dict(bits=4, n_outlier=2)):
            args, kwargs, _, _ = _case(ctx_lens=[7, 13, 4], sink_lens=[2, 1, 2], tail_lens=[3, 0, 1], d=d,
                                       n_outlier_v=1, seed=d + isa, **kw)
            if "k_channel_bits" in kw:
                assert args[1].k_codes.shape[-1] == 5 * d // 8 and int(args[4].k_bits.max()) > 4
            out = quant_decode_attention(*args, **kwargs)
            torch.testing.assert_close(out, paged_decode_attention_ref(*args, **kwargs), atol=2e-5, rtol=1e-5)
    finally:
        _build.set_isa(prev)


@pytest.mark.parametrize("ns", [0, 2])
def test_staged_rows_read_in_place_equal_explicit_sink_and_tail(ns):
    """`StagedRows`: the kernel reads the cache's staging slots (pre-RoPE keys) and rotates the sink and tail rows
    itself; the result equals passing them gathered and rotated, and the reference."""
    from kernels.cpu.quant_attention import StagedRows
    from kernels.rope import apply_rope

    S = 8  # the rows' logical block; the pages hold 4 tokens each (a page is not a block)
    args, _, _, _ = _case(ctx_lens=[8, 4, 0], sink_lens=[0, 0, 0], tail_lens=[0, 0, 0], bits=3, seed=5, block_size=4)
    q, pages, bt, ctx, prof, cos, sin, scale = args
    from kernels.rope import rope_tables
    cos, sin = rope_tables(32, prof.head_dim)  # the sink and tail positions lie past _case's table
    args = (q, pages, bt, ctx, prof, cos, sin, scale)
    g = torch.Generator().manual_seed(1)
    b, h, d = q.shape[0], prof.num_kv_heads, prof.head_dim
    stage_k, stage_v = torch.randn(5, ns + S, h, d, generator=g), torch.randn(5, ns + S, h, d, generator=g)
    slots = torch.tensor([3, 0, 4])
    sink_lens = torch.tensor([ns, ns, min(ns, 1)])
    tail_lens = torch.tensor([3, 1, 0])  # rows ns + 0, ns + 4 (ctx 4 % 8), none
    sink_k = torch.zeros(b, max(ns, 1), h, d)
    sink_v = torch.zeros(b, max(ns, 1), h, d)
    tail_k, tail_v = torch.zeros(b, S, h, d), torch.zeros(b, S, h, d)
    for i in range(b):
        s, n, c, t = int(slots[i]), int(sink_lens[i]), int(ctx[i]), int(tail_lens[i])
        sink_k[i, :n] = apply_rope(stage_k[s, :n], cos[:n], sin[:n])
        sink_v[i, :n] = stage_v[s, :n]
        rows = slice(ns + c % S, ns + c % S + t)
        tail_k[i, :t] = apply_rope(stage_k[s, rows], cos[n + c: n + c + t], sin[n + c: n + c + t])
        tail_v[i, :t] = stage_v[s, rows]
    explicit = dict(sink_k=sink_k, sink_v=sink_v, sink_lens=sink_lens, tail_k=tail_k, tail_v=tail_v,
                    tail_lens=tail_lens)
    want = paged_decode_attention_ref(*args, **explicit)
    torch.testing.assert_close(quant_decode_attention(*args, **explicit), want, atol=2e-5, rtol=1e-5)
    got = quant_decode_attention(*args, sink_lens=sink_lens, tail_lens=tail_lens,
                                 staged=StagedRows(stage_k, stage_v, slots, ns, S))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one or the other"):
        quant_decode_attention(*args, **explicit, staged=StagedRows(stage_k, stage_v, slots, ns, S))


@pytest.mark.parametrize("d", [24, 32])
def test_dequant_rows_equal_dequantize_then_rope(d):
    """`quant_dequant_rows`: sealed tokens read from scattered pages, dequantized and rotated, equal the PyTorch
    ops (`KVPages.read`, `dequantize_kv`, `apply_rope`); a position past the table raises."""
    from kernels.cpu.quant_attention import quant_dequant_rows
    from kernels.kv_quant import dequantize_kv
    from kernels.rope import apply_rope

    args, _, _, _ = _case(ctx_lens=[9, 6], sink_lens=[0, 0], tail_lens=[0, 0], bits=3, d=d, seed=9, n_outlier_v=1)
    q, pages, bt, ctx, prof, cos, sin, scale = args
    S = pages.block_size
    pg = torch.tensor([int(bt[0, i // S]) for i in range(9)])
    sl = torch.tensor([i % S for i in range(9)])
    got = quant_dequant_rows(pages, pg, sl, prof, cos, sin, pos0=2)
    k, v = dequantize_kv(pages.read(pg, sl), prof)
    torch.testing.assert_close(got[0], apply_rope(k, cos[2:11], sin[2:11]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], v, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="exceeds the RoPE table"):
        quant_dequant_rows(pages, pg, sl, prof, cos, sin, pos0=cos.shape[0] - 3)


@pytest.mark.parametrize("isa", [1, 2])
@pytest.mark.parametrize("d,hq", [(32, 4), (64, 4), (64, 2)])
def test_long_sequence_attended_in_chunks_matches_reference(d, hq, isa):
    """A sequence of more than 256 rows is attended in chunks with an online softmax (the dequantized rows stay
    in cache), shorter ones whole in the same call: both equal the reference (D = 64 with two query heads per KV
    head takes the AVX-512 chunk loop, the others the AVX2 one)."""
    from kernels.cpu import _build

    prev = _build.set_isa(isa)
    try:
        args, kwargs, _, _ = _case(ctx_lens=[1100, 37], sink_lens=[2, 1], tail_lens=[3, 2], bits=3, d=d, hq=hq,
                                   seed=4, block_size=16, n_outlier=1, n_outlier_v=1)
        out = quant_decode_attention(*args, **kwargs)
        torch.testing.assert_close(out, paged_decode_attention_ref(*args, **kwargs), atol=2e-5, rtol=1e-5)
    finally:
        _build.set_isa(prev)
