"""Free list of KV blocks with reference counts: the allocator behind every KV cache and the quantized page pool.

The allocator hands out block ids and counts their holders; it knows no tokens or tensors (what a block holds
is its cache's business: actors/kv/paged.py, actors/kv/quantized.py, actors/kv/pool.py).

Invariants:
  * a block is either free (reference count 0, on the free list exactly once) or allocated (count >= 1, not
    on the free list);
  * `allocate` takes a free block and sets its count to 1: the caller owns that one reference;
  * `share` adds a holder to an allocated block (a forked or cached prefix); every holder owns one reference
    and drops it with `free`; a block returns to the free list when its last reference is dropped, so
    exactly once; `free` of a free block raises (double free), so no block is ever handed out twice;
  * `num_free` is what a caller may allocate now: callers (the scheduler) read it before allocating rather
    than catching MemoryError; a subclass may report fewer than the free list holds (the quantized cache's
    byte-aware budget, actors/kv/quantized_sequences.py).
Ids come out LIFO from a list that starts in ascending order (block 0 first), so allocation is deterministic.
"""
from __future__ import annotations


class BlockAllocator:
    """Free list of KV blocks with reference counts (so a forked prefix can be shared).

    Raises:
        MemoryError: `allocate` with no free block (callers check `num_free` first).
        ValueError: freeing a block that is not allocated.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free KV block")
        b = self._free.pop()
        self._ref[b] = 1
        return b

    def share(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._ref[block] += 1

    def free(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated (double free)")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free.append(block)

    def free_all(self, blocks: list[int]) -> None:
        for b in blocks:
            self.free(b)
