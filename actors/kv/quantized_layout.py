"""Byte layout of the quantized KV cache's pages, and the cache's size arithmetic (bytes, pages, sequences).

Mixed bit widths, one byte pool (sub-page allocation, actors/kv/pool.py). Every layer has one uint8 arena of
`num_pages` pages; page p of the pool is page p of every layer's arena and holds the same T_b tokens of one profile
layout b in each (T_b = pool page bytes // that layout's bytes per token over all layers: 13 / 9 / 7 tokens at 2 / 3 /
4 bits for tiny-moe's 3968-byte pages), laid out in each layer as a `KVPages` block [v_scale | k_outliers | v_outliers
(fp16) | k_codes | v_codes (uint8)] ([k_outliers | v_outliers (fp16) | v_scale | k_codes | v_codes (uint8)] where the
value scale is an 8-bit code, `KVQuantProfile.v_scale_bits`), so each layout's `KVPages` is a set of strided views of
the same arenas (block stride = the layer's page bytes). A layer's page bytes are the most any layout needs there
(`layer_page_bytes`): with layer widths allocated by sensitivity (`actors.kv.layer_widths`: a layer's value bits and
key row bytes differ from another's) the layers' pages differ in bytes, not in tokens. Any free page serves any width;
finishing returns whole pages; the only waste is page slack and each sequence's unfilled last page (measured below 5%
on the issue's workload, tests/actors/kv/test_kv_quant_pool.py). Blocks of S tokens at different widths would differ
in bytes; storing them as slabs in fixed pages was measured at 29-44% waste (actors/kv/pool.py docstring), hence pages
sized in tokens per width.

Invariants: a layer's page is a multiple of PAGE_ALIGN bytes, so every fp16 field of a page is 2-byte aligned;
a layout's fields [v_scale | k_outliers | v_outliers | k_codes | v_codes] of Tp tokens end inside the layer's
page (asserted in `arena_views`); profiles with equal `layout_key` share one layout, i.e. one set of views.

Shape legend: NP = pool pages, Tp = tokens per page of one width, H = KV heads, D = head_dim, S = block_size,
Ns = sink tokens.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from actors.kv.pool import choose_page_bytes
from actors.kv.profiles import ModelKVProfile
from kernels.kv_pack import packed_bytes
from kernels.kv_pages import KVPages

PAGE_ALIGN = 16  # bytes; keeps every fp16 field of a page 2-byte aligned and rows friendly to vector loads


def layout_key(profile: ModelKVProfile) -> tuple[tuple[int, int, int, int, int], ...]:
    """Per layer (value bits, Ok, Ov, Pk, value scale bits): profiles with equal keys share one page layout (H and D
    are fixed per cache). Pk (key row bytes) differs from the value row's with per-channel key widths
    (`KVQuantProfile.k_bits`); value bits and Pk may differ between layers (sensitivity-allocated layer widths)."""
    return tuple((p.bits, p.n_outlier_k, p.n_outlier_v, p.k_packed_bytes, p.v_scale_bits) for p in profile.layers)


def layer_page_bytes(keys: Iterable[tuple], tokens_per_page: dict[tuple, int], layer_bytes_per_token) -> list[int]:
    """Bytes of one page in each layer's arena: the most any layout needs there for its tokens per page, rounded up
    to PAGE_ALIGN. keys: layout keys; tokens_per_page: {key: tokens}; layer_bytes_per_token(key, l): bytes."""
    keys = list(keys)
    n_layers = len(keys[0])
    return [max(-(-tokens_per_page[k] * layer_bytes_per_token(k, l) // PAGE_ALIGN) * PAGE_ALIGN for k in keys)
            for l in range(n_layers)]


def arena_views(arena: torch.Tensor, key: tuple[int, int, int, int, int], tokens: int, h: int, d: int) -> KVPages:
    """`KVPages` of one layer's layout over its arena [NP, page bytes] uint8: strided views, no copy (layout in
    module doc). key: that layer's (value bits, Ok, Ov, Pk, value scale bits), an entry of `layout_key`."""
    bits, ok, ov, pk, vsb = key
    npg, pb = arena.shape
    p = packed_bytes(d, bits)
    f16 = arena.view(torch.float16)  # [NP, pb / 2]
    o = 0
    fields = {}
    for name, n, shape in ((("v_scale", tokens * h, (tokens, h)),) if vsb == 16 else ()) + (
            ("k_outliers", tokens * h * ok, (tokens, h, ok)), ("v_outliers", tokens * h * ov, (tokens, h, ov))):
        fields[name] = f16[:, o:o + n].view(npg, *shape)
        o += n
    o *= 2
    if vsb == 8:
        fields["v_scale"] = arena[:, o:o + tokens * h].view(npg, tokens, h)
        o += tokens * h
    for name, row in (("k_codes", pk), ("v_codes", p)):
        n = h * tokens * row
        fields[name] = arena[:, o:o + n].view(npg, h, tokens, row)
        o += n
    assert o <= pb, (o, pb)  # layer_page_bytes guarantees it
    return KVPages(**fields)


class QuantizedKVSizes:
    """Size arithmetic of `QuantizedPagedKVCache`, static so that it serves before a cache exists (the builder).

    `QuantizedPagedKVCache` inherits it: `QuantizedPagedKVCache.max_concurrent_sequences(...)` is this method.
    """

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
        """Bytes of one pool page over all layers for these profiles (actors.kv.pool.choose_page_bytes over the
        profiles' all-layer token sizes), a multiple of num_layers * PAGE_ALIGN.

        The page lies in [largest token, S largest tokens] (so a page never costs more than one logical block at
        the widest width) and minimises page slack plus half a page of tokens per sequence of
        `mean_live_tokens` tokens. Each layer's arena then holds its share (`layer_page_bytes`).
        Raises: ValueError if profiles is empty.
        """
        profiles = list(profiles)
        if not profiles:
            raise ValueError("profiles is empty")
        n_layers = profiles[0].num_layers
        step = PAGE_ALIGN * n_layers
        per_token = {layout_key(p): sum(lp.bytes_per_token() for lp in p.layers) for p in profiles}
        top = max(per_token.values())
        start = -(-top // step) * step
        hi = max(start, block_size * top // step * step)
        return choose_page_bytes(per_token, lo=start, hi=hi, step=step, mean_live_tokens=mean_live_tokens)

    @staticmethod
    def layer_page_bytes_for(profiles: Iterable[ModelKVProfile], page_bytes: int) -> list[int]:
        """Each layer's page bytes in a pool of `page_bytes`-byte pages (over all layers) for these profiles: what
        the arenas allocate per pool page (`layer_page_bytes`; at most page_bytes in all when every layer is
        the same, a little more when layer widths differ between profiles of one pool)."""
        per_layer = {layout_key(p): [lp.bytes_per_token() for lp in p.layers] for p in profiles}
        tokens = {k: page_bytes // sum(b) for k, b in per_layer.items()}
        return layer_page_bytes(per_layer, tokens, lambda k, l: per_layer[k][l])

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
        arena_page = sum(cls.layer_page_bytes_for(profs, page_bytes))  # bytes a pool page allocates
        for p in profs:
            per_page = page_bytes // sum(lp.bytes_per_token() for lp in p.layers)
            costs.append((-(-quant // per_page) + 1) * arena_page + staging)
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
