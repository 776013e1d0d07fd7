"""What bench/kv_quality.py measures a KV cache with: window logits, KL divergence and same-top-1 against the
full-precision run, the Wilson interval, greedy decoding through a cache, retrieval scoring; and the KIVI cache.

Conventions (llama.cpp `llama-perplexity --kl-divergence`): at every evaluated position t (the logits at t
predict token t + 1) the quantized run's distribution q_t is compared with the full-precision run's p_t:
KL(p_t || q_t) = sum_v p_t(v) (log p_t(v) - log q_t(v)) in nats, averaged over positions; "same top-1" is the
share of positions where argmax q_t == argmax p_t (ties: the lowest token id, `torch.argmax`), in percent.

Retrieval decoding reads the cache as serving does: the prompt is prefilled through the cache in one chunk,
then each new token is one decode step (`AttentionMetadata.decode_tokens`, the block table growing a block at
a time as the scheduler grows it), so a quantized cache seals and reads its pages exactly as in serving.

Benchmark and test code only. Shape legend: N = positions, V = vocabulary, T = tokens in a step, H = heads,
D = head_dim, C = context length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from actors.kv.allocator import BlockAllocator
from actors.kv.interface import KVCache
from actors.kv.quantized import mixed_causal_attention
from actors.model.attention import AttentionMetadata
from actors.kv.simulated import BLOCK, window_logits  # noqa: F401 - re-exported for the benches
from actors.kv.simulated import prefill_meta as _prefill_meta
from bench.kivi import kivi_dequantize, kivi_quantize


@dataclass
class WindowStats:
    """Sums over evaluated positions (one row, one domain, one context). `tail_*`: the positions >= `tail_from`
    of a window (positions past 1,024 at 4k), also counted in the totals."""

    nll: float = 0.0
    n: int = 0
    kl: float = 0.0
    same: int = 0
    tail_kl: float = 0.0
    tail_same: int = 0
    tail_n: int = 0

    def ppl(self) -> float:
        return math.exp(self.nll / self.n) if self.n else float("nan")


def kl_and_same_top1(logp_ref_NV: torch.Tensor, logits_NV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position KL(p_ref || q) in nats and whether the top-1 tokens agree.

    Args:
        logp_ref_NV: [N, V] log-probabilities of the reference (full-precision) run, fp32.
        logits_NV: [N, V] logits (or log-probabilities) of the compared run.
    Returns:
        (kl_N fp32 >= 0 up to rounding, same_N bool).
    Raises:
        ValueError: shapes differ.
    """
    if logp_ref_NV.shape != logits_NV.shape:
        raise ValueError(f"reference {tuple(logp_ref_NV.shape)} and compared {tuple(logits_NV.shape)} differ")
    lq = torch.log_softmax(logits_NV.float(), dim=-1)
    kl = (logp_ref_NV.exp() * (logp_ref_NV - lq)).sum(-1)
    return kl, logp_ref_NV.argmax(-1) == lq.argmax(-1)


def add_window(st: WindowStats, logits_NV: torch.Tensor, targets_N: torch.Tensor, logp_ref_NV: torch.Tensor,
               tail_from: int | None) -> None:
    """Add one window's NLL, KL and same-top-1 to `st`. logits_NV: the compared run at positions 0 .. N-1,
    targets_N: int64 next tokens, logp_ref_NV: the reference's log-probabilities at the same positions."""
    st.nll += float(torch.nn.functional.cross_entropy(logits_NV.float(), targets_N, reduction="sum"))
    st.n += targets_N.numel()
    kl, same = kl_and_same_top1(logp_ref_NV, logits_NV)
    st.kl += float(kl.sum())
    st.same += int(same.sum())
    if tail_from is not None and tail_from < targets_N.numel():
        st.tail_kl += float(kl[tail_from:].sum())
        st.tail_same += int(same[tail_from:].sum())
        st.tail_n += targets_N.numel() - tail_from


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n (Wilson, JASA 1927; z = 1.96: 95%).
    Returns (lo, hi) in [0, 1]; (0, 1) for n = 0. Raises ValueError unless 0 <= k <= n."""
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be in [0, n={n}]")
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    mid = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, mid - half), min(1.0, mid + half)


@torch.inference_mode()
def greedy_decode(model, cache: KVCache, prompt_ids: list[int], max_new: int, eos_id: int | None = None,
                  stop=None, logits_out: list | None = None) -> list[int]:
    """Greedy tokens after `prompt_ids`: one prefill step, then one decode step per token (module doc).

    Args:
        model: `actors.model.model.MoEModel`. cache: any `KVCache` with room for len(prompt_ids) + max_new.
        max_new: tokens at most (>= 1). eos_id: stop after this token. stop: optional `f(tokens) -> bool`
            checked after each token. logits_out: if given, each generated token's logits ([V] fp32) are
            appended to it.
    Returns:
        the generated token ids (eos included when reached).
    """
    bs = cache.block_size
    n = len(prompt_ids)
    blocks = [cache.allocator.allocate() for _ in range(-(-n // bs))]
    try:
        h = model.forward(torch.tensor(prompt_ids), torch.arange(n), cache, _prefill_meta(n, blocks, bs))
        out = []

        def take(h_1D):
            logits = model.logits(h_1D).float()[0]
            if logits_out is not None:
                logits_out.append(logits)
            out.append(int(logits.argmax()))
        take(h[-1:])
        while len(out) < max_new and out[-1] != eos_id and not (stop and stop(out)):
            p = n + len(out) - 1  # position of the token being fed
            if p // bs == len(blocks):
                blocks.append(cache.allocator.allocate())
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs]), decode_tokens=torch.tensor([0]),
                decode_block_tables=torch.tensor([blocks], dtype=torch.int64),
                decode_context_lens=torch.tensor([p + 1]), decode_context_lens_host=[p + 1])
            h = model.forward(torch.tensor([out[-1]]), torch.tensor([p]), cache, meta)
            take(h)
        return out
    finally:
        cache.allocator.free_all(blocks)


def answer_digits_done(tok):
    """A `stop` for `greedy_decode`: the text so far (leading spaces stripped) has 6 characters or a non-digit,
    which is all `is_correct` reads of a 5-digit answer."""
    def stop(ids: list[int]) -> bool:
        s = tok.decode(ids).lstrip()
        return len(s) > 5 or any(not ch.isdigit() for ch in s)
    return stop


def score_records(model, cache: KVCache, tok, records, max_new: int, eos_id: int | None = None) -> list[bool]:
    """Exact match (`scripts.retrieval_records.is_correct`) of each record's greedy answer through `cache`."""
    from scripts.retrieval_records import is_correct

    stop = answer_digits_done(tok)
    return [is_correct(tok.decode(greedy_decode(model, cache, list(r.prompt_ids), max_new, eos_id, stop)), r.answer)
            for r in records]


class KiviCache(KVCache):
    """KIVI-style uniform quantization (arXiv 2402.02750) of one sequence at a time, prefill and decode.

    Keys are quantized post-RoPE per channel over groups of `group` tokens, values per token over groups of
    `v_group` channels; a token's group is quantized once it is complete, and the incomplete group stays in
    full precision (KIVI's residual): a query at position p sees key j dequantized iff j < group * ((p + 1) //
    group). Each group depends on its own tokens only, so decoding token by token gives the prefill's numbers.
    A prefill must be a whole sequence (it starts a new one); a decode step continues it by one token.
    `eff_bits`: the effective bits of each prefill's quantized part plus its full-precision tail at 16 bits.
    """

    def __init__(self, bits: int, group: int = 32, v_group: int | None = None, max_tokens: int = 1024):
        self.bits, self.group, self.v_group = bits, group, v_group or group
        self.block_size, self.num_blocks = BLOCK, -(-max_tokens // BLOCK) + 1
        self.allocator = BlockAllocator(self.num_blocks)
        self.eff_bits: list[float] = []
        self._seq: dict[int, list[torch.Tensor]] = {}  # layer -> [k_fp, v_fp, k_dq, v_dq], each [C, H, D]

    def _qdq(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = kivi_quantize(k, v, bits=self.bits, group_size=self.group, v_group_size=self.v_group)
        return kivi_dequantize(q)

    def attend(self, layer, q_THD, k_THD, v_THD, positions_T, meta, rotary, scale):
        k = rotary.apply(k_THD, positions_T).float()
        v = v_THD.float()
        g = self.group
        if meta.prefills:
            (start, n, ctx, _), = meta.prefills
            if n != ctx or meta.decode_tokens.numel():
                raise ValueError("KiviCache prefills whole sequences only, alone in their step")
            nq = ctx // g * g  # complete groups are quantized, the rest stays full precision
            k_dq, v_dq = k.clone(), v.clone()
            if nq:
                qz = kivi_quantize(k[:nq], v[:nq], bits=self.bits, group_size=g, v_group_size=self.v_group)
                k_dq[:nq], v_dq[:nq] = kivi_dequantize(qz)
                if layer == 0:
                    self.eff_bits.append((qz.effective_bits() * nq + 16.0 * (ctx - nq)) / ctx)
            self._seq[layer] = [k, v, k_dq, v_dq]
        else:
            if meta.decode_tokens.numel() != 1:
                raise ValueError("KiviCache decodes one sequence at a time")
            k_fp, v_fp, k_dq, v_dq = self._seq[layer]
            p = int(positions_T[0])
            if p != k_fp.shape[0]:
                raise ValueError(f"decode at position {p} does not continue the sequence of {k_fp.shape[0]} tokens")
            k_fp, v_fp, k_dq, v_dq = (torch.cat([a, b]) for a, b in ((k_fp, k), (v_fp, v), (k_dq, k), (v_dq, v)))
            if (p + 1) % g == 0:  # this token completes a group
                k_dq[p + 1 - g:], v_dq[p + 1 - g:] = self._qdq(k_fp[p + 1 - g:], v_fp[p + 1 - g:])
            self._seq[layer] = [k_fp, v_fp, k_dq, v_dq]
        k_fp, v_fp, k_dq, v_dq = self._seq[layer]
        pos = positions_T.to(torch.int64)
        hi = (pos + 1) // g * g
        return mixed_causal_attention(q_THD, k_fp, v_fp, k_dq, v_dq, pos, 0, hi, scale).to(q_THD.dtype)
