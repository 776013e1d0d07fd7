"""Drive a two-node test from a fresh interpreter joined to `bench.two_nodes.TwoNodes`' cluster (node B may be
SIGSTOPped there, so the test process itself never joins it) and read back its report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.node_loss import NODE_B_PID_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_driver(nodes, module: str, model: str, timeout_s: float) -> dict:
    """`module.drive(model)` in a subprocess with the nodes' environment (node B's pid in NODE_B_PID_ENV): returns
    the JSON of its last stdout line starting `REPORT `; asserts it exited 0 with one (its stderr tail otherwise)."""
    env = {**nodes.env, NODE_B_PID_ENV: str(nodes.procs["b"].pid)}
    r = subprocess.run([sys.executable, "-c", f"from {module} import drive; drive({model!r})"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")]
    assert r.returncode == 0 and lines, f"driver exited {r.returncode}: {r.stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT "):])


def report_and_exit(report: dict) -> None:
    """The driver's end: print `REPORT <json>` (what `run_driver` reads) and exit at once, without `ray.shutdown()`,
    which would wait on a stopped node."""
    print("REPORT " + json.dumps(report, default=str), flush=True)
    os._exit(0)
