"""The process-group rendezvous: one TCPStore server on a port the kernel picks, the ranks as its clients.

The usual recipe (bind a socket to port 0, read the port, close the socket, hand the number to rank 0, which
binds it again for the TCPStore server) leaves a window in which any other process on the node can take the
port: rank 0 then fails with EADDRINUSE and every other rank waits for the rendezvous timeout. Seen in CI (a
full test run with Ray workers starting alongside). Here the server binds port 0 itself and keeps the socket
from the bind onwards, so the port it reports cannot be taken from under it.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def host_store(world_size: int, timeout_s: float = 120.0) -> dist.TCPStore:
    """Start a TCPStore server on a kernel-chosen port (read it from `.port`), listening on every interface.

    It does not wait for clients: each rank, rank 0 included, joins with `join_store` (or keeps using this
    object, which is also a client). timeout_s: seconds a get/wait on the store may block. The server lives as
    long as the returned object; keep it until the process group is destroyed."""
    return dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def join_store(host: str, port: int, world_size: int, timeout_s: float = 120.0) -> dist.TCPStore:
    """Connect to the store started by `host_store` at host:port. Raises torch.distributed.DistNetworkError if
    no server answers within timeout_s seconds."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that can be bound on `host` now, for a server that must be given a port number (Ray Serve's
    HTTP and gRPC proxies, a subprocess). Drawn at random between 20000 (above Ray's default worker ports,
    10002-19999) and the bottom of the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), so no
    outgoing connection is handed it before the server binds it; falls back to a kernel-chosen port when that
    range is empty. Prefer `host_store` or a pre-bound socket where the server accepts one."""
    import random
    import socket

    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(64 if lo > 20001 else 0):
        port = random.randrange(20000, lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
