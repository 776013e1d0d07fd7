"""Request-body size limit of the HTTP front door: a body over the limit gets 413 before it is parsed.

A pure ASGI middleware (`BodyLimit`), so that the refusal has the OpenAI error body: a `Content-Length` over the
limit is answered at once, unread (`reject`); a body without one (chunked) is counted as it arrives and the read
that passes the limit raises `HTTPException(413)`, which FastAPI's body parsing passes on to the app's handler.
(FastAPI's own `max_body_size` answers the first case with Starlette's plain-text 413.) Nothing is tokenized or
parsed for a refused body, so it cannot stall the other streams.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from starlette.exceptions import HTTPException


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most `max_bytes` bytes.

    Args:
        app: the wrapped ASGI app. max_bytes: the limit (bytes, >= 0).
        reject: `reject(scope, receive, send)` answers a request whose `Content-Length` is over the limit.
    Raises (from the wrapped `receive`): HTTPException(413) once a body without a length passes the limit.
    """

    def __init__(self, app, max_bytes: int, reject: Callable[..., Awaitable[None]]):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.app, self.max_bytes, self.reject = app, max_bytes, reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self.reject(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413)
            return message

        await self.app(scope, limited, send)
