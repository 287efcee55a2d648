"""Every decoder of network bytes: any value, of any type, is a rejection, never a crash.

Sizes are checked before anything is allocated (a 187-byte frame may not cost a GiB),
a zstd payload may not declare more than `MAX_ZSTD_RATIO` times its size, decoded deltas
and updates are finite, and metadata that reaches a window is typed and bounded.
"""

from __future__ import annotations

import math
import struct
import time
from typing import Any

import msgpack
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from proptest import examples

from p2pdiloco import compress, wire
from p2pdiloco.compress import (
    CODECS,
    EncodedTensor,
    decode_tensor,
    decode_tensors,
    make_codec,
)
from p2pdiloco.compress import zstd as zstd_stage
from p2pdiloco.compress.topk import _TopkCodec
from p2pdiloco.protocol.window_rules import RunningMean, Wait, WindowMachine, grace_window_s
from p2pdiloco.wire import messages, updates

LIMITS = wire.WireLimits()
RUN = "demo"
META = {"peer": "12D3KooW", "base_round": 4, "tokens": 65536, "steps": 50, "step_time_s": 0.25}
LAYOUT = [{"w": (8, 33), "b": (5,)}, {"e": (300,)}]
FAST = settings(
    max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# Anything msgpack can carry, and then some: NaN, infinities, huge ints, nesting.
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([2**53, 2**63, 2**64 - 1, -1, 0])
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -0.0])
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
# Zeros beside huge dimensions hold no element yet overflow torch's strides (issue 31).
huge_dims = st.sampled_from([2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63])
shapes = (
    st.lists(st.integers(0, 2**40), max_size=4)
    | st.lists(st.integers(0, 9), max_size=3)
    | st.lists(st.just(0) | huge_dims | st.integers(0, 9), min_size=1, max_size=4)
    | junk
)


def raw_frame(header: Any, payload: bytes = b"") -> bytes:
    """A frame built by hand, bypassing encode_message's own checks."""
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<4sI", wire.MAGIC, len(packed)) + packed + payload


def header_and_payload(frame: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from("<I", frame, 4)
    return msgpack.unpackb(frame[8 : 8 + length], raw=False), frame[8 + length :]


def with_meta(frame: bytes, **changes: Any) -> bytes:
    header, payload = header_and_payload(frame)
    header["meta"].update(changes)
    return raw_frame(header, payload)


def contribution(codec: str = "int8", zstd: bool = False) -> bytes:
    tensors = {"w": torch.randn(8, 33), "b": torch.randn(5)}
    encoded = compress.encode_tensors(make_codec(codec, zstd=zstd), tensors)
    return wire.encode_message(wire.Message(wire.CONTRIBUTION, RUN, 5, 0, dict(META), encoded))


def update_frame(values: torch.Tensor | None = None) -> bytes:
    values = torch.randn(8, 33) if values is None else values
    tensors = compress.encode_tensors(make_codec("fp32"), {"w": values, "b": torch.randn(5)})
    return updates.new_update(
        RUN, 3, 0, "sync-peer", "parent-hash", "new-hash", [("a", 0.5, 64), ("b", 0.5, 32)], tensors
    ).frame


def reply_frame(**meta: Any) -> bytes:
    return messages.reply(RUN, 3, 0, "sync-peer", messages.Reply.MERGED, weight=0.5, **meta)


def mutate(frame: bytes, edits: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
    data = bytearray(frame)
    for position, value in edits:
        data[position % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    return bytes(data + tail)


edits = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6)
cuts = st.one_of(st.none(), st.integers(0, 10**6))


def forbid(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    """Make `owner.name` fail the test if anything calls it."""

    def called(*args: Any, **kwargs: Any) -> None:
        pytest.fail(f"{name} was called before the sizes were checked")

    monkeypatch.setattr(owner, name, called)


# ---------------------------------------------------------------------------------------
# compress: tensors


@FAST
@given(
    codec=st.sampled_from(CODECS) | junk,
    shape=shapes,
    meta=st.fixed_dictionaries(
        {},
        optional={
            "block": junk,
            "scale": junk,
            "k": junk,
            "index_bytes": junk,
            "chunk": junk,
            "nnz": junk,
            "zstd": junk,
        },
    )
    | junk,
    payload=st.binary(max_size=64) | junk,
)
@example(codec="fp32", shape=[0, 2**32, 2**32], meta={}, payload=b"")
@example(codec="int8", shape=[2**32, 0], meta={"block": 64}, payload=b"")
def test_decode_tensor_gives_a_tensor_or_a_value_error_for_any_fields(
    codec: Any, shape: Any, meta: Any, payload: Any
) -> None:
    encoded = EncodedTensor(codec, shape, meta, payload)
    try:
        tensor = decode_tensor(encoded, max_elements=1 << 16, finite=True)
    except ValueError:
        pass
    else:
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == tuple(shape)
        assert bool(torch.isfinite(tensor).all())
    nbytes = len(payload) if isinstance(payload, bytes) else payload
    assert isinstance(compress.check_layout(codec, shape, meta, nbytes), str | type(None))


@FAST
@given(
    codec=st.sampled_from(CODECS),
    zstd=st.booleans(),
    edits=edits,
    cut=cuts,
    tail=st.binary(max_size=8),
    meta_key=st.sampled_from(["block", "scale", "k", "index_bytes", "chunk", "nnz", "zstd", None]),
    meta_value=junk,
)
def test_flipped_cut_or_relabelled_payloads_decode_to_the_shape_or_raise_value_error(
    codec: str,
    zstd: bool,
    edits: list[tuple[int, int]],
    cut: int | None,
    tail: bytes,
    meta_key: str | None,
    meta_value: Any,
) -> None:
    good = make_codec(codec, zstd=zstd, block_size=64).encode(torch.randn(3, 70))
    meta = dict(good.meta) if meta_key is None else {**good.meta, meta_key: meta_value}
    bad = EncodedTensor(codec, good.shape, meta, mutate(good.payload, edits, cut, tail))
    try:
        tensor = decode_tensor(bad)
    except ValueError:
        return
    assert tuple(tensor.shape) == (3, 70) and tensor.dtype == torch.float32


@FAST
@given(
    tensors=st.dictionaries(
        st.text(max_size=4) | st.integers(),
        st.builds(
            EncodedTensor, st.sampled_from(CODECS) | junk, shapes, junk, st.binary(max_size=16)
        )
        | junk,
        max_size=3,
    )
    | junk,
    layout=st.none() | st.just({"w": (2, 2)}) | st.just({}),
)
def test_decode_tensors_gives_tensors_or_a_value_error_for_any_map(
    tensors: Any, layout: Any
) -> None:
    try:
        out = decode_tensors(tensors, shapes=layout, max_total_elements=1 << 16)
    except ValueError:
        return
    assert set(out) == set(tensors) and all(bool(torch.isfinite(t).all()) for t in out.values())


TOPK_BOMB = EncodedTensor(
    "topk", (1 << 28,), {"k": 1, "index_bytes": 1}, b"\x00\x00\x80\x3f\x00\x01"
)


def test_decode_tensors_checks_every_size_before_decoding_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = make_codec("fp32").encode(torch.ones(4))
    forbid(monkeypatch, compress, "codec_for")
    with pytest.raises(ValueError, match="not the expected"):
        decode_tensors({"a": small, "w": TOPK_BOMB}, shapes={"a": (4,), "w": (64, 64)})
    with pytest.raises(ValueError, match="missing \\['b'\\], unexpected \\['w'\\]"):
        decode_tensors({"a": small, "w": TOPK_BOMB}, shapes={"a": (4,), "b": (4,)})
    with pytest.raises(ValueError, match="more than 1048576"):
        decode_tensors({"a": small, "w": TOPK_BOMB}, max_total_elements=1 << 20)
    with pytest.raises(ValueError, match="more than 1048576"):
        decode_tensor(TOPK_BOMB, max_elements=1 << 20)


def test_deltas_and_updates_must_be_finite() -> None:
    nan = make_codec("fp32").encode(torch.tensor([1.0, math.nan]))
    inf_scale = EncodedTensor(
        "topk", (4,), {"k": 1, "index_bytes": 1}, struct.pack("<f", math.inf) + b"\x01\x05"
    )
    for bad in (nan, inf_scale):
        with pytest.raises(ValueError, match="non-finite"):
            decode_tensors({"x": bad})
        with pytest.raises(ValueError, match="non-finite"):
            decode_tensor(bad, finite=True)
    assert math.isnan(decode_tensors({"x": nan}, finite=False)["x"][1])  # local use may opt out


# ---------------------------------------------------------------------------------------
# wire: the two bombs of the audit


def topk_bomb_frame() -> bytes:
    msg = wire.Message(wire.CONTRIBUTION, RUN, 1, 0, dict(META), {"w": TOPK_BOMB})
    return wire.encode_message(msg)


def test_a_shape_bomb_frame_is_refused_before_anything_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frame = topk_bomb_frame()
    assert len(frame) < 256
    msg = wire.decode_message(frame, LIMITS)
    assert isinstance(msg, wire.Message)  # the frame itself is well formed
    forbid(monkeypatch, _TopkCodec, "decode")
    start = time.perf_counter()
    refused = wire.decode_tensors(msg, {"w": (64, 64)})
    assert isinstance(refused, wire.Rejected) and "not the expected [64, 64]" in refused.reason
    capped = wire.decode_tensors(msg, max_total_elements=1 << 20)
    assert isinstance(capped, wire.Rejected) and "more than" in capped.reason
    assert time.perf_counter() - start < 0.1


def test_a_zstd_bomb_is_refused_from_its_header_before_decompression(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    zeros = zstandard.ZstdCompressor().compress(bytes(4 << 20))  # 4 MiB of zeros, ~400 bytes
    header, _ = header_and_payload(contribution("fp32"))
    header["tensors"] = [
        {
            "name": "w",
            "codec": "fp32",
            "shape": [1 << 20],
            "meta": {"zstd": True},
            "nbytes": len(zeros),
        }
    ]
    forbid(monkeypatch, zstd_stage, "_bounded_decompress")
    refused = wire.decode_message(raw_frame(header, zeros), LIMITS)
    assert isinstance(refused, wire.Rejected) and "MAX_ZSTD_RATIO" in refused.reason


def test_a_zstd_frame_that_lies_about_its_size_never_decompresses_past_it() -> None:
    # A frame whose header declares 64 KiB but whose blocks hold 16 MiB of zeros.
    frame = bytearray(zstandard.ZstdCompressor().compress(bytes(16 << 20)))
    assert frame[4] >> 6 == 2  # a 4-byte content size, after the window byte if there is one
    at = 5 if frame[4] & 0x20 else 6
    frame[at : at + 4] = struct.pack("<I", 64 << 10)
    assert zstandard.get_frame_parameters(bytes(frame)).content_size == 64 << 10
    bad = EncodedTensor("fp32", (16 << 10,), {"zstd": True}, bytes(frame))
    with pytest.raises(ValueError, match="zstd"):
        decode_tensor(bad)


@FAST
@given(
    tensors=st.dictionaries(
        st.text(min_size=1, max_size=4),
        st.builds(
            EncodedTensor, st.sampled_from(CODECS) | junk, shapes, junk, st.binary(max_size=16)
        ),
        max_size=3,
    ),
    layout=st.none() | st.just({"w": (2, 2)}),
)
def test_wire_decode_tensors_never_raises(tensors: dict, layout: Any) -> None:
    msg = wire.Message(wire.CONTRIBUTION, RUN, 1, 0, dict(META), tensors)
    result = wire.decode_tensors(msg, layout, max_total_elements=1 << 16)
    assert isinstance(result, dict | wire.Rejected)
    assert isinstance(wire.decode_tensors("not a message"), wire.Rejected)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# wire: metadata that reaches a window


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("step_time_s", math.nan, "non-finite"),
        ("step_time_s", math.inf, "non-finite"),
        ("step_time_s", -0.5, "'step_time_s' must be in"),
        ("step_time_s", 1e300, "'step_time_s' must be in"),
        ("step_time_s", 86400.5, "'step_time_s' must be in"),
        ("step_time_s", "0.25", "'step_time_s' must be float"),
        ("step_time_s", True, "'step_time_s' must be float"),
        ("tokens", 2**53, "'tokens' must be in"),
        ("tokens", 2**64 - 1, "'tokens' must be uint"),
        ("tokens", 1.0, "'tokens' must be uint"),
        ("steps", -1, "'steps' must be uint"),
        ("steps", 2**60, "'steps' must be in"),
        ("base_round", 2**53, "'base_round' must be in"),
        ("base_round", None, "'base_round' must be uint"),
    ],
)
def test_contribution_meta_out_of_type_or_bounds_is_rejected(
    field: str, value: Any, reason: str
) -> None:
    refused = wire.decode_message(with_meta(contribution(), **{field: value}), LIMITS)
    assert isinstance(refused, wire.Rejected) and reason in refused.reason


def test_contribution_meta_at_its_bounds_is_accepted() -> None:
    edges = {
        "step_time_s": wire.MAX_STEP_TIME_S,
        "tokens": wire.MAX_COUNT,
        "steps": 0,
        "base_round": wire.MAX_COUNT,
    }
    assert isinstance(wire.decode_message(with_meta(contribution(), **edges), LIMITS), wire.Message)
    assert isinstance(
        wire.decode_message(with_meta(contribution(), step_time_s=3), LIMITS), wire.Message
    )


@pytest.mark.parametrize("field", ["round", "fragment"])
def test_round_and_fragment_numbers_are_bounded(field: str) -> None:
    header, payload = header_and_payload(contribution())
    header[field] = wire.MAX_COUNT + 1
    refused = wire.decode_message(raw_frame(header, payload), LIMITS)
    assert (
        isinstance(refused, wire.Rejected)
        and f"{field} must be an int in [0, {wire.MAX_COUNT}]" in refused.reason
    )


@FAST
@given(field=st.sampled_from(["base_round", "tokens", "steps", "step_time_s"]), value=junk)
def test_whatever_a_contribution_carries_what_passes_is_typed_and_bounded(
    field: str, value: Any
) -> None:
    try:
        frame = with_meta(contribution(), **{field: value})
    except (OverflowError, TypeError, ValueError):
        return  # msgpack cannot even express it
    msg = wire.decode_message(frame, LIMITS)
    if isinstance(msg, wire.Rejected):
        return
    for name in ("base_round", "tokens", "steps"):
        count = msg.meta[name]
        assert type(count) is int and 0 <= count <= wire.MAX_COUNT
    step_time = msg.meta["step_time_s"]
    assert type(step_time) in (int, float) and 0 <= step_time <= wire.MAX_STEP_TIME_S


def test_a_kind_may_only_bound_its_numeric_fields() -> None:
    with pytest.raises(ValueError, match="bounds of k.x"):
        wire.MessageKind("k", required={"x": "str"}, bounds={"x": (0, 1)})
    with pytest.raises(ValueError, match="bounds of k.y"):
        wire.MessageKind("k", optional={"y": "float"}, bounds={"y": (2, 1)})


# ---------------------------------------------------------------------------------------
# messages: replies


@FAST
@given(
    source=st.sampled_from(["reply", "update", "contribution"]),
    edits=edits,
    cut=cuts,
    tail=st.binary(max_size=8),
)
def test_decode_reply_never_raises_on_mutated_frames(
    source: str, edits: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    frame = {"reply": reply_frame, "update": update_frame, "contribution": contribution}[source]()
    result = messages.decode_reply(mutate(frame, edits, cut, tail), LIMITS, RUN)
    if isinstance(result, wire.Message):
        assert result.kind == messages.CONTRIBUTE_REPLY and result.run == RUN
        assert isinstance(result.meta["status"], messages.Reply)  # the enum, not the text


@FAST
@given(
    field=st.sampled_from(
        ["status", "weight", "moved_to", "contributors", "record", "digest", "peer"]
    ),
    value=junk,
)
def test_decode_reply_types_and_bounds_every_field(field: str, value: Any) -> None:
    try:
        frame = with_meta(reply_frame(), **{field: value})
    except (OverflowError, TypeError, ValueError):
        return
    result = messages.decode_reply(frame, LIMITS, RUN)
    if isinstance(result, wire.Rejected):
        return
    meta = result.meta
    assert isinstance(meta["status"], messages.Reply) and isinstance(meta["peer"], str)
    weight = meta.get("weight", 0.0)
    assert type(weight) in (int, float) and 0 <= weight < math.inf
    if "contributors" in meta:
        assert not isinstance(messages.parse_contributors(meta["contributors"]), wire.Rejected)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (lambda: with_meta(reply_frame(), status="exploded"), "unknown reply status"),
        (lambda: with_meta(reply_frame(), weight=-1.0), "'weight' must be in"),
        (lambda: with_meta(reply_frame(), weight=math.nan), "non-finite"),
        (lambda: with_meta(reply_frame(), moved_to=""), "moved_to"),
        (lambda: with_meta(reply_frame(), contributors=[["a", "nan", 1]]), "weight"),
        (lambda: contribution(), "expected a contribute_reply"),
        (lambda: messages.reply("other", 3, 0, "p", messages.Reply.MERGED), "another run"),
        (lambda: b"\x00" * 20, "bad magic"),
    ],
)
def test_decode_reply_rejections_say_why(frame: Any, reason: str) -> None:
    result = messages.decode_reply(frame(), LIMITS, RUN)
    assert isinstance(result, wire.Rejected) and reason in result.reason


@FAST
@given(value=junk | st.lists(st.lists(junk, min_size=3, max_size=3), max_size=3))
def test_parse_contributors_accepts_only_typed_finite_triples(value: Any) -> None:
    parsed = messages.parse_contributors(value)
    if isinstance(parsed, wire.Rejected):
        return
    for peer, weight, tokens in parsed:
        assert isinstance(peer, str) and peer
        assert type(weight) is float and 0.0 <= weight < math.inf
        assert type(tokens) is int and 0 <= tokens <= wire.MAX_COUNT


# ---------------------------------------------------------------------------------------
# updates


@FAST
@given(
    source=st.sampled_from(["update", "reply"]), edits=edits, cut=cuts, tail=st.binary(max_size=8)
)
def test_parse_update_never_raises_on_mutated_frames(
    source: str, edits: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    frame = update_frame() if source == "update" else reply_frame()
    result = updates.parse_update(mutate(frame, edits, cut, tail), LIMITS, RUN, LAYOUT)
    if isinstance(result, wire.Rejected):
        return
    assert {n: tuple(t.shape) for n, t in result.tensors.items()} == LAYOUT[result.fragment]
    try:
        decoded = result.decode()
    except ValueError:
        return
    assert all(bool(torch.isfinite(t).all()) for t in decoded.values())


@FAST
@given(
    field=st.sampled_from(["peer", "parent", "hash", "contributors", "tokens", "grace_s"]),
    value=junk,
)
def test_parse_update_types_every_meta_field(field: str, value: Any) -> None:
    try:
        frame = with_meta(update_frame(), **{field: value})
    except (OverflowError, TypeError, ValueError):
        return
    result = updates.parse_update(frame, LIMITS, RUN, LAYOUT)
    if isinstance(result, wire.Rejected):
        return
    assert isinstance(result.synchronizer, str) and isinstance(result.parent, str) and result.hash
    for peer, weight, tokens in result.contributors:
        assert isinstance(peer, str) and math.isfinite(weight) and weight >= 0 and tokens >= 0


@FAST
@given(data=st.binary(max_size=300) | junk)
def test_parse_update_and_decode_reply_reject_any_junk(data: Any) -> None:
    assert isinstance(updates.parse_update(data, LIMITS, RUN, LAYOUT), wire.Rejected)
    assert isinstance(messages.decode_reply(data, LIMITS, RUN), wire.Rejected)


@pytest.mark.parametrize(
    "contributors",
    [
        [["a", "nan", 1]],
        [["a", 0.5, "7"]],
        [{"a": 1, "b": 2, "c": 3}],
        [["a", 0.5]],
        [[7, 0.5, 1]],
        "abc",
    ],
    ids=["weight-str", "tokens-str", "dict", "pair", "peer-int", "string"],
)
def test_an_update_with_malformed_contributors_is_rejected(contributors: Any) -> None:
    result = updates.parse_update(
        with_meta(update_frame(), contributors=contributors), LIMITS, RUN, LAYOUT
    )
    assert isinstance(result, wire.Rejected) and "contributors" in result.reason


def test_an_update_with_a_nan_is_parsed_but_never_decoded_for_applying() -> None:
    values = torch.randn(8, 33)
    values[2, 3] = math.inf
    update = updates.parse_update(update_frame(values), LIMITS, RUN, LAYOUT)
    assert isinstance(update, updates.Update)
    with pytest.raises(ValueError, match="non-finite"):
        update.decode()


# ---------------------------------------------------------------------------------------
# windows: what the decoders let through cannot poison a window either

numbers = st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1.0, 0.0])


@FAST
@given(samples=st.lists(numbers, max_size=20))
def test_a_running_mean_ignores_samples_that_are_not_durations(samples: list[float]) -> None:
    mean = RunningMean()
    for sample in samples:
        mean.update(sample)
        assert mean.value is None or (math.isfinite(mean.value) and mean.value >= 0)
    durations = [s for s in samples if math.isfinite(s) and s >= 0]
    assert (mean.value is None) == (not durations)


@FAST
@given(
    step_time_s=numbers,
    time_to_quorum_s=numbers,
    sync_time_s=numbers,
    gamma=numbers,
    max_grace_s=st.floats(0, 1e6),
    overlap_steps=st.integers(0, 10**6),
)
def test_the_grace_window_is_finite_and_within_its_max_whatever_the_estimates(
    step_time_s: float,
    time_to_quorum_s: float,
    sync_time_s: float,
    gamma: float,
    max_grace_s: float,
    overlap_steps: int,
) -> None:
    grace = grace_window_s(
        step_time_s=step_time_s,
        overlap_steps=overlap_steps,
        time_to_quorum_s=time_to_quorum_s,
        sync_time_s=sync_time_s,
        gamma=gamma,
        max_grace_s=max_grace_s,
    )
    assert math.isfinite(grace) and 0.0 <= grace <= max_grace_s


@pytest.mark.parametrize(("tokens", "steps"), [(-1, 1), (1.5, 1), (1, None), (True, 1)])
def test_a_window_refuses_counts_that_are_not_counts(tokens: Any, steps: Any) -> None:
    machine = WindowMachine(round=1, fragment=0, opened_at=0.0, deadline_s=10.0, min_quorum=2)
    assert "must be an int" in machine.accept("a", tokens, steps, 0.1, 0.0)
    assert machine.arrivals == {}


def test_a_window_never_waits_until_nan() -> None:
    machine = WindowMachine(round=1, fragment=0, opened_at=0.0, deadline_s=math.nan, min_quorum=2)
    assert machine.accept("a", 10, 1, math.nan, 0.0) is None
    action = machine.next_action(
        0.5,
        expected={"a", "b"},
        better_placed=None,
        step_time_s=math.nan,
        sync_time_s=0.0,
        overlap_steps=4,
        gamma=1.0,
        max_grace_s=5.0,
    )
    assert isinstance(action, Wait) and math.isfinite(action.until)
