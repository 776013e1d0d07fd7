"""Cluster-side watchdog for a Serve app deployed by `moeray serve --address ...`: no orphans when that command dies.

The command holds a lease on a small detached named Ray actor (`Watchdog`, 0 CPUs, in namespace `moeray`) and
renews it every RENEW_S seconds over Ray (`Lease`). When the lease has not been renewed for LEASE_S seconds (the
command died by any signal, SIGKILL included, its node was lost, or it hangs), the watchdog deletes the app
(`serve.delete`: the replica goes, and with it the placement group and the rank actors it owns), shuts Serve
down as well (controller, proxies, their ports) if that command had started it and no other app runs on it, and
then ends itself. Teardown thus completes within LEASE_S + the time Serve takes to stop a replica (< 30 s).

Why a lease on its own actor, not Ray's fate sharing or the replica: the replica is owned by Serve's detached
controller, not by the command, so nothing of the app dies with the command's Ray job; the replica cannot be the
watchdog because Serve replaces it (the lease would restart with it), it may be the very thing that failed to
come up, and an app deleting itself from inside its replica waits on its own shutdown. A renewal lease needs no
Ray internals (no job table), and covers a lost node or a hung command as well as a dead one. The actor restarts
(max_restarts=-1) if its node dies; the restarted one starts a fresh lease, so a dead command's app still goes.

A new `moeray serve --address` deploying the same app name takes the app over: it ends the earlier watchdog(s)
of that app (`take_over`), inheriting the duty to shut Serve down if theirs had it, and the earlier command,
whose lease is then lost, no longer tears the app down.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

log = logging.getLogger("moeray.serve")

LEASE_S = 15.0  # seconds without a renewal before the watchdog tears the app down
RENEW_S = 2.0  # seconds between the command's renewals
NAMESPACE = "moeray"  # Ray namespace of the watchdog actors
PREFIX = "moeray-watchdog-"  # actor name: PREFIX + app + "-" + a random suffix


def serve_running() -> bool:
    """True if a Serve controller already runs on the connected Ray cluster (Ray must be initialized)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return any(a["name"] == SERVE_CONTROLLER_NAME and a.get("namespace") == SERVE_NAMESPACE
               for a in ray.util.list_named_actors(all_namespaces=True))


def teardown(app: str, owns_serve: bool) -> None:
    """Delete Serve app `app` (blocking until its replicas are gone) and, if `owns_serve` and no other app is
    left, shut Serve down (controller and proxies). Errors are logged, not raised: this runs on the way out."""
    from ray import serve

    try:
        serve.delete(app)
    except Exception as e:  # noqa: BLE001 - the app may already be gone, or Serve with it
        log.warning("deleting Serve app %r failed: %s: %s", app, type(e).__name__, e)
    if not owns_serve:
        return
    try:
        left = [name for name in serve.status().applications if name != app]
        if not left:
            serve.shutdown()
        else:
            log.warning("Serve left running: it serves other apps %s", left)
    except Exception as e:  # noqa: BLE001
        log.warning("shutting Serve down failed: %s: %s", type(e).__name__, e)


class Watchdog:
    """The lease holder (a Ray actor: `ray.remote` is applied in `Lease.start`). A thread checks the lease every
    0.5 s; on expiry it runs `teardown(app, owns_serve)` and kills this actor (no restart). The command ends it
    with `ray.kill` when it tears the app down itself or hands it over (`--detach`).

    Raises:
        ValueError: lease_s <= 0."""

    def __init__(self, app: str, lease_s: float, owns_serve: bool):
        if lease_s <= 0:
            raise ValueError(f"lease_s={lease_s} must be > 0")
        self.app, self.lease_s, self.owns_serve = app, lease_s, owns_serve
        self._renewed = time.monotonic()
        threading.Thread(target=self._watch, name="moeray-watchdog", daemon=True).start()

    def owns(self) -> bool:
        """Whether this watchdog's teardown shuts Serve down too (passed on to a command that takes over)."""
        return self.owns_serve

    def renew(self) -> float:
        """Renew the lease; returns its length in seconds."""
        self._renewed = time.monotonic()
        return self.lease_s

    def _watch(self) -> None:
        while (idle := time.monotonic() - self._renewed) <= self.lease_s:
            time.sleep(0.5)
        log.warning("lease of Serve app %r not renewed for %.0f s: deleting the app", self.app, idle)
        teardown(self.app, self.owns_serve)
        import ray

        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


class Lease:
    """The command's side: starts a `Watchdog` for `app` and renews it every `renew_s` s from a daemon thread.
    `lost` is set once the watchdog is gone (taken over by another command, or killed): the app is then no
    longer this command's to tear down."""

    def __init__(self, app: str, owns_serve: bool, lease_s: float = LEASE_S, renew_s: float = RENEW_S):
        if not 0 < renew_s < lease_s:
            raise ValueError(f"renew_s={renew_s} must be in (0, lease_s={lease_s})")
        self.app, self.owns_serve, self.lease_s, self.renew_s = app, owns_serve, lease_s, renew_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._handle = None

    def start(self) -> "Lease":
        """Take the app over from earlier watchdogs (`take_over`) and start this command's; returns self."""
        import ray

        if take_over(self.app):  # Serve was started by the command this one takes over: it is ours to stop now
            self.owns_serve = True
        actor = ray.remote(Watchdog).options(num_cpus=0, max_restarts=-1, lifetime="detached", namespace=NAMESPACE,
                                             name=f"{PREFIX}{self.app}-{uuid.uuid4().hex[:8]}")
        self._handle = actor.remote(self.app, self.lease_s, self.owns_serve)
        ray.get(self._handle.renew.remote(), timeout=60)  # it is up (and the lease starts now)
        threading.Thread(target=self._renew, name="moeray-lease", daemon=True).start()
        return self

    def _renew(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        while not self._stop.wait(self.renew_s):
            try:
                ray.get(self._handle.renew.remote(), timeout=self.lease_s)
            except RayActorError:
                if not self._stop.is_set():
                    self.lost.set()
                    log.warning("the watchdog of Serve app %r is gone (another `moeray serve` took the app over?):"
                                " this command no longer tears it down", self.app)
                return
            except GetTimeoutError:
                log.warning("the watchdog of Serve app %r did not answer within %.0f s", self.app, self.lease_s)

    def release(self, timeout_s: float = 30.0) -> None:
        """Stop renewing and end the watchdog (the app is torn down already, or is to outlive the command);
        returns once it is dead, or after `timeout_s` s."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        self._stop.set()
        if self._handle is None:
            return
        deadline = time.monotonic() + timeout_s
        try:
            ray.kill(self._handle, no_restart=True)
            while time.monotonic() < deadline:  # a renewal is answered until the kill has taken effect
                ray.get(self._handle.renew.remote(), timeout=max(0.1, deadline - time.monotonic()))
                time.sleep(0.1)
        except (RayActorError, GetTimeoutError):
            pass


def take_over(app: str) -> bool:
    """End every watchdog of Serve app `app` (left by an earlier `moeray serve`); returns True if one of them was
    to shut Serve down as well (its command had started Serve), a duty that passes to the caller."""
    import ray

    owned = False
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == NAMESPACE and a["name"].startswith(f"{PREFIX}{app}-"):
            try:
                old = ray.get_actor(a["name"], namespace=NAMESPACE)
            except ValueError:  # gone meanwhile
                continue
            try:
                owned = ray.get(old.owns.remote(), timeout=10) or owned
            except Exception as e:  # noqa: BLE001 - a dying watchdog: end it all the same
                log.warning("watchdog %s did not answer: %s", a["name"], e)
            ray.kill(old, no_restart=True)
    return owned
