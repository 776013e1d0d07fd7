"""`moeray serve` starts its own local Ray with token authentication (RAY_AUTH_MODE=token) unless the user
chose a mode; joining a cluster leaves the mode alone. Without an address both `moeray serve` and `LLM()` start a
private Ray (address "local"), never the cluster a `ray start` on this machine recorded. Unit-level: `ray.init` and `LLM` are replaced by
recorders, in a subprocess, because switching Ray's cached config to token mode is process-wide."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, os, sys
import ray
from ray._raylet import AuthenticationMode, get_authentication_mode

import moeray.api
from moeray import cli_serve

calls = []
ray.is_initialized = lambda: False
ray.init = lambda **kw: calls.append({"mode": os.environ.get("RAY_AUTH_MODE"), **kw})

def case(address):
    calls.clear()
    cli_serve.init_ray(address)
    return {"env": os.environ.get("RAY_AUTH_MODE"), "token": get_authentication_mode() == AuthenticationMode.TOKEN,
            "init": calls[0]}

out = {}
out["joined"] = case("10.0.0.1:6379")  # first, while the mode is still unset
out["local"] = case(None)
out["local_address"] = case("local")

os.environ["RAY_AUTH_MODE"] = "disabled"  # the user's choice wins
out["user_disabled"] = case(None)

del os.environ["RAY_AUTH_MODE"]
def no_cluster(cfg):
    raise ValueError("stop here")
moeray.api.EPCluster = no_cluster  # LLM() with no address: how it starts Ray, then stop
calls.clear()
try:
    moeray.api.LLM(model=sys.argv[1])
except ValueError:
    pass
out["llm_local"] = calls[0]
class FakeLLM:
    def __init__(self, **kw):
        out["grpc_only"] = {"env": os.environ.get("RAY_AUTH_MODE"), "address": kw.get("address")}
        raise ValueError("stop here")
moeray.api.LLM = FakeLLM
import argparse
p = argparse.ArgumentParser(); sub = p.add_subparsers(); cli_serve.add_parser(sub)
a = p.parse_args(["serve", "--model", sys.argv[1], "--http-port", "0", "--grpc-port", "50051"])
out["grpc_only_rc"] = a.func(a)
print("RESULT " + json.dumps(out))
"""


def test_serve_cli_starts_local_ray_with_token_auth(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dir("qwen2_moe")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    # joining a cluster: its auth mode is the cluster's business, nothing is set
    assert out["joined"]["env"] is None and out["joined"]["init"]["address"] == "10.0.0.1:6379"
    # a private local Ray: token mode, set before ray.init and seen by Ray's (re-read) config
    assert out["local"]["env"] == "token" and out["local"]["init"]["mode"] == "token" and out["local"]["token"]
    # private even when a `ray start` cluster runs here: ray.init()'s default address would join that one
    assert out["local"]["init"]["address"] == "local"
    assert out["local_address"]["init"] == {"mode": "token", "address": "local", "include_dashboard": False}
    # RAY_AUTH_MODE set by the user is left as it is
    assert out["user_disabled"]["env"] == "disabled" and out["user_disabled"]["init"]["mode"] == "disabled"
    # LLM() with no address starts its own Ray the same way (it had joined a `ray start` cluster and failed there:
    # "When connecting to an existing cluster, num_cpus and num_gpus must not be provided")
    assert out["llm_local"]["address"] == "local" and out["llm_local"]["num_cpus"] >= 2
    # --http-port 0: the standalone gRPC path (LLM starts Ray) gets token mode too
    assert out["grpc_only"] == {"env": "token", "address": None} and out["grpc_only_rc"] == 2
