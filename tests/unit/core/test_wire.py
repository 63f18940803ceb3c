from __future__ import annotations

import msgpack
import pytest

from sluice.core.wire import (
    DATA_FIELD,
    HEADER_FIELD,
    MalformedEntry,
    ReplyMessage,
    RequestMessage,
    TensorHeader,
    decode_replies,
    decode_reply,
    decode_request,
    encode_replies,
    encode_reply,
    encode_request,
)


def test_request_round_trip() -> None:
    message = RequestMessage(
        request_key="7",
        reply_to="ns:reply:abc",
        inputs=[TensorHeader("x", "FP32", (2, 2), 16), TensorHeader("s", "BYTES", (1,), 7)],
        outputs=["y"],
        client_id="client-1",
        deadline_ns=123,
        enqueued_ns=100,
        priority=2,
        parameters={"k": "v"},
        replies_together=True,
    )
    decoded, payload = decode_request(encode_request(message, b"\x00" * 23))
    assert decoded == message
    assert len(payload) == 23


def test_several_answers_travel_in_one_entry_and_one_reads_as_before() -> None:
    answers = [
        (ReplyMessage("1", 1, [TensorHeader("y", "UINT8", (1, 2), 2)]), b"\x01\x02"),
        (ReplyMessage("2", 1, error_kind="InvalidInput", error="bad"), b""),
        (ReplyMessage("3", 1, [TensorHeader("y", "UINT8", (1, 1), 1)]), b"\x03"),
    ]
    fields = encode_replies(answers)
    decoded = decode_replies(fields)
    assert [(m, bytes(p)) for m, p in decoded] == answers
    assert decode_reply(fields)[0] == answers[0][0]  # (an older reader gets the first)
    single = encode_reply(*answers[0])
    assert encode_replies(answers[:1]) == single
    assert [m for m, _ in decode_replies(single)] == [answers[0][0]]
    del fields[DATA_FIELD + b"2"]
    with pytest.raises(MalformedEntry, match="lacks the data of its answer 2"):
        decode_replies(fields)


def test_an_older_gateways_request_asks_for_one_entry_per_answer() -> None:
    message = RequestMessage("7", "ns:reply:abc", [], ["y"])
    fields = encode_request(message, b"")
    assert b"rt" not in msgpack.unpackb(fields[HEADER_FIELD])
    assert decode_request(fields)[0].replies_together is False


def test_reply_round_trip_with_error() -> None:
    reply = ReplyMessage("9", 3, error_kind="InvalidInput", error="bad")
    decoded, payload = decode_reply(encode_reply(reply))
    assert decoded == reply and len(payload) == 0


def test_reply_parameters_round_trip_and_are_checked() -> None:
    reply = ReplyMessage("9", 3, parameters={"sequence_id": "s", "sequence_end": True, "n": -1})
    assert decode_reply(encode_reply(reply))[0] == reply
    assert b"p" not in msgpack.unpackb(encode_reply(ReplyMessage("9", 3))[HEADER_FIELD])
    for bad in ([1], {"k": 1.5}, {"k": None}, {"k": [1]}):
        header = {"v": 2, "k": "9", "m": 3, "o": [], "p": bad}
        with pytest.raises(MalformedEntry, match="reply parameter"):
            decode_reply({HEADER_FIELD: msgpack.packb(header)})


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {HEADER_FIELD: b"\xc1not msgpack"},
        {HEADER_FIELD: msgpack.packb({"v": 99})},
        {
            HEADER_FIELD: msgpack.packb(
                {"v": 1, "k": "1", "r": "x", "i": [["x", "FP32", [1], 4]], "o": []}
            )
        },
        {
            HEADER_FIELD: msgpack.packb(
                {"v": 1, "k": "1", "r": "x", "i": [["x", "NOPE", [1], 4]], "o": []}
            ),
            DATA_FIELD: b"1234",
        },
        {
            HEADER_FIELD: msgpack.packb({"v": 1, "k": 1, "r": "x", "i": [], "o": []}),
        },
        {
            HEADER_FIELD: msgpack.packb(
                {"v": 1, "k": "1", "r": "x", "i": [["x", "FP32", [-1], 4]], "o": []}
            ),
            DATA_FIELD: b"1234",
        },
        {HEADER_FIELD: msgpack.packb({"v": 2, "k": "1", "r": "x", "i": [], "o": [], "cl": [1]})},
        {
            HEADER_FIELD: msgpack.packb(
                {"v": 2, "k": "1", "r": "x", "i": [], "o": ["y"], "cl": {"y": 0}}
            )
        },
    ],
)
def test_malformed_entries_are_rejected(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(MalformedEntry):
        decode_request(fields)


def test_a_requests_tenant_travels_and_a_bad_one_is_refused() -> None:
    message = RequestMessage(request_key="1", reply_to="r", inputs=[], outputs=[], tenant="team-a")
    decoded, _ = decode_request(encode_request(message, b""))
    assert decoded.tenant == "team-a"
    assert decode_request(encode_request(RequestMessage("1", "r", [], []), b""))[0].tenant == ""
    for bad in ("a}b", "x" * 65, "-lead", "a:b"):
        with pytest.raises(MalformedEntry, match="tenant"):
            decode_request(encode_request(RequestMessage("1", "r", [], [], tenant=bad), b""))
