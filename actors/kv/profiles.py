"""KV quantization profiles of a whole model: save, load, resolve by name, and the `auto` rule.

A model profile is one `kernels.kv_quant.KVQuantProfile` per layer (KVQuant, arXiv 2401.18079: per-channel
pre-RoPE key scales and non-uniform codebooks calibrated offline), calibrated on one text domain
(`moeray calibrate`). On disk it is two files side by side:
  <stem>.safetensors   tensors `layers.<l>.<field>` (fields of KVQuantProfile.to_tensors)
  <stem>.json          metadata: format, version, domain, bits, shapes, outlier counts, calibration data
A model ships its profiles in `<model>/kv_profiles/<domain>-<bits>bit.{safetensors,json}`.

Name resolution (`load_profiles`): `kv_profile` may be a profile name ("prose", "code", "auto"), the path
of a `.safetensors` profile, or a directory of profiles; names resolve in `<model>/kv_profiles/`.

The `auto` rule (`choose_profile`): a prompt is code when at least `CODE_CHAR_THRESHOLD` of its characters
are code punctuation (`CODE_CHARS`) or indentation spaces (runs of >= 2 spaces after a newline). Costs one
pass over the prompt text; on the held-out slices it separates the domains by a wide margin (prose ~1.4%,
Python ~23%; of 300-character chunks, ~1% of prose and ~98% of code score >= 0.06).
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field

import torch

from kernels.kv_profile import KVQuantProfile

FORMAT = "moeray-kv-profile"
VERSION = 1
AUTO = "auto"
# Apostrophes, hyphens and colons are left out: verse and prose use them often.
CODE_CHARS = frozenset("{}[]()<>=;_#*/\\|&^%$@`~+\"")
CODE_CHAR_THRESHOLD = 0.06
_INDENT = re.compile(r"\n( {2,}|\t+)")

# Key bits per head row of the 2-bit recipe (per-channel key widths, `kernels.kv_quant` module docstring):
# 152 bits = 19 bytes for D = 64, i.e. 2.375 bits per key element on average, the bytes the old recipe spent
# on 2-bit codes plus one fp16 outlier channel (18) plus one. Each channel gets 2-8 bits by query-energy-weighted
# key error; with query energies from calibration (bench/kv_quality.py and `moeray calibrate` collect them).
K_CHANNEL_BITS_2 = 152
# The 4-bit recipe uses the same per-channel widths at 4 bits per key element on average (256 bits = 32 bytes
# per head row for D = 64, the bytes of plain 4-bit codes): on the stage-4 tiny-moe checkpoint it raised
# teacher-forced top-1 agreement with full-precision KV from 0.957 to 0.971 (mean of 4 held-out prose slices of
# 512 tokens) where the single-width k-means recipe missed the 97% target (BENCHMARKS.md, KV section).
K_CHANNEL_BITS_4 = 256
# The shipped recipe per code width (what models/tiny-moe/kv_profiles/ was calibrated with and what
# bench/kv_quality.py reports as `ours<b>`): `kernels.kv_quant.fit_kv_profile` options. Chosen on tiny-moe's
# held-out text (BENCHMARKS.md, KV section): at 3 and 4 bits fp16 key outlier channels buy nothing
# measurable and cost 0.125 bits/element per channel and head, so there are none; at 2 bits the keys carry
# most of the error (2-bit keys alone: +1.5% prose / +6% code; 2-bit values alone: +0.6% / -0.8%), so keys
# get per-channel widths (2-8 bits on a uniform grid over each channel's min/max range, allocated by
# query-energy-weighted error, 152 bits per head row) instead of one fp16 outlier channel, and values a
# k-means codebook (measured best of the codebook / range combinations, 24 windows per domain).
RECOMMENDED_FIT_OPTIONS = {
    2: dict(n_outlier=0, n_outlier_v=0, codebook="uniform", codebook_v="kmeans", use_v_zero=True,
            k_range="minmax", k_channel_bits=K_CHANNEL_BITS_2),
    3: dict(n_outlier=0, n_outlier_v=0, codebook="kmeans", codebook_v="kmeans", use_v_zero=True, k_range="mse"),
    4: dict(n_outlier=0, n_outlier_v=0, codebook="uniform", codebook_v="kmeans", use_v_zero=True,
            k_range="minmax", k_channel_bits=K_CHANNEL_BITS_4),
}
# Full-precision sink tokens the recipe was measured with. A sink shifts the 16-token blocks by one, so at a
# block-multiple length 15 tail tokens stay unsealed in fp16 (0.2 bits/element at 1024 tokens) while quality
# does not measurably change on tiny-moe.
RECOMMENDED_SINK_TOKENS = 0


@dataclass(kw_only=True, slots=True)
class ModelKVProfile:
    """A calibrated KV quantization profile for every layer of one model.

    Fields:
        name: profile name (the calibration domain, e.g. "prose" or "code").
        bits: code width, 2, 3 or 4 bits per element (same for every layer).
        layers: one KVQuantProfile per layer, all with the same H, D, bits, outlier counts and key row bytes
            (per-channel key widths `k_bits` may differ between layers and heads, their row sums may not).
        meta: JSON-serialisable metadata (calibration files, tokens, options).
    Raises (in __post_init__):
        ValueError: no layers, or layers disagreeing on bits / shapes / outlier counts.
    """

    name: str
    bits: int
    layers: list[KVQuantProfile]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"profile {self.name!r} has no layers")
        p0 = self.layers[0]
        for l, p in enumerate(self.layers):
            if p.bits != self.bits:
                raise ValueError(f"profile {self.name!r} layer {l}: bits={p.bits} != profile bits={self.bits}")
            if (p.num_kv_heads, p.head_dim, p.n_outlier_k, p.n_outlier_v, p.k_packed_bytes) != \
                    (p0.num_kv_heads, p0.head_dim, p0.n_outlier_k, p0.n_outlier_v, p0.k_packed_bytes):
                raise ValueError(f"profile {self.name!r} layer {l}: (H, D, Ok, Ov, Pk)="
                                 f"{(p.num_kv_heads, p.head_dim, p.n_outlier_k, p.n_outlier_v, p.k_packed_bytes)}"
                                 " differs from layer 0")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layout(self) -> tuple[int, int, int, int, int]:
        """(bits, H, D, Ok, Ov): profiles with equal layouts can share one set of KV pages."""
        p = self.layers[0]
        return (self.bits, p.num_kv_heads, p.head_dim, p.n_outlier_k, p.n_outlier_v)

    def nbytes(self) -> int:
        """Bytes of every tensor of the profile (scales, zeros, codebooks, outlier indices), all layers."""
        return sum(t.numel() * t.element_size() for p in self.layers for t in p.to_tensors().values())

    def to(self, device: torch.device | str) -> "ModelKVProfile":
        return ModelKVProfile(name=self.name, bits=self.bits, layers=[p.to(device) for p in self.layers],
                              meta=dict(self.meta))


def _stem(path: str) -> str:
    for ext in (".safetensors", ".json"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def profile_filename(domain: str, bits: int) -> str:
    """Stem of a shipped profile: `<domain>-<bits>bit`."""
    return f"{domain}-{bits}bit"


def save_profile(profile: ModelKVProfile, path: str) -> tuple[str, str]:
    """Write `<stem>.safetensors` and `<stem>.json`; `path` may name either file or the stem.

    Returns: (safetensors path, json path).
    """
    from safetensors.torch import save_file

    stem = _stem(path)
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    tensors = {f"layers.{l}.{k}": v.detach().cpu().contiguous()
               for l, p in enumerate(profile.layers) for k, v in p.to_tensors().items()}
    save_file(tensors, stem + ".safetensors", metadata={"format": FORMAT})
    os.chmod(stem + ".safetensors", 0o644)  # safetensors writes 0600; ranks may run as another user
    bits, h, d, ok, ov = profile.layout()
    meta = {"format": FORMAT, "version": VERSION, "domain": profile.name, "bits": bits, "num_layers":
            profile.num_layers, "num_kv_heads": h, "head_dim": d, "n_outlier_k": ok, "n_outlier_v": ov,
            "profile_bytes": profile.nbytes(), **profile.meta}
    with open(stem + ".json", "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return stem + ".safetensors", stem + ".json"


def load_profile(path: str, device: torch.device | str = "cpu") -> ModelKVProfile:
    """Read a profile written by `save_profile` (`path`: either file or the stem).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: wrong format or version, or tensors inconsistent with the json.
    """
    from safetensors.torch import load_file

    stem = _stem(path)
    with open(stem + ".json") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{stem}.json: format={meta.get('format')!r} version={meta.get('version')!r}; "
                         f"expected {FORMAT!r} version {VERSION}")
    tensors = load_file(stem + ".safetensors", device=str(device))
    layers = []
    for l in range(int(meta["num_layers"])):
        pre = f"layers.{l}."
        layers.append(KVQuantProfile.from_tensors({k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}))
    extra = {k: v for k, v in meta.items() if k not in ("format", "version", "domain", "bits", "num_layers")}
    return ModelKVProfile(name=meta["domain"], bits=int(meta["bits"]), layers=layers, meta=extra)


def load_profiles(model_dir: str, bits: int, kv_profile: str | None = None,
                  device: torch.device | str = "cpu") -> tuple[dict[str, ModelKVProfile], str]:
    """Every `bits`-bit profile `kv_profile` points at, and the default profile name.

    Args:
        model_dir: model folder; names resolve in `<model_dir>/kv_profiles/`.
        bits: 2, 3 or 4; only profiles of this width are loaded.
        kv_profile: None or "auto" (load all, choose per request), a name ("prose"), a `.safetensors` /
            `.json` path, or a directory of `<name>-<bits>bit` profiles.
    Returns:
        ({name: profile}, default name or "auto").
    Raises:
        ValueError: no `bits`-bit profile found (names the folder searched and how to make one), the named
            profile missing, or the loaded profiles disagree on their layout.
    """
    default = kv_profile or AUTO
    if kv_profile and os.path.isfile(_stem(kv_profile) + ".safetensors"):
        p = load_profile(kv_profile, device)
        if p.bits != bits:
            raise ValueError(f"kv_profile={kv_profile!r} has bits={p.bits}; kv_bits={bits}")
        return {p.name: p}, p.name
    folder = os.path.join(model_dir, "kv_profiles")
    if kv_profile and os.path.isdir(kv_profile):
        folder, default = kv_profile, AUTO
    found = {}
    for f in sorted(glob.glob(os.path.join(folder, f"*-{bits}bit.safetensors"))):
        p = load_profile(f, device)
        found[p.name] = p
    if not found:
        raise ValueError(f"no {bits}-bit KV quantization profile in {folder!r}; create one with "
                         f"`moeray calibrate --domain prose --data FILES --bits {bits} {folder}`")
    if default != AUTO and default not in found:
        raise ValueError(f"kv_profile={default!r} not found among the {bits}-bit profiles {sorted(found)} "
                         f"in {folder!r}")
    layouts = {p.layout() for p in found.values()}
    if len(layouts) > 1:
        raise ValueError(f"profiles in {folder!r} disagree on (bits, H, D, Ok, Ov): {sorted(layouts)}")
    return found, default


def code_fraction(text: str) -> float:
    """Fraction of `text`'s characters that look like code: CODE_CHARS plus indentation after newlines."""
    if not text:
        return 0.0
    n = sum(1 for c in text if c in CODE_CHARS)
    n += sum(len(m.group(1)) for m in _INDENT.finditer(text))
    return n / len(text)


def choose_profile(requested: str | None, available: list[str], default: str, text: str | None = None) -> str:
    """The profile a sequence uses.

    Args:
        requested: the request's profile name, "auto", or None (use `default`).
        available: names of loaded profiles.
        default: the engine's default name or "auto".
        text: the prompt text, needed only for "auto" (None counts as prose).
    Returns:
        A name from `available`. `auto` picks "code" when code_fraction(text) >= CODE_CHAR_THRESHOLD and
        a "code" profile exists, else "prose" if it exists, else the first available name.
    Raises:
        ValueError: the requested name is not available.
    """
    name = requested or default
    if name != AUTO:
        if name not in available:
            raise ValueError(f"kv_profile={name!r} is not loaded; available: {sorted(available)} or 'auto'")
        return name
    if text is not None and "code" in available and code_fraction(text) >= CODE_CHAR_THRESHOLD:
        return "code"
    if "prose" in available:
        return "prose"
    return sorted(available)[0]


# --- calibration ----------------------------------------------------------------------------------------


def collect_calibration_kv(engine, token_ids: list[int], *, window: int = 1024, progress=None,
                           with_query_energy: bool = False):
    """Run the model on `token_ids` in non-overlapping windows and collect every layer's pre-RoPE K and V.

    Args:
        engine: an `actors.engine.engine.RankEngine` (world size 1) holding the model; its cache is used for
            attention (full precision is what calibration should see).
        token_ids: the calibration text, tokenized.
        window: tokens per forward (<= the engine's max_model_len).
        progress: optional callable `(tokens_done)` called after each window (e.g. a tqdm update).
        with_query_energy: also return, per layer, the query energy of each key channel ([H, D] fp32):
            the mean over tokens of (q_d**2 + q_{d +- D/2}**2) / 2 summed over the KV head's query heads,
            from the post-RoPE queries (the pair sum is rotation-invariant). It weights key errors in
            `kernels.kv_quant.fit_kv_profile(query_energy=...)`.
    Returns:
        (k, v) or, with_query_energy, (k, v, q_energy): per layer, k / v [N, H, D] fp32 tensors on CPU,
        N = len(token_ids); q_energy [H, D] fp32.
    Raises:
        ValueError: empty token_ids or window < 1.
    """
    if not token_ids or window < 1:
        raise ValueError(f"need token_ids (got {len(token_ids)}) and window={window} >= 1")
    num_layers = engine.model_cfg.num_layers
    ks: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    vs: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    qe: list[torch.Tensor | None] = [None] * num_layers
    cache = engine.cache
    orig_attend = cache.attend

    def recording_attend(layer, q, k, v, positions, meta, rotary, scale):
        ks[layer].append(k.detach().float().cpu())
        vs[layer].append(v.detach().float().cpu())
        if with_query_energy:
            h, d = k.shape[1], k.shape[2]
            e = q.detach().float().cpu().reshape(q.shape[0], h, -1, d).pow(2).sum(dim=(0, 2))  # [H, D]
            pair = (e[:, : d // 2] + e[:, d // 2:]) * 0.5
            e = torch.cat([pair, pair], dim=1)
            qe[layer] = e if qe[layer] is None else qe[layer] + e
        return orig_attend(layer, q, k, v, positions, meta, rotary, scale)

    cache.attend = recording_attend  # instance attribute shadows the method only during calibration
    try:
        for start in range(0, len(token_ids), window):
            chunk = token_ids[start:start + window]
            engine.prompt_logits(chunk)
            if progress is not None:
                progress(len(chunk))
    finally:
        del cache.attend
    k_out, v_out = [torch.cat(x) for x in ks], [torch.cat(x) for x in vs]
    if with_query_energy:
        return k_out, v_out, [e / len(token_ids) for e in qe]
    return k_out, v_out


def fit_model_profile(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], *, name: str, bits: int,
                      meta: dict | None = None, query_energy: list[torch.Tensor] | None = None,
                      **fit_kw) -> ModelKVProfile:
    """Fit one KVQuantProfile per layer (`kernels.kv_quant.fit_kv_profile`, keyword options in `fit_kw`).

    Args:
        k_layers, v_layers: per layer [N, H, D] pre-RoPE keys and values (from collect_calibration_kv).
        name: profile name (domain). bits: 2, 3 or 4. meta: extra JSON metadata.
        query_energy: optional per-layer [H, D] key-channel weights (collect_calibration_kv with
            with_query_energy=True), used by per-channel key widths (`k_channel_bits`).
    Raises:
        ValueError: from fit_kv_profile (shapes, bits, option ranges), or query_energy of the wrong length.
    """
    from kernels.kv_calibrate import fit_kv_profile

    if query_energy is not None and len(query_energy) != len(k_layers):
        raise ValueError(f"query_energy has {len(query_energy)} layers; k_layers has {len(k_layers)}")
    qe = query_energy if query_energy is not None else [None] * len(k_layers)
    layers = [fit_kv_profile(k, v, bits=bits, query_energy=e, **fit_kw) for k, v, e in zip(k_layers, v_layers, qe)]
    opts = dict(fit_kw)
    if fit_kw.get("k_channel_bits") is not None:
        opts["query_energy"] = query_energy is not None
    return ModelKVProfile(name=name, bits=bits, layers=layers, meta={**(meta or {}), "fit_options": opts})


def model_effective_bits(profile: ModelKVProfile, num_tokens: int, *, block_size: int = 16,
                         sink_tokens: int = 1, full_precision_bytes: int = 2) -> float:
    """Effective bits per K/V element of one sequence of `num_tokens` tokens in the quantized paged cache.

    Counts, per layer: sealed tokens at quantized size (codes, V scales, outlier values), the sink and the
    unsealed tail at `full_precision_bytes` bytes per element, and the profile's tensors amortised over this
    one sequence (a pessimistic bound: they are shared by every sequence). Layers hold equal element counts,
    so the model figure is the mean over layers (`kernels.kv_quant.effective_bits`).

    Raises: ValueError if num_tokens < 1.
    """
    from kernels.kv_profile import effective_bits

    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens} must be >= 1")
    sealed = max(0, num_tokens - sink_tokens) // block_size * block_size
    bits = [effective_bits(p, num_tokens=sealed, num_full_precision_tokens=num_tokens - sealed,
                           full_precision_bytes=full_precision_bytes) for p in profile.layers]
    return sum(bits) / len(bits)


def load_served_profiles(model_dir: str, bits: int, kv_profile: str | None = None, extra_bits=(),
                         device: torch.device | str = "cpu") -> tuple[dict[str, ModelKVProfile], str]:
    """The profiles of a cache that serves several bit widths from one page pool.

    The `bits`-bit profiles (resolved by `load_profiles` from `kv_profile`) keep their names ("prose", "code")
    and hold the default: None / "auto" choose among them. Each width in `extra_bits` adds the model folder's
    (or the `kv_profile` folder's) profiles of that width as "<name>-<b>bit" ("prose-2bit"), which a request
    names to get that width.
    Returns ({name: profile}, default name or "auto").
    Raises:
        ValueError: an extra width outside {2, 3, 4}, or one with no profile (see `load_profiles`).
    """
    profiles, default = load_profiles(model_dir, bits, kv_profile, device)
    folder = kv_profile if kv_profile and os.path.isdir(kv_profile) else None
    for b in sorted(set(extra_bits) - {bits}):
        if b not in (2, 3, 4):
            raise ValueError(f"kv_extra_bits has {b}; each must be 2, 3 or 4")
        more, _ = load_profiles(model_dir, b, folder, device)
        profiles.update({f"{name}-{b}bit": p for name, p in more.items()})
    return profiles, default
