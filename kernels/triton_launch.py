"""Serialise Triton launches under `TRITON_INTERPRET=1`.

The interpreter runs a kernel by patching `triton.language` functions for the duration of the launch and
restoring them afterwards; that patching is process-global, so two threads launching kernels at once (the
expert-prefetch worker and the forward thread) unpatch each other mid-kernel ("Did you forget to add
@triton.jit?"). On a GPU launches are asynchronous and thread-safe, and the guard is a no-op.
"""
from __future__ import annotations

import contextlib
import os
import threading

_LOCK = threading.RLock()


def launch_guard():
    """A context manager to wrap every kernel launch in: a process-wide lock when interpreting, else nothing."""
    return _LOCK if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()
