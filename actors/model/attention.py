"""Attention over the paged KV cache: `paged_attention` (what the engine runs) and the PyTorch reference.

Reference (`paged_attention_ref`): decode sequences (one new token each) are batched: their blocks are
gathered through the block table and attended with a length mask. Prefill sequences are attended one by
one, causally, over their cached prefix plus the new tokens; a long one's KV heads are split over the rank's
compute threads (`kernels.cpu.parallel`). `paged_attention` runs the decode sequences
through the compiled CPU kernel (`kernels.cpu.decode_attention`: one pass over the blocks, no gather
or mask) and each prefill through the compiled causal kernel (`kernels.cpu.prefill_attention`, split over the
compute threads by KV head) when they apply, and the reference for the rest.

Shape legend: T = tokens in the step, B = decode sequences, H = query heads, Hkv = KV heads,
Dh = head_dim, M = max blocks per sequence, S = block_size, L = gathered context length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import tuning
from kernels.cpu import decode_attention, prefill_attention
from kernels.cpu.parallel import run_ranges, threads


@dataclass(kw_only=True, slots=True)
class AttentionMetadata:
    """Where each token of a flattened step lives in the paged cache.

    slot_mapping: [T] int64 flat cache slot of each new token.
    decode_tokens: [B] int64 token index (into T) of each decode sequence's single new token.
    decode_block_tables: [B, M] int64, padded with 0; decode_context_lens: [B] int64 (incl. new token).
    prefills: (token_start, num_new_tokens, context_len, block_table [M'] int64) per prefill sequence.
    decode_context_lens_host: the same lengths as a host list, when the builder has them (saves a device
    sync: a single decode sequence is then attended over a slice, with no mask).
    """

    slot_mapping: torch.Tensor
    decode_tokens: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefills: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    decode_context_lens_host: list[int] | None = None

    def split(self, n: int) -> tuple["AttentionMetadata", "AttentionMetadata"]:
        """A decode-only step's metadata as two micro-batches (`actors.model.two_batch`): sequences [0, n) and
        [n, B), each with its own slots, block tables, context lengths and token indices from 0 (the step's layout,
        `actors.engine.step_plan`: token i is decode sequence i's one new token). Either half may be empty.

        Raises:
            ValueError: the step has prefills, a token that is not a decode token, or n outside [0, B].
        """
        B = self.decode_tokens.numel()
        if self.prefills or self.slot_mapping.numel() != B or not 0 <= n <= B:
            raise ValueError(f"split(n={n}): needs a decode-only step (one token per sequence) and n in [0, B={B}]; "
                             f"got {len(self.prefills)} prefills and {self.slot_mapping.numel()} tokens")
        lens = self.decode_context_lens_host

        def part(a: int, b: int) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=self.slot_mapping[a:b], decode_tokens=self.decode_tokens[a:b] - a,
                decode_block_tables=self.decode_block_tables[a:b], decode_context_lens=self.decode_context_lens[a:b],
                decode_context_lens_host=None if lens is None else lens[a:b])

        return part(0, n), part(n, B)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [N, S, Hkv, Dh], block_table [..., M] -> [..., M*S, Hkv, Dh]."""
    g = cache.index_select(0, block_table.reshape(-1)).view(*block_table.shape, *cache.shape[1:])
    return g.reshape(*block_table.shape[:-1], -1, *cache.shape[2:])


def paged_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as `paged_attention_ref`; on CPU with fp32 K/V the decode sequences go through the compiled
    decode kernel and each prefill through the compiled causal kernel (`kernels.cpu.prefill_attention`), and
    whatever they cannot run through the reference."""
    out = torch.empty_like(q_THD)
    if meta.decode_tokens.numel() and not decode_attention(
            q_THD, k_cache, v_cache, meta.decode_tokens, meta.decode_block_tables, meta.decode_context_lens, scale, out):
        return paged_attention_ref(q_THD, k_cache, v_cache, meta, scale)
    rest = [(start, n, ctx, table) for start, n, ctx, table in meta.prefills if not prefill_attention(
        q_THD[start : start + n], k_cache, v_cache, table, ctx, scale, out[start : start + n])]
    if rest:
        pre = paged_attention_ref(q_THD, k_cache, v_cache, _prefills_only(meta, rest), scale)
        for start, n, _, _ in rest:
            out[start : start + n] = pre[start : start + n]
    return out


def _prefills_only(meta: AttentionMetadata, prefills: list) -> AttentionMetadata:
    z = meta.decode_tokens[:0]
    return AttentionMetadata(slot_mapping=meta.slot_mapping, decode_tokens=z,
                             decode_block_tables=meta.decode_block_tables[:0], decode_context_lens=z, prefills=prefills)


def paged_attention_ref(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the step's queries over their sequences' cached K/V (already written).

    Args:
        q_THD: [T, H, Dh] queries after RoPE (and q-norm). k_cache/v_cache: [N, S, Hkv, Dh].
        meta: token -> sequence/cache layout. scale: softmax scale (usually Dh ** -0.5).
    Returns:
        [T, H, Dh] attention output in q's dtype.
    """
    T, H, Dh = q_THD.shape
    out = torch.empty_like(q_THD)
    B = meta.decode_tokens.numel()
    if B == 1 and meta.decode_context_lens_host is not None:
        ctx = meta.decode_context_lens_host[0]
        k = _gather(k_cache, meta.decode_block_tables[0])[:ctx].transpose(0, 1)  # [Hkv, ctx, Dh]
        v = _gather(v_cache, meta.decode_block_tables[0])[:ctx].transpose(0, 1)
        t = meta.decode_tokens
        # 4-D inputs: the 3-D GQA call takes a slower path on CPU (131 vs 28 us at 134 keys)
        o = F.scaled_dot_product_attention(q_THD.index_select(0, t).transpose(0, 1)[None], k[None], v[None],
                                           scale=scale, enable_gqa=k.shape[0] != H)[0]  # [H, 1, Dh]
        if T == 1:
            return o.transpose(0, 1)
        out.index_copy_(0, t, o.transpose(0, 1))
    elif B:
        k = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [B, Hkv, L, Dh]
        v = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
        L = k.shape[2]
        mask = torch.arange(L, device=q_THD.device)[None, :] < meta.decode_context_lens[:, None]  # [B, L]
        q = q_THD[meta.decode_tokens].unsqueeze(2)  # [B, H, 1, Dh]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                           enable_gqa=k.shape[1] != H)
        out[meta.decode_tokens] = o.squeeze(2)
    for start, n, ctx, table in meta.prefills:
        k = _gather(k_cache, table)[:ctx].transpose(0, 1)  # [Hkv, ctx, Dh]
        v = _gather(v_cache, table)[:ctx].transpose(0, 1)
        q = q_THD[start : start + n].transpose(0, 1)  # [H, n, Dh]
        # a later chunk: query i sits at position ctx - n + i and sees keys 0..ctx-n+i; the whole prompt: SDPA's
        # own causal mask takes its fused kernel (no [n, n] mask built)
        mask = None if ctx == n else (torch.arange(ctx, device=q.device)[None, :]
                                      <= torch.arange(ctx - n, ctx, device=q.device)[:, None])
        Hkv = k.shape[0]
        g = H // Hkv

        def heads(lo: int, hi: int) -> None:  # KV heads [lo, hi) and their query heads: one compute thread's share
            o = F.scaled_dot_product_attention(q[None, lo * g : hi * g], k[None, lo:hi], v[None, lo:hi],
                                               attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=g != 1)[0]
            out[start : start + n, lo * g : hi * g] = o.transpose(0, 1)

        parts = min(Hkv, threads()) if n >= tuning.PARALLEL_ROWS and q_THD.device.type == "cpu" else 1
        run_ranges(heads, [(i * Hkv // parts, (i + 1) * Hkv // parts) for i in range(parts)])
    return out
