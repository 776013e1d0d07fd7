"""KV quantization profiles of a whole model: the data (`ModelKVProfile`), its files, and name resolution.

A model profile is one `kernels.kv_profile.KVQuantProfile` per layer (KVQuant, arXiv 2401.18079: per-channel
pre-RoPE key scales and non-uniform codebooks calibrated offline), calibrated on one text domain
(`moeray calibrate`, actors/kv/calibration.py). Invariants (checked in `ModelKVProfile.__post_init__`): every
layer has the same (H, D) and outlier counts; a layer's value width and key row bytes may differ from another's
(each layer has its own page layout).
On disk it is two files side by side:
  <stem>.safetensors   tensors `layers.<l>.<field>` (fields of KVQuantProfile.to_tensors)
  <stem>.json          metadata: format, version, domain, bits, shapes, outlier counts, calibration data
A model ships its profiles in `<model>/kv_profiles/<domain>-<bits>bit.{safetensors,json}`.

Name resolution (`load_profiles`): `kv_profile` may be a profile name ("prose", "code", "auto"), the path
of a `.safetensors` profile, or a directory of profiles; names resolve in `<model>/kv_profiles/`.
`load_served_profiles` adds the profiles of extra widths as "<name>-<b>bit". Which loaded profile a request
gets (a name, or the `auto` rule) is actors/kv/profile_choice.py.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import torch

from actors.kv.profile_choice import AUTO
from kernels.kv_profile import KVQuantProfile

FORMAT = "moeray-kv-profile"
VERSION = 1


@dataclass(kw_only=True, slots=True)
class ModelKVProfile:
    """A calibrated KV quantization profile for every layer of one model.

    Fields:
        name: profile name (the calibration domain, e.g. "prose" or "code").
        bits: the profile's width, 2, 3 or 4: its name (`<domain>-<bits>bit`) and the `--kv-bits` it serves.
            Layers may spend their bits differently (sensitivity-allocated layer widths,
            `actors.kv.layer_widths`): a layer's value code width `layers[l].bits` (2, 3 or 4; also 1 inside a
            2-bit profile) and key row bytes may differ from layer to layer; each layer has its own page layout
            (`actors.kv.quantized_layout`).
        layers: one KVQuantProfile per layer, all with the same H, D and outlier counts.
        meta: JSON-serialisable metadata (calibration files, tokens, options).
    Raises (in __post_init__):
        ValueError: no layers, bits outside {2, 3, 4}, or layers disagreeing on shapes / outlier counts.
    """

    name: str
    bits: int
    layers: list[KVQuantProfile]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"profile {self.name!r} has no layers")
        if self.bits not in (2, 3, 4):
            raise ValueError(f"profile {self.name!r}: bits={self.bits} must be 2, 3 or 4")
        p0 = self.layers[0]
        for l, p in enumerate(self.layers):
            if (p.num_kv_heads, p.head_dim, p.n_outlier_k, p.n_outlier_v) != \
                    (p0.num_kv_heads, p0.head_dim, p0.n_outlier_k, p0.n_outlier_v):
                raise ValueError(f"profile {self.name!r} layer {l}: (H, D, Ok, Ov)="
                                 f"{(p.num_kv_heads, p.head_dim, p.n_outlier_k, p.n_outlier_v)} differs from layer 0")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layout(self) -> tuple[int, int, int, int, int]:
        """(bits, H, D, Ok, Ov): profiles with equal layouts can share one set of KV pages."""
        p = self.layers[0]
        return (self.bits, p.num_kv_heads, p.head_dim, p.n_outlier_k, p.n_outlier_v)

    def layer_widths(self) -> list[tuple[int, int]]:
        """Per layer (value code bits, key bits per head row): how the profile spends its bits."""
        return [(p.bits, int(p.k_bits[0].long().sum()) if p.per_channel_keys else p.bits * p.head_dim)
                for p in self.layers]

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
