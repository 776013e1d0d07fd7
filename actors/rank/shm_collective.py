"""Same-node all-to-all over POSIX shared memory: the CPU fast path for the decode step's small collectives.

Why. On a small CPU machine one gloo `all_to_all_single` of a few rows costs a fixed latency whatever the
payload (TCP loopback, gloo's I/O threads and their wake-ups; `python bench/collective_latency.py`, numbers in
BENCHMARKS.md). A 4-layer decode step makes 9 of them (the step agreement, then dispatch and combine per MoE
layer), so latency alone dominates a 2-rank decode step. Ranks on one node can exchange these few kB
through shared memory instead, as vLLM's and SGLang's CPU backends do for their tensor-parallel
collectives, at a fraction of gloo's latency.

What goes through it. Only collectives whose sizes every rank knows in advance: the lockstep loop's flag
exchange and the fixed-capacity decode dispatch (`actors.moe.exchange.FixedCapacityExchange`), where
every rank sends every rank the same number of bytes; a prefill's exchange as that too, after its counts
(`AgreedCapacityExchange`, in pieces when large). The decode MoE layers use the segment itself beyond calls
(`actors.moe.slot_exchange`: rows and results read in place, numbered through `reserve`). All ranks run the same
sequence of collectives (lockstep), so which transport a call uses is the same decision on every rank: `fits()`
depends only on the agreed size.

Protocol (one segment per EP group). A header of W int64 counters (one 64-byte line each, holding the
counter at byte 0 and its int32 sleeper count at byte 8), then two banks
(call parity) of W x W slots of `slot_bytes`. Call number k of rank r: copy the chunk for rank d into
slot[k % 2][r][d], publish counter[r] = k + 1, then for every peer s wait until counter[s] >= k + 1 and copy
slot[k % 2][s][r] out. Two banks are enough: a rank can start call k + 2 (overwriting bank k % 2) only after
every peer has published k + 1, which each does only after it finished reading call k. The counter store
follows the data stores in program order, which x86-64 (TSO) keeps visible in that order; the module is
therefore only enabled on x86-64. The same two banks are why one collective is in flight at a time: there is no
split post / complete as the TCP transport has (`actors.rank.tcp_collective`), so two-batch overlap
(`actors.model.two_batch`) is off on a group with this transport; it is for the cross-node links, where a call costs
far more than the compute it could hide behind (on one node the collective costs tens of us).

Waiting (kernels/csrc/shm_a2a.c, when the compiled kernels run). The copies, the publish and the wait are
two C calls per collective (`moeray_shm_a2a_send`, `_recv`; ctypes releases the GIL). A waiting rank spins
(`pause`) for `SPIN_S` (30 us), or `STEP_SPIN_S` (500 us) for a call made within a step, where the peer computes
the same step and usually arrives within that (sleeping and being woken costs ~40 us on a small VM), calling
sched_yield every `YIELD_S` (50 us) meanwhile so that a thread the kernel queued on the waiting rank's core (the
front door's, typically) runs now rather than preempting the rank that computes, then sleeps in
futex(2) FUTEX_WAIT on the low 32 bits of the peer's counter, after announcing itself in that counter line's
sleeper count; a publisher makes the FUTEX_WAKE system call only when the count is nonzero, so the fast path
makes none. Store then fence then load on both sides (seq_cst atomics: x86-64 `xchg` / `lock xadd`) means
either the publisher sees the sleeper or the sleeper sees the new counter: no wake-up is lost. On an
oversubscribed machine a sleeping rank thus leaves its core to the peer and the front door, and still answers
within a wake-up latency instead of a poll interval. The futex wait returns every `LIVENESS_S`, so the rank
checks that the peers' processes still exist (a dead peer surfaces as an error at once, as a closed gloo socket
does, rather than at the timeout) and the timeout. Without the compiled kernels the rank polls in Python
instead: `sched_yield` for `POLL_SPIN_S`, then sleeps between polls (50 us growing to `MAX_SLEEP_S`), with the
same liveness checks. An idle cluster never waits here: the lockstep loop only enters collectives when some
rank has work.

Bring-up (`setup`, over the process group's TCPStore). Hostname + boot id only say the ranks may share
/dev/shm: host-network containers and pods share both yet each has its own /dev/shm. So rank 0 creates the
segment and publishes its name, every other rank tries to attach and reports success or its error through the
store, and rank 0 publishes the verdict: shared memory only if every rank attached within `attach_timeout_s`,
else every rank closes its mapping and returns None together (gloo for everything). The name is unlinked on
every path out of `setup` (success, a failed attach, the attach timeout, an exception), after the verdict or
on the way out of an error, so the memory lives exactly as long as the mappings, also after a crash; if rank 0
is killed before that (SIGKILL mid-setup), its registration with Python's resource tracker, which only the
creator makes and keeps until it unlinks the name, has the tracker unlink it.
`MOERAY_SHM=0` in any rank's environment turns the transport off for the whole group.
"""
from __future__ import annotations

import logging
import os
import platform
import secrets
import time
from multiprocessing import shared_memory

import numpy as np
import torch

from actors.rank.shm_segment import open_untracked, unlink
from kernels.cpu.shm import shm_a2a_entry_points

log = logging.getLogger("moeray.rank")

# spin this long before sleeping on the futex (a call outside a step: the agreement of a rank that was idle)
SPIN_S = float(os.environ.get("MOERAY_SHM_SPIN_S", "0.00003"))
# ... and within a step (`within_step`: the MoE exchanges, the agreement between back-to-back steps), where the peer
# is computing the same step and arrives within it: a futex wake-up costs ~40 us on a 2-vCPU KVM guest, more than
# most waits (2 ranks through HTTP, 64 streams: 0.70-0.78x -> 0.79-0.87x of 1 rank, BENCHMARKS.md)
STEP_SPIN_S = float(os.environ.get("MOERAY_SHM_STEP_SPIN_S", "0.0005"))
# while spinning, sched_yield this often: a front-door thread woken onto the waiting rank's core runs at once instead
# of preempting the rank that computes (2 ranks, 64 streams, 4 alternating runs: 0.66-0.83x -> 0.77-0.93x of 1 rank)
YIELD_S = float(os.environ.get("MOERAY_SHM_YIELD_S", "0.00005"))
# the Python polling path (no compiled kernels): sched_yield this long, then sleep between polls
POLL_SPIN_S = float(os.environ.get("MOERAY_SHM_POLL_SPIN_S", "0.002"))
MAX_SLEEP_S = float(os.environ.get("MOERAY_SHM_MAX_SLEEP_S", "0.001"))
LIVENESS_S = 0.02  # while waiting, check the peer's process (and the timeout) this often
LINE = 64  # bytes per header counter (one cache line each: no false sharing between ranks' counters)
# bytes per (source, destination) slot when the caller does not size them (the rank actor sizes them from the
# model: the fixed-capacity decode dispatch sends C x (D + 1) fp32 per peer, C <= 256 rows)
DEFAULT_SLOT_BYTES = 1 << 20


def _node_id() -> str:
    """Identifies this machine's shared-memory namespace (hostname + boot id)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{platform.node()}/{boot}"


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def check_all_to_all(out: torch.Tensor, inp: torch.Tensor, world: int) -> None:
    """The argument rule of this module's and `tcp_collective`'s `all_to_all_single`: equal contiguous CPU
    tensors of one dtype, dim 0 divisible by `world`. Raises ValueError naming both tensors otherwise."""
    if inp.shape != out.shape or inp.dtype != out.dtype or inp.shape[0] % world or not (
            inp.is_contiguous() and out.is_contiguous()) or inp.device.type != "cpu" or out.device.type != "cpu":
        raise ValueError(f"all_to_all_single: inp {tuple(inp.shape)} {inp.dtype} {inp.device}, out "
                         f"{tuple(out.shape)} {out.dtype} {out.device}: need equal contiguous shapes on CPU, "
                         f"dim 0 divisible by {world}")

class ShmAllToAll:
    """`all_to_all_single` with equal splits over a shared-memory segment, for W ranks on one node.

    Build it with `setup` (collective over the TCPStore of the process group). Args (direct use, tests):
        rank, world: this rank and the group size. name: the segment's name. slot_bytes: capacity per
        (source, destination) pair in bytes. timeout_s: a wait longer than this raises. peer_pids: process id
        of every rank (liveness checks). create: make the segment (rank 0) instead of attaching.

    Raises:
        RuntimeError (from `all_to_all_single`): a peer did not arrive within `timeout_s`, or its process exited.
    """

    def __init__(self, rank: int, world: int, name: str, slot_bytes: int, timeout_s: float,
                 peer_pids: list[int], create: bool = False):
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"rank={rank}, world={world}: need world >= 2 and 0 <= rank < world")
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self.max_chunk_bytes = slot_bytes  # the most bytes per peer one call carries (`fits`)
        self.peer_pids = list(peer_pids)
        size = world * LINE + 2 * world * world * slot_bytes
        self.shm = (shared_memory.SharedMemory(name=name, create=True, size=size) if create else
                    open_untracked(name, size))
        self._counters = np.ndarray((world, LINE // 8), dtype=np.int64, buffer=self.shm.buf)[:, 0]
        if create:
            self._counters[:] = 0
        self._data = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=world * LINE,
                                      count=2 * world * world * slot_bytes)
        self.base = self._counters.ctypes.data  # the segment's address, for the C calls
        # (send, recv) in C, or None: Python copies and polling
        self._c = shm_a2a_entry_points() if platform.machine().lower() in ("x86_64", "amd64") else None
        self._spin_ns, self.slice_ns = int(SPIN_S * 1e9), int(LIVENESS_S * 1e9)
        self.step_spin_ns, self.yield_ns = int(STEP_SPIN_S * 1e9), int(YIELD_S * 1e9)
        self._calls = 0
        self.calls = 0  # completed calls (statistics)
        self.wait_s = 0.0  # seconds spent waiting for peers (statistics)
        self.closed = False
        self.interrupted = False  # `interrupt`: the next liveness check raises

    @classmethod
    def setup(cls, store, rank: int, world: int, timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES,
              prefix: str = "moeray/shm", attach_timeout_s: float | None = None) -> "ShmAllToAll | None":
        """Collective over `store` (the process group's TCPStore; protocol in the module docstring): returns the
        group's transport on every rank, or None on every rank when the machine is not x86-64, the ranks are not
        all on one node, a rank set MOERAY_SHM=0, rank 0 cannot create the segment, or a rank could not attach
        within `attach_timeout_s` seconds (None: max(timeout_s, 60)). The caller then keeps torch.distributed
        for everything. Raises only what the store raises (a peer gone during bring-up)."""
        wait_s = max(timeout_s, 60.0) if attach_timeout_s is None else attach_timeout_s
        on = os.environ.get("MOERAY_SHM", "1") != "0"
        store.set(f"{prefix}/node/{rank}", f"{_node_id()}|{os.getpid()}|{int(on)}")
        name, inst, verdict = "", None, "off"
        try:
            infos = [store.get(f"{prefix}/node/{r}").decode().rsplit("|", 2) for r in range(world)]
            pids = [int(p) for _, p, _ in infos]
            if rank == 0:
                why = ("not x86-64" if platform.machine().lower() not in ("x86_64", "amd64") else
                       "ranks on several nodes" if len({n for n, _, _ in infos}) > 1 else
                       "MOERAY_SHM=0" if any(o == "0" for _, _, o in infos) else None)
                if why is None:
                    name = f"moeray_{secrets.token_hex(6)}"
                    try:
                        inst = cls(0, world, name, slot_bytes, timeout_s, pids, create=True)
                    except OSError as e:  # /dev/shm missing, full or too small
                        name, why = "", f"rank 0 cannot create the segment ({type(e).__name__}: {e})"
                store.set(f"{prefix}/name", name)
                verdict = cls._collect(store, prefix, world, wait_s) if name else f"off ({why})"
                store.set(f"{prefix}/verdict", verdict)
            else:
                name = store.get(f"{prefix}/name").decode()
                if name:
                    try:
                        inst = cls._attach(rank, world, name, slot_bytes, timeout_s, pids)
                        report = "ok"
                    except Exception as e:  # noqa: BLE001 - any failure means: not shared with rank 0
                        report = f"{type(e).__name__}: {e}"
                    store.set(f"{prefix}/attach/{rank}", report)
                    store.add(f"{prefix}/reported", 1)
                    verdict = store.get(f"{prefix}/verdict").decode()
        finally:
            if name:  # after the verdict nobody attaches any more; on an error, nobody should
                unlink(name, tracked=rank == 0 and inst is not None)
            if verdict != "ok" and inst is not None:
                inst.close()
                inst = None
        if name and verdict != "ok":
            log.warning("rank %d: shared-memory transport off, gloo for every collective: %s", rank, verdict)
        return inst

    @classmethod
    def _attach(cls, rank: int, world: int, name: str, slot_bytes: int, timeout_s: float,
                pids: list[int]) -> "ShmAllToAll":
        """A non-zero rank maps rank 0's segment (FileNotFoundError: this rank's /dev/shm is not rank 0's)."""
        return cls(rank, world, name, slot_bytes, timeout_s, pids)

    @staticmethod
    def _collect(store, prefix: str, world: int, wait_s: float) -> str:
        """Rank 0: wait up to `wait_s` s for every other rank's attach report; "ok" if all attached, else
        "off (rank r: why; ...)"."""
        deadline = time.monotonic() + wait_s
        while store.add(f"{prefix}/reported", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        bad = []
        for r in range(1, world):
            key = f"{prefix}/attach/{r}"
            got = store.get(key).decode() if store.check([key]) else f"no report within {wait_s:g} s"
            if got != "ok":
                bad.append(f"rank {r}: {got}")
        return "ok" if not bad else f"off ({'; '.join(bad)})"

    def fits(self, nbytes_per_peer: int) -> bool:
        """Whether a call sending `nbytes_per_peer` bytes to each rank goes through shared memory (never after
        `close`: the callers then take torch.distributed)."""
        return not self.closed and nbytes_per_peer <= self.slot_bytes

    def slot(self, bank: int, src: int, dst: int, nbytes: int) -> torch.Tensor:
        """The first nbytes of slot (bank, src, dst) of the segment, as a uint8 tensor view (no copy)."""
        off = ((bank * self.world + src) * self.world + dst) * self.slot_bytes
        return self._data[off: off + nbytes]

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, within_step: bool = False) -> None:
        """out[chunk s] = rank s's inp[chunk r] for every rank s (r = this rank), equal chunks along dim 0.

        Args:
            out, inp: contiguous CPU tensors of the same dtype and shape, dim 0 divisible by the world size,
                at most `slot_bytes` per chunk (`fits`).
            within_step: the peers compute the same step and will arrive soon: the compiled wait spins
                `STEP_SPIN_S`, not `SPIN_S`, before sleeping (the Python polling path, without compiled kernels,
                yields for `POLL_SPIN_S` before sleeping either way).
        Raises:
            ValueError: bad shapes. RuntimeError: a peer timed out or exited.
        """
        W = self.world
        check_all_to_all(out, inp, W)
        nb = inp.nbytes // W
        if not self.fits(nb):
            raise ValueError(f"all_to_all_single: {nb} bytes per peer exceeds slot_bytes={self.slot_bytes}")
        if self._c is not None:
            self._c_call(out, inp, nb, self.step_spin_ns if within_step else self._spin_ns)
        else:
            self._py_call(out, inp, nb)
        self._calls += 1
        self.calls += 1

    def _c_call(self, out: torch.Tensor, inp: torch.Tensor, nb: int, spin_ns: int) -> None:
        send, recv = self._c
        args = (self.base, LINE, self.world, self.rank, self.slot_bytes, self._calls)
        send(*args, inp.data_ptr(), out.data_ptr(), nb)
        t0 = time.perf_counter()
        s = recv(*args, out.data_ptr(), nb, spin_ns, self.slice_ns, self.yield_ns)
        while s >= 0:  # a peer did not arrive within LIVENESS_S: is it alive, are we past the timeout?
            self.check_peer(s, time.perf_counter() - t0)
            s = recv(*args, out.data_ptr(), nb, spin_ns, self.slice_ns, self.yield_ns)
        self.wait_s += time.perf_counter() - t0

    def reserve(self, n: int) -> int:
        """Numbers for n collectives a caller makes on the segment itself (`actors.moe.slot_exchange`, over `base`
        with this rank's `step_spin_ns` / `slice_ns` / `yield_ns` waits): returns the first; the next call is
        first + n."""
        first, self._calls, self.calls = self._calls, self._calls + n, self.calls + n
        return first

    def check_peer(self, s: int, waited: float) -> None:
        """After a wait slice for rank s ran out: raises RuntimeError when interrupted, past the timeout, or when s
        exited."""
        if self.interrupted:
            raise RuntimeError(f"shared-memory all_to_all: interrupted while waiting for rank {s} (regroup)")
        if waited > self.timeout_s:
            raise RuntimeError(f"shared-memory all_to_all: rank {s} did not arrive within {self.timeout_s} s")
        if not _alive(self.peer_pids[s]):
            raise RuntimeError(f"shared-memory all_to_all: rank {s} (pid {self.peer_pids[s]}) exited")

    def _py_call(self, out: torch.Tensor, inp: torch.Tensor, nb: int) -> None:
        W, r = self.world, self.rank
        src_b, dst_b = inp.view(-1).view(torch.uint8).view(W, -1), out.view(-1).view(torch.uint8).view(W, -1)
        bank, target = self._calls & 1, self._calls + 1
        for d in range(W):
            if d != r:
                self.slot(bank, r, d, nb).copy_(src_b[d])
        dst_b[r].copy_(src_b[r])
        self._counters[r] = target  # publish after the data (x86-64 keeps store order)
        for s in range(W):
            if s != r:
                if self._counters[s] < target:
                    self._wait(s, target)
                dst_b[s].copy_(self.slot(bank, s, r, nb))

    def _wait(self, s: int, target: int) -> None:
        t0 = time.perf_counter()
        sleep, polls, next_check = 0.0, 0, LIVENESS_S
        c = self._counters
        while c[s] < target:
            if sleep:
                time.sleep(sleep)
                sleep = min(sleep * 2, MAX_SLEEP_S)
            else:
                os.sched_yield()
            polls += 1
            if polls % 64 == 0:
                waited = time.perf_counter() - t0
                if waited > POLL_SPIN_S and not sleep:
                    sleep = 5e-5
                if waited > next_check:  # reading /proc costs ~20-50 us: not on every poll
                    next_check = waited + LIVENESS_S
                    self.check_peer(s, waited)
        self.wait_s += time.perf_counter() - t0

    def interrupt(self) -> None:
        """Any thread: a call waiting for a peer raises within LIVENESS_S (elastic EP: the peer is lost, the group
        is re-formed), and so does every later one that has to wait."""
        self.interrupted = True

    def close(self) -> None:
        """Detach from the segment (the name is already unlinked after `setup`); `fits` is False from then on."""
        self.closed = True
        self._data = self._counters = self._c = None
        try:
            self.shm.close()
        except BufferError:  # a tensor view still alive: the OS reclaims the mapping at exit
            pass
