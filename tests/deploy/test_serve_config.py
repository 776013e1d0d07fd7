"""Offline checks of deploy/serve_config.yaml with Ray's own schemas (no cluster started)."""
from __future__ import annotations

import os
import types
import typing

import pytest
import yaml
from pydantic import BaseModel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_CONFIG = os.path.join(REPO, "deploy", "serve_config.yaml")


@pytest.fixture(scope="module")
def config() -> dict:
    with open(SERVE_CONFIG) as f:
        return yaml.safe_load(f)


def _models_in(annotation) -> list[type[BaseModel]]:
    """Pydantic model classes inside a field annotation (Optional[X], list[X], dict[str, X], X | None)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def unknown_keys(data, model: type[BaseModel], path: str = "") -> list[str]:
    """Keys of `data` that `model` does not declare, recursively (Ray's schemas silently ignore them)."""
    if not isinstance(data, dict):
        if isinstance(data, list):
            return [k for i, item in enumerate(data) for k in unknown_keys(item, model, f"{path}[{i}]")]
        return []
    fields = model.model_fields
    names = {n for n in fields} | {f.alias for f in fields.values() if f.alias}
    bad = [f"{path}.{k}".lstrip(".") for k in data if k not in names]
    for name, f in fields.items():
        if name in data and isinstance(data[name], (dict, list)):
            for sub in _models_in(f.annotation)[:1]:
                bad += unknown_keys(data[name], sub, f"{path}.{name}")
    return bad


def test_ray_schema_accepts_it(config):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    assert [a.name for a in schema.applications] == ["moeray"]


def test_no_unknown_keys(config):
    from ray.serve.schema import ServeDeploySchema

    assert unknown_keys(config, ServeDeploySchema) == []
    assert unknown_keys({"applications": [{"nme": "x"}]}, ServeDeploySchema) == ["applications[0].nme"]


def test_every_deployment_autoscales(config):
    from ray.serve.config import AutoscalingConfig

    deps = [d for app in config["applications"] for d in app["deployments"]]
    assert deps
    for d in deps:
        assert "num_replicas" not in d, f"{d['name']}: num_replicas and autoscaling_config exclude each other"
        ac = AutoscalingConfig(**d["autoscaling_config"])
        assert 1 <= ac.min_replicas <= (ac.initial_replicas or ac.min_replicas) <= ac.max_replicas
        assert d["max_ongoing_requests"] >= ac.target_ongoing_requests


def test_import_path_args_and_deployment_names(config):
    import importlib

    from router_service.http.models import ServeAppArgs

    for app in config["applications"]:
        mod, attr = app["import_path"].split(":")
        builder = getattr(importlib.import_module(mod), attr)
        args = ServeAppArgs.model_validate(app.get("args", {}))  # extra="forbid": unknown args fail here
        application = builder(args)
        assert isinstance(application, object) and not isinstance(application, types.FunctionType)
        from router_service.serve.deployment import MoerayServer

        assert {d["name"] for d in app["deployments"]} <= {MoerayServer.name}
        for d in app["deployments"]:
            # the router's queue limit answers 503 before Serve's own queue fills
            assert d["max_ongoing_requests"] >= args.max_queue


def test_unknown_app_arg_is_rejected():
    from pydantic import ValidationError

    from router_service.http.models import ServeAppArgs

    with pytest.raises(ValidationError, match="rnaks"):
        ServeAppArgs.model_validate({"rnaks": 2})
