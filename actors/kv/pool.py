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

Page p as a `KVPages` block of one width is the byte range [p * page_bytes, p * page_bytes + tokens * bytes)
of one arena; with the same page stride for every width, each layer's arrays are strided views of the arena.
`QuantizedPagedKVCache` (actors/kv/quantized.py) stores its sealed tokens this way, and keeps its per-sequence
page tables in `SequencePageTables` below: append-only placement of quantized tokens, copy-on-write `fork`
(pages shared by reference count; the one page a sequence writes into next is copied first if shared),
`truncate` (pages past the cut return to the free list; a partially kept page stays and is masked by the
token count), `release`, and the byte accounting (live bytes, held bytes, fragmentation).

Widths are dictionary keys: bits in the simulation, (bits, Ok, Ov) layouts in the cache; anything hashable.
"""
from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass, field

from actors.kv.paged import BlockAllocator


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


@dataclass(slots=True)
class _PageTable:
    width: Hashable
    pages: list[int] = field(default_factory=list)
    tokens: int = 0  # valid tokens: token t lives in pages[t // T] at slot t % T, T = tokens per page


class SequencePageTables:
    """Per-sequence page tables over one `MixedWidthPagePool`, with sharing by reference count.

    A sequence (any hashable id) has one width and an append-only run of tokens. Invariants: a table holds
    exactly ceil(tokens / T) pages; each page holder owns one reference, so every page returns to the free list
    exactly once, when its last holder lets it go (release, truncate, or the copy-on-write below).

    Raises:
        ValueError: adding an existing sequence, an unknown width, an unknown sequence, a negative count.
        MemoryError: (append, from the pool) no free page.
    """

    def __init__(self, pool: MixedWidthPagePool):
        self.pool = pool
        self._t: dict[Hashable, _PageTable] = {}

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._t

    def __len__(self) -> int:
        return len(self._t)

    def _get(self, seq: Hashable) -> _PageTable:
        t = self._t.get(seq)
        if t is None:
            raise ValueError(f"sequence {seq!r} has no page table")
        return t

    def add(self, seq: Hashable, width: Hashable) -> None:
        """Start an empty table for `seq` at `width` (a key of the pool's bytes_per_token)."""
        if seq in self._t:
            raise ValueError(f"sequence {seq!r} already has a page table")
        self.pool.tokens_per_page(width)  # validates the width
        self._t[seq] = _PageTable(width)

    def width(self, seq: Hashable) -> Hashable:
        return self._get(seq).width

    def tokens(self, seq: Hashable) -> int:
        """Valid tokens of `seq`."""
        return self._get(seq).tokens

    def pages(self, seq: Hashable) -> list[int]:
        """The page table of `seq` (the live list: read, do not modify)."""
        return self._get(seq).pages

    def append(self, seq: Hashable, n: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Place n more tokens after the valid ones; returns (pages [n], slots [n], copies).

        copies: (src page, dst page) pairs the caller must copy, every layer, BEFORE writing the tokens: a page
        that will be written and is shared with another sequence is replaced in this table by a fresh copy
        (copy-on-write; only the page holding token `tokens` can be both shared and written, since pages
        before it are full and never written again).
        Raises: ValueError if n < 0; MemoryError if the pool runs out (the table stays consistent).
        """
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        t = self._get(seq)
        if n == 0:
            return [], [], []
        per = self.pool.tokens_per_page(t.width)
        copies = []
        first, last = t.tokens // per, (t.tokens + n - 1) // per
        for i in range(first, min(last + 1, len(t.pages))):
            old = t.pages[i]
            if self.pool.refcount(old) > 1:
                new = self.pool.allocate()
                copies.append((old, new))
                t.pages[i] = new
                self.pool.free_all([old])  # drops this table's reference; the other holders keep the page
        while len(t.pages) <= last:
            t.pages.append(self.pool.allocate())
        pos = range(t.tokens, t.tokens + n)
        t.tokens += n
        return [t.pages[p // per] for p in pos], [p % per for p in pos], copies

    def locate(self, seq: Hashable, start: int, stop: int) -> tuple[list[int], list[int]]:
        """(pages, slots) of valid tokens [start, stop). Raises ValueError outside [0, tokens]."""
        t = self._get(seq)
        if not 0 <= start <= stop <= t.tokens:
            raise ValueError(f"tokens [{start}, {stop}) outside the {t.tokens} valid tokens of {seq!r}")
        per = self.pool.tokens_per_page(t.width)
        return [t.pages[p // per] for p in range(start, stop)], [p % per for p in range(start, stop)]

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """`dst` gets `src`'s table; every page gains a reference (no copy until one of them writes)."""
        s = self._get(src)
        if dst in self._t:
            raise ValueError(f"sequence {dst!r} already has a page table")
        for p in s.pages:
            self.pool.allocator.share(p)
        self._t[dst] = _PageTable(s.width, list(s.pages), s.tokens)

    def truncate(self, seq: Hashable, tokens: int) -> None:
        """Keep the first `tokens` valid tokens (no-op above the count); pages past the cut lose a reference.

        A page the cut lands inside is kept; its tokens past the cut are masked by the count and overwritten
        (after a copy if shared) by the next `append`. Raises: ValueError if tokens < 0.
        """
        if tokens < 0:
            raise ValueError(f"tokens={tokens} must be >= 0")
        t = self._get(seq)
        if tokens >= t.tokens:
            return
        keep = -(-tokens // self.pool.tokens_per_page(t.width))
        self.pool.free_all(t.pages[keep:])
        del t.pages[keep:]
        t.tokens = tokens

    def release(self, seq: Hashable) -> None:
        """Drop `seq` and its references (no-op for an unknown sequence: release is idempotent)."""
        t = self._t.pop(seq, None)
        if t is not None:
            self.pool.free_all(t.pages)

    def last_page_shared(self, seq: Hashable) -> bool:
        """Whether the next `append` would copy a page first."""
        t = self._get(seq)
        per = self.pool.tokens_per_page(t.width)
        i = t.tokens // per
        return i < len(t.pages) and self.pool.refcount(t.pages[i]) > 1

    def live_bytes(self) -> int:
        """Bytes of valid tokens in held pages, each page counted once (its largest valid count over holders)."""
        best: dict[int, int] = {}
        for t in self._t.values():
            per, bpt = self.pool.tokens_per_page(t.width), self.pool.bytes_per_token[t.width]
            for i, p in enumerate(t.pages):
                best[p] = max(best.get(p, 0), min(per, t.tokens - i * per) * bpt)
        return sum(best.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of the pages held by some sequence (= pool.bytes_reserved)."""
        return self.pool.bytes_reserved

    def fragmentation(self) -> float:
        """1 - live bytes / held bytes now (page slack and each last page's unfilled tail count); 0 if none."""
        held = self.held_bytes
        return 1.0 - self.live_bytes() / held if held else 0.0


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
