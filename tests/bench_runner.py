"""Run a `bench/` script in a subprocess (tiny shapes, Triton's interpreter) and read its RESULT line."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench_result(script: str, *args: str, timeout_s: float = 600) -> dict[str, str]:
    """`python bench/<script> <args>` with TRITON_INTERPRET=1; asserts exit 0 and a last stdout line
    `RESULT key=value ...`, returned as {key: value-string}."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args], env=env,
                       capture_output=True, text=True, timeout=timeout_s, check=False)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return dict(kv.split("=", 1) for kv in last.split()[1:])
