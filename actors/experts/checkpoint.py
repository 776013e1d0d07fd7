"""Packed checkpoints: a Hugging Face model folder whose routed experts are stored as packed sub-4-bit weights.

Layout of a packed folder DST (written by `write_packed_checkpoint`, i.e. `moeray quantize SRC DST`):
  config.json, generation_config.json, tokenizer files      copied from SRC unchanged
  kv_profiles/                                               copied from SRC if present (KV quantization profiles)
  model.safetensors                                          every non-routed-expert tensor of SRC under its
                                                             own name and dtype, plus per MoE layer l:
      {moe}.experts.packed.gate_up.{qcodes,qscales,qzeros,qcodebook?,qmeta}   stack (E, 2I, D), gate rows first
      {moe}.experts.packed.down.{...}                                        stack (E, D, I)
      ({moe} = model.layers.{l}.mlp, or model.layers.{l}.block_sparse_moe for Mixtral; the tensors are
      `kernels.packed_format.PackedWeight.to_tensors` of the stacks, expert e at row e)
  quantization_config.json                                   {"format": "moeray-packed", "version": 1, bits,
                                                             group_size, codebook, effective_bits, ...}
  expert_transitions.safetensors (optional)                  Markov calibration counts
                                                             (`actors.prefetch.predictors`)

`load_packed_experts` reads only the requested experts' rows of each stack (safetensors slices), so an EP
rank never materialises the other ranks' experts. `PackedExpertReader` reads one expert at a time from the
memory-mapped files: the source of the cold tier (`actors.experts.cold_tier.ColdExpertTier`), for models whose
packed experts do not fit in memory.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable

import torch
from safetensors import safe_open

from actors.model.config import ModelConfig
from actors.model.weights import CheckpointReader, _moe_prefix, load_expert_weights
from kernels.packed_format import PackedExperts, PackedWeight, words_per_row
from kernels.packed_quantize import quantize
from actors.prefetch.transitions import TRANSITIONS_FILE

QUANT_CONFIG = "quantization_config.json"
FORMAT = "moeray-packed"
_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt")


def is_packed_checkpoint(path: str) -> bool:
    """True if `path` holds a `quantization_config.json` of this format."""
    f = os.path.join(path, QUANT_CONFIG)
    if not os.path.isfile(f):
        return False
    with open(f) as fh:
        return json.load(fh).get("format") == FORMAT


def read_quant_config(path: str) -> dict:
    """The packed folder's quantization config. Raises FileNotFoundError / ValueError (wrong format)."""
    f = os.path.join(path, QUANT_CONFIG)
    if not os.path.isfile(f):
        raise FileNotFoundError(f"model={path!r}: no {QUANT_CONFIG} (not a packed checkpoint)")
    with open(f) as fh:
        qc = json.load(fh)
    if qc.get("format") != FORMAT or qc.get("version") != 1:
        raise ValueError(f"{f}: format={qc.get('format')!r} version={qc.get('version')!r}, expected {FORMAT!r} 1")
    return qc


def _is_routed_expert_tensor(name: str) -> bool:
    # Routed experts live under `.experts.` (per-expert or fused); the shared expert is `.shared_expert.`.
    return ".experts." in name


def write_packed_checkpoint(src: str, dst: str, *, bits: int, group_size: int = 64, codebook: bool = False,
                            progress: Callable[[int], None] | None = None, kmeans_iters: int = 30) -> dict:
    """Quantize the routed experts of checkpoint `src` and write a packed folder `dst` (layout above).

    Args:
        src: HF model folder (config.json, *.safetensors, tokenizer.json).
        dst: output folder (created; must not be `src`).
        bits: 2, 3 or 4. group_size: 32, 64 or 128. codebook: non-uniform per-matrix levels (Lloyd-Max).
        progress: called with 1 after each MoE layer (e.g. a tqdm `update`).
    Returns:
        the quantization config written (includes `effective_bits` over all routed-expert weights).
    Raises:
        ValueError: `dst` is `src`, or bits / group_size unsupported (from `kernels.packed_quantize.quantize`).
        FileNotFoundError: `src` has no config.json or no safetensors.
    """
    from safetensors.torch import save_file

    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"dst={dst!r} must differ from src")
    cfg = ModelConfig.from_pretrained(src)
    reader = CheckpointReader(src)
    os.makedirs(dst, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name in reader.file_of:
        if not _is_routed_expert_tensor(name) and os.path.basename(reader.file_of[name]) != TRANSITIONS_FILE:
            out[name] = reader.get(name).contiguous()
    nbytes = numel = 0
    for l in range(cfg.num_layers):
        if not cfg.moe_layers[l]:
            continue
        gu, dn = load_expert_weights(reader, cfg, l, range(cfg.num_experts), torch.float32)
        p = f"{_moe_prefix(reader, l)}.experts.packed"
        for proj, w in (("gate_up", gu), ("down", dn)):
            pw = quantize(w, bits=bits, group_size=group_size, codebook=codebook, kmeans_iters=kmeans_iters)
            out.update(pw.to_tensors(f"{p}.{proj}"))
            nbytes += pw.nbytes
            numel += w.numel()
        if progress is not None:
            progress(1)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(dst, "model.safetensors"), 0o644)  # safetensors writes 0600; ranks may run as another user
    for fn in _COPY:
        if os.path.isfile(os.path.join(src, fn)):
            shutil.copyfile(os.path.join(src, fn), os.path.join(dst, fn))
    # KV quantization profiles: attention and the KV projections are not quantized, so SRC's profiles still
    # describe DST's keys and values (recalibrate with `moeray calibrate` to fit the packed model exactly)
    if os.path.isdir(os.path.join(src, "kv_profiles")):
        shutil.copytree(os.path.join(src, "kv_profiles"), os.path.join(dst, "kv_profiles"), dirs_exist_ok=True)
    qc = {"format": FORMAT, "version": 1, "bits": bits, "group_size": group_size, "codebook": codebook,
          "fused_gate_up": True, "quantized": "routed experts (shared experts, attention, embeddings unchanged)",
          "effective_bits": 8 * nbytes / max(numel, 1), "expert_bytes": nbytes, "source": os.path.abspath(src)}
    with open(os.path.join(dst, QUANT_CONFIG), "w") as f:
        json.dump(qc, f, indent=2)
    return qc


def _read_rows(reader: CheckpointReader, name: str, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of a stacked tensor, reading only those slices from disk; `[len(rows), ...]`."""
    sl = reader._open(name).get_slice(name)
    return torch.stack([sl[e : e + 1][0] for e in rows]) if rows else None


def load_packed_experts(path: str, cfg: ModelConfig, layer: int, experts: list[int],
                        reader: CheckpointReader | None = None) -> PackedExperts:
    """The packed experts `experts` (global ids, in this order) of MoE layer `layer` of a packed folder.

    Returns:
        PackedExperts with fused gate_up `(E_loc, 2I, D)` and down `(E_loc, D, I)` on CPU (E_loc = len(experts)).
    Raises:
        ValueError: no experts requested, or the packed tensors are missing for `layer`.
    """
    if not experts:
        raise ValueError(f"layer {layer}: no experts requested")
    reader = reader or CheckpointReader(path)
    p = f"{_moe_prefix(reader, layer)}.experts.packed"
    parts = {}
    for proj in ("gate_up", "down"):
        pre = f"{p}.{proj}"
        if f"{pre}.qmeta" not in reader:
            raise ValueError(f"model={path!r} layer {layer}: packed tensors {pre}.* not found")
        meta = [int(v) for v in reader.get(f"{pre}.qmeta").tolist()]
        bits, group, shape = meta[0], meta[1], meta[2:]
        cb = _read_rows(reader, f"{pre}.qcodebook", experts) if f"{pre}.qcodebook" in reader else None
        parts[proj] = PackedWeight(codes=_read_rows(reader, f"{pre}.qcodes", experts),
                                   scales=_read_rows(reader, f"{pre}.qscales", experts),
                                   zeros=_read_rows(reader, f"{pre}.qzeros", experts), codebook=cb,
                                   bits=bits, group_size=group, shape=(len(experts), *shape[1:]))
    return PackedExperts(gate_up=parts["gate_up"], down=parts["down"])


def packed_layer_names(path: str) -> list[str]:
    """Names of the packed tensors in a folder (for inspection and tests)."""
    names = []
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors") and fn != TRANSITIONS_FILE:
            with safe_open(os.path.join(path, fn), "pt") as f:
                names += [n for n in f.keys() if ".experts.packed." in n]  # noqa: SIM118 - safe_open has no __iter__
    return names


class PackedExpertReader:
    """Reads single packed experts of a packed folder on demand (the cold tier's source).

    `safetensors.safe_open(..., "pt")` memory-maps each file; a read copies only the requested expert's rows
    of each packed stack (codes int32, scales fp16, zeros fp16, codebook fp16) out of the map, so the process
    holds no expert it did not ask for. The OS page cache may keep the file's pages, but those are clean,
    file-backed and reclaimable: they are not counted as resident here.

    Args:
        path: packed folder (`moeray quantize` output). cfg: its ModelConfig.
    Raises:
        ValueError: a MoE layer's packed tensors are missing (names the tensor and the folder).
    Thread-safe: reads are serialised by a lock (the forward and the prefetch worker both read).
    """

    _FIELDS = ("codes", "scales", "zeros", "codebook")

    def __init__(self, path: str, cfg: ModelConfig):
        self.path, self.cfg = path, cfg
        self.reader = CheckpointReader(path)
        self._lock = threading.Lock()
        self._slices: dict[str, object] = {}
        # layer -> proj -> (bits, group_size, stack shape (E, N, K), tensor name prefix, has codebook)
        self.layout: dict[int, dict[str, tuple]] = {}
        for l in range(cfg.num_layers):
            if not cfg.moe_layers[l]:
                continue
            p = f"{_moe_prefix(self.reader, l)}.experts.packed"
            self.layout[l] = {}
            for proj in ("gate_up", "down"):
                pre = f"{p}.{proj}"
                if f"{pre}.qmeta" not in self.reader:
                    raise ValueError(f"model={path!r} layer {l}: packed tensors {pre}.* not found")
                meta = [int(v) for v in self.reader.get(f"{pre}.qmeta").tolist()]
                self.layout[l][proj] = (meta[0], meta[1], tuple(meta[2:]), pre, f"{pre}.qcodebook" in self.reader)

    def empty(self, layer: int, n: int, device: torch.device | str = "cpu") -> PackedExperts:
        """A zero-filled stack of `n` expert slots of `layer`'s packed format (gate_up `(n, 2I, D)`,
        down `(n, D, I)`) on `device`: the preallocated resident set of the cold tier."""
        parts = {}
        for proj, (bits, group, shape, _, has_cb) in self.layout[layer].items():
            _, nrow, k = shape
            g = -(-k // group)
            parts[proj] = PackedWeight(
                codes=torch.zeros(n, nrow, words_per_row(k, bits), dtype=torch.int32, device=device),
                scales=torch.zeros(n, nrow, g, dtype=torch.float16, device=device),
                zeros=torch.zeros(n, nrow, g, dtype=torch.float16, device=device),
                codebook=torch.zeros(n, 1 << bits, dtype=torch.float16, device=device) if has_cb else None,
                bits=bits, group_size=group, shape=(n, nrow, k))
        return PackedExperts(**parts)

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one packed expert of `layer` (codes, scales, zeros, codebook; gate_up and down)."""
        one = self.empty(layer, 1, "meta")
        return one.nbytes

    def _rows(self, name: str, e: int) -> torch.Tensor:
        sl = self._slices.get(name)
        if sl is None:
            sl = self._slices[name] = self.reader._open(name).get_slice(name)
        return sl[e : e + 1][0]

    def read(self, layer: int, expert: int) -> dict[str, dict[str, torch.Tensor]]:
        """Global expert `expert` of `layer`, read from the map: {proj: {field: tensor without the E dim}}
        on CPU. Raises IndexError when `expert` is out of range."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        with self._lock:
            for proj, (_, _, shape, pre, has_cb) in self.layout[layer].items():
                if not 0 <= expert < shape[0]:
                    raise IndexError(f"layer {layer}: expert={expert} outside [0, {shape[0]})")
                out[proj] = {f: self._rows(f"{pre}.q{f}", expert) for f in self._FIELDS if f != "codebook" or has_cb}
        return out

    def read_into(self, layer: int, expert: int, dst: PackedExperts, slot: int) -> int:
        """Copy global expert `expert` of `layer` into slot `slot` of `dst` (a stack from `empty`, any device);
        returns the bytes read."""
        n = 0
        for proj, fields in self.read(layer, expert).items():
            pw = getattr(dst, proj)
            for f, t in fields.items():
                getattr(pw, f)[slot].copy_(t, non_blocking=False)
                n += t.numel() * t.element_size()
        return n

    def read_one(self, layer: int, expert: int, device: torch.device | str = "cpu") -> PackedExperts:
        """Global expert `expert` of `layer` as a one-expert stack (E = 1) on `device` (not kept anywhere)."""
        parts = {}
        for proj, fields in self.read(layer, expert).items():
            bits, group, shape, _, _ = self.layout[layer][proj]
            parts[proj] = PackedWeight(**{f: t.unsqueeze(0).to(device) for f, t in fields.items()},
                                       bits=bits, group_size=group, shape=(1, *shape[1:]))
        return PackedExperts(**parts)
