"""Sub-4-bit, outlier-aware, non-uniform paged KV cache (KVQuant, arXiv 2401.18079) behind `KVCache`.

Where a sequence's tokens live (one layer; Ns = sink tokens, S = block_size, p = position):
  * p < Ns (attention sink: KVQuant keeps the first token in fp16; StreamingLLM, arXiv 2309.17453): full
    precision, in the sequence's staging slot, rows [0, Ns);
  * quantized token t = p - Ns lives in block `block_table[t // S]` at slot t % S of the layer's `KVPages`
    (packed codes + per-token V scale + dense outlier channels; keys stored pre-RoPE, per channel);
  * the block being filled (t // S == number of sealed blocks) stays full precision in the staging slot,
    rows [Ns, Ns + S). When its last token arrives the block is sealed: quantized in one pass with the
    sequence's profile and written into its page. The scheduler's block table (one block per S positions)
    always has room, since ceil((L - Ns) / S) <= ceil(L / S).
Order within one step: write the new tokens, seal the blocks they fill, then attend. A query at position p
therefore sees key j quantized iff Ns <= j < Ns + S * ((p + 1 - Ns) // S), on the decode path (paged kernel)
and on the prefill path (dense, masked) alike, so teacher-forced prefill logits equal token-by-token
decode logits.

A sequence is identified by its first block id (unique while it lives). Its staging slot and profile are
released when that block is freed (finish, abort, preemption): the allocator calls back into the cache.

Sequences in one batch may use different profiles (e.g. prose and code) as long as the profiles share a
layout (bits, outlier counts); decode runs the kernel once per profile group.

Shape legend: T = tokens in the step, B = decode sequences, Hq = query heads, H = KV heads, D = head_dim,
S = block_size, Ns = sink tokens, NB = blocks, M = max blocks per sequence, C = context length of one
prefill sequence, n = its new tokens, R = staging slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.kv_cache import BlockAllocator, KVCache
from actors.kv_profiles import AUTO, ModelKVProfile, choose_profile
from kernels.kv_quant import KVPages, dequantize_keys, dequantize_values, quantize_kv
from kernels.paged_attention import apply_rope, rope_tables



class _SequenceAllocator(BlockAllocator):
    """BlockAllocator that tells the cache when a block returns to the free list."""

    def __init__(self, num_blocks: int, on_release):
        super().__init__(num_blocks)
        self._on_release = on_release

    def free(self, block: int) -> None:
        super().free(block)
        if self._ref[block] == 0:
            self._on_release(block)


@dataclass(slots=True)
class _SeqState:
    slot: int  # staging slot
    profile: str
    length: int = 0  # tokens written (layer 0 view, updated once per step)


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
    o = F.scaled_dot_product_attention(q_nHD.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=k.shape[0] != q_nHD.shape[1])
    return o.transpose(0, 1)


class QuantizedPagedKVCache(KVCache):
    """Paged KV cache with sub-4-bit quantized blocks, a full-precision sink and an unsealed tail.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: pool geometry (block = S tokens, all
            layers).
        profiles: {name: ModelKVProfile}, all with the same layout (bits, H, D, Ok, Ov) and num_layers.
        default_profile: name used when a sequence was not bound to a profile, or "auto".
        max_sequences: staging slots (sequences alive at once), >= 1.
        sink_tokens: Ns full-precision leading tokens per sequence, >= 0.
        rope_theta, max_positions: RoPE base and table length (keys are rotated after dequantization).
        dtype: storage dtype of the full-precision staging rows. device: torch device.
        backend: "torch" (paged_decode_attention_ref) or "triton" (paged_decode_attention_triton).
    Raises:
        ValueError: naming the argument and its limit (no profiles, layout mismatch, layer count mismatch,
            bad sizes, unknown backend or default profile).
        MemoryError: (in attend) more live sequences than staging slots.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 profiles: dict[str, ModelKVProfile], default_profile: str = AUTO, max_sequences: int = 64,
                 sink_tokens: int = 1, rope_theta: float = 10000.0, max_positions: int = 1024,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", backend: str = "torch"):
        if not profiles:
            raise ValueError("profiles is empty; need at least one calibrated KV profile")
        layouts = {p.layout() for p in profiles.values()}
        if len(layouts) != 1:
            raise ValueError(f"profiles disagree on (bits, H, D, Ok, Ov): {sorted(layouts)}")
        bits, h, d, _, _ = layouts.pop()
        if (h, d) != (num_kv_heads, head_dim):
            raise ValueError(f"profiles have (H, D)={(h, d)}; the model has ({num_kv_heads}, {head_dim})")
        for name, p in profiles.items():
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
        self.num_kv_heads, self.head_dim, self.bits = num_kv_heads, head_dim, bits
        self.sink_tokens, self.backend, self.device, self.dtype = sink_tokens, backend, device, dtype
        self.profiles = {n: p.to(device) for n, p in profiles.items()}
        self.default_profile = default_profile
        self.max_sequences = max_sequences
        any_profile = next(iter(self.profiles.values()))
        self.pages = [KVPages.empty(any_profile.layers[l], num_blocks, block_size, device) for l in range(num_layers)]
        rows = sink_tokens + block_size
        self.stage_k = [torch.zeros(max_sequences, rows, h, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.stage_v = [torch.zeros(max_sequences, rows, h, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.cos, self.sin = rope_tables(max_positions, head_dim, base=rope_theta, device=device)
        self.allocator = _SequenceAllocator(num_blocks, self._release)
        self._free_slots = list(range(max_sequences - 1, -1, -1))
        self._seqs: dict[int, _SeqState] = {}  # first block id -> state
        self._bound: dict[int, str] = {}  # first block id -> profile chosen before its first step
        self._plan_meta = None
        self._plan = None
        if backend == "triton":
            from kernels.paged_attention import paged_decode_attention_triton as attn
        else:
            from kernels.paged_attention import paged_decode_attention_ref as attn
        self._decode_attention = attn

    # ------------------------------------------------------------------ sizes and accounting
    @staticmethod
    def bytes_per_block_for(profile: ModelKVProfile, block_size: int) -> int:
        """Bytes of one quantized block (S tokens, every layer): codes, V scales, outlier values."""
        return block_size * sum(p.bytes_per_token() for p in profile.layers)

    @staticmethod
    def staging_bytes_for(num_layers: int, max_sequences: int, sink_tokens: int, block_size: int,
                          num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of the full-precision staging rows (sink + unsealed tail) of `max_sequences` slots."""
        item = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * max_sequences * (sink_tokens + block_size) * num_kv_heads * head_dim * item

    @classmethod
    def max_concurrent_sequences(cls, budget_bytes: int, seq_len: int, profile: ModelKVProfile, *,
                                 block_size: int = 16, sink_tokens: int = 1, dtype: torch.dtype = torch.float16,
                                 num_profiles: int = 1) -> int:
        """How many sequences of `seq_len` tokens fit a KV budget of `budget_bytes` bytes.

        Each sequence costs ceil(seq_len / S) quantized blocks plus one staging slot; the profiles' tensors
        are paid once. Raises: ValueError if seq_len < 1 or budget_bytes < 0.
        """
        if seq_len < 1 or budget_bytes < 0:
            raise ValueError(f"seq_len={seq_len} must be >= 1 and budget_bytes={budget_bytes} >= 0")
        p0 = profile.layers[0]
        per_seq = -(-seq_len // block_size) * cls.bytes_per_block_for(profile, block_size) + cls.staging_bytes_for(
            profile.num_layers, 1, sink_tokens, block_size, p0.num_kv_heads, p0.head_dim, dtype)
        return max(0, (budget_bytes - num_profiles * profile.nbytes()) // per_seq)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_block_for(next(iter(self.profiles.values())), self.block_size)

    def memory_stats(self) -> dict:
        """Memory accounting of the cache (bytes, blocks, sequences).

        bytes_reserved: pages + staging + profiles, allocated up front. bytes_live: what the live sequences'
        data occupies (sealed tokens at quantized size, sink/tail tokens at the staging dtype's size).
        kv_bits_effective: bytes_live * 8 / (live tokens * 2 * L * H * D) (0 with no live token).
        """
        pages = self.num_blocks * self.bytes_per_block
        staging = self.staging_bytes_for(self.num_layers, self.max_sequences, self.sink_tokens, self.block_size,
                                         self.num_kv_heads, self.head_dim, self.dtype)
        prof = sum(p.nbytes() for p in self.profiles.values())
        item = torch.empty(0, dtype=self.dtype).element_size()
        fp_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * item
        live = tokens = 0
        for st in self._seqs.values():
            sealed, n_fp = self._split(st.length)
            live += sealed * self.bytes_per_block // self.block_size + n_fp * fp_token
            tokens += st.length
        elems = tokens * 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return {"kv_bits": self.bits, "kv_bytes_reserved": pages + staging + prof, "kv_bytes_pages": pages,
                "kv_bytes_staging": staging, "kv_bytes_profiles": prof, "kv_bytes_live": live,
                "kv_bits_effective": live * 8.0 / elems if elems else 0.0,
                "kv_blocks_total": self.num_blocks, "kv_blocks_free": self.allocator.num_free,
                "kv_blocks_used": self.allocator.num_used, "kv_sequences": len(self._seqs),
                "kv_staging_slots_free": len(self._free_slots)}

    def _split(self, length: int) -> tuple[int, int]:
        """(sealed quantized tokens, full-precision tokens) of a sequence of `length` tokens."""
        ns, s = self.sink_tokens, self.block_size
        sealed = max(0, length - ns) // s * s
        return sealed, length - sealed

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
        elif st is None:
            self._bound[first_block] = profile

    def _release(self, block: int) -> None:
        self._bound.pop(block, None)
        st = self._seqs.pop(block, None)
        if st is not None:
            self._free_slots.append(st.slot)

    def _state(self, first_block: int) -> _SeqState:
        st = self._seqs.get(first_block)
        if st is None:
            if not self._free_slots:
                raise MemoryError(f"all max_sequences={self.max_sequences} staging slots are in use")
            name = self._bound.pop(first_block, None) or choose_profile(None, list(self.profiles),
                                                                        self.default_profile)
            st = self._seqs[first_block] = _SeqState(slot=self._free_slots.pop(), profile=name)
        return st

    # ------------------------------------------------------------------ the step plan (once per step)
    def _make_plan(self, meta) -> dict:
        ns, s = self.sink_tokens, self.block_size
        dec = []
        for b in range(meta.decode_tokens.numel()):
            table = meta.decode_block_tables[b]
            st = self._state(int(table[0]))
            length = int(meta.decode_context_lens[b])
            st.length = length
            p = length - 1
            row = p if p < ns else ns + (p - ns) % s
            seal = p >= ns and (p - ns) % s == s - 1
            sealed, _ = self._split(length)
            dec.append((b, st, length, row, seal, int(table[(p - ns) // s]) if seal else -1, sealed))
        plan: dict = {"prefills": [], "decode": None}
        if dec:
            b_idx = [x[0] for x in dec]
            sealed = torch.tensor([x[6] for x in dec], dtype=torch.int64)
            lengths = torch.tensor([x[2] for x in dec], dtype=torch.int64)
            sink_lens = lengths.clamp(max=ns)
            tail_lens = lengths - sink_lens - sealed
            tail_pos = (sink_lens + sealed)[:, None] + torch.arange(s)[None, :]  # [B, S]
            tail_pos = tail_pos.clamp(max=self.cos.shape[0] - 1)
            groups: dict[str, list[int]] = {}
            for i, x in enumerate(dec):
                groups.setdefault(x[1].profile, []).append(i)
            seals: dict[str, list[int]] = {}
            for i, x in enumerate(dec):
                if x[4]:
                    seals.setdefault(x[1].profile, []).append(i)
            plan["decode"] = {
                "tok": meta.decode_tokens.to(self.device)[b_idx],
                "slot": torch.tensor([x[1].slot for x in dec], device=self.device),
                "row": torch.tensor([x[3] for x in dec], device=self.device),
                "tables": meta.decode_block_tables.to(self.device, torch.int32),
                "context_lens": sealed.to(self.device, torch.int32),
                "sink_lens": sink_lens.to(self.device, torch.int32),
                "tail_lens": tail_lens.to(self.device, torch.int32),
                "tail_cos": self.cos[tail_pos.to(self.device)], "tail_sin": self.sin[tail_pos.to(self.device)],
                "groups": {n: torch.tensor(ix, device=self.device) for n, ix in groups.items()},
                "seals": {n: (torch.tensor([dec[i][1].slot for i in ix], device=self.device),
                              torch.tensor([dec[i][5] for i in ix], device=self.device)) for n, ix in seals.items()},
            }
        for start, n, ctx, table in meta.prefills:
            st = self._state(int(table[0]))
            st.length = ctx
            plan["prefills"].append((start, n, ctx, table.to(self.device), st))
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
            MemoryError: more live sequences than staging slots.
        """
        if meta is not self._plan_meta:
            self._plan, self._plan_meta = self._make_plan(meta), meta
        out = torch.zeros_like(q_THD)
        if self._plan["decode"] is not None:
            self._decode(layer, q_THD, k_THD, v_THD, self._plan["decode"], scale, out)
        for start, n, ctx, table, st in self._plan["prefills"]:
            out[start:start + n] = self._prefill(layer, q_THD[start:start + n], k_THD[start:start + n],
                                                 v_THD[start:start + n], ctx, table, st, scale).to(out.dtype)
        return out

    def _decode(self, layer, q_THD, k_THD, v_THD, plan, scale, out) -> None:
        ns, s = self.sink_tokens, self.block_size
        sk, sv = self.stage_k[layer], self.stage_v[layer]
        tok, slot = plan["tok"], plan["slot"]
        sk[slot, plan["row"]] = k_THD[tok].to(sk.dtype)
        sv[slot, plan["row"]] = v_THD[tok].to(sv.dtype)
        for name, (seal_slots, seal_blocks) in plan["seals"].items():
            self._seal(layer, name, sk[seal_slots, ns:], sv[seal_slots, ns:], seal_blocks)
        tail_k = _rope_rows(sk[slot, ns:], plan["tail_cos"], plan["tail_sin"])  # [B, S, H, D]
        tail_v = sv[slot, ns:].float()
        kw = {}
        for name, ix in plan["groups"].items():
            if ns:
                sink_k = apply_rope(sk[slot[ix], :ns], self.cos[:ns], self.sin[:ns])  # [b, Ns, H, D]
                kw = dict(sink_k=sink_k.contiguous(), sink_v=sv[slot[ix], :ns].float().contiguous(),
                          sink_lens=plan["sink_lens"][ix])
            o = self._decode_attention(
                q_THD[tok[ix]].float(), self.pages[layer], plan["tables"][ix], plan["context_lens"][ix],
                self.profiles[name].layers[layer], self.cos, self.sin, scale,
                tail_k=tail_k[ix].contiguous(), tail_v=tail_v[ix].contiguous(), tail_lens=plan["tail_lens"][ix], **kw)
            out[tok[ix]] = o.to(out.dtype)

    def _seal(self, layer: int, profile: str, k_nSHD: torch.Tensor, v_nSHD: torch.Tensor,
              blocks_n: torch.Tensor) -> None:
        """Quantize n full blocks of pre-RoPE K / V ([n, S, H, D]) into pages `blocks_n` [n]."""
        n, s, h, d = k_nSHD.shape
        if n == 0:
            return
        qkv = quantize_kv(k_nSHD.reshape(n * s, h, d), v_nSHD.reshape(n * s, h, d),
                          self.profiles[profile].layers[layer])
        self.pages[layer].write(blocks_n.repeat_interleave(s), torch.arange(s, device=self.device).repeat(n), qkv)

    def _prefill(self, layer, q_nHD, k_nHD, v_nHD, ctx, table, st: _SeqState, scale) -> torch.Tensor:
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
        # open region [u, ctx): the old unsealed tail plus the new non-sink tokens
        u = ns + max(0, p0 - ns) // s * s
        k_open = torch.cat([sk[ns:ns + max(0, p0 - u)].float(), k_nHD[n_sink_new:].float()])  # [ctx - u, H, D]
        v_open = torch.cat([sv[ns:ns + max(0, p0 - u)].float(), v_nHD[n_sink_new:].float()])
        n_open = max(0, ctx - u)
        n_full = n_open // s
        if n_full:
            first = (u - ns) // s
            self._seal_rows(layer, st.profile, k_open[:n_full * s], v_open[:n_full * s], table[first:first + n_full])
        rest = n_open - n_full * s
        if rest:
            sk[ns:ns + rest] = k_open[n_full * s:].to(sk.dtype)
            sv[ns:ns + rest] = v_open[n_full * s:].to(sv.dtype)
        # keys/values of all ctx positions, pre-RoPE, in full precision where still available and dequantized
        # where sealed
        sealed, _ = self._split(ctx)
        n_blk = sealed // s
        if n_blk:
            slots = torch.arange(s, device=self.device).repeat(n_blk)
            qkv = self.pages[layer].read(table[:n_blk].repeat_interleave(s), slots)
            k_dq_sealed, v_dq_sealed = dequantize_keys(qkv.k_codes, qkv.k_outliers, prof), \
                dequantize_values(qkv.v_codes, qkv.v_scale, qkv.v_outliers, prof)
        else:
            k_dq_sealed = v_dq_sealed = torch.zeros(0, h, d, device=self.device)
        n_sink = min(ns, ctx)
        k_sink, v_sink = sk[:n_sink].float(), sv[:n_sink].float()
        old_sealed = u - ns if ctx > ns else 0  # sealed before this step: no full-precision copy left
        k_fp = torch.cat([k_sink, k_dq_sealed[:old_sealed], k_open])
        v_fp = torch.cat([v_sink, v_dq_sealed[:old_sealed], v_open])
        k_dq = torch.cat([k_sink, k_dq_sealed, k_open[sealed - old_sealed:]])
        v_dq = torch.cat([v_sink, v_dq_sealed, v_open[sealed - old_sealed:]])
        pos = torch.arange(ctx, device=self.device)
        cos, sin = self.cos[pos], self.sin[pos]
        q_pos = torch.arange(p0, ctx, device=self.device)
        quant_hi = ns + (q_pos + 1 - ns).clamp(min=0) // s * s
        return mixed_causal_attention(q_nHD, apply_rope(k_fp, cos, sin), v_fp, apply_rope(k_dq, cos, sin), v_dq,
                                      q_pos, ns, quant_hi, scale)

    def _seal_rows(self, layer: int, profile: str, k_rows: torch.Tensor, v_rows: torch.Tensor,
                   blocks: torch.Tensor) -> None:
        s = self.block_size
        n = k_rows.shape[0] // s
        self._seal(layer, profile, k_rows.reshape(n, s, *k_rows.shape[1:]), v_rows.reshape(n, s, *v_rows.shape[1:]),
                   blocks)


def build_engine_kv_cache(cfg, mc, *, device: torch.device | str = "cpu") -> QuantizedPagedKVCache:
    """The quantized cache for a RankEngine: profiles from `cfg.kv_profile`, blocks from `cfg.kv_cache_bytes`.

    Args:
        cfg: EngineConfig (kv_bits, kv_profile, kv_cache_bytes, block_size, max_num_seqs, max_model_len,
            kernel_backend, dtype). mc: ModelConfig.
    Raises:
        ValueError: no matching profile (see actors.kv_profiles.load_profiles), or the budget cannot hold the
            profiles, the staging slots and one max_model_len sequence.
    """
    from actors.kv_profiles import load_profiles

    profiles, default = load_profiles(cfg.model, cfg.kv_bits, cfg.kv_profile, device)
    any_p = next(iter(profiles.values()))
    sink = 1
    slots = cfg.max_num_seqs + 1  # +1: RankEngine.prompt_logits runs outside the scheduler
    fixed = QuantizedPagedKVCache.staging_bytes_for(mc.num_layers, slots, sink, cfg.block_size, mc.num_kv_heads,
                                                    mc.head_dim, cfg.torch_dtype)
    fixed += sum(p.nbytes() for p in profiles.values())
    per_block = QuantizedPagedKVCache.bytes_per_block_for(any_p, cfg.block_size)
    num_blocks = max(0, cfg.kv_cache_bytes - fixed) // per_block
    need = math.ceil(cfg.max_model_len / cfg.block_size)
    if num_blocks < need:
        raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} holds {num_blocks} quantized blocks of {per_block} "
                         f"bytes after {fixed} bytes of staging and profiles; one max_model_len={cfg.max_model_len} "
                         f"sequence needs {need}")
    return QuantizedPagedKVCache(
        num_layers=mc.num_layers, num_blocks=num_blocks, block_size=cfg.block_size, num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, profiles=profiles, default_profile=default, max_sequences=slots, sink_tokens=sink,
        rope_theta=mc.rope_theta, max_positions=cfg.max_model_len, dtype=cfg.torch_dtype, device=device,
        backend=cfg.kernel_backend)
