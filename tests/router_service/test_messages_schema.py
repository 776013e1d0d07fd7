"""Router <-> rank msgpack messages carry a schema version; a message of another version is refused."""
from __future__ import annotations

import msgpack
import pytest

from actors.engine.messages import SCHEMA_VERSION, GenerateRequest, TokenOutput, decode_outputs, encode_outputs


def test_round_trip():
    req = GenerateRequest(request_id="r1", prompt_ids=[1, 2], params={"max_tokens": 3}, arrival=1.5)
    assert GenerateRequest.decode(req.encode()) == req
    outs = [TokenOutput(request_id="r1", token_ids=[7], text="é", finish_reason="length")]
    assert decode_outputs(encode_outputs(outs)) == outs


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0, None])
def test_wrong_version_rejected(version):
    body = {"type": "generate", "request_id": "r", "prompt_ids": [1], "params": {}, "arrival": 0.0}
    if version is not None:
        body["v"] = version
    with pytest.raises(ValueError, match="schema version"):
        GenerateRequest.decode(msgpack.packb(body, use_bin_type=True))
    items = {"v": version, "type": "outputs", "items": []} if version is not None else {"type": "outputs", "items": []}
    with pytest.raises(ValueError, match="schema version"):
        decode_outputs(msgpack.packb(items, use_bin_type=True))


def test_wrong_type_rejected():
    with pytest.raises(ValueError, match="expected a 'generate' message"):
        GenerateRequest.decode(encode_outputs([]))


def test_outputs_frame_rows_keep_every_field():
    outs = [TokenOutput(request_id="a", token_ids=[1, 2], text="xy", prompt_tokens=5),
            TokenOutput(request_id="b", finish_reason="error", error="boom", num_preemptions=2)]
    assert decode_outputs(encode_outputs(outs)) == outs


def test_outputs_row_of_wrong_width_rejected():
    bad = msgpack.packb({"v": SCHEMA_VERSION, "type": "outputs", "items": [["r1", [1], ""]]}, use_bin_type=True)
    with pytest.raises(ValueError, match="outputs row must have 7 or 9 fields"):
        decode_outputs(bad)


def test_outputs_rows_with_logprobs_round_trip_and_stay_compact_without():
    """The logprob fields ride as two trailing row fields, float32 on the wire (exact for fp32 values); rows
    without them keep the 7-field layout, so an old frame decodes and a frame without logprobs is as small."""
    import numpy as np

    lp = float(np.float32(-1.2345678))
    outs = [TokenOutput(request_id="a", token_ids=[7], text="x", logprobs=[[lp, 3, [1, 2], [-0.5, -0.75]]],
                        prompt_logprobs=[None, [-2.5, 1, [4], [-2.5]]]),
            TokenOutput(request_id="b", token_ids=[1], text="y")]
    data = encode_outputs(outs)
    assert decode_outputs(data) == outs
    rows = msgpack.unpackb(data, raw=False)["items"]
    assert [len(r) for r in rows] == [9, 7]
    assert len(encode_outputs(outs[1:])) == len(msgpack.packb(
        {"v": SCHEMA_VERSION, "type": "outputs", "items": [outs[1].to_wire()]}, use_bin_type=True))
