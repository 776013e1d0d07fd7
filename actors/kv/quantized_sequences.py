"""Per-sequence bookkeeping of the quantized KV cache: logical blocks, sequence states, pool budget, step plan.

Two levels of blocks:
  * logical blocks: the ids the scheduler allocates from `self.allocator` (one per S positions, as for any
    `KVCache`); they name a sequence (its first block id) and bound its length. They hold no data.
  * pages: physical storage, one page table per sequence (`SequencePageTables`), filled as blocks seal.
`allocator.num_free` is byte-aware: the logical blocks that still fit the page pool if each new one holds S
tokens at the widest width, after what the known sequences' blocks will claim, so the unchanged scheduler
admits more 2-bit than 4-bit sequences and never over-commits the pool.

Copy-on-write `fork`, `truncate`, and finish / cancel: a sequence is identified by its first logical block;
its staging slot, profile and page references are released when that block is freed (finish, abort,
preemption): the allocator calls back into the cache. Pages are reference counted, so each returns to the
free list exactly once.

Invariants:
  * a live sequence (key: its first logical block) has exactly one staging slot, one profile and one page
    table; `SequenceAllocator` calls `_release` when that block's last reference is freed, which returns the
    slot and drops the page references;
  * `_committed` caches what the live sequences will still claim from the pool; every change of a sequence
    (plan, new sequence, bind, fork, truncate, release) resets it to None;
  * the step plan is built once per step, by the first layer's `attend` (keyed by the `meta` object), and
    shared by every layer (two-batch overlap: one per micro-batch, the two kept side by side while their layers
    alternate); fork and truncate drop the cached plans.
`QuantizedKVSequences` is the bookkeeping half of `QuantizedPagedKVCache` (actors/kv/quantized.py): the cache's
constructor sets every attribute it reads (geometry, `profiles`, `tables`, `pool`, `allocator`, staging rows,
RoPE tables, `_seqs`, `_bound`, `_free_slots`, `_plan_meta`, `_other_plan`, `_committed`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.kv.allocator import BlockAllocator
from actors.kv.profile_choice import choose_profile


class SequenceAllocator(BlockAllocator):
    """Logical-block allocator: tells the cache when a block returns, and caps `num_free` by the page pool.

    It also counts allocation bursts (runs of `allocate` between two reads of `num_free`): the scheduler
    checks `num_free` before it hands one sequence its blocks, so a burst is one sequence, and the cache
    reserves one rounding page per burst until the step's plan tells it whose blocks they are.
    """

    def __init__(self, num_blocks: int, on_release, budget):
        super().__init__(num_blocks)
        self._on_release = on_release
        self._budget = budget
        self.bursts = 0
        self._queried = True

    def allocate(self) -> int:
        b = super().allocate()
        if self._queried:
            self.bursts += 1
            self._queried = False
        return b

    def free(self, block: int) -> None:
        super().free(block)
        if self._ref[block] == 0:
            self._on_release(block)

    @property
    def num_ids_free(self) -> int:
        """Free logical block ids, whatever the pool holds."""
        return len(self._free)

    @property
    def num_free(self) -> int:
        """Logical blocks that can be handed out now without over-committing the page pool."""
        self._queried = True
        return min(len(self._free), self._budget())


@dataclass(slots=True)
class SequenceState:
    slot: int  # staging slot
    profile: str
    length: int = 0  # tokens written (layer 0 view, updated once per step)
    nblocks: int = 0  # logical blocks known to belong to the sequence (for the pool budget)


class QuantizedKVSequences:
    """Sequences of a `QuantizedPagedKVCache`: profiles, staging slots, page tables, pool budget, step plan."""

    def _budget_free_blocks(self) -> int:
        """Logical blocks admissible now: free pages after what the live sequences' blocks will claim.

        A known sequence with nb logical blocks at width w will hold at most ceil(nb * S / T_w) pages (+1 when
        its next write copies a shared page). Blocks handed out but not yet seen in a step (unknown owner and
        width) are charged at the widest width, plus one rounding page per allocation burst (one sequence
        each, see `SequenceAllocator`), and one more page is kept for the sequence about to receive blocks.
        A caller that hands several sequences their blocks without reading `num_free` in between may
        over-commit by a page per extra sequence (MemoryError at the seal, never corruption).
        """
        s = self.block_size
        t_min = min(self.tokens_per_page.values())
        if self._committed is None:  # recomputed after any change of a sequence (plan, fork, truncate, release)
            outstanding = known = 0
            for first, st in self._seqs.items():
                t = self.tokens_per_page[self._key[st.profile]]
                need = -(-st.nblocks * s // t) + (1 if self.tables.last_page_shared(first) else 0)
                outstanding += max(0, need - len(self.tables.pages(first)))
                known += st.nblocks
            self._committed = (outstanding, known)
        outstanding, known = self._committed
        unknown = max(0, self.allocator.num_used - known)
        rounding = min(unknown, max(self.allocator.bursts, 1))
        pages = self.pool.num_free - outstanding - -(-unknown * s // t_min) - rounding - 1
        return max(0, pages) * t_min // s

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
            self.tables.release(first_block)
            self.tables.add(first_block, self._key[profile])
            self._committed = None
        elif st is None:
            self._bound[first_block] = profile

    def _release(self, block: int) -> None:
        self._bound.pop(block, None)
        st = self._seqs.pop(block, None)
        if st is not None:
            self._committed = None
            self.tables.release(block)
            self._free_slots.append(st.slot)

    def _new_state(self, first_block: int, profile: str) -> SequenceState:
        if not self._free_slots:
            raise MemoryError(f"all max_sequences={self.max_sequences} staging slots are in use")
        st = self._seqs[first_block] = SequenceState(slot=self._free_slots.pop(), profile=profile)
        self.tables.add(first_block, self._key[profile])
        self._committed = None
        return st

    def _state(self, first_block: int) -> SequenceState:
        st = self._seqs.get(first_block)
        if st is None:
            name = self._bound.pop(first_block, None) or choose_profile(None, list(self.profiles),
                                                                        self.default_profile)
            st = self._new_state(first_block, name)
        return st

    def fork(self, src_seq: int, dst_seq: int) -> None:
        """Copy-on-write fork: sequence `dst_seq` (a first logical block) continues from `src_seq`.

        The child shares every sealed quantized page of the parent by reference count and gets a copy of the
        parent's full-precision staging rows (sink and unsealed tail) in a slot of its own; it keeps the
        parent's profile and length. A later seal into a page still shared copies the page first, so neither
        side ever sees the other's new tokens. The caller owns the child's logical blocks: it must hold
        ceil(length / S) of them, the first being `dst_seq`, and free them as for any sequence.

        Raises:
            ValueError: `src_seq` is not a live sequence, or `dst_seq` already holds tokens or equals src_seq.
            MemoryError: no free staging slot.
        """
        st = self._seqs.get(src_seq)
        if st is None:
            raise ValueError(f"src_seq={src_seq} is not a live sequence of this cache")
        old = self._seqs.get(dst_seq)
        if dst_seq == src_seq or (old is not None and old.length > 0):
            raise ValueError(f"dst_seq={dst_seq} already holds tokens (or is src_seq)")
        if old is not None:
            self._release(dst_seq)
        self._bound.pop(dst_seq, None)
        if not self._free_slots:
            raise MemoryError(f"all max_sequences={self.max_sequences} staging slots are in use")
        new = SequenceState(slot=self._free_slots.pop(), profile=st.profile, length=st.length,
                        nblocks=-(-st.length // self.block_size))
        self._seqs[dst_seq] = new
        self.tables.fork(src_seq, dst_seq)
        self._plan_meta, self._other_plan, self._committed = None, None, None
        for sk, sv in zip(self.stage_k, self.stage_v):
            sk[new.slot] = sk[st.slot]
            sv[new.slot] = sv[st.slot]

    def truncate(self, seq: int, num_tokens: int) -> int:
        """Cut sequence `seq` (first logical block) back to its first `num_tokens` tokens.

        Quantized part: pages past the cut lose this sequence's reference (shared pages stay with their other
        holders). A cut inside a sealed block keeps that block's kept tokens SEALED and masks the rest (q
        becomes the cut) rather than dequantizing them back to staging: dequantized values would not requantize
        to the same codes (the per-token V scale moves), whereas kept-and-masked tokens are exactly what a
        never-truncated sequence holds once the block is complete again (quantization is per token). So after
        re-extending past that block's end, the sequence equals one built to the same tokens directly; before,
        the kept tokens of that one block are seen quantized where a fresh sequence would see full precision.
        Full-precision part: a cut in the unsealed tail or the sink just shortens it.

        Returns: logical blocks the caller keeps (ceil(num_tokens / S)); it frees the rest of its block table
            itself (keep >= 1: the first block names the sequence).
        Raises: ValueError if `seq` is not live or num_tokens is outside [0, length].
        """
        st = self._seqs.get(seq)
        if st is None:
            raise ValueError(f"seq={seq} is not a live sequence of this cache")
        if not 0 <= num_tokens <= st.length:
            raise ValueError(f"num_tokens={num_tokens} must be in [0, length={st.length}]")
        self.tables.truncate(seq, max(0, num_tokens - self.sink_tokens))
        st.length = num_tokens
        keep = -(-num_tokens // self.block_size)
        st.nblocks = min(st.nblocks, max(keep, 1))
        self._plan_meta, self._other_plan, self._committed = None, None, None  # cached plans are stale
        return keep

    # ------------------------------------------------------------------ the step plan (once per step)
    def _make_plan(self, meta) -> dict:
        """Bookkeeping of one step, shared by every layer: rows, seals, page placement, copy-on-write copies."""
        ns, s, dev = self.sink_tokens, self.block_size, self.device
        copies: list[tuple[int, int]] = []
        dec = []
        seals: dict[str, tuple[list, list, list, list]] = {}  # profile -> (slots, rows, pages, page slots)
        n_dec = meta.decode_tokens.numel()
        firsts = meta.decode_block_tables[:, 0].tolist() if n_dec else []  # host ints once, not a tensor op a row
        lengths_b = meta.decode_context_lens_host or meta.decode_context_lens.tolist()
        for b in range(n_dec):
            first = firsts[b]
            st = self._state(first)
            length = lengths_b[b]
            p = length - 1
            q = self.tables.tokens(first)
            if p < ns + q and (p >= ns or q):
                raise ValueError(f"decode at position {p} of sequence {first}, which holds {q} sealed tokens")
            st.length = length
            st.nblocks = max(st.nblocks, -(-length // s))
            row = p if p < ns else ns + (p - ns) % s
            if p >= ns and (p - ns) % s == s - 1:
                n_seal = p - ns + 1 - q
                pages, pslots, cp = self.tables.append(first, n_seal)
                copies += cp
                g = seals.setdefault(st.profile, ([], [], [], []))
                g[0].extend([st.slot] * n_seal)
                g[1].extend(range(ns + q % s, ns + q % s + n_seal))
                g[2].extend(pages)
                g[3].extend(pslots)
                q += n_seal
            dec.append((b, st, length, row, q, first))
        plan: dict = {"prefills": [], "decode": None}
        if dec:
            b_idx = [x[0] for x in dec]
            sealed = torch.tensor([x[4] for x in dec], dtype=torch.int64)
            lengths = torch.tensor([x[2] for x in dec], dtype=torch.int64)
            sink_lens = lengths.clamp(max=ns)
            tail_lens = lengths - sink_lens - sealed
            ptabs = [self.tables.pages(x[5]) for x in dec]
            m = max(1, max(len(t) for t in ptabs))
            ptab = torch.tensor([list(t) + [0] * (m - len(t)) for t in ptabs], dtype=torch.int32)  # one tensor op
            groups: dict[str, list[int]] = {}
            for i, x in enumerate(dec):
                groups.setdefault(x[1].profile, []).append(i)
            plan["decode"] = {
                "tok": meta.decode_tokens.to(dev)[b_idx],
                "slot": torch.tensor([x[1].slot for x in dec], device=dev),
                "row": torch.tensor([x[3] for x in dec], device=dev),
                "page_tables": ptab.to(dev),
                "context_lens": sealed.to(dev, torch.int32),
                "sink_lens": sink_lens.to(dev, torch.int32),
                "tail_lens": tail_lens.to(dev, torch.int32),
                "groups": {n: torch.tensor(ix, device=dev) for n, ix in groups.items()},
                "seals": {n: tuple(torch.tensor(v, dtype=torch.int64, device=dev) for v in g)
                          for n, g in seals.items()},
            }
        for start, n, ctx, table in meta.prefills:
            first = int(table[0])
            st = self._state(first)
            p0 = ctx - n
            if p0 != st.length:
                raise ValueError(f"prefill of sequence {first} starts at position {p0}; it holds {st.length} tokens")
            q_old = self.tables.tokens(first)
            q_new = max(q_old, (ctx - ns) // s * s) if ctx > ns else 0
            st.length = ctx
            st.nblocks = max(st.nblocks, int(table.numel()))
            pages, pslots, cp = self.tables.append(first, q_new - q_old)
            copies += cp
            rp, rs = self.tables.locate(first, 0, q_new)
            i64 = dict(dtype=torch.int64, device=dev)
            plan["prefills"].append((start, n, ctx, st, q_old, q_new,
                                     (torch.tensor(pages, **i64), torch.tensor(pslots, **i64)),
                                     (torch.tensor(rp, **i64), torch.tensor(rs, **i64))))
        self.allocator.bursts, self.allocator._queried = 0, True  # every block handed out has a known owner
        self._committed = None
        plan["copies"] = (torch.tensor([c[0] for c in copies], dtype=torch.int64, device=dev),
                          torch.tensor([c[1] for c in copies], dtype=torch.int64, device=dev)) if copies else None
        return plan
