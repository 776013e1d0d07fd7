"""`moeray` command line. stdout carries completions only; logs go to stderr."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

from cluster.config import (CLI_PLACEMENT_TIMEOUT_S, DEFAULT_MODEL, PLACEMENT_STRATEGIES, ClusterConfig,
                            check_placement_timeout, check_prefix_routing, default_ranks, resolve_placement)

_CLUSTER = ClusterConfig.__dataclass_fields__  # defaults come from the config, not retyped here


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default, except an unset (None) or empty one: those help texts say what unset
    means ("unset: ...") themselves."""

    def _get_help_string(self, action):
        if action.default is None or action.default == [] or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for PROMPTs through the EP cluster",
                       formatter_class=HelpFormatter)
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder (HF layout)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks; unset: 2 on CPU, one per GPU on CUDA")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None, help="per-request RNG seed; unset: random")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(p)
    p.add_argument("--address", default=None, help="Ray address (else RAY_ADDRESS, else a private local Ray)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt per line (else the completion text; with several prompts, each "
                        "after a '--- prompt i/n: PROMPT ---' line)")
    p.add_argument("--stats", action="store_true", help="print the cluster expert-load snapshot to stderr")
    p.set_defaults(func=cmd_generate)


def add_engine_args(p) -> None:
    """Where the ranks run and what each runs: placement, context, batch, KV cache, packed experts, prefetch,
    kernels, gating (shared by `generate` and `serve`; `engine_kwargs` turns them into LLM / ClusterConfig
    keywords)."""
    p.add_argument("--placement-strategy", type=str.upper, choices=PLACEMENT_STRATEGIES, default=None,
                   help="how Ray places the ranks on the cluster's nodes (unset: PACK, or STRICT_SPREAD with "
                        "--ranks-per-node). PACK: as few nodes as possible (ranks of one "
                        "node exchange through shared memory; across nodes every all-to-all goes over gloo/TCP, several "
                        "times slower per decode step); SPREAD: one rank per node where possible (more memory and "
                        "bandwidth per rank; after a node dies the group is rebuilt on the survivors); "
                        "STRICT_SPREAD: one rank per node or nothing (after a node dies the group waits for a new "
                        "node); STRICT_PACK: all ranks on one node or nothing. See README 'Several machines'")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                   help="N ranks on each node, on --ranks / N distinct nodes (--ranks must be a multiple of N; Ray "
                        "places node groups of N ranks, each on one node). --placement-strategy then applies to the "
                        "groups: STRICT_SPREAD (the default here: waits for enough nodes) or SPREAD (distinct nodes "
                        "where possible). Unset: no grouping")
    p.add_argument("--placement-timeout-s", type=float, default=CLI_PLACEMENT_TIMEOUT_S, metavar="S",
                   help="seconds to wait for Ray to place the ranks; a layout the cluster cannot hold (more "
                        "CPUs / GPUs / nodes than it has) then fails with one error line naming what was asked for "
                        "and what the cluster has, exit 1 (serve: exit 2). Raise it when nodes are autoscaled in")
    p.add_argument("--redundant-experts", action="store_true",
                   help="place every routed expert on at least two ranks (needs --ranks >= 2; costs expert memory, "
                        "logged at start and in the stats / moeray_redundant_expert_bytes): when one rank dies, its "
                        "requests end with a retriable error and the survivors go on serving every other stream "
                        "(elastic EP); without it a rank loss rebuilds the whole group")
    p.add_argument("--two-batch-overlap", action="store_true", help="decode steps of >= 8 sequences per rank as two "
                   "micro-batches, one's all-to-all in flight while the other computes (across nodes; README)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window in tokens; unset: the model's max_position_embeddings (as vLLM)")
    p.add_argument("--max-num-seqs", type=int, default=_CLUSTER["max_num_seqs"].default,
                   help="running sequences per rank at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=_CLUSTER["max_batched_tokens"].default,
                   help="tokens per engine step at most (decodes first, then prefill chunks), per rank; >= "
                        "--max-num-seqs. A step with decodes takes at most 256 (max_mixed_tokens): streams keep pace")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill long prompts in chunks mixed into decode steps under --max-num-batched-tokens, "
                        "so running streams keep their pace (off: a prompt is prefilled whole in one step)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching: full KV blocks kept by content hash and shared, so a prompt "
                        "starting with a cached prefix skips its prefill (vLLM's APC; --no-prefix-caching: off)")
    p.add_argument("--prefix-routing", action=argparse.BooleanOptionalAction, default=_CLUSTER["prefix_routing"].default,
                   help="with prefix caching, the router sends a request to the rank whose past prompts share its "
                        "longest prefix (in KV blocks) unless that rank is busier than the least-loaded one by more "
                        "than --prefix-routing-imbalanced-threshold requests (Ray Serve LLM's prefix-aware router); "
                        "--no-prefix-routing: always the least-loaded rank")
    p.add_argument("--prefix-routing-imbalanced-threshold", type=float,
                   default=_CLUSTER["prefix_routing_imbalanced_threshold"].default, metavar="N",
                   help="requests in flight a rank may have over the least-loaded one and still get a request by "
                        "prefix affinity (inf: load ignored)")
    p.add_argument("--prefix-routing-match-rate-threshold", type=float,
                   default=_CLUSTER["prefix_routing_match_rate_threshold"].default, metavar="R",
                   help="fraction of the prompt's tokens the longest match must cover to route by it, in [0, 1]")
    p.add_argument("--kv-cache-bytes", type=int, default=_CLUSTER["kv_cache_bytes"].default,
                   help="KV cache budget per rank (bytes)")
    p.add_argument("--dtype", default=_CLUSTER["dtype"].default, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype")
    p.add_argument("--weight-storage", default="auto", choices=["auto", "compute"],
                   help="auto: a bf16 checkpoint computed in fp32 on CPU keeps its matrices in bf16 (same values, half "
                        "the bytes per decode step); compute: every weight in --dtype")
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4],
                   help="quantize the KV cache to this many bits per element (unset: full precision)")
    p.add_argument("--kv-extra-bits", type=int, nargs="+", default=None, choices=[2, 3, 4], metavar="B",
                   help="more KV widths served from the same page pool (needs --kv-bits); a request picks one by "
                        "naming the profile '<name>-<B>bit', e.g. prose-2bit")
    p.add_argument("--kv-profile", default=None,
                   help="KV quantization profile: a name in <model>/kv_profiles (prose, code), 'auto' (per prompt), "
                        "a profile .safetensors path, or a folder of profiles; the deployment default, which a request "
                        "overrides with its own kv_profile field")
    p.add_argument("--weight-bits", type=int, default=None, choices=[2, 3, 4],
                   help="pack the routed experts to this many bits at load time (a packed --model is served as is)")
    p.add_argument("--expert-cache", type=int, default=None, metavar="C",
                   help="packed experts only: experts per layer kept dequantized, over the whole layer (split "
                        "over the ranks; capped at E). Unset: 0 on CPU with fp32 compute, where the compiled "
                        "kernel runs the packed experts as fast as a dequantized copy; all experts elsewhere")
    p.add_argument("--resident-experts", type=int, default=None, metavar="N",
                   help="packed experts per layer kept in memory (unset: all); the rest are read on demand from "
                        "the memory-mapped packed --model, for models larger than memory")
    p.add_argument("--prefetch", default="auto", choices=["auto", "none", "frequent", "markov", "lookahead", "hybrid"]
                   + [f"pre_attention{s}" for s in ("", "_hybrid", "_prev", "_prev_hybrid")],
                   help="packed experts only: the predictor that fills the expert cache ahead of each layer. "
                        "auto: none when the cache holds every expert, and on CPU (where prefetch measured "
                        "slower than none); the default predictor, hybrid, on CUDA or with --resident-experts")
    p.add_argument("--kernel-backend", default="torch", choices=["torch", "triton"],
                   help="packed-expert kernels (triton on CPU needs TRITON_INTERPRET=1, set automatically)")
    p.add_argument("--gating", default="exact",
                   choices=["exact", "balanced", "capacity", "dynamic", "velocity", "sticky"],
                   help="gating policy of the deployment (the rules: actors/moe/gating_router.py)")
    p.add_argument("--gating-option", action="append", default=[], metavar="KEY=VALUE",
                   help="gating knob, e.g. sticky_margin=0.1 or top_p=0.6 (repeatable)")


def engine_kwargs(a) -> dict:
    """ClusterConfig keywords (engine_options included) from `add_engine_args` flags.

    Raises ValueError on --placement-timeout-s not > 0 (or not finite), --ranks not a multiple of
    --ranks-per-node (unset --ranks: 2, or one per visible GPU), --ranks-per-node < 1 or with
    --placement-strategy PACK / STRICT_PACK, on --max-num-batched-tokens below --max-num-seqs, a prefix-routing
    threshold out of range, a --kv-profile the ranks could not load at --kv-bits, a bad --gating-option
    (malformed, unknown key or out-of-range value), a negative --expert-cache, --resident-experts below 1, or
    expert-cache / prefetch flags without packed experts (checked here, before any Ray work). Warns on stderr
    when a prefetch predictor is asked for while the expert cache is left at its CPU default of 0."""
    if a.expert_cache is not None and a.expert_cache < 0:
        raise ValueError(f"--expert-cache={a.expert_cache} must be >= 0 (experts per layer kept dequantized)")
    if a.max_num_batched_tokens < a.max_num_seqs:
        raise ValueError(f"--max-num-batched-tokens={a.max_num_batched_tokens} must be >= --max-num-seqs="
                         f"{a.max_num_seqs} (a full decode batch must fit one step)")
    try:
        check_prefix_routing(a.prefix_routing_imbalanced_threshold, a.prefix_routing_match_rate_threshold)
        check_placement_timeout(a.placement_timeout_s)
    except ValueError as e:  # the message names the ClusterConfig field; the user typed the flag
        raise ValueError(f"--{str(e).replace('_', '-')}") from None
    strategy = placement_flags(a)
    if a.resident_experts is not None and a.resident_experts < 1:
        raise ValueError(f"--resident-experts={a.resident_experts} must be >= 1")
    asked = [f for f, on in (("--expert-cache", a.expert_cache is not None),
                             (f"--prefetch {a.prefetch}", a.prefetch not in ("auto", "none"))) if on]
    if asked and a.weight_bits is None:
        from actors.experts.checkpoint import is_packed_checkpoint

        model = getattr(a, "model", None)
        if model is not None and not is_packed_checkpoint(model):
            raise ValueError(f"{' and '.join(asked)} apply to packed experts: add --weight-bits B (2, 3 or 4) or "
                             f"serve a packed --model (moeray quantize); --model {model} is not packed")
    if a.prefetch not in ("auto", "none") and a.expert_cache is None and a.kernel_backend == "torch":
        print(f"moeray: warning: --prefetch {a.prefetch} without --expert-cache: on CPU the cache defaults to 0 "
              "(packed experts run from their packed bytes), so nothing would be prefetched there; pass "
              "--expert-cache C", file=sys.stderr)
    kw = dict(max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, kv_cache_bytes=a.kv_cache_bytes,
              dtype=a.dtype, max_batched_tokens=a.max_num_batched_tokens, placement_strategy=strategy,
              ranks_per_node=a.ranks_per_node, placement_timeout_s=a.placement_timeout_s,
              redundant_experts=a.redundant_experts, prefix_routing=a.prefix_routing,
              prefix_routing_imbalanced_threshold=a.prefix_routing_imbalanced_threshold,
              prefix_routing_match_rate_threshold=a.prefix_routing_match_rate_threshold)
    opts = {"kv_bits": a.kv_bits, "kv_profile": a.kv_profile, "kv_extra_bits": a.kv_extra_bits,
            "weight_bits": a.weight_bits, "expert_cache_capacity": a.expert_cache, "prefetch": a.prefetch,
            "resident_experts": a.resident_experts, "kernel_backend": a.kernel_backend, "gating": a.gating,
            "weight_storage": a.weight_storage, "enable_chunked_prefill": a.enable_chunked_prefill,
            "enable_prefix_caching": a.prefix_caching, "two_batch_overlap": a.two_batch_overlap}
    if a.kv_bits is not None:  # a profile the ranks cannot load fails here, not in their setup after Ray started
        from actors.kv.profiles import load_served_profiles

        try:
            load_served_profiles(a.model, a.kv_bits, a.kv_profile, tuple(a.kv_extra_bits or ()))
        except (ValueError, OSError) as e:
            raise ValueError(f"--kv-profile: {e}") from None
    if a.gating_option:
        opts["gating_options"] = parse_gating_options(a.gating_option)
        from actors.moe.gating import GatingConfig

        try:  # unknown keys and out-of-range knobs fail here, not in the rank actors after Ray has started
            GatingConfig.from_options(a.gating, opts["gating_options"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"--gating-option: {e}") from None
    kw["engine_options"] = {k: v for k, v in opts.items() if v is not None}
    if a.kernel_backend == "triton":
        import torch
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the local Ray workers
    return kw


def placement_flags(a) -> str:
    """The placement strategy of --placement-strategy / --ranks-per-node / --ranks (`resolve_placement`, unset
    --ranks as `ClusterConfig.auto`: one per visible GPU, else 2). Raises ValueError naming the flags."""
    ranks = getattr(a, "ranks", None)
    if ranks is None:
        ranks = default_ranks()
    try:
        return resolve_placement(ranks, a.ranks_per_node, a.placement_strategy)
    except ValueError as e:  # the message names the ClusterConfig fields; the user typed the flags
        msg = re.sub(r"\b(ranks_per_node|placement_strategy|ranks)=", lambda m: f"--{m[1].replace('_', '-')}=", str(e))
        raise ValueError(msg + (" (--ranks unset: 2, or one per GPU)" if getattr(a, "ranks", None) is None else "")) from None


def parse_gating_options(items: list[str]) -> dict:
    """["sticky_margin=0.1", "k_max=4"] -> {"sticky_margin": 0.1, "k_max": 4}. Raises ValueError on a bad item."""
    out: dict = {}
    for it in items:
        key, sep, val = it.partition("=")
        if not sep or not key:
            raise ValueError(f"--gating-option {it!r} must look like KEY=VALUE")
        try:
            out[key] = int(val) if val.lstrip("-").isdigit() else float(val)
        except ValueError:
            raise ValueError(f"--gating-option {key}={val!r}: the value must be a number") from None
    return out


def start_llm(a, **kw):
    """`LLM(model=a.model, ranks=a.ranks, address=a.address, **kw)`, or an exit status after one `moeray: error:`
    line on stderr (no traceback): 2 for a bad configuration (ValueError, FileNotFoundError), 1 when the cluster
    cannot come up (Ray did not start; the ranks were not placed within --placement-timeout-s, said by
    `cluster.node_groups.describe_unplaced`; a rank failed its setup). Shared by `generate` and `serve`'s
    gRPC-only path."""
    from moeray.api import LLM

    try:
        return LLM(model=a.model, ranks=a.ranks, address=a.address, **kw)
    except (ValueError, FileNotFoundError) as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - Ray could not start or the ranks could not be placed / set up
        from cluster.node_groups import PlacementTimeoutError

        why = str(e) if isinstance(e, PlacementTimeoutError) else f"{type(e).__name__}: {e}"
        # a Ray that LLM started is stopped by LLM itself; one the caller started is left to them
        print(f"moeray: error: could not bring up the cluster: {why}", file=sys.stderr)
        return 1


def cmd_generate(a) -> int:
    from actors.engine.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                                seed=a.seed, stop=a.stop)
    except ValueError as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    empty = [i for i, p in enumerate(a.prompts, 1) if not p]
    if empty:  # the router rejects it too, but only after Ray and the ranks are up (~15 s)
        print(f"moeray: error: prompt {empty[0]} of {len(a.prompts)} is empty", file=sys.stderr)
        return 2
    try:
        kw = engine_kwargs(a)
    except ValueError as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    llm = start_llm(a, **kw)
    if isinstance(llm, int):
        return llm
    try:
        outs = llm.generate(a.prompts, params)
        if a.stats:
            print_stats(llm.stats(), sys.stderr)
    finally:
        llm.shutdown()
    failed = 0
    for i, o in enumerate(outs):
        if o.finish_reason == "error":
            failed += 1
            shown = o.prompt if len(o.prompt) <= 60 else o.prompt[:57] + "..."  # a 4k-token prompt is one line
            print(f"moeray: prompt {i + 1}/{len(outs)} ({shown!r}) failed: {o.error}", file=sys.stderr)
        if a.json:
            print(json.dumps({"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, **({"error": o.error} if o.error else {})}))
        elif o.finish_reason != "error":
            if len(outs) > 1:  # a header per prompt: completions may hold newlines and blank lines themselves
                print(f"--- prompt {i + 1}/{len(outs)}: {o.prompt!r} ---")
            print(o.text)
    sys.stdout.flush()
    return 1 if failed else 0


def print_stats(s: dict, f) -> None:
    """The cluster snapshot of `--stats`: per layer the expert load balance, router thrash and, with packed
    experts, the expert-cache hit rate and prefetch recall (the ranks' mean); per rank the packed experts'
    predictor and totals; KV blocks."""
    rt = s.get("routing", {})
    extra = [k for k in ("thrash", "hit_rate", "recall") if k in rt]
    print("layer  tokens  expert max/mean  rank max/mean" + "".join(f"  {k:>8}" for k in extra), file=f)
    for row in s["layers"]:
        l = row["layer"]
        cols = "".join(f"  {rt[k][l]:>8.3f}" for k in extra)
        print(f"{l:>5}  {row['tokens']:>6}  {row['expert_max_mean']:>15.3f}  {row['rank_max_mean']:>13.3f}{cols}",
              file=f)
    for i, r in enumerate(s.get("ranks", [])):
        ec = r.get("expert_cache")
        if ec:
            print(f"rank {i} packed experts: prefetch {ec['predictor']}, eviction {ec['policy']}, expert-cache hit "
                  f"rate {ec['hit_rate']:.3f}, prediction recall {ec['recall']:.3f}, wasted prefetches "
                  f"{ec['wasted_prefetch_frac']:.3f} (nan: nothing looked up / predicted / prefetched)", file=f)
    print(f"KV blocks free {s['kv_blocks_free']}/{s['kv_blocks_total']}", file=f)


# Other subcommands live in their own modules, each with `add_parser(subparsers)` that calls
# `set_defaults(func=handler)`; a module that is absent is simply not offered.
SUBCOMMAND_MODULES = ("moeray.cli_quantize", "moeray.cli_calibrate", "moeray.cli_serve", "moeray.cli_top")


def main(argv: list[str] | None = None) -> int:
    import importlib

    ap = argparse.ArgumentParser(prog="moeray", description="Expert-parallel MoE serving on Ray")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    for name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        mod.add_parser(sub)
    a = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MOERAY_LOG", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(a.func(a) or 0)


if __name__ == "__main__":
    sys.exit(main())
