"""Stable public import path of the Ray Serve application: `router_service.serve_app:build_app`.

Serve configs name it (`import_path` in deploy/serve_config.yaml, k8s/rayservice.yaml and users' own
configs), so this module stays put while the code moves: it only re-exports `build_app` from
`router_service.serve.deployment` (the deployment `MoerayServer`, `GRPC_SERVICER_FUNCTION`) and
`router_service.http.app` holds the HTTP routes.
"""
from router_service.serve.deployment import build_app

__all__ = ["build_app"]
