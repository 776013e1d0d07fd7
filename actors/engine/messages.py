"""Messages between the router and the ranks (msgpack, versioned), all in one place.

Every message is a msgpack map with `v` (schema version) and `type`. Decoding a message of an
unknown version raises ValueError, so a mixed-version cluster fails loudly instead of silently.

An `outputs` frame carries every sequence's new tokens of one rank step as one msgpack array of rows, each row the
`TokenOutput` fields in declaration order (`WIRE_FIELDS`): no per-output map keys to pack and unpack, which is
most of a frame's cost at 32-64 sequences per step. The optional trailing fields (`OPTIONAL_WIRE_FIELDS`:
logprobs) are left off a row when they are all None, so a frame without logprobs is as before; floats go as
msgpack float32 (the rank computes them in fp32, so nothing is lost).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack

SCHEMA_VERSION = 2


def _pack(kind: str, body: dict) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "type": kind, **body}, use_bin_type=True)


def _unpack(data: bytes, kind: str) -> dict:
    d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if d.get("v") != SCHEMA_VERSION:
        raise ValueError(f"message schema version {d.get('v')} != {SCHEMA_VERSION}")
    if d.get("type") != kind:
        raise ValueError(f"expected a {kind!r} message, got {d.get('type')!r}")
    d.pop("v"), d.pop("type")
    return d


@dataclass(kw_only=True, slots=True)
class GenerateRequest:
    """Router -> rank: start a sequence. `params` is `SamplingParams.to_dict()`."""

    request_id: str
    prompt_ids: list[int]
    params: dict
    arrival: float = 0.0

    def encode(self) -> bytes:
        return _pack("generate", asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> "GenerateRequest":
        return cls(**_unpack(data, "generate"))


@dataclass(kw_only=True, slots=True)
class TokenOutput:
    """Rank -> router: new tokens of one sequence since the last poll.

    finish_reason: None while running; "stop" (EOS / stop string / stop id), "length", "abort",
    or "error" (then `error` says why).
    logprobs: with `SamplingParams.logprobs`, one `TokenLogprob` per id of `token_ids`, else None.
    prompt_logprobs: with `SamplingParams.prompt_logprobs`, in the request's first output: one per prompt token,
    the first None (nothing predicts it), else None.
    A `TokenLogprob` is a list [logprob, rank, top_ids, top_logprobs]: the token's log-probability (float), its
    rank among the vocabulary (1 = most probable), and the k most probable ids with theirs, descending.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def to_wire(self) -> tuple:
        """The output as one frame row: its fields in declaration order (`WIRE_FIELDS`), the optional trailing
        ones only when one is set."""
        row = (self.request_id, self.token_ids, self.text, self.finish_reason, self.error, self.prompt_tokens,
               self.num_preemptions)
        if self.logprobs is None and self.prompt_logprobs is None:
            return row
        return row + (self.logprobs, self.prompt_logprobs)


WIRE_FIELDS = tuple(TokenOutput.__dataclass_fields__)  # the row layout of an `outputs` frame
OPTIONAL_WIRE_FIELDS = ("logprobs", "prompt_logprobs")  # trailing; a row may leave all of them off
_REQUIRED = len(WIRE_FIELDS) - len(OPTIONAL_WIRE_FIELDS)


def _rows_to_outputs(rows: list) -> list[TokenOutput]:
    if any(len(r) not in (_REQUIRED, len(WIRE_FIELDS)) for r in rows):
        raise ValueError(f"an outputs row must have {_REQUIRED} or {len(WIRE_FIELDS)} fields ({', '.join(WIRE_FIELDS)})")
    return [TokenOutput(request_id=r[0], token_ids=r[1], text=r[2], finish_reason=r[3], error=r[4],
                        prompt_tokens=r[5], num_preemptions=r[6]) if len(r) == _REQUIRED else
            TokenOutput(request_id=r[0], token_ids=r[1], text=r[2], finish_reason=r[3], error=r[4],
                        prompt_tokens=r[5], num_preemptions=r[6], logprobs=r[7], prompt_logprobs=r[8])
            for r in rows]


def encode_outputs(outputs: list[TokenOutput]) -> bytes:
    """One step's outputs as an `outputs` frame (rows, see `WIRE_FIELDS`)."""
    return msgpack.packb({"v": SCHEMA_VERSION, "type": "outputs", "items": [o.to_wire() for o in outputs]},
                         use_bin_type=True, use_single_float=True)


def decode_outputs(data: bytes) -> list[TokenOutput]:
    """Inverse of `encode_outputs`. Raises ValueError: wrong version, type or row shape."""
    return _rows_to_outputs(_unpack(data, "outputs")["items"])


def encode_failure(error: str) -> bytes:
    """Rank -> router, last frame of a failed rank's output channel."""
    return _pack("failed", {"error": error})


def decode_frame(data: bytes) -> tuple[list[TokenOutput], str | None]:
    """An output-channel frame -> (outputs, failure message or None); an empty frame is a heartbeat."""
    if not data:
        return [], None
    d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if d.get("v") != SCHEMA_VERSION:
        raise ValueError(f"message schema version {d.get('v')} != {SCHEMA_VERSION}")
    if d.get("type") == "failed":
        return [], str(d["error"])
    if d.get("type") != "outputs":
        raise ValueError(f"expected an 'outputs' or 'failed' frame, got {d.get('type')!r}")
    return _rows_to_outputs(d["items"]), None
