"""All-to-all over one plain TCP connection per rank pair: the cross-node path for the decode step's small
collectives, where shared memory cannot go.

Why. A 2-rank decode step across nodes makes 9 all-to-alls (the step agreement, then dispatch and combine per MoE
layer of the shipped model), each a few kB, so latency, not bandwidth, sets its time. gloo's
`all_to_all_single` hands every message to its I/O thread and waits on a condition variable: two thread
wake-ups per side per call. On the 2-core machine a gloo exchange of 4 rows of 257 fp32 between two processes
took ~1000 us under load, the same bytes over a blocking TCP socket with TCP_NODELAY, read and written by the
calling thread, ~24 us (BENCHMARKS.md "Two nodes"). The dependency chain (layer l + 1's dispatch needs layer l's
combine through attention) leaves nothing to merge at batch 1 but the step agreement, so the lever is the cost
per message.

What goes through it. Exactly what `actors.rank.shm_collective` carries on one node, behind the same interface
(`fits`, `all_to_all_single`, `close`): collectives whose size every rank knows (the lockstep loop's flags, the
fixed-capacity decode dispatch), at most `max_bytes` per peer; the rest stays on torch.distributed. All ranks
make the same sequence of calls (lockstep) and `fits` depends only on the agreed size, so every rank picks the
same transport for every call.

Protocol. Each call sends this rank's chunk for every peer, then reads every peer's chunk for this rank. A send
of at most `max_bytes` never blocks (each socket's send and receive buffers together hold more), so
sending everything before reading cannot deadlock for any world size; TCP keeps each pair's messages in order,
so call k's bytes never mix with call k + 1's. Split in two (`post`: the sends; `complete`: the reads), a call
can be in flight while this rank computes: two-batch overlap (`actors.model.two_batch`) keeps up to `MAX_POSTED`
posted, completed in post order; `all_to_all_single` is `post` then `complete`. A closed connection (the peer
exited: its kernel resets it) raises at once; a silent peer (a lost node) raises after `timeout_s`.

Bring-up (`setup`, over the process group's TCPStore). Every rank listens on its node IP (port from the kernel),
publishes it, connects to every lower rank (sending its rank number) and accepts every higher one; each rank
reports success or its error, and the transport is on only when every rank succeeded, else every rank closes
its sockets and returns None (gloo for everything).
"""
from __future__ import annotations

import logging
import socket
from collections import deque
import struct
import time

import torch

from actors.rank.shm_collective import check_all_to_all

log = logging.getLogger("moeray.rank")

MAX_BYTES = 64 << 10  # per peer per call: larger messages take torch.distributed (and never block a send)
SOCK_BUF = 512 << 10  # requested SO_SNDBUF / SO_RCVBUF (the kernel caps them at net.core.[wr]mem_max)
MAX_POSTED = 2  # calls posted and not completed at most (`post`): two micro-batches' exchanges in flight


class TcpAllToAll:
    """`all_to_all_single` with equal splits over a full mesh of TCP connections.

    Build it with `setup`. Args (direct use, tests): rank, world; socks: {peer rank: connected socket};
    timeout_s: a peer silent this long raises; max_bytes: the largest chunk per peer.

    Raises:
        RuntimeError (from `all_to_all_single`): a peer closed its connection or stayed silent `timeout_s`.
    """

    def __init__(self, rank: int, world: int, socks: dict[int, socket.socket], timeout_s: float,
                 max_bytes: int = MAX_BYTES):
        if world < 2 or not 0 <= rank < world or sorted(socks) != [r for r in range(world) if r != rank]:
            raise ValueError(f"rank={rank}, world={world}, peers={sorted(socks)}: need one socket per other rank")
        self.rank, self.world, self.timeout_s, self.max_bytes = rank, world, timeout_s, max_bytes
        self.max_chunk_bytes = max_bytes  # the most bytes per peer one call carries (`fits`)
        self.socks = socks
        for s in socks.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(timeout_s)
        self.calls = 0  # completed calls (statistics)
        self.wait_s = 0.0  # seconds spent reading peers' chunks (statistics)
        self.closed = False
        self._tickets = 0  # tickets handed out by `post`
        self._posted: deque = deque()  # outstanding calls, oldest first: (ticket, inp, its bytes, bytes per peer)

    @classmethod
    def setup(cls, store, rank: int, world: int, host: str, timeout_s: float, max_bytes: int = MAX_BYTES,
              prefix: str = "moeray/tcp", connect_timeout_s: float = 30.0) -> "TcpAllToAll | None":
        """Collective over `store` (protocol in the module docstring): the group's transport on every rank, or
        None on every rank when any rank could not listen, connect or accept within `connect_timeout_s`.
        host: this rank's address the others can reach (its Ray node IP)."""
        socks: dict[int, socket.socket] = {}
        srv = None
        report = "ok"
        try:
            srv = socket.create_server((host, 0), backlog=world)
            srv.settimeout(connect_timeout_s)
            store.set(f"{prefix}/addr/{rank}", f"{host}|{srv.getsockname()[1]}")
            for peer in range(rank):
                h, p = store.get(f"{prefix}/addr/{peer}").decode().rsplit("|", 1)
                s = socket.create_connection((h, int(p)), timeout=connect_timeout_s)
                _buffers(s)
                s.sendall(struct.pack("<i", rank))
                socks[peer] = s
            for _ in range(world - 1 - rank):
                s, _ = srv.accept()
                s.settimeout(connect_timeout_s)
                _buffers(s)
                peer = struct.unpack("<i", _read_exact(s, 4))[0]
                if not rank < peer < world or peer in socks:
                    raise RuntimeError(f"unexpected peer rank {peer}")
                socks[peer] = s
        except Exception as e:  # noqa: BLE001 - any failure: this group keeps gloo
            report = f"{type(e).__name__}: {e}"
            if srv is None:  # peers wait for this rank's address: publish that there is none
                store.set(f"{prefix}/addr/{rank}", "|0")
        finally:
            if srv is not None:
                srv.close()
        store.set(f"{prefix}/report/{rank}", report)
        bad = [f"rank {r}: {got}" for r in range(world)
               if (got := store.get(f"{prefix}/report/{r}").decode()) != "ok"]
        if bad:
            for s in socks.values():
                s.close()
            log.warning("rank %d: TCP all-to-all off, gloo for every collective: %s", rank, "; ".join(bad))
            return None
        return cls(rank, world, socks, timeout_s, max_bytes)

    def fits(self, nbytes_per_peer: int) -> bool:
        """Whether a call sending `nbytes_per_peer` bytes to each rank goes over these sockets (never after
        `close`: the callers then take torch.distributed)."""
        return not self.closed and nbytes_per_peer <= self.max_bytes

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, within_step: bool = False) -> None:
        """out[chunk s] = rank s's inp[chunk r] for every rank s (r = this rank), equal chunks along dim 0:
        `complete(post(inp), out)`.

        Args:
            out, inp: contiguous CPU tensors of the same dtype and shape, dim 0 divisible by the world size,
                at most `max_bytes` per chunk (`fits`).
            within_step: the same-node transport's spin hint (`ShmAllToAll.all_to_all_single`); a socket read
                blocks in the kernel with no spin phase, so it changes nothing here.
        Raises:
            ValueError: bad shapes. RuntimeError: a peer closed its connection or timed out, or a posted call is
                still outstanding (its bytes come first on every socket).
        """
        check_all_to_all(out, inp, self.world)
        if self._posted:
            raise RuntimeError(f"all_to_all_single with {len(self._posted)} posted call(s) outstanding: complete "
                               "them first (calls complete in post order)")
        self.complete(self.post(inp), out)

    def post(self, inp: torch.Tensor) -> int:
        """First half of a split all-to-all: send every peer its chunk of `inp` now (a send of at most `max_bytes`
        never blocks, so this returns without waiting for any peer) and return the call's ticket for `complete`.
        At most `MAX_POSTED` calls are outstanding (two micro-batches' exchanges in flight,
        `actors.model.two_batch`): every peer may then hold up to MAX_POSTED x max_bytes unread from this rank,
        which the socket buffers (SOCK_BUF each way) hold, so a post still never blocks. `inp` must stay
        unchanged until `complete` (this rank's own chunk is copied then).

        Args:
            inp: contiguous CPU tensor, dim 0 divisible by the world size, at most `max_bytes` per chunk.
        Returns: the ticket (an int, increasing by one per post).
        Raises:
            ValueError: bad shape or size. RuntimeError: MAX_POSTED calls already outstanding, or a peer closed
                its connection.
        """
        W = self.world
        if inp.device.type != "cpu" or not inp.is_contiguous() or inp.dim() == 0 or inp.shape[0] % W:
            raise ValueError(f"post: inp must be a contiguous CPU tensor with dim 0 divisible by world={W}, got "
                             f"shape {tuple(inp.shape)} on {inp.device}")
        if len(self._posted) >= MAX_POSTED:
            raise RuntimeError(f"post: {len(self._posted)} calls outstanding, at most MAX_POSTED={MAX_POSTED}")
        nb = inp.nbytes // W
        if not self.fits(nb):
            raise ValueError(f"post: {nb} bytes per peer exceeds max_bytes={self.max_bytes} (or the transport is "
                             "closed)")
        src = memoryview(inp.view(-1).view(torch.uint8).numpy())
        try:
            for s, sock in self.socks.items():
                sock.sendall(src[s * nb:(s + 1) * nb])
        except TimeoutError as e:
            raise RuntimeError(f"TCP all_to_all: a peer was silent for {self.timeout_s} s") from e
        except OSError as e:
            raise RuntimeError(f"TCP all_to_all: {type(e).__name__}: {e}") from e
        self._tickets += 1
        self._posted.append((self._tickets, inp, src, nb))
        return self._tickets

    def complete(self, ticket: int, out: torch.Tensor) -> None:
        """Second half of a split all-to-all: read every peer's chunk of call `ticket` into `out` (and this rank's
        own chunk from the posted `inp`): out[chunk s] = rank s's inp[chunk r]. Tickets complete strictly in post
        order (TCP keeps each socket's bytes in order: the oldest call's come first).

        Args:
            ticket: what `post` returned, the oldest outstanding. out: contiguous CPU tensor of the posted inp's
                dtype and shape.
        Raises:
            ValueError: `ticket` is not the oldest outstanding call, or `out` does not match its inp.
            RuntimeError: a peer closed its connection or stayed silent `timeout_s`.
        """
        if not self._posted or self._posted[0][0] != ticket:
            raise ValueError(f"complete: ticket {ticket} is not the oldest outstanding call "
                             f"{[t for t, *_ in self._posted]} (tickets complete in post order)")
        _, inp, src, nb = self._posted[0]
        if (not out.is_contiguous() or out.device.type != "cpu" or out.dtype != inp.dtype
                or out.shape != inp.shape):
            raise ValueError(f"complete: out {tuple(out.shape)} {out.dtype} must be a contiguous CPU tensor like the "
                             f"posted inp {tuple(inp.shape)} {inp.dtype}")
        self._posted.popleft()
        r = self.rank
        dst = memoryview(out.view(-1).view(torch.uint8).numpy())
        try:
            dst[r * nb:(r + 1) * nb] = src[r * nb:(r + 1) * nb]
            t0 = time.perf_counter()
            for s, sock in self.socks.items():
                try:
                    _read_into(sock, dst[s * nb:(s + 1) * nb], s)
                except TimeoutError as e:  # no reset, no FIN: a hung process or a lost node
                    raise RuntimeError(f"TCP all_to_all: rank {s} was silent for {self.timeout_s} s (hung, or its "
                                       f"node is lost)") from e
            self.wait_s += time.perf_counter() - t0
        except OSError as e:
            raise RuntimeError(f"TCP all_to_all: {type(e).__name__}: {e}") from e
        self.calls += 1

    @property
    def outstanding(self) -> int:
        """Posted calls not completed yet (0 to MAX_POSTED)."""
        return len(self._posted)

    def interrupt(self) -> None:
        """Any thread: shut every connection down, so a call blocked on a silent peer (a lost node, no reset)
        raises at once instead of at `timeout_s` (elastic EP: the group is re-formed without it)."""
        for s in self.socks.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close every connection (the peers' next call raises); `fits` is False from then on."""
        self.closed = True
        for s in self.socks.values():
            try:
                s.close()
            except OSError:
                pass


def _buffers(s: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        s.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


def _read_into(sock: socket.socket, view: memoryview, peer: int) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise RuntimeError(f"TCP all_to_all: rank {peer} closed its connection (exited)")
        got += k


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf), -1)
    return bytes(buf)
