"""Decode attention of `QuantizedPagedKVCache` (actors/kv/quantized.py): the step's decode sequences, one launch per
profile present in the batch, after their new tokens are written and the blocks they fill sealed.

Two ways, same result up to fp32 rounding: where the compiled CPU kernel runs (fp32 staging on the CPU,
`_staged_kernel`) it reads each sequence's full-precision sink and tail rows in place from the staging slots and
rotates them itself (`kernels.cpu.quant_attention.StagedRows`); otherwise (the Triton backend, the PyTorch
reference) the tails are gathered and rotated here first, a [B, S, H, D] copy per layer. At 64 sequences that copy
and its RoPE pass cost ~1.2 ms a step (4 layers, shipped model), the kernel's own unpacking ~1.2 ms.

The mixin reads the cache's stage_k / stage_v, sink_tokens, block_size, device, views / _key / profiles, cos / sin,
_decode_attention, _staged_kernel and _seal. Shape legend as actors/kv/quantized.py.
"""
from __future__ import annotations

import torch

from kernels.cpu import quant_attention
from kernels.cpu.quant_attention import StagedRows
from kernels.rope import apply_rope


def _rope_rows(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with a position per (sequence, row): x [B, S, H, D], cos/sin [B, S, D] -> fp32."""
    x = x_BSHD.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos_BSD[..., None, :] + rot * sin_BSD[..., None, :]


class QuantizedDecode:
    """`_decode` of `QuantizedPagedKVCache` (module docstring)."""

    def _decode(self, layer, q_THD, k_THD, v_THD, plan, scale, out) -> None:
        """Write the decode tokens' K / V [T, H, D] into their staging rows, seal the blocks they fill, attend: out[tok]
        = attention of q [T, Hq, D] (this step's plan: `QuantizedKVSequences._make_plan`)."""
        ns = self.sink_tokens
        sk, sv = self.stage_k[layer], self.stage_v[layer]
        tok, slot = plan["tok"], plan["slot"]
        sk[slot, plan["row"]] = k_THD[tok].to(sk.dtype)
        sv[slot, plan["row"]] = v_THD[tok].to(sv.dtype)
        for name, (slots, rows, pages, pslots) in plan["seals"].items():
            self._seal(layer, name, sk[slots, rows], sv[slots, rows], pages, pslots)
        if self._staged_kernel and self._decode_staged(layer, q_THD, plan, scale, out):
            return  # the compiled kernel read the sink and tail rows where they lie
        rows, cos, sin = self._tail_rows(plan)
        tail_k = _rope_rows(sk[slot[:, None], rows], cos, sin)  # [B, S, H, D]
        tail_v = sv[slot[:, None], rows].float()
        kw = {}
        for name, ix in plan["groups"].items():
            if ns:
                sink_k = apply_rope(sk[slot[ix], :ns], self.cos[:ns], self.sin[:ns])  # [b, Ns, H, D]
                kw = dict(sink_k=sink_k.contiguous(), sink_v=sv[slot[ix], :ns].float().contiguous(),
                          sink_lens=plan["sink_lens"][ix])
            o = self._decode_attention(
                q_THD[tok[ix]].float(), self.views[self._key[name]][layer], plan["page_tables"][ix],
                plan["context_lens"][ix], self.profiles[name].layers[layer], self.cos, self.sin, scale,
                tail_k=tail_k[ix].contiguous(), tail_v=tail_v[ix].contiguous(), tail_lens=plan["tail_lens"][ix], **kw)
            out[tok[ix]] = o.to(out.dtype)

    def _tail_rows(self, plan) -> tuple:
        """(staging rows [B, S] of each decode sequence's tail, rows past tail_lens masked; their RoPE cos / sin
        [B, S, D]) for the gathering path, made once per step and kept in the plan (the staged kernel needs none)."""
        if "tail_rows" not in plan:
            ns, s, dev = self.sink_tokens, self.block_size, self.device
            sealed, sink = plan["context_lens"].long(), plan["sink_lens"].long()
            ar = torch.arange(s, device=dev)[None, :]
            plan["tail_rows"] = ((ns + sealed % s)[:, None] + ar).clamp(max=ns + s - 1)
            pos = ((sink + sealed)[:, None] + ar).clamp(max=self.cos.shape[0] - 1)
            plan["tail_cos"], plan["tail_sin"] = self.cos[pos], self.sin[pos]
        return plan["tail_rows"], plan["tail_cos"], plan["tail_sin"]

    def _decode_staged(self, layer, q_THD, plan, scale, out) -> bool:
        """The decode sequences' attention by the compiled kernel reading this layer's staging rows in place (no
        gather, RoPE pass or copy of every sequence's sink and tail per layer); False when it cannot run."""
        outs = []
        for name, (tok, tables, sealed, sink_lens, tail_lens, slot) in _group_rows(plan).items():
            o = quant_attention.quant_decode_attention(
                q_THD[tok].float(), self.views[self._key[name]][layer], tables, sealed,
                self.profiles[name].layers[layer], self.cos, self.sin, scale, sink_lens=sink_lens, tail_lens=tail_lens,
                staged=StagedRows(self.stage_k[layer], self.stage_v[layer], slot, self.sink_tokens, self.block_size))
            if o is None:
                return False
            outs.append((tok, o))
        for t, o in outs:
            out[t] = o.to(out.dtype)
        return True


_GROUP_FIELDS = ("tok", "page_tables", "context_lens", "sink_lens", "tail_lens", "slot")


def _group_rows(plan) -> dict[str, tuple]:
    """Per profile in the step, its decode sequences' plan tensors (`_GROUP_FIELDS`) as the compiled kernel reads
    them: int64, contiguous, gathered once per step and kept in the plan, not again on every layer (one profile for
    the whole batch: no gather)."""
    got = plan.get("group_rows")
    if got is None:
        n = plan["tok"].numel()
        got = plan["group_rows"] = {
            name: tuple((plan[f] if ix.numel() == n else plan[f][ix]).to(torch.int64).contiguous()
                        for f in _GROUP_FIELDS)
            for name, ix in plan["groups"].items()}
    return got
