"""One `Generate` call in flight (`GenerateCall`): its requests' `TokenOutput`s as `GenerateResponse`s, the status it
ended with counted once, and every unfinished request aborted on its rank when the call ends, for both gRPC
transports (router_service/grpc/server.py, router_service/serve/deployment.py)."""
from __future__ import annotations

import threading

import grpc

from actors.engine.messages import TokenOutput
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.stream import RequestStream

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
          "error": pb.FINISH_REASON_ERROR}


class RpcError(Exception):
    """The status a call ends with (`code`, a `grpc.StatusCode`, and `details`). Each transport turns it into
    its own abort: `context.abort` in the standalone server, `grpc_context.set_code` + raise behind Serve."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details

    def __reduce__(self):  # Serve carries it from the replica to the proxy; rebuild with both fields
        return (RpcError, (self.code, self.details))


def _token_logprob(token_id: int, e: list) -> pb.TokenLogprob:
    """A rank's `TokenLogprob` entry ([logprob, rank, top_ids, top_logprobs]) as the proto message."""
    return pb.TokenLogprob(token_id=token_id, logprob=e[0], rank=e[1],
                           top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in zip(e[2], e[3])])


class GenerateCall:
    """One `Generate` in flight over one prompt or a batch, n outputs each (`streams[i]`: output i, that is prompt
    i // n's output i % n). `response(o, i)` turns output i's `TokenOutput` into its `GenerateResponse`; `finished`
    once every output's last one went out. `close()`
    (idempotent, thread-safe) aborts the requests not finished; transports call it when the call ends for any
    reason (cancel, disconnect, deadline, error). The call's end status is counted once in `metrics`
    (`moeray_requests_total{frontend="grpc",endpoint="Generate"}`): OK, CANCELLED (an output aborted, or the call
    ended early) or UNAVAILABLE (a rank failed)."""

    def __init__(self, router, streams: list[RequestStream], timer=None, metrics=None):
        self.router, self.streams = router, list(streams)
        self.timer = timer  # a router_service.metrics.RequestObserver over the streams (TTFT / ITL / e2e), or None
        self.metrics = metrics  # a router_service.metrics.Metrics, or None
        self.completion = [0] * len(self.streams)  # tokens streamed so far, per output
        self._left = len(self.streams)
        self._aborted = False
        self._closed = False  # close() ran: the unfinished requests were aborted (once)
        self._lock = threading.Lock()
        self._finished = threading.Event()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def response(self, o: TokenOutput, index: int = 0) -> pb.GenerateResponse:
        """The response for one `TokenOutput` of output `index`; its last one (finish_reason set) carries its usage.

        Raises:
            RpcError: UNAVAILABLE when the rank failed (`finish_reason == "error"`; retriable).
        """
        if self.timer is not None:
            self.timer.observe(index, o.token_ids, o.finish_reason)
        stream = self.streams[index]
        if o.finish_reason == "error":
            self._end("UNAVAILABLE")  # the router already ended it on every rank; close() aborts the others
            raise RpcError(grpc.StatusCode.UNAVAILABLE, o.error or "the rank failed")
        self.completion[index] += len(o.token_ids)
        resp = pb.GenerateResponse(request_id=stream.request_id, text=o.text, token_ids=o.token_ids, index=index,
                                   finish_reason=FINISH.get(o.finish_reason, pb.FINISH_REASON_UNSPECIFIED))
        if o.logprobs:
            resp.logprobs.extend(_token_logprob(t, e) for t, e in zip(o.token_ids, o.logprobs))
        if o.prompt_logprobs is not None:
            p = stream.out.prompt
            ids = list(p) if isinstance(p, list) else self.router.tokenizer.encode(p).ids
            resp.prompt_logprobs.extend(_token_logprob(t, e) for t, e in zip(ids[1:], o.prompt_logprobs[1:]))
        if o.finish_reason is not None:
            p, c = stream.out.prompt_tokens, self.completion[index]
            resp.usage.CopyFrom(pb.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c))
            with self._lock:
                self._left -= 1
                self._aborted |= o.finish_reason == "abort"
                last = self._left == 0
            if last:
                self._end("CANCELLED" if self._aborted else "OK")
        return resp

    def close(self, code: str = "CANCELLED") -> None:
        """End the call: abort every request not finished on its rank, and count the end status `code` unless
        the call already ended (CANCELLED: cancel, disconnect or a client deadline; DEADLINE_EXCEEDED: the
        server's request timeout, `router_service.request_timeout`)."""
        self._end(code)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for s in self.streams:  # none after a normal end; the other prompts after an error or an early end
            if not s.done.is_set():
                self.router.abort(s.request_id)

    def _end(self, code: str) -> bool:
        """Mark the call ended with `code` (counted) unless it already was; returns whether this call did."""
        with self._lock:
            if self._finished.is_set():
                return False
            self._finished.set()
        if self.metrics is not None:
            self.metrics.requests.labels("grpc", "Generate", code).inc()
        return True
