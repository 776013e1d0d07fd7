"""Shared fixtures: tiny random HF models (built locally, never downloaded) and one Ray instance."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU through the interpreter

import pytest  # noqa: E402

from tests.tiny_models import build_tiny_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "models", "tiny-moe")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: path of a saved tiny random model of the given architecture (cached per session)."""
    cache: dict = {}

    def make(arch: str, **kw) -> str:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_tiny_model(arch, str(tmp_path_factory.mktemp(arch)), **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Every test that uses the shared Ray instance (directly or through another fixture) carries the `ray`
    marker, so `pytest -m "not ray"` is the unit suite with no cluster."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
