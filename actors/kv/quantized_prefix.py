"""Automatic prefix caching over the quantized KV cache (actors/kv/quantized.py): shared sealed pages.

The quantized cache's logical blocks hold no data: a sequence's K/V live in its staging slot (the Ns full-precision
sink tokens and the unsealed tail) and in sealed quantized pages shared by reference count (copy-on-write,
actors/kv/page_tables.py). So the cached unit here is a sealed prefix: tokens [0, Ns + j*S), j >= 1, the sink
plus j sealed quantized blocks (no full-precision tail), named by the chained hash of actors/kv/prefix_cache.py
over those cuts, salted with the sequence's profile name, its page layout (bits, outlier counts, key row bytes)
and Ns, since those decide the bytes. A hit forks the sequence that holds the prefix
(`QuantizedPagedKVCache.fork`: its pages shared, its staging rows copied) and truncates the child to the cut,
where it holds exactly j sealed blocks and no tail: the state a run without the cache has after the same
tokens (quantization is per token, and a query past the cut sees the same keys quantized), so greedy tokens are
identical.

Sources and retention: a hash names the first sequence (its first logical block) that computed and sealed the
prefix; a sealed prefix is never rewritten (pages before the appended position are full, and a shared page is
copied before a write). When a source sequence ends (finished, aborted, preempted) it is retained: the cache
keeps one reference on its first logical block, so its staging slot and pages stay; at most `max_retained` are
kept, and the least recently retained is evicted first, when the scheduler needs pages (`evict_one`, before any
running sequence is preempted) or a staging slot (`attach`: every admitted sequence, plus the scratch slot of
`RankEngine.prompt_logits`, finds one free). A
retained sequence is never running, so evicting it frees only pages no running sequence holds (shared pages
keep their other holders' references). Eviction or release drops the sequence's hashes.
"""
from __future__ import annotations

from collections import OrderedDict

from actors.kv.prefix_cache import chain_hashes, may_hit


class QuantizedPrefixCache:
    """Scheduler protocol of `actors.kv.prefix_cache.PrefixCache` for a `QuantizedPagedKVCache`.

    Args: cache. default_gating: the deployment's gating policy. max_retained: ended sources kept at most.
    """

    def __init__(self, cache, default_gating: str = "exact", max_retained: int = 0):
        self.cache, self.default_gating, self.max_retained = cache, default_gating, max_retained
        self.queries = self.hits = 0
        self._src: dict[bytes, int] = {}  # hash -> first logical block of the sequence that holds the prefix
        self._owned: dict[int, list[bytes]] = {}
        self._retained: OrderedDict[int, None] = OrderedDict()
        self._match_src: int | None = None
        release = cache.allocator._on_release  # the cache's release of a sequence; forget its hashes first

        def on_release(block: int) -> None:
            self._forget(block)
            release(block)

        cache.allocator._on_release = on_release

    def _cuts(self, n: int) -> list[int]:
        ns, s = self.cache.sink_tokens, self.cache.block_size
        return list(range(ns + s, n + 1, s))

    def _hashes(self, seq, n_tokens: int) -> list[bytes]:
        cuts = self._cuts(n_tokens)
        if len(seq.block_hashes) < len(cuts):
            c = self.cache
            prof = seq.kv_profile or c.choose_profile(None)
            salt = f"{prof}|{c._key[prof]}|{c.sink_tokens}".encode()
            seq.block_hashes = chain_hashes(seq.token_ids(0, cuts[-1]), cuts, salt, parents=seq.block_hashes)
        return seq.block_hashes[:len(cuts)]

    def match(self, seq) -> tuple[int, list[int]]:
        """(cached tokens, []) of `seq`'s longest cached sealed prefix (at most length - 1 tokens)."""
        self._match_src = None
        if not may_hit(seq, self.default_gating):
            return 0, []
        tokens = 0
        for cut, h in zip(self._cuts(seq.length - 1), self._hashes(seq, seq.length - 1)):
            src = self._src.get(h)
            if src is None:
                break
            tokens, self._match_src = cut, src
        return tokens, []

    def pin_cost(self, blocks: list[int]) -> int:
        return 0

    def acquire(self, seq, tokens: int, blocks: list[int]) -> list[int]:
        """Counts the query and the hit (tokens); the data is attached once the sequence has its blocks."""
        self.queries += len(seq.prompt_ids)
        self.hits += min(tokens, len(seq.prompt_ids))
        return []

    def attach(self, seq, tokens: int, running=()) -> None:
        """Give `seq` (admitted, its blocks allocated) the matched prefix: fork the source, cut the child to
        `tokens`. First, retained sources give up staging slots until `seq`, the `running` sequences without one
        yet (admitted this step) and the scratch slot have one."""
        c = self.cache
        need = 2 + sum(1 for r in running if r.block_table and r.block_table[0] not in c._seqs)
        while len(c._free_slots) < need and self.evict_one():
            pass
        if tokens:
            first = seq.block_table[0]
            self.cache.fork(self._match_src, first)
            self.cache.truncate(first, tokens)
            self._touch(self._match_src)
        self._match_src = None

    def _touch(self, first: int) -> None:
        if first in self._retained:
            self._retained.move_to_end(first)

    def commit(self, seq) -> None:
        """Name `seq`'s sealed prefixes whose K/V are computed (cuts <= num_cached)."""
        hs = self._hashes(seq, min(seq.num_cached, seq.length))
        if len(hs) > seq.num_committed and seq.block_table:
            first = seq.block_table[0]
            for h in hs[seq.num_committed:]:
                if h not in self._src:
                    self._src[h] = first
                    self._owned.setdefault(first, []).append(h)
            seq.num_committed = len(hs)

    def release(self, seq) -> None:
        """`seq` ends: keep it as a source if it names a cached prefix (one reference on its first block)."""
        first = seq.block_table[0]
        if not self._owned.get(first) or self.max_retained < 1:
            return
        st = self.cache._seqs.get(first)
        if st is None:  # never ran a step: nothing cached
            return
        self.cache.allocator.share(first)
        st.nblocks = 1  # it holds one logical block now (the pool budget counts its pages, not its length)
        self.cache._committed = None
        self._retained[first] = None
        while len(self._retained) > self.max_retained:
            self.evict_one()

    def evict_one(self, keep=None) -> bool:
        """Evict the least recently used retained source (never the one just matched). False: none left."""
        for first in self._retained:
            if first != self._match_src:
                del self._retained[first]
                self.cache.allocator.free(first)  # -> the cache releases its slot and pages, `_forget` its hashes
                return True
        return False

    def clear(self) -> None:
        """Evict every retained source."""
        self._match_src = None
        while self.evict_one():
            pass

    def _forget(self, first: int) -> None:
        self._retained.pop(first, None)
        for h in self._owned.pop(first, []):
            if self._src.get(h) == first:
                del self._src[h]

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_blocks": len(self._src), "prefix_cache_sources": len(self._retained)}
