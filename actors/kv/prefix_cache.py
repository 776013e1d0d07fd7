"""Automatic prefix caching for the full-precision paged cache (vLLM's APC semantics): content-addressed KV blocks.

A full KV block (S tokens, all layers) is named by a chained hash: h_i = sha256(h_{i-1} || salt || token ids of
block i), h_-1 = b"" (vLLM's `hash_block_tokens`; the salt carries what else decides the block's bytes, e.g. the
KV width and profile of a quantized cache, actors/kv/quantized_prefix.py). So two sequences with the same first
i blocks of tokens get the same h_0..h_{i-1}, and a block's hash says what its whole prefix was.

Invariants of `PrefixCachingAllocator` (a `BlockAllocator`, actors/kv/allocator.py):
  * a block gets a hash only once it is full and its K/V are computed (`PrefixCache.commit`); a hashed block is
    never written again (a sequence only writes at positions >= its cached count, past its full blocks), so it
    is shared read-only by every sequence that `acquire`s it (one reference each);
  * one block per hash: a second sequence that computed the same block itself keeps its copy unhashed;
  * a hashed block whose last reference is dropped is kept, evictable, in an LRU (`num_free` counts it):
    `allocate` takes a never-hashed free block first, else evicts the least recently freed cached block (its
    hash is dropped); a block with a holder is never evicted. A sequence frees its blocks last to first, so
    under pressure a prefix's tail goes before its head (as vLLM).
Scheduler protocol (`PrefixCache`, actors/engine/scheduler.py): `match` at admission (longest cached prefix,
whole blocks, at most length - 1 tokens so the last position is computed and has logits), `acquire` the matched
blocks, `commit` after the step that computed them, then the ordinary `free`. Counters (tokens, as vLLM):
`queries` (prompt tokens looked up), `hits` (of those, found cached).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from actors.kv.allocator import BlockAllocator
from actors.moe.gating_router import _STATEFUL


def chain_hashes(token_ids: list[int], cuts: list[int], salt: bytes = b"", parents: list[bytes] | None = None
                 ) -> list[bytes]:
    """Chained block hashes of `token_ids` at the increasing cut points `cuts` (h_j covers [0, cuts[j])).

    `parents`: hashes already computed for the first len(parents) cuts (extended, not recomputed).
    Returns the list of 32-byte sha256 digests, one per cut.
    """
    out = list(parents or [])
    prev = out[-1] if out else b""
    start = cuts[len(out) - 1] if out else 0
    for cut in cuts[len(out):]:
        prev = hashlib.sha256(prev + salt + array("q", token_ids[start:cut]).tobytes()).digest()
        out.append(prev)
        start = cut
    return out


def may_hit(seq, default_gating: str) -> bool:
    """Whether `seq` may skip its cached positions (`params_may_hit` of its params)."""
    return params_may_hit(seq.params, default_gating)


def params_may_hit(params, default_gating: str) -> bool:
    """Whether a request with these `SamplingParams` may skip cached positions: not with `prompt_logprobs` (every
    position is scored, as vLLM) nor a stateful gating policy (`sticky`, `velocity`: each token's routing reads the
    previous one's). The router asks the same before routing by prefix (router_service/prefix_affinity.py)."""
    return params.prompt_logprobs is None and (params.gating or default_gating) not in _STATEFUL


class PrefixCachingAllocator(BlockAllocator):
    """`BlockAllocator` whose freed full blocks stay cached (by hash) until evicted, LRU (module docstring)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._hash: dict[int, bytes] = {}  # block -> hash
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # hashed blocks with no holder, oldest first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks with a hash (held or evictable)."""
        return len(self._hash)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def allocate(self) -> int:
        if self._free:
            return super().allocate()
        if not self._lru:
            raise MemoryError("no free KV block")
        b, _ = self._lru.popitem(last=False)  # evict the least recently freed cached block
        del self._by_hash[self._hash.pop(b)]
        self._ref[b] = 1
        return b

    def free(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated (double free)")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash:
                self._lru[block] = None
            else:
                self._free.append(block)

    def free_all(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # the tail becomes least recent: evicted before the head
            self.free(b)

    def evict_all(self) -> None:
        """Drop every cached block nobody holds (back to the plain free list)."""
        for b in self._lru:
            del self._by_hash[self._hash.pop(b)]
            self._free.append(b)
        self._lru.clear()

    def lookup(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def acquire(self, block: int) -> None:
        """Take one reference on a cached block (held or evictable)."""
        if self._ref[block] == 0:
            del self._lru[block]
        self._ref[block] += 1

    def register(self, block: int, h: bytes) -> None:
        """Name a full, computed block by its hash (no-op if the hash or the block is named already)."""
        if h not in self._by_hash and block not in self._hash:
            self._hash[block], self._by_hash[h] = h, block


class PrefixCache:
    """The scheduler's view of prefix caching over a `PrefixCachingAllocator` (protocol in the module docstring).

    Args: allocator. block_size: S. default_gating: the deployment's gating policy (see `may_hit`).
    """

    def __init__(self, allocator: PrefixCachingAllocator, block_size: int, default_gating: str = "exact"):
        self.alloc, self.block_size, self.default_gating = allocator, block_size, default_gating
        self.queries = self.hits = 0

    def _hashes(self, seq, n_blocks: int) -> list[bytes]:
        if len(seq.block_hashes) < n_blocks:
            s = self.block_size
            seq.block_hashes = chain_hashes(seq.token_ids(0, n_blocks * s), [s * (i + 1) for i in range(n_blocks)],
                                            parents=seq.block_hashes)
        return seq.block_hashes[:n_blocks]

    def match(self, seq) -> tuple[int, list[int]]:
        """(cached tokens, their blocks in order) of `seq`'s longest cached prefix."""
        if not may_hit(seq, self.default_gating):
            return 0, []
        blocks = []
        for h in self._hashes(seq, (seq.length - 1) // self.block_size):
            b = self.alloc.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return len(blocks) * self.block_size, blocks

    def pin_cost(self, blocks: list[int]) -> int:
        """Free blocks that `acquire(blocks)` takes out of `num_free` (the evictable ones)."""
        return sum(1 for b in blocks if self.alloc.refcount(b) == 0)

    def acquire(self, seq, tokens: int, blocks: list[int]) -> list[int]:
        """Share the matched blocks with `seq` (admitted now); returns them (the head of its block table).
        Counts the query (its prompt tokens) and the hit (the cached ones among them)."""
        for b in blocks:
            self.alloc.acquire(b)
        self.queries += len(seq.prompt_ids)
        self.hits += min(tokens, len(seq.prompt_ids))
        return list(blocks)

    def attach(self, seq, tokens: int, running=()) -> None:
        """Nothing to do here: the shared blocks hold the data (the quantized cache copies state here)."""

    def commit(self, seq) -> None:
        """Name `seq`'s full blocks whose K/V are computed (positions < num_cached)."""
        n = min(seq.num_cached, seq.length) // self.block_size
        if n > seq.num_committed:
            for i, h in enumerate(self._hashes(seq, n)[seq.num_committed:], start=seq.num_committed):
                self.alloc.register(seq.block_table[i], h)
            seq.num_committed = n

    def release(self, seq) -> None:
        """Before `seq`'s blocks are freed: nothing to keep beyond the hashed blocks themselves."""

    def evict_one(self, keep=None) -> bool:
        """Evictable blocks already count in `num_free` (allocate evicts): nothing to do."""
        return False

    def clear(self) -> None:
        """Evict every cached block nobody holds."""
        self.alloc.evict_all()

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_blocks": self.alloc.num_cached}
