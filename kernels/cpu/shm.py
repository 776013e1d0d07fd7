"""The shared-memory all-to-all's copies, publish and futex wait in C (kernels/csrc/shm_a2a.c).

Used by `actors.rank.shm_collective.ShmAllToAll`, which keeps its Python polling path when this returns None.
"""
from __future__ import annotations

from kernels.cpu import _build


def shm_a2a_entry_points():
    """(send, recv): the ctypes functions `moeray_shm_a2a_send` / `moeray_shm_a2a_recv` (calls release the GIL),
    or None when the compiled kernels cannot run. Arguments and the segment layout: kernels/csrc/shm_a2a.c."""
    lib = _build.lib()
    if lib is None:
        return None
    return lib.moeray_shm_a2a_send, lib.moeray_shm_a2a_recv
