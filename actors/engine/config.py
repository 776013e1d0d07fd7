"""Per-rank engine settings (`EngineConfig`): validated at construction, errors name the field and the limit."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.moe.gating import GatingConfig


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Per-rank engine settings (validated).

    kv_cache_bytes: KV memory budget of this rank in bytes. block_size: tokens per KV block.
    max_model_len: prompt + output tokens per sequence at most. dtype: compute dtype name.
    weight_storage: "auto" keeps the weight matrices of a bf16 checkpoint in bf16 when computing in fp32 on
    CPU and the bf16-weight kernel is available (`kernels.cpu`: same values, half the bytes read per
    decode step); "compute" casts every weight to `dtype`.
    """

    model: str
    dtype: str = "float32"
    weight_storage: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 64 * 2**20
    max_model_len: int = 1024
    max_num_seqs: int = 64
    # tokens computed per step at most (decodes + prefill chunks), vLLM's --max-num-batched-tokens; with
    # enable_chunked_prefill (--enable-chunked-prefill) a long prompt is split into chunks mixed into decode
    # steps, so running streams keep their pace (actors.engine.scheduler). 512 (vLLM V0's chunked-prefill
    # default; vLLM-CPU V1 serves 2048): a 500-token prompt in one step, 25.9 ms on 2 threads (256: two steps, 31.7);
    # the cost, the longest step 32 running streams see while a 1000-token prompt prefills: 36.8 ms (256: 20.8)
    # (bench/chunked_prefill.py, BENCHMARKS.md)
    max_batched_tokens: int = 512
    # ... and at most this many while any sequence decodes (its prefill chunks fill what the decodes leave), so a
    # long prompt arriving at an idle rank takes one 512-token step while running streams see 256-token steps
    # (a 500-token prompt idle: 25.9 ms; the longest step 32 streams see beside a 1000-token prefill: 20.8 ms at 256
    # against 36.8 at 512, bench/chunked_prefill.py). None: max_batched_tokens. Never below max_num_seqs.
    max_mixed_tokens: int | None = 256
    enable_chunked_prefill: bool = True
    # automatic prefix caching (vLLM's --enable-prefix-caching, on by default): full KV blocks kept by content
    # hash and shared between sequences (actors.kv.prefix_cache, actors.kv.quantized_prefix)
    enable_prefix_caching: bool = True
    num_threads: int = 0  # 0: leave torch's default
    kernel_backend: str = "torch"  # "torch" (PyTorch reference) | "triton"
    # KV cache: kv_bits None = full precision; 2/3/4 = quantized with profile `kv_profile`
    kv_bits: int | None = None
    kv_profile: str | None = None
    # further widths served from the same page pool; a request picks one by naming "<profile>-<b>bit"
    kv_extra_bits: tuple[int, ...] = ()
    # routed experts: weight_bits None = as in the checkpoint; 2/3/4 = packed at load time
    weight_bits: int | None = None
    weight_group_size: int = 64
    expert_cache_capacity: int | None = None  # experts per layer kept dequantized (None: 0 on CPU, else all)
    prefetch: str = "none"  # expert prefetch predictor name
    # packed experts per layer kept in memory (None: all); fewer are read on demand from the memory-mapped
    # packed checkpoint (the cold tier, actors.experts.cold_tier.ColdExpertTier)
    resident_experts: int | None = None
    # gating policy of the deployment (actors.moe.gating.POLICIES) and its knobs (GatingConfig)
    gating: str = "exact"
    gating_options: dict | None = None
    device: str = "auto"  # "auto": cuda if available (the actor's visible GPU), else cpu
    # two-batch overlap (actors.model.two_batch): a decode-only step whose agreed largest per-rank batch is at least
    # tbo_min_batch runs as two micro-batches, one's all-to-all in flight while the other computes; only over a
    # split transport (TCP across nodes, gloo), never the same-node shared memory. Off by default: slower, not
    # faster, on the 2-core test VM (BENCHMARKS.md "Two-batch overlap across nodes")
    two_batch_overlap: bool = False
    tbo_min_batch: int = 8

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if self.weight_storage not in ("auto", "compute"):
            raise ValueError(f"weight_storage={self.weight_storage!r} must be auto or compute")
        if self.kernel_backend not in ("torch", "triton"):
            raise ValueError(f"kernel_backend={self.kernel_backend!r} must be torch or triton")
        for name in ("kv_bits", "weight_bits"):
            b = getattr(self, name)
            if b is not None and b not in (2, 3, 4):
                raise ValueError(f"{name}={b} must be 2, 3 or 4 (or unset for full precision)")
        self.kv_extra_bits = tuple(self.kv_extra_bits or ())
        if any(b not in (2, 3, 4) for b in self.kv_extra_bits):
            raise ValueError(f"kv_extra_bits={list(self.kv_extra_bits)}: each must be 2, 3 or 4")
        if self.kv_extra_bits and self.kv_bits is None:
            raise ValueError("kv_extra_bits needs kv_bits (the default width) to be set")
        if self.resident_experts is not None and self.resident_experts < 1:
            raise ValueError(f"resident_experts={self.resident_experts} must be >= 1 (or unset: all resident)")
        for name in ("block_size", "kv_cache_bytes", "max_model_len", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_mixed_tokens is not None and self.max_mixed_tokens < 1:
            raise ValueError(f"max_mixed_tokens={self.max_mixed_tokens} must be >= 1 (or unset: max_batched_tokens)")
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_batched_tokens={self.max_batched_tokens} must be >= max_num_seqs="
                             f"{self.max_num_seqs} (a full decode batch must fit one step)")
        if self.tbo_min_batch < 2:
            raise ValueError(f"tbo_min_batch={self.tbo_min_batch} must be >= 2 (two micro-batches of >= 1 sequence)")
        self.gating_config()  # validates policy and options

    def gating_config(self) -> GatingConfig:
        """The deployment's `GatingConfig` (the fused selection kernel follows `kernel_backend`).

        Raises:
            ValueError: unknown policy or option, or an out-of-range knob.
        """
        return GatingConfig.from_options(self.gating, self.gating_options, backend=self.kernel_backend)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
