"""Two-batch overlap's step split (`AttentionMetadata.split`, `actors.model.two_batch.split_step`): each micro-batch
keeps its own sequences' slots, block tables, context lengths and gating rows, token indices from 0, either half
possibly empty; a step with a prefill is refused. And attention over each half's metadata equals the same rows of
attention over the whole step's."""
from __future__ import annotations

import pytest
import torch

from actors.model.attention import AttentionMetadata, paged_attention_ref
from actors.model.two_batch import split_step
from actors.moe.gating import GatingBatch


def _decode_meta(B: int, M: int = 3, bs: int = 4) -> AttentionMetadata:
    tables = torch.arange(B * M, dtype=torch.int64).view(B, M)
    lens = [1 + (5 * i) % (M * bs) for i in range(B)]
    slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
    return AttentionMetadata(slot_mapping=torch.tensor(slots), decode_tokens=torch.arange(B),
                             decode_block_tables=tables, decode_context_lens=torch.tensor(lens),
                             decode_context_lens_host=lens)


@pytest.mark.parametrize("B", [0, 1, 8, 9])
def test_split_keeps_each_halfs_sequences(B):
    meta = _decode_meta(B)
    ids, pos = torch.arange(100, 100 + B), meta.decode_context_lens - 1
    gating = GatingBatch(slots_T=torch.arange(B) + 3, positions_T=pos, policy_T=torch.arange(B) % 2)
    a, b = split_step(ids, pos, meta, gating)
    n = -(-B // 2)
    assert (a.T, b.T) == (n, B - n)
    for mb, lo, hi in ((a, 0, n), (b, n, B)):
        m = mb.meta
        assert torch.equal(m.decode_tokens, torch.arange(hi - lo))
        assert torch.equal(m.slot_mapping, meta.slot_mapping[lo:hi])
        assert torch.equal(m.decode_block_tables, meta.decode_block_tables[lo:hi])
        assert torch.equal(m.decode_context_lens, meta.decode_context_lens[lo:hi])
        assert m.decode_context_lens_host == meta.decode_context_lens_host[lo:hi] and not m.prefills
        assert torch.equal(mb.ids, ids[lo:hi]) and torch.equal(mb.pos, pos[lo:hi])
        assert torch.equal(mb.gating.slots_T, gating.slots_T[lo:hi])
        assert torch.equal(mb.gating.positions_T, pos[lo:hi]) and torch.equal(mb.gating.policy_T, gating.policy_T[lo:hi])


def test_split_refuses_a_step_with_a_prefill():
    meta = _decode_meta(2)
    meta.prefills = [(2, 3, 3, torch.tensor([7]))]
    meta.slot_mapping = torch.arange(5)
    with pytest.raises(ValueError, match="decode-only"):
        meta.split(1)
    with pytest.raises(ValueError, match="n in"):
        _decode_meta(3).split(4)


def test_attention_of_each_half_equals_the_whole_steps_rows():
    B, H, Hkv, Dh, bs = 9, 4, 2, 8, 4
    meta = _decode_meta(B, bs=bs)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B * 3, bs, Hkv, Dh, generator=g)
    v = torch.randn(B * 3, bs, Hkv, Dh, generator=g)
    q = torch.randn(B, H, Dh, generator=g)
    whole = paged_attention_ref(q, k, v, meta, 0.3)
    ma, mb = meta.split(5)
    halves = torch.cat([paged_attention_ref(q[:5], k, v, ma, 0.3), paged_attention_ref(q[5:], k, v, mb, 0.3)])
    assert torch.allclose(halves, whole, atol=1e-6)
