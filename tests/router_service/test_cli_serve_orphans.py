"""No orphans: the app `moeray serve --address ...` deploys on a Ray cluster goes when that command dies (SIGKILL
included: the cluster-side watchdog's lease runs out) and when its deploy fails; `--detach` leaves it running.

The test runs its own Ray head (`ray start --head --block` on 127.0.0.11 with token auth, in a temp dir, in its own
process group, killed at the end), not the shared test Ray. The cluster's actors and placement groups are read by a
separate driver process (`STATE`), since this process may already be attached to the shared Ray."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

pytestmark = pytest.mark.ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
HEAD_IP = "127.0.0.11"  # Ray rewrites 127.0.0.1 to the host's outward address: another loopback address

# what lives on the cluster: every actor not DEAD (class, name) and every placement group not REMOVED
STATE = r"""
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
actors = [(a["ActorClassName"], a["Name"]) for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
pgs = [k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"]
print("STATE " + json.dumps({"actors": sorted(actors), "pgs": pgs}))
"""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Head:
    """A one-node Ray cluster of this test's own."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="moeray-orph-", dir="/tmp")  # short: Ray's socket paths have a limit
        self.address = f"{HEAD_IP}:{_free_port(HEAD_IP)}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env = {**env, "PYTHONPATH": REPO, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
        self.log = open(os.path.join(self.dir, "head.log"), "w")
        self.proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", HEAD_IP, "--port", self.address.split(":")[1],
             "--temp-dir", self.dir, "--num-cpus", "2", "--object-store-memory", str(100 << 20),
             "--include-dashboard", "false", "--disable-usage-stats"],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir)

    def state(self) -> dict:
        r = subprocess.run([sys.executable, "-c", STATE, self.address], env=self.env, capture_output=True, text=True,
                           timeout=60, cwd=REPO)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("STATE ")]
        assert r.returncode == 0 and lines, r.stderr[-3000:]
        out = json.loads(lines[-1][len("STATE "):])
        out["classes"] = sorted({c for c, _ in out["actors"]})
        return out

    def wait_up(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, open(os.path.join(self.dir, "head.log")).read()[-3000:]
            try:
                self.state()
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left (gcs_server may linger)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        h.wait_up()
        yield h
    finally:
        h.stop()


def serve_cmd(head: Head, model: str, port: int, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "moeray.cli", "serve", "--address", head.address, "--model", model, "--ranks", "1",
            "--http-port", str(port), "--grpc-port", "0", "--kv-cache-bytes", str(4 << 20), "--max-num-seqs", "8",
            *extra]
    return subprocess.Popen(argv, env=head.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except OSError as e:
        return getattr(e, "code", None)


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    while health(port) != 200:
        assert proc.poll() is None, f"moeray serve exited {proc.returncode}: {proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, "moeray serve did not come up"
        time.sleep(0.5)


def wait_empty(head: Head, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = head.state()
        if (not s["actors"] and not s["pgs"]) or time.monotonic() > deadline:
            return s
        time.sleep(1.0)


APP_CLASSES = ["RankWorker", "ServeController", "ServeReplica:moeray:MoerayServer", "Watchdog"]


def test_sigkilled_serve_leaves_no_actor(head, tiny_model_dir):
    port = _free_port()
    proc = serve_cmd(head, tiny_model_dir("qwen2_moe"), port)
    try:
        wait_healthy(proc, port)
        up = head.state()
        assert up["classes"] == APP_CLASSES and len(up["pgs"]) == 1, up  # the app, its rank and the watchdog
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(10)
        left = wait_empty(head, 45.0)  # the lease (15 s) runs out, then the app and Serve are deleted
        took = time.monotonic() - t0  # an upper bound: each look at the cluster is a new driver (a few s)
        assert left["actors"] == [] and left["pgs"] == [], left
        print(f"torn down {took:.1f} s after the SIGKILL")
        assert took <= 30.0, f"the app outlived its command by {took:.1f} s (issue 19: within 30 s)"
        assert health(port) is None  # nobody listens on the port any more
    finally:
        if proc.poll() is None:
            proc.kill()


def test_failed_deploy_is_deleted_before_exit(head, tiny_model_dir):
    # the replica's ClusterConfig refuses it: Serve reports the deploy failed (the CLI cannot check it before)
    proc = serve_cmd(head, tiny_model_dir("qwen2_moe"), _free_port(), "--max-model-len", "100000")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 2, out[-4000:]
    assert "deploy failed" in out and "moeray: error:" in out
    s = head.state()  # right at exit: nothing left, Serve included (this command started it)
    assert s["actors"] == [] and s["pgs"] == [], s


def test_detached_serve_outlives_the_command(head, tiny_model_dir):
    port = _free_port()
    proc = serve_cmd(head, tiny_model_dir("qwen2_moe"), port, "--detach")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out[-4000:]
    assert "detached" in out and "serve.delete('moeray')" in out
    assert health(port) == 200
    s = head.state()
    assert s["classes"] == [c for c in APP_CLASSES if c != "Watchdog"] and len(s["pgs"]) == 1, s  # no watchdog
