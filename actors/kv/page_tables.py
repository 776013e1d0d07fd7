"""Per-sequence page tables over the quantized page pool: where each sealed token lives, shared by refcount.

A sequence (any hashable id; the quantized cache uses its first logical block) has one width and an
append-only run of valid tokens: token t lives in page `pages[t // T]` at slot `t % T`, T = the pool's tokens
per page at that width. Page p of the pool is the byte range [p * page_bytes, (p + 1) * page_bytes) of every
layer's arena (actors/kv/pool.py, actors/kv/quantized_layout.py).

Invariants:
  * a table holds exactly ceil(tokens / T) pages; pages before the one holding token `tokens` are full and
    never written again;
  * every holder of a page owns one reference in the pool's `BlockAllocator` (actors/kv/allocator.py): `fork`
    shares pages instead of copying them, and a page returns to the free list exactly once, when its last
    holder lets it go (`release`, `truncate`, or the copy-on-write below);
  * copy-on-write: `append` never writes a shared page in place; the one page that can be both shared and
    written (the one holding token `tokens`) is replaced by a fresh copy first, and the caller copies its
    bytes, every layer, before writing;
  * `truncate` returns the pages past the cut; a partially kept page stays, its tokens past the cut masked
    by the count and overwritten (after a copy if shared) by the next `append`.
Byte accounting: `live_bytes` (valid tokens, a shared page counted once), `held_bytes`, `fragmentation`.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from actors.kv.pool import MixedWidthPagePool

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
