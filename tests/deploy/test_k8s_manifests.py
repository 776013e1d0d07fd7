"""k8s/ manifests against the KubeRay CRDs' openAPIV3Schema (offline, with jsonschema), and in step with
deploy/serve_config.yaml and the ranks' placement group."""
from __future__ import annotations

import functools
import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KUBERAY = os.path.normpath(os.path.join(REPO, "..", "shared", "kuberay"))
K8S = os.path.join(REPO, "k8s")
SERVE_CONFIG = os.path.join(REPO, "deploy", "serve_config.yaml")


def load(path: str) -> dict:
    with open(path) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # the CRDs are ~1 MB each


@functools.lru_cache(maxsize=None)
def _load_cached(path: str) -> dict:
    return load(path)


def crd_schema(name: str) -> dict:
    path = os.path.join(KUBERAY, name)
    if not os.path.isfile(path):
        pytest.skip(f"KubeRay CRD {path} is absent on this machine: schema validation skipped")
    crd = _load_cached(path)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def pruned_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the API server would prune (unknown to a structural schema): jsonschema alone lets them by."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, dict) and "properties" in schema:
        props = schema["properties"]
        out = [f"{path}.{k}" for k in obj if k not in props]
        for k, v in obj.items():
            if k in props:
                out += pruned_fields(v, props[k], f"{path}.{k}")
        return out
    if isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [p for k, v in obj.items() for p in pruned_fields(v, schema["additionalProperties"], f"{path}.{k}")]
    if isinstance(obj, list) and "items" in schema:
        return [p for i, v in enumerate(obj) for p in pruned_fields(v, schema["items"], f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("manifest, crd, kind", [
    ("rayservice.yaml", "ray.io_rayservices.yaml", "RayService"),
    ("raycluster.yaml", "ray.io_rayclusters.yaml", "RayCluster"),
])
def test_manifest_matches_crd(manifest, crd, kind):
    import jsonschema

    schema = crd_schema(crd)
    doc = load(os.path.join(K8S, manifest))
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # the metadata schema is bare `type: object`; check the spec for fields the API server would drop
    assert pruned_fields(doc["spec"], schema["properties"]["spec"], "spec") == []


def test_pruning_check_catches_typos():
    schema = crd_schema("ray.io_rayclusters.yaml")["properties"]["spec"]
    assert pruned_fields({"enableInTreeAutoscaler": True}, schema, "spec") == ["spec.enableInTreeAutoscaler"]


def test_serve_config_is_deploys_and_cluster_specs_agree():
    svc = load(os.path.join(K8S, "rayservice.yaml"))
    with open(SERVE_CONFIG) as f:
        assert svc["spec"]["serveConfigV2"] == f.read()
    assert svc["spec"]["rayClusterConfig"] == load(os.path.join(K8S, "raycluster.yaml"))["spec"]


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_resources_match_rank_placement_group():
    """Each rank asks Ray for a bundle {CPU: MOERAY_NUM_CPUS_PER_RANK, GPU: MOERAY_NUM_GPUS_PER_RANK} (read from
    the pod env by the replica); the GPU group must hold one EP cluster at its minimum and one per Serve replica
    at its maximum, and what Ray advertises must match what the pod requests."""
    import ray

    spec = load(os.path.join(K8S, "rayservice.yaml"))["spec"]
    serve_cfg = yaml.safe_load(spec["serveConfigV2"])
    (app,) = serve_cfg["applications"]
    ranks = app["args"]["ranks"]
    max_serve_replicas = max(d["autoscaling_config"]["max_replicas"] for d in app["deployments"])
    replica_cpus = max(d["ray_actor_options"]["num_cpus"] for d in app["deployments"])
    rc = spec["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    assert rc["rayVersion"] == ray.__version__
    groups = {g["groupName"]: g for g in rc["workerGroupSpecs"]}
    for g in [rc["headGroupSpec"], *groups.values()]:
        (c,) = g["template"]["spec"]["containers"]
        env = _env(c)
        gpus_per_rank, cpus_per_rank = float(env["MOERAY_NUM_GPUS_PER_RANK"]), float(env["MOERAY_NUM_CPUS_PER_RANK"])
        assert c["resources"]["requests"] == c["resources"]["limits"]
        assert str(c["resources"]["requests"]["cpu"]) == g["rayStartParams"]["num-cpus"] or g is rc["headGroupSpec"]
        assert str(c["resources"]["requests"].get("nvidia.com/gpu", "0")) == g["rayStartParams"].get("num-gpus", "0")
    gpu = groups["gpu"]
    pod_gpus = float(gpu["rayStartParams"]["num-gpus"])
    pod_cpus = float(gpu["rayStartParams"]["num-cpus"])
    ranks_per_pod = int(min(pod_gpus / gpus_per_rank, pod_cpus // cpus_per_rank))
    assert ranks_per_pod >= 1
    assert gpu["minReplicas"] * ranks_per_pod >= ranks  # one EP cluster fits at the minimum
    assert gpu["maxReplicas"] * ranks_per_pod >= ranks * max_serve_replicas  # and every replica's at the maximum
    # a replica fits next to a rank on a GPU pod, or on a CPU pod
    assert pod_cpus - cpus_per_rank * ranks_per_pod >= replica_cpus or float(groups["cpu"]["rayStartParams"]["num-cpus"]) >= replica_cpus
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
