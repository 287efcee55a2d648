"""Frames round-trip; every malformed input is a Rejected with a reason, never an exception."""

from __future__ import annotations

import struct
import time
import tracemalloc
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco.compress import CODECS, EncodedTensor, encode_tensors, make_codec
from p2pdiloco.wire import (
    CONTRIBUTION,
    MAGIC,
    OUTER_UPDATE,
    PROTOCOL_VERSION,
    STATE_REQUEST,
    Message,
    MessageKind,
    Rejected,
    WireLimits,
    decode_message,
    decode_tensors,
    encode_message,
    frames,
    register_kind,
)

LIMITS = WireLimits()
CONTRIBUTION_META = {"peer": "12D3KooW", "base_round": 4, "tokens": 65536, "steps": 50}


def contribution(codec: str = "int8", **tensors: torch.Tensor) -> Message:
    tensors = tensors or {"w": torch.randn(8, 33), "b": torch.randn(5)}
    return Message(
        CONTRIBUTION,
        "demo",
        round=5,
        fragment=2,
        meta={**CONTRIBUTION_META, "hash": b"\x01" * 32, "losses": [2.5, 2.25]},
        tensors=encode_tensors(make_codec(codec), tensors),
    )


def raw_frame(header: Any, payload: bytes = b"", magic: bytes = MAGIC) -> bytes:
    """A frame built by hand, bypassing encode_message's own checks."""
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<4sI", magic, len(packed)) + packed + payload


def header_of(msg: Message) -> dict[str, Any]:
    data = encode_message(msg)
    (length,) = struct.unpack_from("<I", data, 4)
    return msgpack.unpackb(data[8 : 8 + length], raw=False)


def payload_of(msg: Message) -> bytes:
    return b"".join(t.payload for t in msg.tensors.values())


def rejected(data: Any, limits: WireLimits = LIMITS) -> str:
    result = decode_message(data, limits)
    assert isinstance(result, Rejected), result
    return result.reason


# ---------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("codec", CODECS)
def test_a_contribution_round_trips(codec: str) -> None:
    msg = contribution(codec)
    decoded = decode_message(encode_message(msg), LIMITS)
    assert decoded == msg
    tensors = decode_tensors(decoded)
    assert not isinstance(tensors, Rejected)
    assert list(tensors) == ["w", "b"] and tensors["w"].shape == (8, 33)


def test_every_builtin_kind_round_trips() -> None:
    tensors = encode_tensors(make_codec("fp32"), {"x": torch.ones(3)})
    for msg in [
        Message(OUTER_UPDATE, "r", 1, 0, {"peer": "s", "contributors": ["a", "b"]}, tensors),
        Message(STATE_REQUEST, "r", 0, 0, {"peer": "new"}),
    ]:
        assert decode_message(encode_message(msg), LIMITS) == msg


def test_frame_starts_with_magic_and_header_length() -> None:
    data = encode_message(contribution())
    (length,) = struct.unpack_from("<I", data, 4)
    assert data[:4] == MAGIC and header_of(contribution())["version"] == PROTOCOL_VERSION
    assert len(data) == 8 + length + len(payload_of(contribution()))


def test_decoder_accepts_bytearray_and_memoryview() -> None:
    data = encode_message(contribution())
    assert isinstance(decode_message(bytearray(data), LIMITS), Message)
    assert isinstance(decode_message(memoryview(data), LIMITS), Message)


def test_encoder_refuses_what_a_peer_would_reject() -> None:
    with pytest.raises(ValueError, match="lacks meta field 'tokens'"):
        encode_message(Message(CONTRIBUTION, "r", 0, 0, {"peer": "p", "base_round": 0}))
    with pytest.raises(ValueError, match="carry no tensors"):
        tensors = encode_tensors(make_codec("fp32"), {"x": torch.ones(1)})
        encode_message(Message(STATE_REQUEST, "r", 0, 0, {"peer": "p"}, tensors))
    with pytest.raises(ValueError, match="non-finite"):
        encode_message(Message(STATE_REQUEST, "r", 0, 0, {"peer": "p", "x": float("nan")}))


def test_other_modules_can_register_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "_KINDS", dict(frames._KINDS))
    register_kind(
        MessageKind("heartbeat", required={"peer": "str", "load": "float"}, carries_tensors=False)
    )
    msg = Message("heartbeat", "r", 0, 0, {"peer": "p", "load": 0.5})
    frame = encode_message(msg)
    assert decode_message(frame, LIMITS) == msg
    with pytest.raises(ValueError, match="already registered"):
        register_kind(MessageKind("heartbeat"))
    register_kind(MessageKind("heartbeat", required={"peer": "str", "gpu": "str"}), replace=True)
    assert "lacks meta field 'gpu'" in rejected(frame)
    with pytest.raises(ValueError, match="unknown type"):
        MessageKind("x", required={"a": "complex"})


# ---------------------------------------------------------------------------------------
# every rejection reason


def mutated_header(**changes: Any) -> bytes:
    msg = contribution()
    header = header_of(msg)
    header.update(changes)
    return raw_frame(header, payload_of(msg))


def mutated_tensor(index: int = 0, **changes: Any) -> bytes:
    msg = contribution()
    header = header_of(msg)
    header["tensors"][index].update(changes)
    return raw_frame(header, payload_of(msg))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (None, "frame must be bytes"),
        ("text", "frame must be bytes"),
        (b"", "truncated frame"),
        (b"P2PD\x00", "truncated frame"),
        (raw_frame({}, magic=b"HTTP"), "bad magic"),
        (MAGIC + struct.pack("<I", 100) + b"\x80", "truncated frame: header claims 100"),
        (MAGIC + struct.pack("<I", 0xFFFFFFFF), "exceeds max_header_bytes"),
        (MAGIC + struct.pack("<I", 3) + b"\xc1\xc1\xc1", "not valid msgpack"),
        (MAGIC + struct.pack("<I", 2) + b"\x90\x90", "not valid msgpack"),  # extra data
        (raw_frame([1, 2]), "header must be a map"),
        (mutated_header(version=2), "unsupported protocol version 2"),
        (mutated_header(version=True), "unsupported protocol version"),
        (mutated_header(extra=1), "unknown ['extra']"),
        (mutated_header(kind="gossip"), "unknown message kind"),
        (mutated_header(kind=7), "unknown message kind"),
        (mutated_header(run=""), "run name"),
        (mutated_header(round="5"), "round must be an int"),
        (mutated_header(round=-1), "round must be an int"),
        (mutated_header(round=True), "round must be an int"),
        (mutated_header(fragment=2**63), "fragment must be an int"),
        (mutated_header(meta=[1]), "'meta' must be a map"),
        (mutated_header(meta={"peer": "p"}), "lacks meta field 'base_round'"),
        (mutated_header(meta={**CONTRIBUTION_META, "tokens": -5}), "'tokens' must be uint"),
        (mutated_header(meta={**CONTRIBUTION_META, "tokens": 1.5}), "'tokens' must be uint"),
        (mutated_header(meta={**CONTRIBUTION_META, "peer": b"p"}), "'peer' must be str"),
        (mutated_header(meta={**CONTRIBUTION_META, "x": float("inf")}), "non-finite"),
        (mutated_header(meta={**CONTRIBUTION_META, "x": [[[[[1]]]]]}), "nests deeper"),
        (mutated_header(meta={**CONTRIBUTION_META, "x": {"": 1}}), "key of meta.x"),
        (mutated_header(tensors={}), "'tensors' must be a list"),
        (mutated_header(tensors=[1]), "tensor descriptor 0 must have keys"),
        (mutated_tensor(name="b"), "appears twice"),
        (mutated_tensor(name=None), "tensor 0 name"),
        (mutated_tensor(codec="int3"), "unknown codec"),
        (mutated_tensor(codec="fp32"), "unknown meta key"),
        (mutated_tensor(shape=[8, 34]), "implies"),
        (mutated_tensor(shape="8x33"), "shape must be a list"),
        (mutated_tensor(shape=[8, -33]), "bad dimension"),
        (mutated_tensor(shape=[1] * 9), "max_ndim is 8"),
        (mutated_tensor(meta={"block": 256}), "scale"),
        (mutated_tensor(meta={"block": 256, "scale": "fp16", "zstd": 1}), "zstd"),
        (mutated_tensor(nbytes=-1), "nbytes must be an int"),
        (mutated_tensor(nbytes=10**15), "implies"),
        (encode_message(contribution()) + b"\x00", "frame length mismatch"),
        (encode_message(contribution())[:-1], "frame length mismatch"),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 50 else "frame",
)
def test_malformed_frames_are_rejected_with_a_reason(data: Any, reason: str) -> None:
    assert reason in rejected(data)


def test_limits_are_enforced() -> None:
    data = encode_message(contribution())
    assert "exceeds max_frame_bytes" in rejected(data, WireLimits(max_frame_bytes=len(data) - 1))
    assert "exceeds max_header_bytes" in rejected(data, WireLimits(max_header_bytes=50))
    assert "exceed max_tensors=1" in rejected(data, WireLimits(max_tensors=1))
    assert "max_elements_per_tensor" in rejected(data, WireLimits(max_elements_per_tensor=100))
    assert "max_total_elements" in rejected(data, WireLimits(max_total_elements=268))
    assert "max_ndim is 1" in rejected(data, WireLimits(max_ndim=1))
    assert isinstance(decode_message(data, WireLimits(max_total_elements=269)), Message)
    with pytest.raises(ValueError, match="max_tensors"):
        WireLimits(max_tensors=0)


@pytest.mark.parametrize(
    "shape", [[10**12], [10**6, 10**6], [2**64 - 1], [2**40] * 8, [0, 2**63], [0, 2**32, 2**32]]
)
def test_huge_declared_sizes_are_rejected_fast_without_allocating(shape: list[int]) -> None:
    header = header_of(contribution())
    header["tensors"] = [
        {"name": "x", "codec": "fp32", "shape": shape, "meta": {}, "nbytes": 4 * 10**12}
    ]
    data = raw_frame(header)
    tracemalloc.start()
    start = time.perf_counter()
    reason = rejected(data)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert any(why in reason for why in ("max_elements_per_tensor", "bad dimension", "implies"))
    assert elapsed < 0.1 and peak < 1 << 20


def test_non_finite_tensors_are_rejected_after_decoding() -> None:
    bad = contribution("fp32", x=torch.tensor([1.0, float("nan")]))
    msg = decode_message(encode_message(bad), LIMITS)
    assert isinstance(msg, Message)  # framing is fine; content is checked by decode_tensors
    assert "non-finite" in decode_tensors(msg).reason
    inf_scale = contribution("int8", x=torch.tensor([1.0, float("inf"), 0.0]))
    assert "non-finite" in decode_tensors(decode_message(encode_message(inf_scale), LIMITS)).reason


def test_invalid_codec_content_is_rejected_by_decode_tensors() -> None:
    payload = struct.pack("<f", 1.0) + bytes([3, 0]) + bytes([1, 1])  # index 3 twice
    topk = EncodedTensor("topk", (10,), {"k": 2, "index_bytes": 1}, payload)
    msg = Message(CONTRIBUTION, "r", 0, 0, CONTRIBUTION_META, {"t": topk})
    result = decode_tensors(decode_message(encode_message(msg), LIMITS))
    assert isinstance(result, Rejected) and "'t'" in result.reason and "repeat" in result.reason


# ---------------------------------------------------------------------------------------
# fuzzing: nothing crashes the decoder

VALID = encode_message(contribution("int4"))
VALID_ZSTD = encode_message(
    Message(
        CONTRIBUTION,
        "demo",
        1,
        0,
        CONTRIBUTION_META,
        encode_tensors(make_codec("topk", zstd=True), {"x": torch.randn(300)}),
    )
)


def decode_fully(data: bytes) -> Message | Rejected:
    result = decode_message(data, LIMITS)
    if isinstance(result, Message):
        tensors = decode_tensors(result)
        assert isinstance(tensors, Rejected | dict)
    return result


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected(data: bytes) -> None:
    assert isinstance(decode_fully(data), Rejected)


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=256))
def test_random_headers_behind_valid_magic_never_crash(header: bytes) -> None:
    result = decode_fully(MAGIC + struct.pack("<I", len(header)) + header)
    assert isinstance(result, Rejected | Message)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frame=st.sampled_from([VALID, VALID_ZSTD]),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    tail=st.binary(max_size=8),
)
def test_mutated_frames_never_crash(
    frame: bytes, edits: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    data = bytearray(frame)
    for position, value in edits:
        data[position % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    data += tail
    result = decode_fully(bytes(data))
    if bytes(data) == frame:
        assert isinstance(result, Message)
    else:
        assert isinstance(result, Rejected | Message)


plain_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=examples(300), deadline=None)
@given(
    field=st.sampled_from(["version", "kind", "run", "round", "fragment", "meta", "tensors"]),
    tensor_field=st.sampled_from(["name", "codec", "shape", "meta", "nbytes", None]),
    value=plain_values,
)
def test_wrong_types_in_any_header_field_are_rejected(
    field: str, tensor_field: str | None, value: Any
) -> None:
    header = header_of(contribution())
    if tensor_field is None:
        header[field] = value
    else:
        header["tensors"][0][tensor_field] = value
    try:
        data = raw_frame(header, payload_of(contribution()))
    except (OverflowError, TypeError, ValueError):
        return  # msgpack cannot even express it
    assert isinstance(decode_fully(data), Rejected | Message)


