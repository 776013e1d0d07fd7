"""Builds and loads the compiled CPU kernels (kernels/csrc) and is the one place holding the loaded library.

Sources: every `kernels/csrc/*.c` and `*.h` (package data), compiled together into one shared library with the
system C compiler (`$CC`, else `cc`) and `_FLAGS` (AVX2 + FMA, one thread, C99), under
`$MOERAY_KERNEL_CACHE` (default `~/.cache/moeray/kernels`) as `cpu_kernels_<key>.so`, where the key hashes
every source's name and text, the flags and the compiler. Built once per key: under a private name, then renamed,
so ranks starting together never load a half-written file. Loaded with `ctypes` (calls release the GIL), each
entry point's argument and result types set from `_abi.SIGNATURES`.

Not built (every wrapper then declines and its caller runs the PyTorch path): with
`MOERAY_DISABLE_CPU_KERNELS=1`, off x86-64 or without AVX2/FMA (silently), or when the sources are missing or the
compiler fails (one warning naming the error).

Instruction set: the blocked GEMM (csrc/gemm.c) has an AVX-512 build of its loops beside the AVX2 one, chosen
at load: AVX-512 when the CPU has avx512f/bw/dq/vl, else AVX2. `MOERAY_CPU_ISA=avx2` forces the AVX2 loops (A/B
runs, tests of that path); `set_isa` switches at run time (tests).

Invariant: `_lib` is the library or None, valid once `_tried` is True. Wrappers read it only through `lib()` at
call time, so a test that sets `_build._lib = None` and `_build._tried = True` disables every wrapper.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

from kernels.cpu._abi import SIGNATURES

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# -fno-semantic-interposition: with -fPIC alone gcc ran the packed-expert kernel ~2.5x slower (measured)
_FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-fno-semantic-interposition", "-std=c99", "-pthread"]

_lock = threading.Lock()
_lib = None  # the loaded ctypes library, once built
_tried = False


_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")


def _cpu_flags() -> set[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _cpu_supports_avx2_fma() -> bool:
    flags = _cpu_flags()
    return "avx2" in flags and "fma" in flags


def best_isa() -> int:
    """The widest GEMM build this CPU runs: 2 (AVX-512), else 1 (AVX2); `MOERAY_CPU_ISA=avx2` gives 1."""
    if os.environ.get("MOERAY_CPU_ISA", "").lower() == "avx2":
        return 1
    return 2 if all(f in _cpu_flags() for f in _AVX512) else 1


def set_isa(level: int) -> int:
    """Use the GEMM loops of `level` (1: AVX2, 2: AVX-512; capped at `best_isa()`); returns the previous level.

    Raises:
        RuntimeError: the kernels are not built.
    """
    lib_ = lib()
    if lib_ is None:
        raise RuntimeError("set_isa: the CPU kernels are not built")
    prev = int(lib_.moeray_isa())
    lib_.moeray_set_isa(min(int(level), best_isa()))
    return prev


def _sources() -> dict[str, str]:
    """{file name: text} of every .c and .h under `CSRC`, sorted by name. Raises OSError when there is no .c."""
    files = sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h")) if CSRC.is_dir() else []
    if not any(p.suffix == ".c" for p in files):
        raise OSError(f"no C sources under {CSRC}")
    return {p.name: p.read_text() for p in files}


def _compile() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    sources = _sources()
    h = hashlib.sha256()
    for name, text in sources.items():
        h.update(f"{name}\0{text}\0".encode())
    h.update((" ".join(_FLAGS) + cc).encode())
    key = h.hexdigest()[:16]
    cache = os.environ.get("MOERAY_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moeray", "kernels")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, f"cpu_kernels_{key}.so")
    if not os.path.isfile(so):
        # build under a private name, then rename: ranks starting together never load a half-written file
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            for name, text in sources.items():  # compile exactly the text that was hashed
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
            srcs = [os.path.join(tmp, name) for name in sources if name.endswith(".c")]
            out = os.path.join(tmp, "k.so")
            subprocess.run([cc, *_FLAGS, *srcs, "-o", out, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(out, so)
    return ctypes.CDLL(so)


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("MOERAY_DISABLE_CPU_KERNELS") == "1" or not _cpu_supports_avx2_fma():
            _tried = True
            return None
        try:
            lib = _compile()
            for name, (args, res) in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            lib.moeray_set_isa(best_isa())
            _lib = lib
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("CPU kernels unavailable (%s %s); using the PyTorch paths", e,
                        detail.decode(errors="replace")[:500])
        _tried = True
        return _lib


def cpu_kernels_available() -> bool:
    """True when the compiled CPU kernels can run on this machine (compiles them on first call)."""
    return _load() is not None


def lib():
    """The loaded library, or None when the kernels cannot run (builds it on first call)."""
    return _lib if _tried else _load()
