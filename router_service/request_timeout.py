"""The server's request timeout, one rule for both front doors: a request still generating `request_timeout_s`
seconds after it was admitted is aborted on its rank (KV blocks freed) and ends with an error naming the limit,
HTTP 504 (`router_service.http.serving.OpenAIServer.outputs`) or gRPC DEADLINE_EXCEEDED (the standalone server's
`MoerayServicer.Generate` and, behind Serve's gRPC proxy, `MoerayServer.Generate`, which shares HTTP's `outputs`).
`moeray serve --request-timeout-s` (and `python -m router_service.grpc.server --request-timeout-s`) sets it for
every server they start. A client's own shorter gRPC deadline still ends its call first (status and abort as
before)."""
from __future__ import annotations

REQUEST_TIMEOUT_S = 600.0  # default of `create_app`, the gRPC servers and every --request-timeout-s


def check_request_timeout(value: float | None) -> float | None:
    """`value` if it is a valid request timeout (seconds > 0, or None: no limit).

    Raises:
        ValueError: naming the field, `request_timeout_s=0 must be > 0 (or None: no limit)`.
    """
    if value is not None and not value > 0:
        raise ValueError(f"request_timeout_s={value} must be > 0 (or None: no limit)")
    return value


class RequestTimedOut(Exception):
    """A request ran past the server's request timeout (`timeout_s`): HTTP 504, gRPC DEADLINE_EXCEEDED. The
    message names the limit and the flag that sets it."""

    def __init__(self, timeout_s: float):
        super().__init__(f"the request ran past the server's request timeout of {timeout_s:g} s "
                         f"(--request-timeout-s) and was stopped")
        self.timeout_s = timeout_s

    def __reduce__(self):  # rebuilt from the limit when carried between processes
        return (RequestTimedOut, (self.timeout_s,))
