"""Errors the front doors map to status codes (HTTP 400 / gRPC INVALID_ARGUMENT, 503 / UNAVAILABLE...)."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad client input. `field` names the offending field; the message gives value and limit."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404 `model_not_found`, as OpenAI; gRPC
    NOT_FOUND)."""

    def __init__(self, model: str, served: str):
        super().__init__("model", f"model={model!r} is not served; available: [{served!r}]")


class OverloadedError(RuntimeError):
    """The queue limit is reached; retry later (HTTP 503 / gRPC RESOURCE_EXHAUSTED)."""


class EngineError(RuntimeError):
    """A rank failed while serving the request (retriable: HTTP 503 / gRPC UNAVAILABLE)."""
