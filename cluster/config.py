"""Cluster configuration (internal dataclass; user-facing validation happens at the CLI/HTTP edge)."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields

import torch

from actors.engine.config import EngineConfig
from actors.model.config import ModelConfig

# the engine's own defaults (one home: `actors.engine.config.EngineConfig`)
_ENGINE = {f.name: f.default for f in fields(EngineConfig)}
# Ray placement-group strategies for the rank bundles (trade-off: README "Several machines", `moeray generate --help`)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
# with ranks_per_node the bundles are node groups of N ranks: only strategies that put them on distinct nodes
NODE_GROUP_STRATEGIES = ("STRICT_SPREAD", "SPREAD")
# the CLI's --placement-timeout-s default: an interactive command on a fixed cluster fails fast
CLI_PLACEMENT_TIMEOUT_S = 60.0
# ClusterConfig.rank_silence_s's default: 4 missed heartbeats (one a second), then 4 s to answer a health call; the
# router then declares a node lost without a reset after 8 s, before the 10 s collective timeout (pg_timeout_s)
RANK_SILENCE_S = 4.0
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny-moe")


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """How many ranks, what each runs, and what resources each asks Ray for.

    ranks: world size of the EP group. num_cpus_per_rank: fractional CPU per rank bundle
    (default 0.5 so 2 ranks fit a 2-core machine next to the driver). num_gpus_per_rank: 1 on CUDA.
    kv_cache_bytes: KV budget per rank (bytes). num_threads_per_rank: compute threads of each rank (0: the CPUs of
    its node over the ranks placed there, `actors.rank.threads`). pg_timeout_s: process-group timeout (<= 10 s): a
    collective waits this long for a silent peer (a node lost without a reset), then the rank fails its step.
    rank_silence_s: the router's bound on a rank's silence (see the field); with ranks >= 2 it must be below
    pg_timeout_s / 2, so that the router's verdict comes before the collective timeout (`check_silence`).
    placement_strategy: the rank placement group's Ray strategy, one of PLACEMENT_STRATEGIES (PACK: as few
    nodes as possible; SPREAD: across nodes, soft; STRICT_SPREAD: one rank per node; STRICT_PACK: one node).
    None (the default) resolves here to PACK, or to STRICT_SPREAD with ranks_per_node.
    ranks_per_node: N ranks on each node (None: no grouping, one bundle per rank). ranks must be a multiple of N;
    the placement group is then ranks / N bundles of N x the per-rank resources (`cluster.node_groups`), and
    placement_strategy applies to those node groups: STRICT_SPREAD (the default) puts them on ranks / N distinct
    nodes or waits; SPREAD on distinct nodes where possible (two groups may share a node, e.g. after a node loss).
    PACK / STRICT_PACK with ranks_per_node are a ValueError (they would stack groups on one node).
    placement_timeout_s: seconds `EPCluster` waits for Ray to place the rank placement group before it gives up
    with `cluster.node_groups.PlacementTimeoutError` (a TimeoutError naming the layout and the cluster's
    resources); finite and > 0. Patient by default (nodes may be autoscaled in); `moeray generate|serve
    --placement-timeout-s` defaults to CLI_PLACEMENT_TIMEOUT_S. rank_niceness: the rank actors' CPU niceness, 0..19
    or None (see the field).
    """

    model: str = DEFAULT_MODEL
    ranks: int = 2
    dtype: str = _ENGINE["dtype"]
    max_model_len: int | None = None  # default: the model's max_position_embeddings (as vLLM)
    max_num_seqs: int = _ENGINE["max_num_seqs"]
    max_batched_tokens: int = _ENGINE["max_batched_tokens"]
    block_size: int = _ENGINE["block_size"]
    kv_cache_bytes: int = _ENGINE["kv_cache_bytes"]
    num_cpus_per_rank: float = 0.5
    num_gpus_per_rank: float = 0.0
    num_threads_per_rank: int = 0  # 0: the node's CPUs over the ranks on it (actors.rank.threads)
    pg_timeout_s: float = 10.0
    # seconds without a frame on a rank's channel before the router asks it `health`, with as long to answer
    # (`router_service.rank_channels`): a rank on a node lost without a reset is found within 2x this
    rank_silence_s: float = RANK_SILENCE_S
    placement_strategy: str | None = None  # resolved in __post_init__: PACK, or STRICT_SPREAD with ranks_per_node
    ranks_per_node: int | None = None
    placement_timeout_s: float = 300.0
    # every routed expert on two ranks (`cluster.placement.redundant_placement`): the loss of one rank leaves the
    # survivors serving (elastic EP, `EPCluster.shrink`) instead of a whole-group rebuild; costs expert memory
    redundant_experts: bool = False
    # "auto": on CPU (gloo) with every rank on one node, the decode step's small all-to-alls (step agreement,
    # fixed-capacity dispatch) go through shared memory (`actors.rank.shm_collective`); "torch": all via gloo/NCCL
    transport: str = "auto"
    engine_options: dict = field(default_factory=dict)  # extra EngineConfig fields (kv_bits, weight_bits, ...)
    # the rank actors' CPU niceness (`RAY_worker_niceness` in their runtime env; None: Ray's 15 for workers, below
    # its own daemons and any nice-0 process, whose every wake-up preempts a rank at once; lockstep ranks then stall
    # each other at the next exchange). 0, as Ray runs job drivers, with the Serve replica (the front door) at 0 as
    # well (`router_service.serve.deployment`): a rank above the front door starves it where the ranks hold every
    # core (BENCHMARKS.md). 0..19: lowering a niceness would need privilege.
    rank_niceness: int | None = 0
    # the router's rank choice (router_service/prefix_affinity.py, after Ray Serve LLM's PrefixCacheAffinityRouter):
    # the rank whose past prompts share the longest prefix with a request, when its requests in flight are within
    # `imbalanced_threshold` of the least-loaded rank's and the match covers >= `match_rate_threshold` of the
    # prompt; else the least-loaded rank. Applies only while the ranks' prefix caching is on.
    prefix_routing: bool = True
    prefix_routing_imbalanced_threshold: float = 8.0  # requests; Ray's default inf ignores load, its example is 10
    prefix_routing_match_rate_threshold: float = 0.1  # Ray's default

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks} must be >= 1")
        if not 0 < self.pg_timeout_s <= 10:
            raise ValueError(f"pg_timeout_s={self.pg_timeout_s} must be in (0, 10]")
        check_placement_timeout(self.placement_timeout_s)
        check_silence(self.rank_silence_s, self.pg_timeout_s, self.ranks)
        self.placement_strategy = resolve_placement(self.ranks, self.ranks_per_node, self.placement_strategy)
        if self.redundant_experts and self.ranks < 2:
            raise ValueError(f"redundant_experts needs ranks >= 2 (every expert on two ranks), got ranks={self.ranks}")
        if self.transport not in ("auto", "torch"):
            raise ValueError(f"transport={self.transport!r} must be auto or torch")
        check_prefix_routing(self.prefix_routing_imbalanced_threshold, self.prefix_routing_match_rate_threshold)
        if self.num_threads_per_rank < 0:
            raise ValueError(f"num_threads_per_rank={self.num_threads_per_rank} must be >= 0 (0: automatic)")
        if self.rank_niceness is not None and not 0 <= self.rank_niceness <= 19:
            raise ValueError(f"rank_niceness={self.rank_niceness} must be in [0, 19] or None (Ray's default)")
        if self.num_cpus_per_rank <= 0:
            raise ValueError(f"num_cpus_per_rank={self.num_cpus_per_rank} must be > 0")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model={self.model!r}: no config.json there")
        mc = ModelConfig.from_pretrained(self.model)
        if self.max_model_len is None:
            self.max_model_len = mc.max_position_embeddings
        if not 1 <= self.max_model_len <= mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} must be in [1, the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}]")

    @property
    def backend(self) -> str:
        return "nccl" if self.num_gpus_per_rank > 0 else "gloo"

    def engine_config(self) -> dict:
        return {"model": self.model, "dtype": self.dtype, "block_size": self.block_size,
                "kv_cache_bytes": self.kv_cache_bytes, "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs, "max_batched_tokens": self.max_batched_tokens,
                **self.engine_options}

    @classmethod
    def auto(cls, **kw) -> "ClusterConfig":
        """One rank per GPU on CUDA (unless `ranks` given), CPU defaults otherwise."""
        kw.setdefault("ranks", default_ranks())
        if torch.cuda.is_available():
            kw.setdefault("num_gpus_per_rank", 1.0)
            kw.setdefault("num_cpus_per_rank", 1.0)
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


def default_ranks() -> int:
    """The rank count `ClusterConfig.auto` uses when none is given: one per visible GPU, else the field's default."""
    return torch.cuda.device_count() if torch.cuda.is_available() else ClusterConfig.__dataclass_fields__["ranks"].default


def check_prefix_routing(imbalanced_threshold: float, match_rate_threshold: float) -> None:
    """Raises ValueError unless imbalanced_threshold >= 0 (requests; inf allowed) and match_rate_threshold is in
    [0, 1] (names the field)."""
    if not imbalanced_threshold >= 0:
        raise ValueError(f"prefix_routing_imbalanced_threshold={imbalanced_threshold} must be >= 0 (requests)")
    if not 0 <= match_rate_threshold <= 1:
        raise ValueError(f"prefix_routing_match_rate_threshold={match_rate_threshold} must be in [0, 1]")


def check_silence(rank_silence_s: float, pg_timeout_s: float, ranks: int) -> None:
    """Raises ValueError unless rank_silence_s (seconds) is > 0 and finite and, with ranks >= 2, below
    pg_timeout_s / 2 (names both fields and the limit). The router declares a silent rank (its node lost without a
    reset) lost up to 2 x rank_silence_s after its last frame; a survivor's collective waiting on it gives up after
    pg_timeout_s. The router's verdict must come first: else the survivor's step fails first, clients read that the
    survivor failed, and (without redundant experts) the rebuild asks the silent rank again."""
    if not 0 < rank_silence_s < math.inf:
        raise ValueError(f"rank_silence_s={rank_silence_s} must be > 0 and finite (seconds)")
    if ranks >= 2 and not 2 * rank_silence_s < pg_timeout_s:
        raise ValueError(f"rank_silence_s={rank_silence_s} must be < pg_timeout_s / 2 = {pg_timeout_s / 2:g} "
                         f"(pg_timeout_s={pg_timeout_s}): a silent rank is declared lost up to 2 x rank_silence_s "
                         f"after its last frame, and that must come before a survivor's collective times out")


def check_placement_timeout(placement_timeout_s: float) -> None:
    """Raises ValueError unless placement_timeout_s (seconds) is finite and > 0 (names the field)."""
    if not 0 < placement_timeout_s < math.inf:
        raise ValueError(f"placement_timeout_s={placement_timeout_s} must be > 0 and finite (seconds)")


def resolve_placement(ranks: int, ranks_per_node: int | None, placement_strategy: str | None) -> str:
    """The rank placement group's strategy for these ClusterConfig fields: placement_strategy if given, else PACK,
    or STRICT_SPREAD with ranks_per_node (node groups on distinct nodes).

    Raises ValueError (naming the fields) on a strategy not in PLACEMENT_STRATEGIES, ranks_per_node < 1, ranks
    not a multiple of ranks_per_node, or ranks_per_node with a strategy not in NODE_GROUP_STRATEGIES."""
    if placement_strategy is not None and placement_strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement_strategy={placement_strategy!r} must be one of {', '.join(PLACEMENT_STRATEGIES)}")
    if ranks_per_node is None:
        return placement_strategy or "PACK"
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 (or unset)")
    if ranks % ranks_per_node:
        raise ValueError(f"ranks={ranks} must be a multiple of ranks_per_node={ranks_per_node} (that many ranks "
                         f"on each node)")
    if placement_strategy not in (None, *NODE_GROUP_STRATEGIES):
        raise ValueError(f"placement_strategy={placement_strategy!r} with ranks_per_node={ranks_per_node} must be "
                         f"one of {', '.join(NODE_GROUP_STRATEGIES)} or unset (STRICT_SPREAD): {placement_strategy} "
                         f"would put several node groups on one node")
    return placement_strategy or "STRICT_SPREAD"
