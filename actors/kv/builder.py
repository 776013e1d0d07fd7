"""Build the KV cache of a RankEngine from its EngineConfig (full precision, or quantized: profiles, page size,
page count) and its prefix cache (`build_prefix_cache`, on unless `enable_prefix_caching` is off).

Contract: the quantized cache fits `cfg.kv_cache_bytes` (staging rows and profiles first, then whole pages), and its
pages hold at least one `max_model_len` sequence at the widest width plus the allocator's headroom (what
it charges for a sequence in flight); otherwise ValueError before any cache tensor is allocated.
"""
from __future__ import annotations

import math

import torch

from actors.kv.calibration import RECOMMENDED_SINK_TOKENS
from actors.kv.paged import PagedKVCache
from actors.kv.prefix_cache import PrefixCache
from actors.kv.profiles import load_served_profiles
from actors.kv.quantized import QuantizedPagedKVCache


def build_kv_cache(cfg, mc, device: torch.device | str = "cpu"):
    """The rank's KV cache: `PagedKVCache` in the compute dtype (kv_bits unset) or `build_engine_kv_cache`.

    Raises: ValueError if `cfg.kv_cache_bytes` cannot hold one `max_model_len` sequence.
    """
    if cfg.kv_bits is not None:
        return build_engine_kv_cache(cfg, mc, device=device)
    dtype = cfg.torch_dtype
    per_block = PagedKVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype)
    num_blocks = cfg.kv_cache_bytes // per_block
    need = -(-cfg.max_model_len // cfg.block_size)
    if num_blocks < need:
        raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} holds {num_blocks} blocks of {per_block} bytes; "
                         f"one max_model_len={cfg.max_model_len} sequence needs {need}")
    return PagedKVCache(mc.num_layers, num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype, device,
                        prefix_caching=cfg.enable_prefix_caching)


def build_prefix_cache(cfg, cache):
    """The scheduler's prefix cache over `cache` (None when `cfg.enable_prefix_caching` is off)."""
    if not cfg.enable_prefix_caching:
        return None
    if cfg.kv_bits is not None:
        from actors.kv.quantized_prefix import QuantizedPrefixCache

        return QuantizedPrefixCache(cache, cfg.gating, max_retained=cfg.max_num_seqs)
    return PrefixCache(cache.allocator, cfg.block_size, cfg.gating)


def build_engine_kv_cache(cfg, mc, *, device: torch.device | str = "cpu") -> QuantizedPagedKVCache:
    """The quantized cache for a RankEngine: profiles from `cfg.kv_profile`, pages from `cfg.kv_cache_bytes`.

    Args:
        cfg: EngineConfig (kv_bits, kv_extra_bits, kv_profile, kv_cache_bytes, block_size, max_num_seqs, max_model_len,
            kernel_backend, dtype). mc: ModelConfig.
    Raises:
        ValueError: no matching profile (see actors.kv.profiles.load_profiles), or the budget cannot hold the
            profiles, the staging slots and one max_model_len sequence at the widest width.
    """
    profiles, default = load_served_profiles(cfg.model, cfg.kv_bits, cfg.kv_profile, cfg.kv_extra_bits, device)
    sink = RECOMMENDED_SINK_TOKENS  # what the shipped profiles were chosen with (bench/kv_quality.py)
    slots = cfg.max_num_seqs + 1  # +1: RankEngine.prompt_logits runs outside the scheduler
    fixed = QuantizedPagedKVCache.staging_bytes_for(mc.num_layers, slots, sink, cfg.block_size, mc.num_kv_heads,
                                                    mc.head_dim, cfg.torch_dtype)
    fixed += sum(p.nbytes() for p in profiles.values())
    page = QuantizedPagedKVCache.pool_page_bytes(profiles.values(), cfg.block_size)
    arena_page = sum(QuantizedPagedKVCache.layer_page_bytes_for(profiles.values(), page))  # what a page allocates
    num_pages = max(0, cfg.kv_cache_bytes - fixed) // arena_page
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
