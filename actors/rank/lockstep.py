"""The lockstep loop of one rank: the step thread that keeps every rank's collectives paired.

Lockstep protocol. Every router call that may create work (a request, an abort, shutdown) is followed
by a wake sequence number `seq` that is sent to every rank; a rank that has seen a `seq` holds the
request behind it: over Ray actor calls, the router draws the seq only after the owning rank holds the
request; over the ranks' channels (`router_service.rank_channels`), it writes the request and then the
seq on the owner's connection, whose frames arrive in order. A rank sleeps (on a condition variable: no spinning) until it
has seen a `seq` above the last agreed one. Each round, every rank reads its `seen_seq` and then
checks for work, and contributes `[has_work, -seen_seq, stop, -committed_epoch, num_tokens, has_prefill]` to one
MAX over the group (an all-to-all of the replicated flags: cheaper than gloo's all_reduce); all ranks
therefore agree on whether to run a step (all of them do, with zero tokens if need be), on when to
stop, and on `agreed_seq`, the SMALLEST seq seen: a rank goes back to sleep only when every rank has
read its latest seq, so the work behind that seq was in this round's `has_work`. (With the largest
seq, a rank whose request landed just after its work check could be told its own seq was agreed,
while a peer that got the wake first reported no work: it slept with the request queued. Seen once
as a hung request in `tests/cluster/test_cluster.py`.) Since every `seq` reaches every rank, a rank
that wakes for `seq` is always joined by the others. The fifth flag, the largest planned token count,
lets every rank's dispatcher choose the fixed-capacity exchange for the step (`StepContext.step_max_tokens`); the
sixth, whether any rank's step has a prefill, gates two-batch overlap (`StepContext.decode_only`).
After the six flags each rank's row carries its `balanced` expert load of the previous step (L * E int64,
`RankEngine.take_balance_load`; 256 bytes on the shipped model): the flags are MAXed, the loads SUMmed, and
every rank applies the group's load to its balancing bias before the step (`apply_balance_load`), so the
bias is the same on every rank after every step with no collective of its own.

Expert placement changes (EPLB rebalancing) ride on the same agreement: the launcher first has every
rank `prepare_placement(placement, epoch)` (weights read off the step thread), then `commit_placement(epoch)`
on every rank. A fourth flag carries `-committed_epoch`, so MAX gives minus the smallest epoch committed on
all ranks; when that exceeds the applied epoch, every rank applies it in the same round, before the step.
Sequences and KV caches are untouched, so requests in flight just continue under the new placement.

Elastic EP (redundant experts, `actors.rank.elastic`): an error in a round does not fail an elastic rank at once;
it waits for the survivors' new group and re-runs the interrupted step there (the plan is kept; `RankEngine.run`
changes no sequence before its forward returns, so the re-run writes the same K/V and samples the same token).
A regroup order to a rank with no error (idle, or a replacement joining) is taken at the top of its next round.
"""
from __future__ import annotations

import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from actors.rank.elastic import RegroupNow
from actors.rank.output_channel import HEARTBEAT_S


class LockstepLoop:
    """The step thread of `actors.rank.worker.RankWorker` (a mixin: `_loop` runs on the worker's state).

    Reads the worker's `engine`, `world_size`, `group`, `shm`, `channel`, its wake state under `_cond`
    (`_wake_seq`, `_stop`, `_commit_epoch`) and `_applied_epoch`; calls `_apply_placement`; on an error sets
    `_failed`, fails every request and wakes `commit_placement` waiters (`_pl_cond`).
    """

    def _loop(self) -> None:
        """Rounds until stop; on an error, an elastic rank (redundant experts) waits for the survivors' new group
        (`RankWorker.regroup`) and re-runs the interrupted step in it, else (or when no new group comes) fails."""
        pending = None
        while True:
            try:
                self._rounds(pending)
                return self._close_group()
            except Exception as e:  # noqa: BLE001 - a dead peer or a bug
                pending, self._inflight = self._inflight, None
                # a lost peer (world > 1) or a replacement joining (an order, even alone): the new group
                if not (self.elastic and (self.world_size > 1 or isinstance(e, RegroupNow)) and self._await_regroup(e)):
                    return self._fail(e)

    def _fail(self, e: Exception) -> None:
        """Fail every in-flight request loudly (the loop ends)."""
        self._failed = f"rank {self.rank}: {type(e).__name__}: {e}"
        traceback.print_exc()
        # the requests' own error (what clients see) names the rank and the kind, not the exception's text
        self.channel.push(self.engine.fail_all(
            f"rank {self.rank} failed during a step ({type(e).__name__}); retry the request"))
        self.channel.tick(heartbeat=False)  # the `failed` frame, then the error outputs
        with self._pl_cond:
            self._pl_cond.notify_all()
        self._close_group()

    def _close_group(self) -> None:
        """Leave the process group and close the step transport."""
        if self.world_size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        if self.shm is not None:
            self.shm.close()  # the dispatcher's `fits` checks then fail: torch.distributed from here on

    def _rounds(self, pending=None) -> None:
        """The lockstep rounds in the current group; `pending`: a planned step an error interrupted, re-run first
        (its forward had not changed any sequence: `RankEngine.run` advances them only after it)."""
        agreed, idle, W = 0, pending is None, self.world_size
        n = 6 + self.engine.balance_width  # the flags, then the `balanced` load counters
        shm = self.shm if self.shm is not None and self.shm.fits(8 * n) else None
        if shm is not None:  # CPU: numpy views of the tensors, 1 numpy op each instead of ~10 torch ops
            flag_np, in_np = np.zeros((W, n), dtype=np.int64), np.zeros((W, n), dtype=np.int64)
            flag, flags_in = torch.from_numpy(flag_np).view(-1), torch.from_numpy(in_np).view(-1)
        else:
            flag = torch.zeros(n, dtype=torch.int64, device=self.engine.device)  # NCCL needs it on the GPU
            flags_in = torch.zeros(n * W, dtype=torch.int64, device=self.engine.device)
        while True:
            with self._cond:
                if (idle and self._wake_seq <= agreed and not self._stop and self._regroup_order is None
                        and self._commit_epoch <= self._applied_epoch):
                    self._cond.wait(timeout=HEARTBEAT_S)
                still_idle = (idle and self._wake_seq <= agreed and not self._stop
                              and self._commit_epoch <= self._applied_epoch)
                seen, stop, committed = self._wake_seq, self._stop, self._commit_epoch
                regroup = self._regroup_order is not None
            if regroup:  # an idle survivor of a lost peer: the new group first (`actors.rank.elastic`)
                raise RegroupNow("regroup ordered")
            if still_idle:
                self.channel.tick()  # a new connection, or a heartbeat
                continue
            plan, t_max, prefill = None, None, 1
            if self.world_size > 1:
                # this rank's step is planned before the agreement, so the group learns its largest token
                # count (the dispatcher's fixed capacity) in the same agreement
                plan = pending if pending is not None else (
                    self.engine.plan() if self.engine.has_work and not stop else None)
                pending, self._inflight = None, plan
                mine = (int(plan is not None), -seen, int(stop), -committed, plan.num_tokens if plan else 0,
                        int(plan is not None and bool(plan.meta.prefills)))
                load = self.engine.take_balance_load()  # the previous step's, [L * E] int64 or None
                t0 = time.perf_counter()
                # MAX over ranks as an all-to-all of the replicated flags: gloo's all_reduce of 5 int64 takes
                # ~1.9 ms on the 2-core machine, its all-to-all ~0.7 ms, shared memory ~0.1 ms
                if shm is not None:
                    flag_np[:, :6] = mine  # every row: the flags go to every rank
                    flag_np[:, 6:] = 0 if load is None else load.numpy()
                    shm.all_to_all_single(flags_in, flag, within_step=not idle)  # steps back to back: spin
                    work, agreed, stop, committed, t_max, prefill = in_np[:, :6].max(0).tolist()
                    group_load = in_np[:, 6:].sum(0)
                else:
                    flag[:6] = torch.tensor(mine)
                    flag[6:] = 0 if load is None else load
                    dist.all_to_all_single(flags_in, flag.repeat(W), group=self.group)
                    rows = flags_in.view(W, n)
                    work, agreed, stop, committed, t_max, prefill = rows[:, :6].amax(0).tolist()
                    group_load = rows[:, 6:].sum(0)
                self.engine.timing["sync_s"] += time.perf_counter() - t0
                agreed, committed = -agreed, -committed  # the smallest seq seen, the smallest epoch committed
            else:  # alone: nothing to agree on (and no tensor ops on the decode path)
                work, agreed = self.engine.has_work or pending is not None, seen
                plan, pending = pending, None
            if stop:
                break
            if self.world_size > 1:  # the same sum on every rank: the same bias for this step
                self.engine.apply_balance_load(group_load)
            if committed > self._applied_epoch:  # committed on every rank: switch now, all together
                self._apply_placement(committed)
            if not work:
                idle = True
                continue
            idle = False
            if plan is None:  # alone, or the others have work: an empty step if nothing was planned here
                plan = self.engine.plan(schedule=self.world_size == 1)
            self._inflight = plan if plan.seqs else None
            outs = self.engine.run(plan, t_max, decode_only=not prefill)
            self._inflight = None
            self.channel.emit(outs)
