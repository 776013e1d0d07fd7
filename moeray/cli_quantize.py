"""`moeray quantize SRC DST`: write a packed sub-4-bit checkpoint, and seed its Markov expert predictor.

    moeray quantize --bits 3 --group-size 64 models/tiny-moe /tmp/tiny-moe-3b
    moeray generate --model /tmp/tiny-moe-3b --expert-cache 4 "To be, or not to be"

The routed experts are quantized group-wise (uniform grid, or `--codebook` for non-uniform Lloyd-Max
levels) and stored packed (`actors.experts.checkpoint`); everything else is copied unchanged. Then, unless
`--no-calibrate`, a calibration run routes training text through the packed model and saves the expert
transition counts beside it (`expert_transitions.safetensors`), which seed the Markov prefetcher.
Calibration text: the `--calib-text` files, else a fixed sample of the running interpreter's standard
library sources outside the model's held-out packages (the code half of the tiny-moe training corpus).
"""
from __future__ import annotations

import os
import sys
import sysconfig
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

# Held out from the tiny-moe training corpus (scripts/train_tiny_moe.py): never calibrate on them.
HELDOUT_CODE_PACKAGES = ("json", "html", "wsgiref")


class QuantizeArgs(BaseModel):
    """Validated `moeray quantize` options."""

    src: str = Field(description="full-precision HF model folder")
    dst: str = Field(description="output folder for the packed checkpoint")
    bits: Literal[2, 3, 4] = Field(3, description="bits per expert weight code")
    group_size: Literal[32, 64, 128] = Field(64, description="weights per fp16 scale/zero group")
    codebook: bool = Field(False, description="non-uniform per-matrix levels (Lloyd-Max) instead of a uniform grid")
    calibrate: bool = Field(True, description="seed the Markov expert predictor from a calibration run")
    calib_text: list[str] = Field(default_factory=list, description="calibration text files")
    calib_tokens: int = Field(8192, ge=64, description="calibration tokens at most")
    calib_chunk: int = Field(256, ge=16, description="tokens per calibration sequence")


def default_calibration_text(max_chars: int = 200_000) -> str:
    """A deterministic sample of standard-library `.py` sources, skipping the held-out packages and tests."""
    root = sysconfig.get_paths()["stdlib"]
    parts, n = [], 0
    skip = set(HELDOUT_CODE_PACKAGES) | {f"test_{p}" for p in HELDOUT_CODE_PACKAGES} | {"test", "site-packages",
                                                                                       "__pycache__", "idlelib"}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, fn), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            parts.append(text)
            n += len(text)
            if n >= max_chars:
                return "\n".join(parts)[:max_chars]
    return "\n".join(parts)


def stdlib_code_sample(chars_per_file: int = 700, parts: int = 3) -> list[str]:
    """A slice of `chars_per_file` characters from the middle of every standard-library `.py` file (sorted
    walk; skipping the held-out packages, test folders, idlelib, site-packages and files under 200 characters),
    joined in order and cut into `parts` texts of about equal file counts. Why: a few large modules are one
    genre of code; this reaches the rest (codec and data tables, small packages) that the model was trained
    on too. Returns: up to `parts` non-empty str (fewer when there are fewer files). Raises ValueError:
    chars_per_file or parts < 1."""
    if chars_per_file < 1 or parts < 1:
        raise ValueError(f"chars_per_file={chars_per_file} and parts={parts} must be >= 1")
    root = sysconfig.get_paths()["stdlib"]
    skip = set(HELDOUT_CODE_PACKAGES) | {f"test_{p}" for p in HELDOUT_CODE_PACKAGES} | {
        "test", "tests", "idle_test", "idlelib", "site-packages", "__pycache__"}
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for fn in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(dirpath, fn), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) >= 200:
                m = max(0, len(text) // 2 - chars_per_file // 2)
                out.append(text[m : m + chars_per_file])
    per = -(-len(out) // parts)
    return ["\n".join(out[i * per : (i + 1) * per]) for i in range(parts) if out[i * per : (i + 1) * per]]


def calibration_chunks(model: str, texts: list[str], max_tokens: int, chunk: int) -> list[list[int]]:
    """Tokenize `texts` with the model's tokenizer and cut them into sequences of `chunk` tokens, taking
    an equal share of `max_tokens` from each text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    share = max_tokens // max(len(texts), 1)
    out = []
    for text in texts:
        ids = tok.encode(text).ids[:share]
        out += [ids[i : i + chunk] for i in range(0, len(ids) - 1, chunk) if len(ids[i : i + chunk]) > 1]
    return out


def run_calibration(model: str, texts: list[str], *, max_tokens: int = 8192, chunk: int = 256,
                    pre_attention_tokens: int = 131072, pre_attention_texts: list[str] = (),
                    progress: bool = True) -> str:
    """Route `texts` through `model` (one in-process rank) and save `expert_transitions.safetensors` there:
    transition counts and log-linear weights from `max_tokens` of them, the pre-attention MLPs trained on up
    to `pre_attention_tokens` of the same texts plus `pre_attention_texts` (an equal share of each; 0: no
    MLPs; about 40 s extra per 100k tokens on one core). The MLPs gain from more text where the counts do not
    need it (tiny-moe, held-out recall at k+1, prose / code: 118k tokens of 5 texts 0.948 / 0.931, 325k of 11
    texts 0.956 / 0.943; bench/experts.py with 17 texts: 0.956 / 0.944, 0.957 / 0.947 in the hybrid; the 4k
    model: 0.944 / 0.897 in the hybrid, 0.946 / 0.908 with `stdlib_code_sample` added, BENCHMARKS.md). The same
    text trains the two-state MLPs (`actors.prefetch.pre_attention_prev`: 0.972 / 0.951 on the 4k model; the
    shipped recipe, 675k tokens, took 641 s at one thread in all). Returns the file's path."""
    from tqdm import tqdm

    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from router_service.routing.calibration import calibrate
    from actors.prefetch.transitions import TRANSITIONS_FILE

    mc = ModelConfig.from_pretrained(model)
    chunks = calibration_chunks(model, texts, max_tokens, min(chunk, mc.max_position_embeddings))
    cfg = EngineConfig(model=model, max_model_len=min(1024, mc.max_position_embeddings),
                       kv_cache_bytes=64 * 2**20)
    eng = RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    path = os.path.join(model, TRANSITIONS_FILE)
    it = tqdm(chunks, desc="calibrating expert transitions", unit="seq", file=sys.stderr, disable=not progress)
    seen = {tuple(c) for c in chunks}
    extra = [c for c in calibration_chunks(model, [*texts, *pre_attention_texts], pre_attention_tokens,
                                           min(chunk, mc.max_position_embeddings))
             if tuple(c) not in seen] if pre_attention_tokens > max_tokens else []
    calibrate(eng, it, path, meta={"tokens": sum(map(len, chunks)), "sequences": len(chunks),
                                   "pre_attention_tokens": sum(map(len, chunks + extra))},
              pre_attention_chunks=extra, pre_attention=pre_attention_tokens > 0)
    if eng.expert_runtime is not None:
        eng.expert_runtime.detach()
    return path


def cmd_quantize(a) -> int:
    from tqdm import tqdm

    from actors.model.config import ModelConfig
    from actors.experts.checkpoint import write_packed_checkpoint

    try:
        args = QuantizeArgs(src=a.src, dst=a.dst, bits=a.bits, group_size=a.group_size, codebook=a.codebook,
                            calibrate=not a.no_calibrate, calib_text=a.calib_text or [],
                            calib_tokens=a.calib_tokens, calib_chunk=a.calib_chunk)
        mc = ModelConfig.from_pretrained(args.src)
    except (ValidationError, ValueError, FileNotFoundError) as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    n_moe = sum(mc.moe_layers)
    try:
        with tqdm(total=n_moe, desc=f"quantizing experts to {args.bits} bits", unit="layer", file=sys.stderr) as bar:
            qc = write_packed_checkpoint(args.src, args.dst, bits=args.bits, group_size=args.group_size,
                                         codebook=args.codebook, progress=bar.update)
    except (ValueError, FileNotFoundError) as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}: routed experts at {qc['effective_bits']:.3f} bits per weight "
          f"({qc['expert_bytes'] / 2**20:.2f} MiB), bits={args.bits} group_size={args.group_size} "
          f"codebook={args.codebook}")
    if args.calibrate:
        try:
            texts = []
            for fn in args.calib_text:
                with open(fn, encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
        except OSError as e:
            print(f"moeray: error: --calib-text: {e}", file=sys.stderr)
            return 2
        path = run_calibration(args.dst, texts or [default_calibration_text()], max_tokens=args.calib_tokens,
                               chunk=args.calib_chunk)
        print(f"wrote {path}")
    return 0


def add_parser(sub) -> None:
    from moeray.cli import HelpFormatter

    p = sub.add_parser("quantize", help="write a packed sub-4-bit expert checkpoint (SRC -> DST)",
                       formatter_class=HelpFormatter)
    p.add_argument("src", metavar="SRC", help="full-precision HF model folder")
    p.add_argument("dst", metavar="DST", help="output folder")
    p.add_argument("--bits", type=int, default=3, choices=[2, 3, 4], help="bits per expert weight code")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                   help="inputs per scale / zero group")
    p.add_argument("--codebook", action="store_true", help="non-uniform Lloyd-Max levels per matrix")
    p.add_argument("--no-calibrate", action="store_true", help="skip the Markov-predictor calibration run")
    p.add_argument("--calib-text", action="append", default=[], metavar="FILE",
                   help="calibration text file (repeatable; default: a standard-library source sample)")
    p.add_argument("--calib-tokens", type=int, default=8192, help="tokens of calibration text routed")
    p.add_argument("--calib-chunk", type=int, default=256, help="tokens per calibration sequence")
    p.set_defaults(func=cmd_quantize)
