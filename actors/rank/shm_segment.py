"""The shared-memory transport's segment name outside its mappings (`actors.rank.shm_collective`): attach without
the resource tracker, unlink without it complaining.

Python's resource tracker unlinks the shared-memory names a process registered when that process dies: the creator
(rank 0) keeps its registration until `setup` unlinks the name itself, so a rank 0 SIGKILLed mid-setup leaves no
segment; attaching ranks never register (Python < 3.13 registers every attach by default).
"""
from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory


def open_untracked(name: str, size: int) -> shared_memory.SharedMemory:
    """Attach to segment `name` without registering it with the resource tracker. Python < 3.13 registers every
    attach, which would unlink (or warn about) the segment when this process exits; `setup` unlinks it explicitly
    after the verdict. Registering and then unregistering (moeray did until 2026-12-05) sent a second unregister to a tracker
    that processes started by multiprocessing share with the creator, whose own registration it removed (the
    creator's later unregister then printed a `KeyError: '/moeray_...'` traceback), so an attach never registers."""
    try:
        return shared_memory.SharedMemory(name=name, size=size, track=False)  # Python >= 3.13
    except TypeError:
        pass
    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None  # only SharedMemory.__init__ calls it in this window
    try:
        return shared_memory.SharedMemory(name=name, size=size)
    finally:
        resource_tracker.register = register


def unlink(name: str, tracked: bool) -> None:
    """Remove the segment's name (the memory stays until the last mapping goes). Any rank may call it; a name
    already gone is fine. `tracked`: this process created it, so its resource tracker forgets it too."""
    try:
        shared_memory._posixshmem.shm_unlink("/" + name)  # noqa: SLF001 - SharedMemory.unlink minus tracking
    except FileNotFoundError:
        pass
    if tracked:
        try:
            resource_tracker.unregister("/" + name, "shared_memory")
        except Exception:  # noqa: BLE001
            pass
