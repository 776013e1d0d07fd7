"""Two Ray nodes on one machine, for the cross-node test (tests/cluster/test_two_nodes.py) and bench/multinode.py.

Node A is a Ray head on 127.0.0.11, node B a second raylet on 127.0.0.12 joined to it (Ray rewrites 127.0.0.1 to
the host's outward address, so both use other loopback addresses, which Linux routes through `lo`). Where
`unshare` is allowed (root, or a user namespace), each node runs in a mount namespace of its own with a private
tmpfs on /dev/shm, and node B also in its own UTS namespace (hostname `moeray-node-b`): what two machines look
like to moeray (hostname + boot id say "another node", and a shared-memory segment one node makes is not on the
other). Node A gets a private /dev/shm too so that counting moeray segments there is not disturbed by other
processes on the host. Without unshare both nodes share the host's hostname and /dev/shm, and node B's
processes run with `MOERAY_SHM=0` (the shared-memory transport off, so ranks still talk gloo across the node
boundary); `isolated` says which setup is running.

Each node is one `ray start --block` process in a session of its own, with its own temp dir and kernel-chosen
ports, stopped by killing that session's process group (never `ray stop`, which stops every Ray on the machine,
the test suite's shared instance included). The driver is whoever connects to `address`; the cluster uses
token auth so a stray driver of another Ray on the machine cannot join it.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
HEAD_IP, NODE_B_IP = "127.0.0.11", "127.0.0.12"
NODE_B_HOSTNAME = "moeray-node-b"
SEGMENT_PREFIX = "moeray_"  # shared-memory segment names (actors.rank.shm_collective)


def free_port(host: str) -> int:
    """A port the kernel hands out on `host` now (the head's GCS port; Ray binds it again at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def unshare_allowed() -> bool:
    """Whether this process may make UTS + mount namespaces and mount a tmpfs in them (root, usually)."""
    try:
        r = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm && hostname moeray-probe"],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def wait_alive(nodes: int = 2, timeout_s: float = 60.0) -> None:
    """In a driver connected to a `TwoNodes` cluster (ray.init done): until Ray counts `nodes` nodes alive.
    Raises RuntimeError after `timeout_s` seconds."""
    import ray

    deadline = time.monotonic() + timeout_s
    while sum(n["Alive"] for n in ray.nodes()) < nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{nodes} nodes not alive within {timeout_s}s: {ray.nodes()}")
        time.sleep(0.2)


class TwoNodes:
    """Start node A (head) and node B; `address` for drivers, `env` for driver subprocesses, `stop()` at the end.

    Args:
        cpus_a, cpus_b: logical CPUs each node offers Ray (ranks ask 0.5 each by default).
        isolate: None: private namespaces when `unshare_allowed()`; True: require them (RuntimeError if not
            allowed); False: share the host's (node B with MOERAY_SHM=0).
        shm_mb: size of each private /dev/shm tmpfs (MiB); it holds the node's Ray object store too.
        token: the cluster's auth token (default: RAY_AUTH_TOKEN if set, else a new random one). Ray reads
            RAY_AUTH_MODE / RAY_AUTH_TOKEN when it is imported, so an in-process driver sets both before
            importing ray and passes nothing here.
    Raises:
        RuntimeError: a node did not come up within `timeout_s` (the message has the tail of its log).
    """

    def __init__(self, cpus_a: int = 2, cpus_b: int = 2, isolate: bool | None = None, shm_mb: int = 512,
                 timeout_s: float = 90.0, token: str | None = None):
        allowed = unshare_allowed()
        if isolate and not allowed:
            raise RuntimeError("unshare --uts --mount is not allowed here (needs root or user namespaces)")
        self.isolated = allowed if isolate is None else isolate
        self.dir = tempfile.mkdtemp(prefix="moeray-2n-", dir="/tmp")  # short: Ray's socket paths have a limit
        self.address = f"{HEAD_IP}:{free_port(HEAD_IP)}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env = {**base, "PYTHONPATH": REPO, "RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": token or os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16)}
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}
        try:
            # node B's `ray start` retries the head's GCS until it answers: both start at once
            self._start("a", ["--head", "--port", self.address.split(":")[1], "--node-ip-address", HEAD_IP,
                              "--num-cpus", str(cpus_a), "--include-dashboard", "false",
                              "--dashboard-agent-listen-port", str(free_port(HEAD_IP))], shm_mb, None)
            self._start("b", ["--address", self.address, "--node-ip-address", NODE_B_IP, "--num-cpus", str(cpus_b),
                              "--dashboard-agent-listen-port", str(free_port(NODE_B_IP))], shm_mb, NODE_B_HOSTNAME)
            self._wait_started(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, node: str, args: list[str], shm_mb: int, hostname: str | None) -> None:
        tmp = os.path.join(self.dir, node)
        os.makedirs(tmp)
        ray = [RAY, "start", "--block", *args, "--temp-dir", tmp, "--object-store-memory", str(80 << 20),
               "--disable-usage-stats"]
        env = dict(self.env)
        if self.isolated:
            setup = f"mount -t tmpfs -o size={shm_mb}m tmpfs /dev/shm"
            if hostname:
                setup += f" && hostname {hostname}"
            argv = ["unshare", "--mount", *(["--uts"] if hostname else []), "sh", "-c", f'{setup} && exec "$@"',
                    "sh", *ray]
        else:
            argv = ray
            if node == "b":
                env["MOERAY_SHM"] = "0"
        self._logs[node] = open(os.path.join(self.dir, f"{node}.log"), "w")
        # unshare execs sh, which execs ray: the Popen pid is the `ray start` process inside the namespaces
        self.procs[node] = subprocess.Popen(argv, env=env, stdout=self._logs[node], stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=tmp)

    def log_tail(self, node: str, chars: int = 3000) -> str:
        try:
            with open(os.path.join(self.dir, f"{node}.log")) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _wait_started(self, timeout_s: float) -> None:
        """Until both `ray start` logs say the runtime started (node B's raylet has then registered with the
        head's GCS; a driver still checks `ray.nodes()`, see `wait_alive`)."""
        deadline = time.monotonic() + timeout_s
        while not all("Ray runtime started" in self.log_tail(node, 1 << 16) for node in self.procs):
            for node, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"node {node} exited {p.returncode}: {self.log_tail(node)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not up within {timeout_s}s:\n" +
                                   "\n".join(f"{k}: {self.log_tail(k)}" for k in self.procs))
            time.sleep(0.2)

    def shm_dir(self, node: str) -> str:
        """The /dev/shm node `node` ("a" or "b") sees, readable from this process (through /proc/<pid>/root
        into the node's mount namespace)."""
        return f"/proc/{self.procs[node].pid}/root/dev/shm" if self.isolated else "/dev/shm"

    def segments(self, node: str) -> list[str]:
        """moeray shared-memory segments in node `node`'s /dev/shm."""
        return sorted(n for n in os.listdir(self.shm_dir(node)) if n.startswith(SEGMENT_PREFIX))

    def stop(self) -> None:
        """Kill both nodes' sessions (SIGKILL to each process group: `ray start --block`, its GCS, raylet, agents
        and workers; a graceful SIGTERM took ~13 s here) and remove the temp dir."""
        for node in ("b", "a"):
            p = self.procs.get(node)
            if p is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)
        for f in self._logs.values():
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "TwoNodes":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
