"""Sub-4-bit, outlier-aware, non-uniform paged KV cache (KVQuant, arXiv 2401.18079) behind `KVCache`.

Where a sequence's tokens live (one layer; Ns = sink tokens, S = block_size, p = position, q = the sequence's
quantized token count):
  * p < Ns (attention sink: KVQuant keeps the first token in fp16; StreamingLLM, arXiv 2309.17453): full
    precision, in the sequence's staging slot, rows [0, Ns);
  * quantized token t = p - Ns < q lives in the shared page pool (actors/kv/pool.py) at page
    `page_table[t // T]`, slot t % T, where T = tokens per page of the sequence's width (packed codes +
    per-token V scale + dense outlier channels; keys stored pre-RoPE, per channel, with one width or
    per-channel widths, whose key row of Pk bytes differs from the value row: the page layout is keyed by
    (bits, Ok, Ov, Pk), actors/kv/quantized_layout.py);
  * tokens t >= q (the unsealed tail, all in the logical block being filled) stay full precision in the
    staging slot, row Ns + t % S. When a token completes its logical block (t % S == S - 1) the tail is
    sealed: quantized in one pass with the sequence's profile and appended to its pages.
Normally q = S * floor((L - Ns) / S) for a sequence of L tokens; after `truncate` into a sealed block q is
the cut (see `QuantizedKVSequences.truncate`). Order within one step: write the new tokens, seal the blocks
they fill, then attend.
A query at position p sees key j quantized iff Ns <= j < Ns + max(q_before_step, S * ((p + 1 - Ns) // S)),
on the decode path (paged kernel) and the prefill path (dense, masked) alike, so teacher-forced prefill logits
equal token-by-token decode logits.

Decode runs the kernel once per profile present in the batch (so at least once per bit width): BITS, the
page's token count and the codebooks are compile-time or per-launch constants of the kernel; per-sequence
widths inside one launch would need per-program code paths and were not worth it for at most a few groups.

The cache in parts: this module holds the storage (one uint8 page arena and the full-precision staging rows
per layer), the per-layer write / seal and the prefill's attention; the decode attention is
actors/kv/quantized_decode.py, the page layout and size arithmetic actors/kv/quantized_layout.py, the sequences,
pool budget and step plan actors/kv/quantized_sequences.py, the page tables actors/kv/page_tables.py, the build
from an EngineConfig actors/kv/builder.py.

Shape legend: T = tokens in the step, B = decode sequences, Hq = query heads, H = KV heads, D = head_dim,
S = block_size, Ns = sink tokens, NP = pool pages, Tp = tokens per page of one width, M = max pages per
sequence, C = context length of one prefill sequence, n = its new tokens, R = staging slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.kv.interface import KVCache
from actors.kv.page_tables import SequencePageTables
from actors.kv.pool import MixedWidthPagePool
from actors.kv.profile_choice import AUTO
from actors.kv.profiles import ModelKVProfile
from actors.kv.quantized_decode import QuantizedDecode
from actors.kv.quantized_layout import PAGE_ALIGN, QuantizedKVSizes, arena_views, layer_page_bytes, layout_key
from actors.kv.quantized_sequences import QuantizedKVSequences, SequenceAllocator, SequenceState
from kernels.cpu.attention import mixed_prefill_attention
from kernels.cpu.quant_attention import quant_dequant_rows
from kernels.kv_quant import dequantize_keys, dequantize_values, quantize_kv
from kernels.rope import apply_rope, rope_tables


def mixed_causal_attention(q_nHD: torch.Tensor, k_fp_CHD: torch.Tensor, v_fp_CHD: torch.Tensor,
                           k_dq_CHD: torch.Tensor, v_dq_CHD: torch.Tensor, q_pos_n: torch.Tensor,
                           quant_lo: int, quant_hi_n: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention where each query sees some keys dequantized and the rest in full precision.

    Query i (position q_pos_n[i]) sees key j <= q_pos_n[i]; it uses the dequantized key/value of j when
    quant_lo <= j < quant_hi_n[i], else the full-precision one. This is what decoding sees when the cache
    quantizes keys as their block seals.

    Args:
        q_nHD: [n, Hq, D] queries (post-RoPE). k_fp/v_fp, k_dq/v_dq: [C, H, D] keys (post-RoPE) and values.
        q_pos_n: [n] int64 positions of the queries (< C). quant_lo: first position that is ever quantized.
        quant_hi_n: [n] int64, one past the last quantized position each query sees.
        scale: softmax scale.
    Returns:
        [n, Hq, D] fp32.
    """
    c, h, _ = k_fp_CHD.shape
    n = q_nHD.shape[0]
    if q_nHD.device.type == "cpu" and torch.equal(q_pos_n, torch.arange(c - n, c)):  # a prefill's last n positions
        out = torch.empty(q_nHD.shape, dtype=torch.float32)
        q = q_nHD.float().contiguous()
        if mixed_prefill_attention(q, k_dq_CHD.float().contiguous(), v_dq_CHD.float().contiguous(),
                                   k_fp_CHD.float().contiguous(), v_fp_CHD.float().contiguous(), quant_lo, quant_hi_n,
                                   scale, out):  # the compiled kernel (AVX-512); else the masked SDPA below
            return out
    j = torch.arange(c, device=q_nHD.device)
    quant = (j[None, :] >= quant_lo) & (j[None, :] < quant_hi_n[:, None])  # [n, C]
    causal = j[None, :] <= q_pos_n[:, None]
    # Each position appears once among the 2C keys [full precision; dequantized], so one masked softmax over
    # both halves is the mixed attention.
    mask = torch.cat([causal & ~quant, causal & quant], dim=1)  # [n, 2C]
    k = torch.cat([k_fp_CHD, k_dq_CHD]).float().transpose(0, 1)  # [H, 2C, D]
    v = torch.cat([v_fp_CHD, v_dq_CHD]).float().transpose(0, 1)
    o = F.scaled_dot_product_attention(q_nHD.float().transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                       scale=scale, enable_gqa=k.shape[0] != q_nHD.shape[1])[0]  # 4-D: faster GQA
    return o.transpose(0, 1)


class QuantizedPagedKVCache(QuantizedKVSizes, QuantizedKVSequences, QuantizedDecode, KVCache):
    """Paged KV cache with sub-4-bit quantized pages of mixed widths, a full-precision sink and unsealed tail.

    Args:
        num_layers, block_size, num_kv_heads, head_dim: geometry (logical block = S tokens, all layers).
        num_blocks: logical block ids the scheduler may hand out (>= 1).
        profiles: {name: ModelKVProfile}, all with the model's (H, D) and num_layers; bit widths and outlier
            counts may differ (2, 3 and 4 bits in one cache).
        default_profile: name used when a sequence was not bound to a profile, or "auto".
        max_sequences: staging slots (sequences alive at once), >= 1.
        sink_tokens: Ns full-precision leading tokens per sequence, >= 0.
        rope_theta, max_positions: RoPE base and table length (keys are rotated after dequantization).
        dtype: storage dtype of the full-precision staging rows. device: torch device.
        backend: "torch" (the compiled CPU kernel, else paged_decode_attention_ref) or "triton"
            (paged_decode_attention_triton).
        page_bytes: bytes of one pool page over all layers (default `pool_page_bytes(profiles, S)`); must be a
            multiple of num_layers * 16 and hold one token of every profile.
        num_pages: pool pages (default: enough for num_blocks logical blocks at the widest width).
    Raises:
        ValueError: naming the argument and its limit (no profiles, (H, D) or layer count mismatch, bad sizes,
            unknown backend or default profile, bad page_bytes).
        MemoryError: (in attend / fork) more live sequences than staging slots, or the page pool exhausted by
            a caller that allocated logical blocks beyond `allocator.num_free`.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 profiles: dict[str, ModelKVProfile], default_profile: str = AUTO, max_sequences: int = 64,
                 sink_tokens: int = 1, rope_theta: float = 10000.0, max_positions: int = 1024,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", backend: str = "torch",
                 page_bytes: int | None = None, num_pages: int | None = None):
        if not profiles:
            raise ValueError("profiles is empty; need at least one calibrated KV profile")
        for name, p in profiles.items():
            _, h, d, _, _ = p.layout()
            if (h, d) != (num_kv_heads, head_dim):
                raise ValueError(f"profile {name!r} has (H, D)={(h, d)}; the model has ({num_kv_heads}, {head_dim})")
            if p.num_layers != num_layers:
                raise ValueError(f"profile {name!r} has {p.num_layers} layers; the model has {num_layers}")
        if default_profile != AUTO and default_profile not in profiles:
            raise ValueError(f"default_profile={default_profile!r} is not one of {sorted(profiles)} or 'auto'")
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend={backend!r} must be torch or triton")
        for name, val, lo in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                              ("max_sequences", max_sequences, 1), ("sink_tokens", sink_tokens, 0),
                              ("max_positions", max_positions, 1)):
            if val < lo:
                raise ValueError(f"{name}={val} must be >= {lo}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.sink_tokens, self.backend, self.device, self.dtype = sink_tokens, backend, device, dtype
        self.profiles = {n: p.to(device) for n, p in profiles.items()}
        self.default_profile = default_profile
        self.max_sequences = max_sequences
        self._key = {n: layout_key(p) for n, p in self.profiles.items()}
        widths = sorted({p.bits for p in self.profiles.values()})
        self.bits = widths[0] if len(widths) == 1 else None  # one width: as before; mixed: see `widths`
        self.widths = widths
        # pool geometry
        if page_bytes is None:
            page_bytes = self.pool_page_bytes(self.profiles.values(), block_size)
        if page_bytes < 1 or page_bytes % (num_layers * PAGE_ALIGN):
            raise ValueError(f"page_bytes={page_bytes} must be a positive multiple of num_layers * {PAGE_ALIGN} "
                             f"= {num_layers * PAGE_ALIGN}")
        layer_bpt = {self._key[n]: [lp.bytes_per_token() for lp in p.layers] for n, p in self.profiles.items()}
        bpt = {k: sum(b) for k, b in layer_bpt.items()}
        self.page_bytes = page_bytes
        t_min = min(page_bytes // b for b in bpt.values())
        if num_pages is None:
            num_pages = -(-num_blocks * block_size // max(t_min, 1)) + 2
        self.pool = MixedWidthPagePool(bpt, page_bytes, num_pages)  # ValueError if a token exceeds a page
        self.num_pages = num_pages
        self.tables = SequencePageTables(self.pool)
        self.tokens_per_page = {k: self.pool.tokens_per_page(k) for k in bpt}
        # each layer's page: the most any layout needs there (layers differ with allocated layer widths)
        self.layer_page_bytes = layer_page_bytes(bpt, self.tokens_per_page, lambda k, l: layer_bpt[k][l])
        # == layer_page_bytes_for(profiles, page_bytes): the builder sizes the pool with it
        self.arena = [torch.zeros(num_pages, pb, dtype=torch.uint8, device=device) for pb in self.layer_page_bytes]
        self.views = {k: [arena_views(a, k[l], t, num_kv_heads, head_dim) for l, a in enumerate(self.arena)]
                      for k, t in self.tokens_per_page.items()}
        rows = sink_tokens + block_size
        h, d = num_kv_heads, head_dim
        self.stage_k = [torch.zeros(max_sequences, rows, h, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.stage_v = [torch.zeros(max_sequences, rows, h, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.cos, self.sin = rope_tables(max_positions, head_dim, base=rope_theta, device=device)
        self.allocator = SequenceAllocator(num_blocks, self._release, self._budget_free_blocks)
        self._free_slots = list(range(max_sequences - 1, -1, -1))
        self._seqs: dict[int, SequenceState] = {}  # first block id -> state
        self._bound: dict[int, str] = {}  # first block id -> profile chosen before its first step
        self._plan_meta = self._plan = self._other_plan = None  # this step's plan (and the other micro-batch's)
        self._committed: tuple[int, int] | None = None  # (outstanding pages, known blocks), see _budget_free_blocks
        if backend == "triton":
            from kernels.paged_attention_triton import paged_decode_attention_triton as attn
        else:  # the compiled CPU kernel where it runs (kernels/csrc/quant_decode_attention.c), else the reference
            from kernels.cpu.quant_attention import quant_decode_attention_or_ref as attn
        self._decode_attention = attn
        # decode reads the staging rows in place where the compiled kernel runs (`_decode_staged`)
        self._staged_kernel = backend != "triton" and dtype == torch.float32 and torch.device(device).type == "cpu"

    # ------------------------------------------------------------------ sizes and accounting
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one logical block (S tokens) at the widest profile."""
        return max(self.bytes_per_block_for(p, self.block_size) for p in self.profiles.values())

    def memory_stats(self) -> dict:
        """Memory accounting of the cache (bytes, blocks, pages, sequences).

        kv_bytes_reserved: arena + staging + profiles, allocated up front. kv_bytes_pages: the arena.
        kv_bytes_held: pages held by live sequences. kv_bytes_live_quantized: bytes of their valid quantized
        tokens (a shared page counted once). kv_fragmentation = 1 - live quantized / held (page slack and
        every last page's unfilled tail included; 0 with nothing held). kv_bytes_live: all live data (quantized
        tokens at their size, sink/tail tokens at the staging dtype's size). kv_bits_effective: kv_bytes_live *
        8 / (live tokens * 2 * L * H * D) (0 with no live token). kv_blocks_*: logical blocks (ids);
        kv_blocks_admissible: `allocator.num_free`, the pool-aware count the scheduler sees.
        """
        staging = self.staging_bytes_for(self.num_layers, self.max_sequences, self.sink_tokens, self.block_size,
                                         self.num_kv_heads, self.head_dim, self.dtype)
        arena = self.num_pages * sum(self.layer_page_bytes)
        prof = sum(p.nbytes() for p in self.profiles.values())
        item = torch.empty(0, dtype=self.dtype).element_size()
        fp_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * item
        live = tokens = 0
        for first, st in self._seqs.items():
            q = self.tables.tokens(first)
            live += q * self.pool.bytes_per_token[self._key[st.profile]] + (st.length - q) * fp_token
            tokens += st.length
        elems = tokens * 2 * self.num_layers * self.num_kv_heads * self.head_dim
        held = self.tables.held_bytes
        live_q = self.tables.live_bytes()
        used_ids = self.allocator.num_used
        return {"kv_bits": self.bits if self.bits is not None else list(self.widths),
                "kv_bytes_reserved": arena + staging + prof, "kv_bytes_pages": arena,
                "kv_bytes_staging": staging, "kv_bytes_profiles": prof, "kv_bytes_live": live,
                "kv_bytes_held": held, "kv_bytes_live_quantized": live_q,
                "kv_fragmentation": 1.0 - live_q / held if held else 0.0,
                "kv_bits_effective": live * 8.0 / elems if elems else 0.0,
                "kv_blocks_total": self.num_blocks, "kv_blocks_free": self.num_blocks - used_ids,
                "kv_blocks_used": used_ids, "kv_blocks_admissible": self.allocator.num_free,
                "kv_pages_total": self.num_pages, "kv_pages_free": self.pool.num_free,
                "kv_pages_used": self.pool.allocator.num_used, "kv_page_bytes": self.page_bytes,
                "kv_tokens_per_page": dict(sorted(((p.bits, self.tokens_per_page[self._key[n]])
                                                   for n, p in self.profiles.items()), reverse=True)),
                "kv_sequences": len(self._seqs), "kv_staging_slots_free": len(self._free_slots)}

    # ------------------------------------------------------------------ attend
    def attend(self, layer, q_THD, k_THD, v_THD, positions_T, meta, rotary, scale):
        """Write the step's new K (pre-RoPE) / V, seal the blocks they fill, and attend (see module doc).

        Args:
            layer: layer index. q_THD: [T, Hq, D] post-RoPE queries. k_THD, v_THD: [T, H, D] new keys (before
            RoPE) and values. positions_T: [T] int64. meta: AttentionMetadata of the step. rotary: unused
            (the cache keeps fp32 RoPE tables of its own). scale: softmax scale.
        Returns:
            [T, Hq, D] in q's dtype.
        Raises:
            MemoryError: more live sequences than staging slots, or no free page for a seal.
            ValueError: a step that does not continue a sequence where it stands (decode of a sealed position,
                prefill not starting at the sequence's length).
        """
        if meta is not self._plan_meta:  # a new step, or the other micro-batch's (two-batch overlap): its own plan
            if self._other_plan is not None and self._other_plan[0] is meta:
                (self._plan_meta, self._plan), self._other_plan = self._other_plan, (self._plan_meta, self._plan)
            else:
                self._other_plan = None if self._plan_meta is None else (self._plan_meta, self._plan)
                self._plan, self._plan_meta = self._make_plan(meta), meta
        out = torch.zeros_like(q_THD)
        if self._plan["copies"] is not None:  # copy-on-write, before any write of this layer
            src, dst = self._plan["copies"]
            self.arena[layer][dst] = self.arena[layer][src]
        if self._plan["decode"] is not None:
            self._decode(layer, q_THD, k_THD, v_THD, self._plan["decode"], scale, out)
        for start, n, ctx, st, q_old, q_new, seal_at, read_at in self._plan["prefills"]:
            out[start:start + n] = self._prefill(layer, q_THD[start:start + n], k_THD[start:start + n],
                                                 v_THD[start:start + n], ctx, st, q_old, q_new, seal_at, read_at,
                                                 scale).to(out.dtype)
        return out

    def _seal(self, layer: int, profile: str, k_nHD: torch.Tensor, v_nHD: torch.Tensor, pages_n: torch.Tensor,
              slots_n: torch.Tensor) -> None:
        """Quantize n tokens of pre-RoPE K / V ([n, H, D]) into (page, slot) = (pages_n[i], slots_n[i])."""
        if k_nHD.shape[0] == 0:
            return
        qkv = quantize_kv(k_nHD, v_nHD, self.profiles[profile].layers[layer])
        self.views[self._key[profile]][layer].write(pages_n, slots_n, qkv)

    def _prefill(self, layer, q_nHD, k_nHD, v_nHD, ctx, st: SequenceState, q_old, q_new, seal_at, read_at,
                 scale) -> torch.Tensor:
        """Write n new tokens at positions [ctx - n, ctx) of one sequence, seal, attend causally."""
        ns, s = self.sink_tokens, self.block_size
        n = q_nHD.shape[0]
        p0 = ctx - n
        sk, sv = self.stage_k[layer][st.slot], self.stage_v[layer][st.slot]  # [Ns + S, H, D]
        prof = self.profiles[st.profile].layers[layer]
        h, d = self.num_kv_heads, self.head_dim
        # sink rows
        n_sink_new = max(0, min(ns, ctx) - p0)
        if n_sink_new:
            sk[p0:p0 + n_sink_new] = k_nHD[:n_sink_new].to(sk.dtype)
            sv[p0:p0 + n_sink_new] = v_nHD[:n_sink_new].to(sv.dtype)
        # open region: quantized indices [q_old, ctx - Ns), the old unsealed tail plus the new non-sink tokens
        old_tail = max(0, p0 - ns) - q_old
        r0 = ns + q_old % s
        k_open = torch.cat([sk[r0:r0 + old_tail].float(), k_nHD[n_sink_new:].float()])  # [ctx - Ns - q_old, H, D]
        v_open = torch.cat([sv[r0:r0 + old_tail].float(), v_nHD[n_sink_new:].float()])
        n_seal = q_new - q_old
        self._seal(layer, st.profile, k_open[:n_seal], v_open[:n_seal], *seal_at)
        rest = k_open.shape[0] - n_seal
        if rest:
            r = ns + q_new % s
            sk[r:r + rest] = k_open[n_seal:].to(sk.dtype)
            sv[r:r + rest] = v_open[n_seal:].to(sv.dtype)
        # the sealed tokens dequantized and rotated: one compiled pass (no page read-back, no PyTorch dequantize),
        # else PyTorch ops
        sealed = quant_dequant_rows(self.views[self._key[st.profile]][layer], *read_at, prof, self.cos, self.sin,
                                    ns) if q_new and self._staged_kernel else None
        if sealed is None and q_new:
            qkv = self.views[self._key[st.profile]][layer].read(*read_at)
            pos = torch.arange(ns, ns + q_new, device=self.device)
            sealed = (apply_rope(dequantize_keys(qkv.k_codes, qkv.k_outliers, prof), self.cos[pos], self.sin[pos]),
                      dequantize_values(qkv.v_codes, qkv.v_scale, qkv.v_outliers, prof))
        elif sealed is None:
            sealed = (torch.zeros(0, h, d, device=self.device),) * 2
        return self._prefill_attend(q_nHD, sk, sv, k_open, v_open, sealed, ctx, p0, q_old, n_seal, scale)

    def _prefill_attend(self, q_nHD, sk, sv, k_open, v_open, sealed, ctx, p0, q_old, n_seal, scale) -> torch.Tensor:
        """`_prefill`'s attention, the sealed tokens given dequantized and rotated (keys [q_new, H, D] at positions
        Ns .., values): the sink and open rows are rotated here, and each query reads a position dequantized where
        decode would (`mixed_causal_attention`)."""
        ns, s = self.sink_tokens, self.block_size
        n_sink = min(ns, ctx)
        k_rot, v_sealed = sealed  # [q_new, H, D], positions ns ..
        pos = torch.cat([torch.arange(n_sink), torch.arange(ns + q_old, ctx)])
        fp = apply_rope(torch.cat([sk[:n_sink].float(), k_open]), self.cos[pos], self.sin[pos])
        v_sink = sv[:n_sink].float()
        k_fp = torch.cat([fp[:n_sink], k_rot[:q_old], fp[n_sink:]])  # q_old tokens have no full-precision copy left
        v_fp = torch.cat([v_sink, v_sealed[:q_old], v_open])
        k_dq = torch.cat([fp[:n_sink], k_rot, fp[n_sink + n_seal:]])
        v_dq = torch.cat([v_sink, v_sealed, v_open[n_seal:]])
        q_pos = torch.arange(p0, ctx, device=self.device)
        quant_hi = ns + torch.clamp((q_pos + 1 - ns).clamp(min=0) // s * s, min=q_old)
        return mixed_causal_attention(q_nHD, k_fp, v_fp, k_dq, v_dq, q_pos, ns, quant_hi, scale)
