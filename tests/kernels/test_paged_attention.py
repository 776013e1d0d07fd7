"""Paged decode attention over quantized KV blocks: reference vs dense attention, Triton vs reference.

Shape legend: B = sequences, Hq = query heads, H = KV heads, D = head_dim, S = block_size, T = tokens of one
sequence (sink + quantized + tail).
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.bench_runner import run_bench_result  # noqa: E402
from kernels.kv_calibrate import fit_kv_profile  # noqa: E402
from kernels.kv_pages import KVPages  # noqa: E402
from kernels.kv_quant import dequantize_kv, quantize_kv  # noqa: E402
from kernels.paged_attention import paged_decode_attention_ref  # noqa: E402
from kernels.paged_attention_triton import paged_decode_attention_triton  # noqa: E402
from kernels.rope import apply_rope, rope_tables  # noqa: E402


def _case(*, ctx_lens, sink_lens=None, tail_lens=None, hq=4, h=2, d=32, block_size=4, bits=4, n_outlier=2,
          n_outlier_v=0, seed=0, n_sink=2, n_tail=4, fp16_inputs=False, **fit_kw):
    """Random sequences split into sink / quantized blocks (shuffled pool order) / tail, plus dense truth.

    Returns (args, kwargs, dense, err): args/kwargs for the paged functions, dense [B, Hq, D] exact
    full-precision attention, and err = per-sequence max row-norm of the K and V dequantization errors and of
    V itself (each [B]).
    """
    g = torch.Generator().manual_seed(seed)
    b = len(ctx_lens)
    sink_lens = sink_lens if sink_lens is not None else [n_sink] * b
    tail_lens = tail_lens if tail_lens is not None else [0] * b
    lens = [s + c + t for s, c, t in zip(sink_lens, ctx_lens, tail_lens)]
    k_cal, v_cal = torch.randn(64, h, d, generator=g), torch.randn(64, h, d, generator=g)
    prof = fit_kv_profile(k_cal, v_cal, bits=bits, n_outlier=n_outlier, n_outlier_v=n_outlier_v, **fit_kw)
    cos, sin = rope_tables(max(lens) + 3, d)

    n_blocks = [math.ceil(c / block_size) for c in ctx_lens]
    pool = torch.randperm(sum(n_blocks) + 3, generator=g)  # blocks not in order, some unused
    pages = KVPages.empty(prof, num_blocks=pool.numel(), block_size=block_size)
    table = torch.zeros(b, max(max(n_blocks), 1) + 1, dtype=torch.int32)
    sink_k = torch.zeros(b, n_sink, h, d)
    sink_v = torch.zeros(b, n_sink, h, d)
    tail_k = torch.zeros(b, n_tail, h, d)
    tail_v = torch.zeros(b, n_tail, h, d)
    q = torch.randn(b, hq, d, generator=g)
    dense = torch.zeros(b, hq, d)
    k_err, v_err, v_max = torch.zeros(b), torch.zeros(b), torch.zeros(b)
    used = 0
    for i in range(b):
        k_pre = torch.randn(lens[i], h, d, generator=g)
        v = torch.randn(lens[i], h, d, generator=g)
        if fp16_inputs:
            k_pre, v = k_pre.half().float(), v.half().float()
        k_rot = apply_rope(k_pre, cos[: lens[i]], sin[: lens[i]])
        ns, c, nt = sink_lens[i], ctx_lens[i], tail_lens[i]
        sink_k[i, :ns], sink_v[i, :ns] = k_rot[:ns], v[:ns]
        tail_k[i, :nt], tail_v[i, :nt] = k_rot[ns + c:], v[ns + c:]
        blocks = pool[used: used + n_blocks[i]]
        used += n_blocks[i]
        table[i, : n_blocks[i]] = blocks.int()
        if c:
            t = torch.arange(c)
            qkv = quantize_kv(k_pre[ns: ns + c], v[ns: ns + c], prof)
            pages.write(blocks[t // block_size], t % block_size, qkv)
            k_hat, v_hat = dequantize_kv(qkv, prof)
            k_err[i] = (k_hat - k_pre[ns: ns + c]).norm(dim=-1).max()
            v_err[i] = (v_hat - v[ns: ns + c]).norm(dim=-1).max()
        v_max[i] = v.norm(dim=-1).max() if lens[i] else 0.0
        qi = q[i].reshape(h, hq // h, d)
        p = torch.einsum("hgd,thd->hgt", qi, k_rot).mul(d ** -0.5).softmax(-1)
        dense[i] = torch.einsum("hgt,thd->hgd", p, v).reshape(hq, d)
    args = (q, pages, table, torch.tensor(ctx_lens, dtype=torch.int32), prof, cos, sin, d ** -0.5)
    kwargs = dict(sink_k=sink_k, sink_v=sink_v, sink_lens=torch.tensor(sink_lens, dtype=torch.int32),
                  tail_k=tail_k, tail_v=tail_v, tail_lens=torch.tensor(tail_lens, dtype=torch.int32))
    return args, kwargs, dense, dict(k=k_err, v=v_err, v_max=v_max)


def test_ref_equals_dense_when_quantization_bypassed():
    # every channel an fp16 outlier: codes unused, so only paging, RoPE order and softmax union remain
    args, kwargs, dense, _ = _case(ctx_lens=[7, 12, 1], sink_lens=[2, 1, 0], tail_lens=[3, 0, 4],
                                      n_outlier=32, n_outlier_v=32, fp16_inputs=True)
    out = paged_decode_attention_ref(*args, **kwargs)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_ref_within_dequant_error_bound_at_4_bits():
    args, kwargs, dense, err = _case(ctx_lens=[9, 16, 5], tail_lens=[1, 2, 3], bits=4)
    out = paged_decode_attention_ref(*args, **kwargs)
    q, scale = args[0], args[-1]
    # RoPE is a rotation, so a score moves by at most eps = scale * |q| * |dk|; softmax weights then move by
    # a factor within exp(+-2 eps), giving |do| <= (exp(2 eps) - 1) * max|v_hat| + max|dv|.
    eps = scale * q.norm(dim=-1) * err["k"][:, None]  # [B, Hq]
    v_err, v_max = err["v"][:, None], err["v_max"][:, None]
    bound = (torch.exp(2 * eps) - 1) * (v_max + v_err) + v_err
    err = (out - dense).norm(dim=-1)
    assert bool((err <= bound + 1e-5).all()), (err, bound)
    assert torch.cosine_similarity(out, dense, dim=-1).min() > 0.97


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_triton_matches_ref(bits):
    args, kwargs, _, _ = _case(ctx_lens=[7, 13, 4], sink_lens=[2, 1, 2], tail_lens=[3, 0, 1], bits=bits,
                                  n_outlier=2, n_outlier_v=1, seed=bits)
    ref = paged_decode_attention_ref(*args, **kwargs)
    out = paged_decode_attention_triton(*args, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_triton_matches_ref_without_sink_tail_or_outliers():
    args, kwargs, _, _ = _case(ctx_lens=[5, 0, 9], sink_lens=[0, 0, 0], hq=2, h=2, block_size=16,
                                  bits=3, n_outlier=0, seed=7)
    q = args[0]
    ref = paged_decode_attention_ref(*args)
    out = paged_decode_attention_triton(*args)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[1], torch.zeros_like(q[1]))  # no tokens at all -> zero output


@pytest.mark.parametrize("budget,n_outlier", [(76, 0), (96, 1)])
def test_triton_matches_ref_per_channel_key_bits(budget, n_outlier):
    """Per-channel key widths (k_bits): codes straddle bytes at arbitrary offsets, the key row (Pk bytes)
    differs from the value row (P), and widths go up to 8 bits; the kernel reads them like the reference."""
    d = 32
    energy = (4.0 ** torch.linspace(0, 7, d)).repeat(2, 1)  # very uneven weights: some channels get 5-8 bits
    args, kwargs, dense, err = _case(ctx_lens=[7, 13, 4], sink_lens=[2, 1, 2], tail_lens=[3, 0, 1], bits=2,
                                     n_outlier=n_outlier, n_outlier_v=1, seed=11, k_channel_bits=budget,
                                     query_energy=energy)
    prof, pages = args[4], args[1]
    assert prof.per_channel_keys and int(prof.k_bits.max()) > 3
    assert pages.k_codes.shape[-1] == -(-budget // 8) != pages.v_codes.shape[-1]
    ref = paged_decode_attention_ref(*args, **kwargs)
    out = paged_decode_attention_triton(*args, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.cosine_similarity(ref, dense, dim=-1).min() > 0.8  # 2-bit values of Gaussian data


def test_validation_errors():
    args, kwargs, _, _ = _case(ctx_lens=[3], bits=2)
    q = args[0]
    bad = (torch.zeros(1, 3, q.shape[-1]),) + args[1:]
    for fn in (paged_decode_attention_ref, paged_decode_attention_triton):
        with pytest.raises(ValueError, match="Hq=3"):
            fn(*bad, **kwargs)
        with pytest.raises(ValueError, match="tail_lens"):
            fn(*args, tail_k=kwargs["tail_k"], tail_v=kwargs["tail_v"])


def test_gpu_kv_bench_tiny_runs_under_interpreter():
    """`bench/gpu_kv.py --tiny` runs the GPU benchmark's code path (random pages, the Triton kernel, the fp16
    baseline, the RESULT line) at tiny shapes on the CPU interpreter."""
    vals = run_bench_result("gpu_kv.py", "--tiny")
    assert {"bw_frac_3b_8k", "bw_frac_3b_32k", "ms_3b_32k", "fp16_ms_32k", "speedup_3b_32k"} <= set(vals)
    assert float(vals["ms_3b_32k"]) > 0
