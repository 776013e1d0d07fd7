"""Sub-page allocation of quantized KV blocks of mixed bit widths from one byte arena (slab allocation).

A 2-, 3- and 4-bit block of S tokens differ in bytes (for tiny-moe: 4864, 6912, 8960 bytes over all layers),
so one free list of equal blocks cannot serve sequences of different widths without wasting the difference.
The pool is an arena of equal pages; a free page is claimed by one size class (bit width) and carved into
`page_bytes // block_bytes` sub-pages, one block each; the page returns to the free page list when its last
block is freed. Allocation takes a slot of the fullest partly used page of the class, so sparsely used pages
drain and return (Bonwick's slab allocator, USENIX 1994, with a fullest-first page choice). `best_page_bytes`
picks a page size that every class fills almost exactly (tiny-moe: 179968 bytes = 37 / 26 / 20 blocks, at
most 0.43% slack).

Fragmentation (what `simulate_fragmentation` measures): 1 - (bytes of live KV data) / (bytes of pages held),
summed over the steps of a workload; live data = tokens * bytes per token of their width, so the unfilled
tail of each sequence's last block, page slack and free slots in held pages all count as waste.

This is the allocator and its accounting; the engine's `QuantizedPagedKVCache` still uses one width per
cache (the kernel addresses `KVPages` of one layout).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Page:
    bits: int
    free: list[int]
    used: int = 0


@dataclass(kw_only=True, slots=True)
class PoolStats:
    """Pool accounting in bytes and pages."""

    pages_total: int
    pages_used: int
    bytes_reserved: int  # pages held by some class * page_bytes
    bytes_blocks: int  # allocated blocks * their block bytes
    blocks_used: dict[int, int] = field(default_factory=dict)  # bits -> blocks


def best_page_bytes(block_bytes: dict[int, int], lo: int = 32768, hi: int = 262144, unit: int = 256) -> int:
    """Page size in [lo, hi] (multiple of `unit`) minimising the worst class's slack `page % block / page`.

    Raises: ValueError if a block is larger than `hi` or the range is empty.
    """
    if not block_bytes or max(block_bytes.values()) > hi or lo > hi:
        raise ValueError(f"block_bytes={block_bytes} must be non-empty and fit pages in [lo={lo}, hi={hi}]")
    start = max(lo, max(block_bytes.values()))
    start = -(-start // unit) * unit
    return min(range(start, hi + 1, unit), key=lambda p: (max((p % b) / p for b in block_bytes.values()), p))


class SubPagePool:
    """Mixed-width KV block pool: pages of `page_bytes`, each carved into blocks of one bit width.

    Args:
        block_bytes: {bits: bytes of one block of that width (all layers)}, each <= page_bytes.
        page_bytes: bytes per page. num_pages: pages in the arena (>= 1).
    Handles are ints `page * 256 + slot`; `offset(handle)` is the block's byte offset in the arena.
    Raises:
        ValueError: a block larger than a page, num_pages < 1, unknown bits, double free.
        MemoryError: `allocate` with no free slot of that width and no free page.
    """

    def __init__(self, block_bytes: dict[int, int], page_bytes: int, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        for b, n in block_bytes.items():
            if not 0 < n <= page_bytes or page_bytes // n > 256:
                raise ValueError(f"block_bytes[{b}]={n} must be in (page_bytes/256, page_bytes={page_bytes}]")
        self.block_bytes = dict(block_bytes)
        self.page_bytes, self.num_pages = page_bytes, num_pages
        self.per_page = {b: page_bytes // n for b, n in block_bytes.items()}
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, _Page] = {}
        self._partial: dict[int, set[int]] = {b: set() for b in block_bytes}  # pages with a free slot

    def allocate(self, bits: int) -> int:
        if bits not in self.block_bytes:
            raise ValueError(f"bits={bits} is not one of {sorted(self.block_bytes)}")
        part = self._partial[bits]
        if part:
            pid = min(part, key=lambda p: (len(self._pages[p].free), p))  # fullest first
        elif self._free_pages:
            pid = self._free_pages.pop()
            self._pages[pid] = _Page(bits=bits, free=list(range(self.per_page[bits] - 1, -1, -1)))
            part.add(pid)
        else:
            raise MemoryError(f"no free {bits}-bit KV block and no free page ({self.num_pages} pages)")
        page = self._pages[pid]
        slot = page.free.pop()
        page.used += 1
        if not page.free:
            part.discard(pid)
        return pid * 256 + slot

    def free(self, handle: int) -> None:
        pid, slot = divmod(handle, 256)
        page = self._pages.get(pid)
        if page is None or slot in page.free or slot >= self.per_page[page.bits]:
            raise ValueError(f"handle={handle} (page {pid}, slot {slot}) is not allocated")
        page.free.append(slot)
        page.used -= 1
        if page.used == 0:
            del self._pages[pid]
            self._partial[page.bits].discard(pid)
            self._free_pages.append(pid)
        else:
            self._partial[page.bits].add(pid)

    def offset(self, handle: int) -> int:
        """Byte offset of a block in the arena."""
        pid, slot = divmod(handle, 256)
        return pid * self.page_bytes + slot * self.block_bytes[self._pages[pid].bits]

    def stats(self) -> PoolStats:
        used: dict[int, int] = {b: 0 for b in self.block_bytes}
        for p in self._pages.values():
            used[p.bits] += p.used
        return PoolStats(pages_total=self.num_pages, pages_used=len(self._pages),
                         bytes_reserved=len(self._pages) * self.page_bytes,
                         bytes_blocks=sum(self.block_bytes[b] * n for b, n in used.items()), blocks_used=used)


def simulate_fragmentation(pool: SubPagePool, *, num_seqs: int = 200, max_len: int = 1024, block_size: int = 16,
                           arrival_steps: int = 600, cancel_prob: float = 0.1, seed: int = 0) -> dict:
    """Random workload on `pool`: fragmentation = 1 - sum(live bytes) / sum(reserved bytes) over all steps.

    Each sequence draws a width from the pool's classes, a final length uniform in [1, max_len], an arrival
    step uniform in [0, arrival_steps) and a prompt length uniform in [1, length]; it prefills its prompt on
    arrival, then decodes one token per step until its length, or is cancelled at a random step with
    probability `cancel_prob`. Finishing or cancelling frees all its blocks.
    Returns: {"fragmentation", "peak_bytes_reserved", "steps", "frees_balanced"}.
    """
    rnd = random.Random(seed)
    widths = sorted(pool.block_bytes)
    seqs = []
    for _ in range(num_seqs):
        n = rnd.randint(1, max_len)
        stop = rnd.randint(1, n) if rnd.random() < cancel_prob else n
        seqs.append({"bits": rnd.choice(widths), "arrive": rnd.randrange(arrival_steps), "len": 0,
                     "prompt": rnd.randint(1, n), "stop": stop, "blocks": []})
    live, waiting = [], sorted(seqs, key=lambda s: s["arrive"])
    live_sum = res_sum = 0
    peak, step = 0, 0
    while waiting or live:
        while waiting and waiting[0]["arrive"] <= step:
            s = waiting.pop(0)
            s["len"] = min(s["prompt"], s["stop"])
            live.append(s)
        for s in list(live):
            if s["blocks"] and s["len"] < s["stop"]:
                s["len"] += 1
            while len(s["blocks"]) * block_size < s["len"]:
                s["blocks"].append(pool.allocate(s["bits"]))
        st = pool.stats()
        live_sum += sum(s["len"] * pool.block_bytes[s["bits"]] / block_size for s in live)
        res_sum += st.bytes_reserved
        peak = max(peak, st.bytes_reserved)
        for s in list(live):
            if s["len"] >= s["stop"]:
                for h in s["blocks"]:
                    pool.free(h)
                live.remove(s)
        step += 1
    return {"fragmentation": 1.0 - live_sum / res_sum if res_sum else 0.0, "peak_bytes_reserved": peak,
            "steps": step, "frees_balanced": pool.stats().pages_used == 0 and math.isclose(
                len(pool._free_pages), pool.num_pages)}
