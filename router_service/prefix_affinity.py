"""Rank choice for a new request: prefix-aware (the rank likely to hold its longest cached prefix) when load allows,
else least-loaded, after Ray Serve LLM's `PrefixCacheAffinityRouter`.

What the router knows. Each rank's automatic prefix cache (actors/kv/prefix_cache.py, actors/kv/quantized_prefix.py)
names a full KV block by a chained hash of the token ids before it; the router keeps, per rank, an LRU-bounded
index of the same chained block hashes (`chain_hashes`, the same block size and cut points) of the prompts it sent
there. Asking the ranks instead would cost a Ray call (or a frame round trip) per request on the submit path;
the index costs one sha256 per prompt block, computed outside the router's lock. The quantized cache salts its
hashes with the page layout of the sequence's KV profile; the router only compares its own hashes with its own, so
it salts them with the profile a request names (`kv_profile`; unset or "auto": none, since the rank picks "auto"
from the whole prompt), and prompts under different named profiles never match.

Ageing: a rank evicts its cached blocks LRU when it needs pages; the index approximates that with an LRU of at most
`capacity_blocks` (the rank's KV block count) hashes per rank, touched on every prompt routed there, tail before
head (a rank frees a sequence's blocks last to first, so the head of a prefix outlives its tail). It over-counts
what a rank holds (running sequences and generated tokens also take blocks; the quantized cache keeps at most
max_num_seqs ended sources), so a match is a likely hit, not a sure one: a wrong guess costs a prefill, never a
wrong token (the rank's own lookup decides what is reused). Generated tokens are not indexed. The index is cleared
when the EP group is rebuilt (the caches are gone).

The choice (`choose_rank`), with load = requests in flight on a rank as the router counts them (running + queued):
  1. no prefix data, or a request that cannot hit (prompt_logprobs, a stateful gating policy: `params_may_hit`):
     least-loaded;
  2. the ranks whose load is within `imbalanced_threshold` requests of the least-loaded are the candidates
     (Ray: "load balanced" while max - min queue length <= the threshold; this is that test per rank);
  3. among them the longest match (in blocks); if it covers at least `match_rate_threshold` of the prompt's tokens
     (Ray's match rate, counted in tokens rather than characters), the least-loaded of the ranks with that match
     gets the request (counted in `routed`); below it, least-loaded (Ray picks the replica with the smallest
     tree there; the least-loaded rank spreads new prefixes just as well and keeps the EP group's steps even).
Least-loaded means the smallest outstanding token cost (prompt + max_tokens of its requests in flight), ties to the
lower rank: the router's rule before prefix routing.
"""
from __future__ import annotations

from collections import OrderedDict

from dataclasses import fields

from actors.kv.calibration import RECOMMENDED_SINK_TOKENS
from actors.kv.prefix_cache import chain_hashes, params_may_hit
from cluster.config import ClusterConfig, check_prefix_routing

_DEFAULTS = {f.name: f.default for f in fields(ClusterConfig)}  # one home for the thresholds' defaults


class PrefixIndex:
    """Per rank, the chained block hashes of the prompts routed there, LRU-bounded (module docstring).

    Args: ranks: world size. block_size: S, tokens per KV block (the ranks'). capacity_blocks: hashes kept per rank
    at most (>= 1). first_cut: tokens before the first block boundary (the quantized cache's sink tokens; 0 for
    full precision), so cut j is at first_cut + (j + 1) * S.
    """

    def __init__(self, ranks: int, block_size: int, capacity_blocks: int, first_cut: int = 0):
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError(f"block_size={block_size} and capacity_blocks={capacity_blocks} must be >= 1")
        self.block_size, self.capacity, self.first_cut = block_size, capacity_blocks, first_cut
        self._lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(ranks)]

    def hashes(self, token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        """Chained hashes of the prompt's full blocks a rank may reuse (at most len - 1 tokens, as the rank's
        `match`: the last position is always computed). `salt`: what else names the blocks (a KV profile)."""
        cuts = list(range(self.first_cut + self.block_size, len(token_ids), self.block_size))
        return chain_hashes(token_ids, cuts, salt) if cuts else []

    def match(self, hashes: list[bytes]) -> list[int]:
        """Per rank, how many leading blocks of `hashes` its index holds."""
        out = []
        for lru in self._lru:
            n = 0
            while n < len(hashes) and hashes[n] in lru:
                n += 1
            out.append(n)
        return out

    def insert(self, rank: int, hashes: list[bytes]) -> None:
        """Record (or touch) `hashes` on `rank`, head most recent; evict the least recent past the capacity."""
        lru = self._lru[rank]
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def size(self, rank: int) -> int:
        return len(self._lru[rank])

    def clear(self, capacity_blocks: int | None = None, ranks: int | None = None) -> None:
        """Forget everything (the EP group was rebuilt); optionally a new per-rank capacity and rank count."""
        if capacity_blocks is not None:
            self.capacity = max(1, capacity_blocks)
        self._lru = [OrderedDict() for _ in range(len(self._lru) if ranks is None else ranks)]

    def drop(self, rank: int) -> None:
        """Forget rank `rank` (it left the group); the ranks above it move down one index."""
        del self._lru[rank]

    def insert_rank(self, rank: int) -> None:
        """A new, empty rank at index `rank`; the ranks from it move up one index."""
        self._lru.insert(rank, OrderedDict())


def choose_rank(costs: list[int], requests: list[int], matched_tokens: list[int], prompt_tokens: int,
                imbalanced_threshold: float, match_rate_threshold: float) -> tuple[int, bool]:
    """(rank, chosen by prefix affinity) for one request (rules in the module docstring).

    Args: costs: outstanding token cost per rank. requests: requests in flight per rank. matched_tokens: per rank,
    tokens of the prompt's prefix its index holds (all 0: no prefix data). prompt_tokens: the prompt's length (> 0).
    """
    ranks = range(len(costs))
    least = min(ranks, key=lambda r: (costs[r], r))
    floor = min(requests)
    cands = [r for r in ranks if requests[r] - floor <= imbalanced_threshold]
    best = max(matched_tokens[r] for r in cands)
    if best == 0 or best < match_rate_threshold * prompt_tokens:
        return least, False
    return min((r for r in cands if matched_tokens[r] == best), key=lambda r: (requests[r], costs[r], r)), True


class RankChooser:
    """The router's per-rank load (token cost and request count of the requests in flight) and, with prefix routing,
    the `PrefixIndex`; `choose` picks a rank (`choose_rank`) and charges it. Not thread-safe: the router calls
    `choose`, `release` and `reset` under its lock (`hashes` needs none).

    Args: ranks: world size. prefix_routing: route by prefix affinity (off: least-loaded only). block_size, first_cut:
    the ranks' block boundaries. capacity_blocks: the index's hashes per rank (the rank's KV block count).
    imbalanced_threshold (requests, >= 0), match_rate_threshold (in [0, 1]): see `choose_rank`.
    default_gating: the deployment's gating policy (a request on a stateful one cannot hit, `params_may_hit`).
    Raises: ValueError for a threshold out of range (naming it).
    """

    def __init__(self, ranks: int, *, prefix_routing: bool = True, block_size: int = 16, first_cut: int = 0,
                 capacity_blocks: int = 1,
                 imbalanced_threshold: float = _DEFAULTS["prefix_routing_imbalanced_threshold"],
                 match_rate_threshold: float = _DEFAULTS["prefix_routing_match_rate_threshold"],
                 default_gating: str = "exact"):
        check_prefix_routing(imbalanced_threshold, match_rate_threshold)
        self.ranks = self._world = ranks  # ranks now (after a `drop`), ranks of a whole group
        self.imbalanced_threshold, self.match_rate_threshold = imbalanced_threshold, match_rate_threshold
        self.default_gating = default_gating
        self.index = PrefixIndex(ranks, block_size, capacity_blocks, first_cut) if prefix_routing else None
        self.costs, self.requests = [0] * ranks, [0] * ranks
        self.routed = 0  # requests sent to a rank by prefix affinity since start

    @classmethod
    def for_cluster(cls, cfg, capacity_blocks: int = 1) -> "RankChooser":
        """From a `cluster.config.ClusterConfig`: prefix routing on when `cfg.prefix_routing` and the ranks' prefix
        caching (`engine_options["enable_prefix_caching"]`, default on) both are."""
        opts = cfg.engine_options
        on = cfg.prefix_routing and opts.get("enable_prefix_caching", True)
        return cls(cfg.ranks, prefix_routing=on, block_size=cfg.block_size,
                   first_cut=RECOMMENDED_SINK_TOKENS if opts.get("kv_bits") is not None else 0,
                   capacity_blocks=capacity_blocks, imbalanced_threshold=cfg.prefix_routing_imbalanced_threshold,
                   match_rate_threshold=cfg.prefix_routing_match_rate_threshold,
                   default_gating=opts.get("gating", "exact"))

    @property
    def prefix_routing(self) -> bool:
        return self.index is not None

    def hashes(self, token_ids: list[int], params) -> list[bytes] | None:
        """The prompt's block hashes when prefix routing applies to it (None: off, or `params` cannot hit)."""
        if self.index is None or not params_may_hit(params, self.default_gating):
            return None
        profile = params.kv_profile if params.kv_profile not in (None, "auto") else ""
        return self.index.hashes(token_ids, profile.encode())

    def choose(self, hashes: list[bytes] | None, prompt_tokens: int, cost: int) -> int:
        """The rank for a request (its `hashes` from `hashes`), charged `cost` tokens and one request; its hashes are
        recorded on that rank."""
        if hashes:
            matched = [n * self.index.block_size for n in self.index.match(hashes)]
        else:
            matched = [0] * self.ranks
        rank, by_prefix = choose_rank(self.costs, self.requests, matched, prompt_tokens,
                                      self.imbalanced_threshold, self.match_rate_threshold)
        self.routed += by_prefix
        if hashes:
            self.index.insert(rank, hashes)
        self.costs[rank] += cost
        self.requests[rank] += 1
        return rank

    def release(self, rank: int, cost: int) -> None:
        """A request on `rank` ended."""
        self.costs[rank] -= cost
        self.requests[rank] -= 1

    def drop(self, rank: int) -> None:
        """Rank `rank` left the group (elastic EP): its load and index entries go, the ranks above move down one."""
        del self.costs[rank], self.requests[rank]
        self.ranks -= 1
        if self.index is not None:
            self.index.drop(rank)

    def insert(self, rank: int) -> None:
        """A replacement rank joined as `rank` (elastic EP): no load, an empty index; the ranks from it move up."""
        self.costs.insert(rank, 0)
        self.requests.insert(rank, 0)
        self.ranks += 1
        if self.index is not None:
            self.index.insert_rank(rank)

    def reset(self, capacity_blocks: int | None = None) -> None:
        """A new EP group (all its ranks): no load, an empty index (optionally a new capacity per rank)."""
        self.ranks = self._world
        self.costs, self.requests = [0] * self.ranks, [0] * self.ranks
        if self.index is not None:
            self.index.clear(capacity_blocks, self.ranks)

