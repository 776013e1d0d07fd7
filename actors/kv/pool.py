"""One page pool for quantized KV blocks of mixed bit widths (2/3/4 bits) with low fragmentation.

Quantized tokens cost different bytes per width (tiny-moe, all layers: 304 / 432 / 560 bytes per token at 2 / 3
/ 4 bits), so equal-token blocks of different widths differ in size, and a pool of the largest block size
would waste up to 46% on 2-bit sequences. Here every page has the same byte size and a page holds as many
tokens as its width allows (sub-page granularity in tokens: at 5184 bytes, 17 / 12 / 9 tokens), so any free
page serves any width, one free list suffices, and a finished sequence returns whole pages.

Why not slabs (a page carved into several blocks of one width): measured with `simulate_fragmentation` on
the workload below, slabs of 176 KiB pages (37 / 26 / 20 blocks) pinned half-empty pages after sequences
finished and wasted 29-44% of the bytes held; one block per page cannot pin anything.

The page size (`choose_page_bytes`) trades page slack (bytes a width cannot fill) against the unfilled tail
of each sequence's last page (half a page of tokens on average).

Fragmentation = 1 - (bytes of live KV data) / (bytes of pages held), summed over the steps of a workload;
live data = tokens * bytes per token of their width, so page slack and unfilled last pages count as waste.
Target: <= 5% on 200 sequences with lengths uniform in [1, 1024], widths mixed, random arrival / finish.

What a page holds: T_w = page_bytes // bytes_per_token[w] quantized tokens of ONE width w at a time (its
holder's); page p is the byte range [p * page_bytes, (p + 1) * page_bytes) of an arena, so with the same page
stride for every width each width's arrays are strided views of one arena (`QuantizedPagedKVCache`,
actors/kv/quantized.py, lays them out in actors/kv/quantized_layout.py). Ownership: page ids and their
reference counts live in the pool's `BlockAllocator` (actors/kv/allocator.py); per-sequence placement,
sharing and copy-on-write are `SequencePageTables` (actors/kv/page_tables.py).

Widths are dictionary keys: bits in the simulation, (bits, Ok, Ov, Pk) layouts in the cache; anything hashable.
"""
from __future__ import annotations

import random

from actors.kv.allocator import BlockAllocator


def choose_page_bytes(bytes_per_token: dict[int, int], *, lo: int = 2048, hi: int = 32768, step: int = 16,
                      mean_live_tokens: float = 400.0) -> int:
    """Page size in [lo, hi] (multiple of `step`) minimising expected waste over the widths.

    Waste of width b = page slack (page % bytes_per_token[b]) / page + half a page of tokens / mean_live_tokens.
    Raises: ValueError if a token does not fit the largest page or the range is empty.
    """
    if not bytes_per_token or max(bytes_per_token.values()) > hi or lo > hi or step < 1:
        raise ValueError(f"bytes_per_token={bytes_per_token} must fit pages in [lo={lo}, hi={hi}] (step={step})")

    def waste(p: int) -> float:
        return sum((p % t) / p + (p // t) / 2 / mean_live_tokens for t in bytes_per_token.values())

    start = -(-max(lo, max(bytes_per_token.values())) // step) * step
    return min(range(start, hi + 1, step), key=lambda p: (waste(p), p))


class MixedWidthPagePool:
    """Equal-byte pages, each holding `tokens_per_page(bits)` quantized tokens of one width.

    Args:
        bytes_per_token: {bits: bytes of one quantized token, all layers (codes, scales, outliers)}.
        page_bytes: bytes per page (>= the largest token). num_pages: pages in the pool (>= 1).
    Raises:
        ValueError: a token larger than a page, num_pages < 1, unknown bits.
        MemoryError: `allocate` with no free page.
    """

    def __init__(self, bytes_per_token: dict[int, int], page_bytes: int, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        for b, t in bytes_per_token.items():
            if not 0 < t <= page_bytes:
                raise ValueError(f"bytes_per_token[{b}]={t} must be in (0, page_bytes={page_bytes}]")
        self.bytes_per_token = dict(bytes_per_token)
        self.page_bytes, self.num_pages = page_bytes, num_pages
        self.allocator = BlockAllocator(num_pages)

    def tokens_per_page(self, bits: int) -> int:
        if bits not in self.bytes_per_token:
            raise ValueError(f"bits={bits} is not one of {sorted(self.bytes_per_token)}")
        return self.page_bytes // self.bytes_per_token[bits]

    def pages_for(self, bits: int, tokens: int) -> int:
        """Pages a sequence of `tokens` tokens at `bits` bits needs."""
        return -(-tokens // self.tokens_per_page(bits))

    def allocate(self) -> int:
        return self.allocator.allocate()

    def free_all(self, pages: list[int]) -> None:
        self.allocator.free_all(pages)

    def refcount(self, page: int) -> int:
        """Holders of `page` (0 when free)."""
        return self.allocator._ref[page]  # BlockAllocator keeps the counts; it has no public getter

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def offset(self, page: int) -> int:
        """Byte offset of a page in the arena."""
        return page * self.page_bytes

    @property
    def bytes_reserved(self) -> int:
        """Bytes of pages held by sequences."""
        return self.allocator.num_used * self.page_bytes

    def max_concurrent_sequences(self, bits: int, tokens: int) -> int:
        """Sequences of `tokens` tokens at `bits` bits the pool holds at once."""
        return self.num_pages // self.pages_for(bits, tokens)


def simulate_fragmentation(pool: MixedWidthPagePool, *, num_seqs: int = 200, max_len: int = 1024,
                           arrival_steps: int = 600, cancel_prob: float = 0.1, seed: int = 0) -> dict:
    """Random workload on `pool`; fragmentation = 1 - sum(live bytes) / sum(reserved bytes) over all steps.

    Each sequence draws a width uniformly from the pool's widths, a final length uniform in [1, max_len], an
    arrival step uniform in [0, arrival_steps) and a prompt length uniform in [1, length]; it prefills its
    prompt on arrival, then decodes one token per step until its length, or until a random cancellation
    point (probability `cancel_prob`). Finishing or cancelling frees all its pages.
    Returns: {"fragmentation", "peak_bytes_reserved", "steps", "free_pages_restored"}.
    Raises: MemoryError if the pool is too small for the workload.
    """
    rnd = random.Random(seed)
    widths = sorted(pool.bytes_per_token)
    free0 = pool.allocator.num_free
    seqs = []
    for _ in range(num_seqs):
        n = rnd.randint(1, max_len)
        stop = rnd.randint(1, n) if rnd.random() < cancel_prob else n
        seqs.append({"bits": rnd.choice(widths), "arrive": rnd.randrange(arrival_steps), "len": 0,
                     "prompt": rnd.randint(1, n), "stop": stop, "pages": []})
    waiting = sorted(seqs, key=lambda s: s["arrive"])
    live: list[dict] = []
    live_sum = res_sum = 0.0
    peak = step = 0
    while waiting or live:
        while waiting and waiting[0]["arrive"] <= step:
            s = waiting.pop(0)
            s["len"] = min(s["prompt"], s["stop"])
            live.append(s)
        for s in live:
            if s["pages"] and s["len"] < s["stop"]:
                s["len"] += 1
            while len(s["pages"]) < pool.pages_for(s["bits"], s["len"]):
                s["pages"].append(pool.allocate())
        live_sum += sum(s["len"] * pool.bytes_per_token[s["bits"]] for s in live)
        res_sum += pool.bytes_reserved
        peak = max(peak, pool.bytes_reserved)
        for s in [s for s in live if s["len"] >= s["stop"]]:
            pool.free_all(s["pages"])
            live.remove(s)
        step += 1
    return {"fragmentation": 1.0 - live_sum / res_sum if res_sum else 0.0, "peak_bytes_reserved": peak,
            "steps": step, "free_pages_restored": pool.allocator.num_free == free0}
