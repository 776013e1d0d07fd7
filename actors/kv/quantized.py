"""Sub-4-bit, outlier-aware, non-uniform paged KV cache (KVQuant, arXiv 2401.18079) behind `KVCache`.

Where a sequence's tokens live (one layer; Ns = sink tokens, S = block_size, p = position, q = the sequence's
quantized token count):
  * p < Ns (attention sink: KVQuant keeps the first token in fp16; StreamingLLM, arXiv 2309.17453): full
    precision, in the sequence's staging slot, rows [0, Ns);
  * quantized token t = p - Ns < q lives in the shared page pool (below) at page `page_table[t // T]`, slot
    t % T, where T = tokens per page of the sequence's width (packed codes + per-token V scale + dense
    outlier channels; keys stored pre-RoPE, per channel, with one width or per-channel widths, whose key
    row of Pk bytes differs from the value row: the page layout is keyed by (bits, Ok, Ov, Pk));
  * tokens t >= q (the unsealed tail, all in the logical block being filled) stay full precision in the
    staging slot, row Ns + t % S. When a token completes its logical block (t % S == S - 1) the tail is
    sealed: quantized in one pass with the sequence's profile and appended to its pages.
Normally q = S * floor((L - Ns) / S) for a sequence of L tokens; after `truncate` into a sealed block q is
the cut (see `truncate`). Order within one step: write the new tokens, seal the blocks they fill, then attend.
A query at position p sees key j quantized iff Ns <= j < Ns + max(q_before_step, S * ((p + 1 - Ns) // S)),
on the decode path (paged kernel) and the prefill path (dense, masked) alike, so teacher-forced prefill logits
equal token-by-token decode logits.

Mixed bit widths, one byte pool (sub-page allocation, actors/kv/pool.py). Every layer has one uint8 arena of
`num_pages` equal pages; page p is the same byte range in every layer's arena. A page holds T_b tokens of
one width b (T_b = page bytes // bytes per token: 13 / 9 / 7 tokens at 2 / 3 / 4 bits for tiny-moe's 3968-byte
pages), laid
out as a `KVPages` block [v_scale | k_outliers | v_outliers (fp16) | k_codes | v_codes (uint8)], so each
width's `KVPages` is a set of strided views of the same arena (block stride = page bytes). Any free page
serves any width; finishing returns whole pages; the only waste is page slack and each sequence's unfilled
last page (measured below 5% on the issue's workload, tests/actors/test_kv_quant_pool.py). Blocks of S
tokens at different widths would differ in bytes; storing them as slabs in fixed pages was measured at
29-44% waste (kv_pool docstring), hence pages sized in tokens per width.

Two levels of blocks:
  * logical blocks: the ids the scheduler allocates from `self.allocator` (one per S positions, as for any
    `KVCache`); they name a sequence (its first block id) and bound its length. They hold no data.
  * pages: physical storage, one page table per sequence (`SequencePageTables`), filled as blocks seal.
`allocator.num_free` is byte-aware: the logical blocks that still fit the page pool if each new one holds S
tokens at the widest width, after what the known sequences' blocks will claim, so the unchanged scheduler
admits more 2-bit than 4-bit sequences and never over-commits the pool.

Decode runs the kernel once per profile present in the batch (so at least once per bit width): BITS, the
page's token count and the codebooks are compile-time or per-launch constants of the kernel; per-sequence
widths inside one launch would need per-program code paths and were not worth it for at most a few groups.

Copy-on-write `fork`, `truncate`, and finish / cancel: a sequence is identified by its first logical block;
its staging slot, profile and page references are released when that block is freed (finish, abort,
preemption): the allocator calls back into the cache. Pages are reference counted, so each returns to the
free list exactly once.

Shape legend: T = tokens in the step, B = decode sequences, Hq = query heads, H = KV heads, D = head_dim,
S = block_size, Ns = sink tokens, NP = pool pages, Tp = tokens per page of one width, M = max pages per
sequence, C = context length of one prefill sequence, n = its new tokens, R = staging slots.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.kv.paged import BlockAllocator, KVCache
from actors.kv.pool import MixedWidthPagePool, SequencePageTables, choose_page_bytes
from actors.kv.profiles import AUTO, ModelKVProfile, choose_profile
from kernels.kv_pack import packed_bytes
from kernels.kv_pages import KVPages
from kernels.kv_quant import dequantize_keys, dequantize_values, quantize_kv
from kernels.rope import apply_rope, rope_tables

_PAGE_ALIGN = 16  # bytes; keeps every fp16 field of a page 2-byte aligned and rows friendly to vector loads


class _SequenceAllocator(BlockAllocator):
    """Logical-block allocator: tells the cache when a block returns, and caps `num_free` by the page pool.

    It also counts allocation bursts (runs of `allocate` between two reads of `num_free`): the scheduler
    checks `num_free` before it hands one sequence its blocks, so a burst is one sequence, and the cache
    reserves one rounding page per burst until the step's plan tells it whose blocks they are.
    """

    def __init__(self, num_blocks: int, on_release, budget):
        super().__init__(num_blocks)
        self._on_release = on_release
        self._budget = budget
        self.bursts = 0
        self._queried = True

    def allocate(self) -> int:
        b = super().allocate()
        if self._queried:
            self.bursts += 1
            self._queried = False
        return b

    def free(self, block: int) -> None:
        super().free(block)
        if self._ref[block] == 0:
            self._on_release(block)

    @property
    def num_ids_free(self) -> int:
        """Free logical block ids, whatever the pool holds."""
        return len(self._free)

    @property
    def num_free(self) -> int:
        """Logical blocks that can be handed out now without over-committing the page pool."""
        self._queried = True
        return min(len(self._free), self._budget())


@dataclass(slots=True)
class _SeqState:
    slot: int  # staging slot
    profile: str
    length: int = 0  # tokens written (layer 0 view, updated once per step)
    nblocks: int = 0  # logical blocks known to belong to the sequence (for the pool budget)


def layout_key(profile: ModelKVProfile) -> tuple[int, int, int, int]:
    """(bits, Ok, Ov, Pk): profiles with equal keys share one page layout (H and D are fixed per cache).
    Pk (key row bytes) differs from the value row's with per-channel key widths (`KVQuantProfile.k_bits`)."""
    bits, _, _, ok, ov = profile.layout()
    return bits, ok, ov, profile.layers[0].k_packed_bytes


def _arena_views(arena: torch.Tensor, key: tuple[int, int, int, int], tokens: int, h: int, d: int) -> KVPages:
    """`KVPages` of one width over arena [NP, page bytes] uint8: strided views, no copy (layout in module doc)."""
    bits, ok, ov, pk = key
    npg, pb = arena.shape
    p = packed_bytes(d, bits)
    f16 = arena.view(torch.float16)  # [NP, pb / 2]
    o = 0
    fields = {}
    for name, n, shape in (("v_scale", tokens * h, (tokens, h)), ("k_outliers", tokens * h * ok, (tokens, h, ok)),
                           ("v_outliers", tokens * h * ov, (tokens, h, ov))):
        fields[name] = f16[:, o:o + n].view(npg, *shape)
        o += n
    o *= 2
    for name, row in (("k_codes", pk), ("v_codes", p)):
        n = h * tokens * row
        fields[name] = arena[:, o:o + n].view(npg, h, tokens, row)
        o += n
    assert o <= pb, (o, pb)  # tokens_per_page guarantees it
    return KVPages(**fields)


def _rope_rows(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with a position per (sequence, row): x [B, S, H, D], cos/sin [B, S, D] -> fp32."""
    x = x_BSHD.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos_BSD[..., None, :] + rot * sin_BSD[..., None, :]


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


class QuantizedPagedKVCache(KVCache):
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
        backend: "torch" (paged_decode_attention_ref) or "triton" (paged_decode_attention_triton).
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
        if page_bytes < 1 or page_bytes % (num_layers * _PAGE_ALIGN):
            raise ValueError(f"page_bytes={page_bytes} must be a positive multiple of num_layers * {_PAGE_ALIGN} "
                             f"= {num_layers * _PAGE_ALIGN}")
        bpt = {self._key[n]: p.layers[0].bytes_per_token() * num_layers for n, p in self.profiles.items()}
        self.page_bytes, self.layer_page_bytes = page_bytes, page_bytes // num_layers
        t_min = min(page_bytes // b for b in bpt.values())
        if num_pages is None:
            num_pages = -(-num_blocks * block_size // max(t_min, 1)) + 2
        self.pool = MixedWidthPagePool(bpt, page_bytes, num_pages)  # ValueError if a token exceeds a page
        self.num_pages = num_pages
        self.tables = SequencePageTables(self.pool)
        self.tokens_per_page = {k: self.pool.tokens_per_page(k) for k in bpt}
        self.arena = [torch.zeros(num_pages, self.layer_page_bytes, dtype=torch.uint8, device=device)
                      for _ in range(num_layers)]
        self.views = {k: [_arena_views(a, k, t, num_kv_heads, head_dim) for a in self.arena]
                      for k, t in self.tokens_per_page.items()}
        rows = sink_tokens + block_size
        h, d = num_kv_heads, head_dim
        self.stage_k = [torch.zeros(max_sequences, rows, h, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.stage_v = [torch.zeros(max_sequences, rows, h, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.cos, self.sin = rope_tables(max_positions, head_dim, base=rope_theta, device=device)
        self.allocator = _SequenceAllocator(num_blocks, self._release, self._budget_free_blocks)
        self._free_slots = list(range(max_sequences - 1, -1, -1))
        self._seqs: dict[int, _SeqState] = {}  # first block id -> state
        self._bound: dict[int, str] = {}  # first block id -> profile chosen before its first step
        self._plan_meta = None
        self._plan = None
        self._committed: tuple[int, int] | None = None  # (outstanding pages, known blocks), see _budget_free_blocks
        if backend == "triton":
            from kernels.paged_attention_triton import paged_decode_attention_triton as attn
        else:
            from kernels.paged_attention import paged_decode_attention_ref as attn
        self._decode_attention = attn

    # ------------------------------------------------------------------ sizes and accounting
    @staticmethod
    def bytes_per_block_for(profile: ModelKVProfile, block_size: int) -> int:
        """Bytes of S quantized tokens of `profile` (all layers): codes, V scales, outlier values."""
        return block_size * sum(p.bytes_per_token() for p in profile.layers)

    @staticmethod
    def staging_bytes_for(num_layers: int, max_sequences: int, sink_tokens: int, block_size: int,
                          num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of the full-precision staging rows (sink + unsealed tail) of `max_sequences` slots."""
        item = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * max_sequences * (sink_tokens + block_size) * num_kv_heads * head_dim * item

    @staticmethod
    def pool_page_bytes(profiles: Iterable[ModelKVProfile], block_size: int, *,
                        mean_live_tokens: float = 400.0) -> int:
        """Bytes of one pool page over all layers for these profiles (kv_pool.choose_page_bytes per layer).

        The per-layer page lies in [largest token, S largest tokens] (so a page never costs more than one
        logical block at the widest width) and minimises page slack plus half a page of tokens per sequence
        of `mean_live_tokens` tokens. Raises: ValueError if profiles is empty.
        """
        profiles = list(profiles)
        if not profiles:
            raise ValueError("profiles is empty")
        per_layer = {layout_key(p): p.layers[0].bytes_per_token() for p in profiles}
        top = max(per_layer.values())
        start = -(-top // _PAGE_ALIGN) * _PAGE_ALIGN
        hi = max(start, block_size * top // _PAGE_ALIGN * _PAGE_ALIGN)
        pb = choose_page_bytes(per_layer, lo=start, hi=hi, step=_PAGE_ALIGN, mean_live_tokens=mean_live_tokens)
        return pb * profiles[0].num_layers

    @classmethod
    def max_concurrent_sequences(cls, budget_bytes: int, seq_len: int,
                                 profile: ModelKVProfile | Sequence[ModelKVProfile], *, block_size: int = 16,
                                 sink_tokens: int = 1, dtype: torch.dtype = torch.float16, num_profiles: int = 1,
                                 page_bytes: int | None = None) -> int:
        """How many sequences of `seq_len` tokens fit a KV budget of `budget_bytes` bytes.

        `profile` is one profile, or a list whose profiles the sequences take in turn (a 2/3/4-bit mix).
        Each sequence costs the pages of its seq_len - Ns quantized tokens plus one page of headroom (the
        allocator's reserve for a sequence in flight) and one staging slot; the profiles' tensors are paid
        once (`num_profiles` times for a single profile, each listed profile once for a list). `page_bytes`
        defaults to `pool_page_bytes` of the profiles. Raises: ValueError if seq_len < 1 or budget_bytes < 0.
        """
        if seq_len < 1 or budget_bytes < 0:
            raise ValueError(f"seq_len={seq_len} must be >= 1 and budget_bytes={budget_bytes} >= 0")
        single = isinstance(profile, ModelKVProfile)
        profs = [profile] if single else list(profile)
        if page_bytes is None:
            page_bytes = cls.pool_page_bytes(profs, block_size)
        p0 = profs[0].layers[0]
        staging = cls.staging_bytes_for(profs[0].num_layers, 1, sink_tokens, block_size, p0.num_kv_heads,
                                        p0.head_dim, dtype)
        quant = max(0, seq_len - sink_tokens)
        costs = []
        for p in profs:
            per_page = page_bytes // sum(lp.bytes_per_token() for lp in p.layers)
            costs.append((-(-quant // per_page) + 1) * page_bytes + staging)
        fixed = num_profiles * profile.nbytes() if single else sum(p.nbytes() for p in {id(p): p for p in profs}.values())
        left = budget_bytes - fixed
        if left <= 0:
            return 0
        cycle = sum(costs)
        n = (left // cycle) * len(costs)
        left -= (left // cycle) * cycle
        for c in costs:
            if c > left:
                break
            left -= c
            n += 1
        return n

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one logical block (S tokens) at the widest profile."""
        return max(self.bytes_per_block_for(p, self.block_size) for p in self.profiles.values())

    def _budget_free_blocks(self) -> int:
        """Logical blocks admissible now: free pages after what the live sequences' blocks will claim.

        A known sequence with nb logical blocks at width w will hold at most ceil(nb * S / T_w) pages (+1 when
        its next write copies a shared page). Blocks handed out but not yet seen in a step (unknown owner and
        width) are charged at the widest width, plus one rounding page per allocation burst (one sequence
        each, see `_SequenceAllocator`), and one more page is kept for the sequence about to receive blocks.
        A caller that hands several sequences their blocks without reading `num_free` in between may
        over-commit by a page per extra sequence (MemoryError at the seal, never corruption).
        """
        s = self.block_size
        t_min = min(self.tokens_per_page.values())
        if self._committed is None:  # recomputed after any change of a sequence (plan, fork, truncate, release)
            outstanding = known = 0
            for first, st in self._seqs.items():
                t = self.tokens_per_page[self._key[st.profile]]
                need = -(-st.nblocks * s // t) + (1 if self.tables.last_page_shared(first) else 0)
                outstanding += max(0, need - len(self.tables.pages(first)))
                known += st.nblocks
            self._committed = (outstanding, known)
        outstanding, known = self._committed
        unknown = max(0, self.allocator.num_used - known)
        rounding = min(unknown, max(self.allocator.bursts, 1))
        pages = self.pool.num_free - outstanding - -(-unknown * s // t_min) - rounding - 1
        return max(0, pages) * t_min // s

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
        arena = self.num_pages * self.page_bytes
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
                "kv_tokens_per_page": {k[0]: t for k, t in sorted(self.tokens_per_page.items(), reverse=True)},
                "kv_sequences": len(self._seqs), "kv_staging_slots_free": len(self._free_slots)}

    # ------------------------------------------------------------------ sequences and profiles
    def profile_names(self) -> list[str]:
        return sorted(self.profiles)

    def choose_profile(self, requested: str | None, text: str | None = None) -> str:
        """Resolve a request's profile name (or "auto" via the prompt text). Raises ValueError if unknown."""
        return choose_profile(requested, list(self.profiles), self.default_profile, text)

    def bind(self, first_block: int, profile: str) -> None:
        """Use `profile` for the sequence whose block table starts with `first_block` (call before its prefill).

        Raises: ValueError if the profile is not loaded.
        """
        if profile not in self.profiles:
            raise ValueError(f"profile={profile!r} is not one of {sorted(self.profiles)}")
        st = self._seqs.get(first_block)
        if st is not None and st.length == 0:
            st.profile = profile
            self.tables.release(first_block)
            self.tables.add(first_block, self._key[profile])
            self._committed = None
        elif st is None:
            self._bound[first_block] = profile

    def _release(self, block: int) -> None:
        self._bound.pop(block, None)
        st = self._seqs.pop(block, None)
        if st is not None:
            self._committed = None
            self.tables.release(block)
            self._free_slots.append(st.slot)

    def _new_state(self, first_block: int, profile: str) -> _SeqState:
        if not self._free_slots:
            raise MemoryError(f"all max_sequences={self.max_sequences} staging slots are in use")
        st = self._seqs[first_block] = _SeqState(slot=self._free_slots.pop(), profile=profile)
        self.tables.add(first_block, self._key[profile])
        self._committed = None
        return st

    def _state(self, first_block: int) -> _SeqState:
        st = self._seqs.get(first_block)
        if st is None:
            name = self._bound.pop(first_block, None) or choose_profile(None, list(self.profiles),
                                                                        self.default_profile)
            st = self._new_state(first_block, name)
        return st

    def fork(self, src_seq: int, dst_seq: int) -> None:
        """Copy-on-write fork: sequence `dst_seq` (a first logical block) continues from `src_seq`.

        The child shares every sealed quantized page of the parent by reference count and gets a copy of the
        parent's full-precision staging rows (sink and unsealed tail) in a slot of its own; it keeps the
        parent's profile and length. A later seal into a page still shared copies the page first, so neither
        side ever sees the other's new tokens. The caller owns the child's logical blocks: it must hold
        ceil(length / S) of them, the first being `dst_seq`, and free them as for any sequence.

        Raises:
            ValueError: `src_seq` is not a live sequence, or `dst_seq` already holds tokens or equals src_seq.
            MemoryError: no free staging slot.
        """
        st = self._seqs.get(src_seq)
        if st is None:
            raise ValueError(f"src_seq={src_seq} is not a live sequence of this cache")
        old = self._seqs.get(dst_seq)
        if dst_seq == src_seq or (old is not None and old.length > 0):
            raise ValueError(f"dst_seq={dst_seq} already holds tokens (or is src_seq)")
        if old is not None:
            self._release(dst_seq)
        self._bound.pop(dst_seq, None)
        if not self._free_slots:
            raise MemoryError(f"all max_sequences={self.max_sequences} staging slots are in use")
        new = _SeqState(slot=self._free_slots.pop(), profile=st.profile, length=st.length,
                        nblocks=-(-st.length // self.block_size))
        self._seqs[dst_seq] = new
        self.tables.fork(src_seq, dst_seq)
        self._plan_meta, self._committed = None, None
        for sk, sv in zip(self.stage_k, self.stage_v):
            sk[new.slot] = sk[st.slot]
            sv[new.slot] = sv[st.slot]

    def truncate(self, seq: int, num_tokens: int) -> int:
        """Cut sequence `seq` (first logical block) back to its first `num_tokens` tokens.

        Quantized part: pages past the cut lose this sequence's reference (shared pages stay with their other
        holders). A cut inside a sealed block keeps that block's kept tokens SEALED and masks the rest (q
        becomes the cut) rather than dequantizing them back to staging: dequantized values would not requantize
        to the same codes (the per-token V scale moves), whereas kept-and-masked tokens are exactly what a
        never-truncated sequence holds once the block is complete again (quantization is per token). So after
        re-extending past that block's end, the sequence equals one built to the same tokens directly; before,
        the kept tokens of that one block are seen quantized where a fresh sequence would see full precision.
        Full-precision part: a cut in the unsealed tail or the sink just shortens it.

        Returns: logical blocks the caller keeps (ceil(num_tokens / S)); it frees the rest of its block table
            itself (keep >= 1: the first block names the sequence).
        Raises: ValueError if `seq` is not live or num_tokens is outside [0, length].
        """
        st = self._seqs.get(seq)
        if st is None:
            raise ValueError(f"seq={seq} is not a live sequence of this cache")
        if not 0 <= num_tokens <= st.length:
            raise ValueError(f"num_tokens={num_tokens} must be in [0, length={st.length}]")
        self.tables.truncate(seq, max(0, num_tokens - self.sink_tokens))
        st.length = num_tokens
        keep = -(-num_tokens // self.block_size)
        st.nblocks = min(st.nblocks, max(keep, 1))
        self._plan_meta, self._committed = None, None  # a cached plan no longer describes the sequence
        return keep

    # ------------------------------------------------------------------ the step plan (once per step)
    def _make_plan(self, meta) -> dict:
        """Bookkeeping of one step, shared by every layer: rows, seals, page placement, copy-on-write copies."""
        ns, s, dev = self.sink_tokens, self.block_size, self.device
        copies: list[tuple[int, int]] = []
        dec = []
        seals: dict[str, tuple[list, list, list, list]] = {}  # profile -> (slots, rows, pages, page slots)
        for b in range(meta.decode_tokens.numel()):
            first = int(meta.decode_block_tables[b, 0])
            st = self._state(first)
            length = int(meta.decode_context_lens[b])
            p = length - 1
            q = self.tables.tokens(first)
            if p < ns + q and (p >= ns or q):
                raise ValueError(f"decode at position {p} of sequence {first}, which holds {q} sealed tokens")
            st.length = length
            st.nblocks = max(st.nblocks, -(-length // s))
            row = p if p < ns else ns + (p - ns) % s
            if p >= ns and (p - ns) % s == s - 1:
                n_seal = p - ns + 1 - q
                pages, pslots, cp = self.tables.append(first, n_seal)
                copies += cp
                g = seals.setdefault(st.profile, ([], [], [], []))
                g[0].extend([st.slot] * n_seal)
                g[1].extend(range(ns + q % s, ns + q % s + n_seal))
                g[2].extend(pages)
                g[3].extend(pslots)
                q += n_seal
            dec.append((b, st, length, row, q, first))
        plan: dict = {"prefills": [], "decode": None}
        if dec:
            b_idx = [x[0] for x in dec]
            sealed = torch.tensor([x[4] for x in dec], dtype=torch.int64)
            lengths = torch.tensor([x[2] for x in dec], dtype=torch.int64)
            sink_lens = lengths.clamp(max=ns)
            tail_lens = lengths - sink_lens - sealed
            ar = torch.arange(s)[None, :]
            tail_rows = (ns + sealed % s)[:, None] + ar  # [B, S]; rows past tail_lens are masked
            tail_rows = tail_rows.clamp(max=ns + s - 1)
            tail_pos = ((sink_lens + sealed)[:, None] + ar).clamp(max=self.cos.shape[0] - 1)
            ptabs = [self.tables.pages(x[5]) for x in dec]
            m = max(1, max(len(t) for t in ptabs))
            ptab = torch.zeros(len(dec), m, dtype=torch.int32)
            for i, t in enumerate(ptabs):
                ptab[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            groups: dict[str, list[int]] = {}
            for i, x in enumerate(dec):
                groups.setdefault(x[1].profile, []).append(i)
            tail_pos = tail_pos.to(dev)
            plan["decode"] = {
                "tok": meta.decode_tokens.to(dev)[b_idx],
                "slot": torch.tensor([x[1].slot for x in dec], device=dev),
                "row": torch.tensor([x[3] for x in dec], device=dev),
                "page_tables": ptab.to(dev),
                "context_lens": sealed.to(dev, torch.int32),
                "sink_lens": sink_lens.to(dev, torch.int32),
                "tail_lens": tail_lens.to(dev, torch.int32),
                "tail_rows": tail_rows.to(dev),
                "tail_cos": self.cos[tail_pos], "tail_sin": self.sin[tail_pos],
                "groups": {n: torch.tensor(ix, device=dev) for n, ix in groups.items()},
                "seals": {n: tuple(torch.tensor(v, dtype=torch.int64, device=dev) for v in g)
                          for n, g in seals.items()},
            }
        for start, n, ctx, table in meta.prefills:
            first = int(table[0])
            st = self._state(first)
            p0 = ctx - n
            if p0 != st.length:
                raise ValueError(f"prefill of sequence {first} starts at position {p0}; it holds {st.length} tokens")
            q_old = self.tables.tokens(first)
            q_new = max(q_old, (ctx - ns) // s * s) if ctx > ns else 0
            st.length = ctx
            st.nblocks = max(st.nblocks, int(table.numel()))
            pages, pslots, cp = self.tables.append(first, q_new - q_old)
            copies += cp
            rp, rs = self.tables.locate(first, 0, q_new)
            i64 = dict(dtype=torch.int64, device=dev)
            plan["prefills"].append((start, n, ctx, st, q_old, q_new,
                                     (torch.tensor(pages, **i64), torch.tensor(pslots, **i64)),
                                     (torch.tensor(rp, **i64), torch.tensor(rs, **i64))))
        self.allocator.bursts, self.allocator._queried = 0, True  # every block handed out has a known owner
        self._committed = None
        plan["copies"] = (torch.tensor([c[0] for c in copies], dtype=torch.int64, device=dev),
                          torch.tensor([c[1] for c in copies], dtype=torch.int64, device=dev)) if copies else None
        return plan

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
        if meta is not self._plan_meta:
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

    def _decode(self, layer, q_THD, k_THD, v_THD, plan, scale, out) -> None:
        ns = self.sink_tokens
        sk, sv = self.stage_k[layer], self.stage_v[layer]
        tok, slot = plan["tok"], plan["slot"]
        sk[slot, plan["row"]] = k_THD[tok].to(sk.dtype)
        sv[slot, plan["row"]] = v_THD[tok].to(sv.dtype)
        for name, (slots, rows, pages, pslots) in plan["seals"].items():
            self._seal(layer, name, sk[slots, rows], sv[slots, rows], pages, pslots)
        rows = plan["tail_rows"]
        tail_k = _rope_rows(sk[slot[:, None], rows], plan["tail_cos"], plan["tail_sin"])  # [B, S, H, D]
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

    def _seal(self, layer: int, profile: str, k_nHD: torch.Tensor, v_nHD: torch.Tensor, pages_n: torch.Tensor,
              slots_n: torch.Tensor) -> None:
        """Quantize n tokens of pre-RoPE K / V ([n, H, D]) into (page, slot) = (pages_n[i], slots_n[i])."""
        if k_nHD.shape[0] == 0:
            return
        qkv = quantize_kv(k_nHD, v_nHD, self.profiles[profile].layers[layer])
        self.views[self._key[profile]][layer].write(pages_n, slots_n, qkv)

    def _prefill(self, layer, q_nHD, k_nHD, v_nHD, ctx, st: _SeqState, q_old, q_new, seal_at, read_at,
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
        # keys/values of all ctx positions, pre-RoPE, in full precision where still available and dequantized
        # where sealed
        if q_new:
            qkv = self.views[self._key[st.profile]][layer].read(*read_at)
            k_dq_sealed = dequantize_keys(qkv.k_codes, qkv.k_outliers, prof)
            v_dq_sealed = dequantize_values(qkv.v_codes, qkv.v_scale, qkv.v_outliers, prof)
        else:
            k_dq_sealed = v_dq_sealed = torch.zeros(0, h, d, device=self.device)
        n_sink = min(ns, ctx)
        k_sink, v_sink = sk[:n_sink].float(), sv[:n_sink].float()
        k_fp = torch.cat([k_sink, k_dq_sealed[:q_old], k_open])  # q_old tokens have no full-precision copy left
        v_fp = torch.cat([v_sink, v_dq_sealed[:q_old], v_open])
        k_dq = torch.cat([k_sink, k_dq_sealed, k_open[n_seal:]])
        v_dq = torch.cat([v_sink, v_dq_sealed, v_open[n_seal:]])
        pos = torch.arange(ctx, device=self.device)
        cos, sin = self.cos[pos], self.sin[pos]
        q_pos = torch.arange(p0, ctx, device=self.device)
        quant_hi = ns + torch.clamp((q_pos + 1 - ns).clamp(min=0) // s * s, min=q_old)
        return mixed_causal_attention(q_nHD, apply_rope(k_fp, cos, sin), v_fp, apply_rope(k_dq, cos, sin), v_dq,
                                      q_pos, ns, quant_hi, scale)


def build_engine_kv_cache(cfg, mc, *, device: torch.device | str = "cpu") -> QuantizedPagedKVCache:
    """The quantized cache for a RankEngine: profiles from `cfg.kv_profile`, pages from `cfg.kv_cache_bytes`.

    Args:
        cfg: EngineConfig (kv_bits, kv_extra_bits, kv_profile, kv_cache_bytes, block_size, max_num_seqs, max_model_len,
            kernel_backend, dtype). mc: ModelConfig.
    Raises:
        ValueError: no matching profile (see actors.kv.profiles.load_profiles), or the budget cannot hold the
            profiles, the staging slots and one max_model_len sequence at the widest width.
    """
    from actors.kv.profiles import RECOMMENDED_SINK_TOKENS, load_served_profiles

    profiles, default = load_served_profiles(cfg.model, cfg.kv_bits, cfg.kv_profile, cfg.kv_extra_bits, device)
    sink = RECOMMENDED_SINK_TOKENS  # what the shipped profiles were chosen with (bench/kv_quality.py)
    slots = cfg.max_num_seqs + 1  # +1: RankEngine.prompt_logits runs outside the scheduler
    fixed = QuantizedPagedKVCache.staging_bytes_for(mc.num_layers, slots, sink, cfg.block_size, mc.num_kv_heads,
                                                    mc.head_dim, cfg.torch_dtype)
    fixed += sum(p.nbytes() for p in profiles.values())
    page = QuantizedPagedKVCache.pool_page_bytes(profiles.values(), cfg.block_size)
    num_pages = max(0, cfg.kv_cache_bytes - fixed) // page
    per_page = [page // QuantizedPagedKVCache.bytes_per_block_for(p, 1) for p in profiles.values()]
    t_min, t_max = min(per_page), max(per_page)
    need_blocks = math.ceil(cfg.max_model_len / cfg.block_size)
    # the allocator's charge for one sequence in flight (see QuantizedPagedKVCache._budget_free_blocks)
    need = -(-need_blocks * cfg.block_size // t_min) + 2
    if num_pages < need:
        raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} holds {num_pages} pages of {page} bytes after "
                         f"{fixed} bytes of staging and profiles; one max_model_len={cfg.max_model_len} sequence "
                         f"needs {need}")
    return QuantizedPagedKVCache(
        num_layers=mc.num_layers, num_blocks=max(need_blocks, num_pages * t_max // cfg.block_size),
        block_size=cfg.block_size, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, profiles=profiles,
        default_profile=default, max_sequences=slots, sink_tokens=sink, rope_theta=mc.rope_theta,
        max_positions=cfg.max_model_len, dtype=cfg.torch_dtype, device=device, backend=cfg.kernel_backend,
        page_bytes=page, num_pages=num_pages)
