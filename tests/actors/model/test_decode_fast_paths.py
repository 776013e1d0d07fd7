"""The decode fast paths (one sequence, one token, few rows) equal the general paths they shortcut."""
from __future__ import annotations

import torch

from actors.model.attention import AttentionMetadata, paged_attention_ref
from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.placement import ExpertPlacement
from actors.moe.experts import LocalExperts
from actors.model.layers import Rotary, rms_norm
from kernels.gating import topk_softmax_ref


def test_single_decode_sequence_slice_path_equals_masked_path():
    g = torch.Generator().manual_seed(0)
    N, S, Hkv, H, Dh = 6, 4, 2, 4, 8
    kc, vc = torch.randn(N, S, Hkv, Dh, generator=g), torch.randn(N, S, Hkv, Dh, generator=g)
    table = torch.tensor([[4, 1, 3]])
    for T, dec_tok, prefills in ((1, [0], []), (4, [3], [(0, 3, 3, torch.tensor([0]))])):
        q = torch.randn(T, H, Dh, generator=g)
        args = dict(slot_mapping=torch.zeros(T, dtype=torch.int64), decode_tokens=torch.tensor(dec_tok),
                    decode_block_tables=table, decode_context_lens=torch.tensor([10]), prefills=prefills)
        masked = paged_attention_ref(q, kc, vc, AttentionMetadata(**args), 0.3)
        sliced = paged_attention_ref(q, kc, vc, AttentionMetadata(**args, decode_context_lens_host=[10]), 0.3)
        torch.testing.assert_close(sliced, masked, rtol=1e-6, atol=1e-6)
    # and the masked path equals plain attention over the first 10 gathered tokens
    k = kc[table[0]].reshape(-1, Hkv, Dh)[:10].repeat_interleave(2, dim=1)
    v = vc[table[0]].reshape(-1, Hkv, Dh)[:10].repeat_interleave(2, dim=1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q[3], k) * 0.3, dim=-1)
    torch.testing.assert_close(sliced[3], torch.einsum("ht,thd->hd", p, v), rtol=1e-5, atol=1e-5)


def test_rotary_reuses_tables_only_for_the_same_positions_tensor():
    rot = Rotary(8, 10000.0, 32, torch.float32)
    x = torch.randn(3, 2, 8)

    def reference(x, pos):
        cos, sin = rot.cos[pos][:, None], rot.sin[pos][:, None]
        return x * cos + torch.cat([-x[..., 4:], x[..., :4]], dim=-1) * sin

    p1, p2 = torch.tensor([0, 5, 9]), torch.tensor([1, 2, 31])
    for p in (p1, p1, p2, p1):
        torch.testing.assert_close(rot.apply(x, p), reference(x, p), rtol=1e-6, atol=1e-6)


def test_rms_norm_fp32_path_matches_transformers_formula():
    x, w = torch.randn(5, 16) * 3, torch.randn(16)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want, rtol=1e-6, atol=1e-6)


def test_one_token_dispatch_equals_general_path_and_counts_rows():
    g = torch.Generator().manual_seed(1)
    E, D, I, K = 5, 12, 7, 2
    experts = LocalExperts(torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g))
    disp = AllToAllDispatcher(ExpertPlacement.contiguous(1, E, 1), 0)
    x = torch.randn(1, D, generator=g)
    w, ids = topk_softmax_ref(torch.randn(1, E, generator=g), K, False)
    fast = disp.run(0, x, ids, w, experts, may_pad=False)
    general = disp.run(0, x, ids, w, experts, may_pad=True)
    torch.testing.assert_close(fast, general, rtol=1e-6, atol=1e-6)
    ref = sum(w[0, k] * experts._ffn(x, int(ids[0, k])) for k in range(K))
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert disp.sent_rows.tolist() == [[2 * K]]


def test_few_rows_with_repeated_experts_take_the_sorted_path():
    g = torch.Generator().manual_seed(2)
    E, D, I = 3, 6, 5
    experts = LocalExperts(torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g))
    x = torch.randn(4, D, generator=g)
    for ids in ([2, 0, 1], [1, 1, 0, 1], [2]):
        y = experts(x[: len(ids)], torch.tensor(ids))
        want = torch.cat([experts._ffn(x[r : r + 1], e) for r, e in enumerate(ids)])
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
