"""Framing and validation of every message that crosses the network.

    frame = magic b"P2PD" | u32 LE header length | msgpack header | tensor payloads

The header carries the protocol version, the message kind, run, round, fragment, free
scalar metadata and one descriptor per tensor (name, codec, shape, meta, nbytes); the
payloads follow in descriptor order, back to back. `decode_message` never raises: every
length is checked against `WireLimits` before anything is allocated or decoded, and any
malformed input becomes a `Rejected(reason)`, including numeric metadata outside the
bounds its kind declares (a `step_time_s` of NaN or 1e300 never reaches a window).
`decode_tensors` then checks names and shapes against the layout the caller expects
before it decodes anything, runs the codecs and rejects non-finite values. Layout,
limits and reasons are in docs/protocol.md.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from p2pdiloco import compress
from p2pdiloco.compress import CODECS, EncodedTensor, check_layout
from p2pdiloco.shapes import check_shape

__all__ = [
    "CONTRIBUTION",
    "MAX_NAME_CHARS",
    "MAGIC",
    "MAX_COUNT",
    "MAX_STEP_TIME_S",
    "OUTER_UPDATE",
    "PROTOCOL_VERSION",
    "STATE_REQUEST",
    "Message",
    "MessageKind",
    "Rejected",
    "WireLimits",
    "decode_message",
    "decode_tensors",
    "lazy_tensors",
    "encode_message",
    "register_kind",
    "tensor_bytes",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAGIC = b"P2PD"
_PREFIX = struct.Struct("<4sI")  # magic, header length in bytes
_HEADER_KEYS = frozenset({"version", "kind", "run", "round", "fragment", "meta", "tensors"})
_TENSOR_KEYS = frozenset({"name", "codec", "shape", "meta", "nbytes"})
MAX_NAME_CHARS = 512
"""Longest run name, tensor name or metadata key, in characters."""
MAX_META_DEPTH = 4
"""Deepest nesting of lists/maps inside metadata values."""
_U63 = 1 << 63
MAX_COUNT = (1 << 53) - 1
"""Largest round, fragment, step or token count a peer may send: exact as a float, so
sums, means and time estimates built from them stay exact and finite."""
MAX_STEP_TIME_S = 86400.0
"""Longest inner-step time a learner may claim, seconds (a day); larger claims are refused."""


@dataclass(frozen=True)
class Rejected:
    """A message (or stream) refused at the boundary; `reason` says why, for logs and counters."""

    reason: str


@dataclass(frozen=True)
class WireLimits:
    """Bounds every decoder enforces before it allocates anything."""

    max_frame_bytes: int = 1 << 30
    """Largest whole frame, in bytes (1 GiB)."""
    max_header_bytes: int = 1 << 20
    """Largest msgpack header, in bytes (1 MiB)."""
    max_tensors: int = 4096
    """Most tensors in one message."""
    max_elements_per_tensor: int = 1 << 28
    """Most elements in one tensor (268M)."""
    max_total_elements: int = 1 << 28
    """Most elements over all tensors of one message."""
    max_ndim: int = 8
    """Most dimensions of one tensor."""

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WireLimits.{name} must be an int >= 1, got {value!r}")


_UNLIMITED = WireLimits(*(1 << 62 for _ in range(6)))

# ---------------------------------------------------------------------------------------
# message kinds

FIELD_TYPES = ("int", "uint", "float", "str", "bytes", "bool", "list", "any")
"""Types a kind may require of a metadata field (uint: an int in [0, 2^63))."""


@dataclass(frozen=True)
class MessageKind:
    """A kind of message and the metadata fields it must (or may) carry, with their types."""

    name: str
    required: Mapping[str, str] = field(default_factory=dict)
    """Metadata fields every message of this kind carries, name -> one of `FIELD_TYPES`."""
    optional: Mapping[str, str] = field(default_factory=dict)
    """Fields that are type-checked when present; any other field is free plain data."""
    carries_tensors: bool = True
    """Whether messages of this kind may carry tensors."""
    bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Inclusive [low, high] of numeric fields (required or optional), checked after the type."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"MessageKind.name must be a non-empty string, got {self.name!r}")
        for fields in (self.required, self.optional):
            for key, kind in fields.items():
                if kind not in FIELD_TYPES:
                    raise ValueError(f"field {self.name}.{key} has unknown type {kind!r}")
        for key, (low, high) in self.bounds.items():
            kind = self.required.get(key, self.optional.get(key))
            if kind not in ("int", "uint", "float") or not low <= high:
                raise ValueError(
                    f"bounds of {self.name}.{key} need a numeric field and low <= high"
                )


CONTRIBUTION = "contribution"
"""learner -> synchronizer: the delta of one fragment since `base_round`."""
OUTER_UPDATE = "outer_update"
"""synchronizer -> everyone: the merged outer gradient of (round, fragment)."""
STATE_REQUEST = "state_request"
"""newcomer -> peer: please send the global state."""

_KINDS: dict[str, MessageKind] = {}


def register_kind(kind: MessageKind, *, replace: bool = False) -> None:
    """Make `kind` known to every encoder and decoder in this process."""
    if kind.name in _KINDS and not replace:
        raise ValueError(f"message kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind


register_kind(
    MessageKind(
        CONTRIBUTION,
        required={"peer": "str", "base_round": "uint", "tokens": "uint", "steps": "uint"},
        optional={"unreachable": "list", "step_time_s": "float", "first_step": "uint", "last_step": "uint"},
        bounds={
            "base_round": (0, MAX_COUNT),
            "tokens": (0, MAX_COUNT),
            "steps": (0, MAX_COUNT),
            "step_time_s": (0.0, MAX_STEP_TIME_S),
            # the learner's own step counts (informative: goodput is attributed by them)
            "first_step": (0, MAX_COUNT),
            "last_step": (0, MAX_COUNT),
        },
    )
)
register_kind(
    MessageKind(
        OUTER_UPDATE,
        required={"peer": "str"},
        optional={
            "contributors": "list",
            "tokens": "uint",
            "parent": "str",
            "hash": "str",
            "grace_s": "float",
        },
        bounds={"tokens": (0, MAX_COUNT), "grace_s": (0.0, math.inf)},
    )
)
register_kind(
    MessageKind(
        STATE_REQUEST,
        required={"peer": "str"},
        optional={"part": "uint"},
        bounds={"part": (0, MAX_COUNT)},
        carries_tensors=False,
    )
)


@dataclass(frozen=True)
class Message:
    """One message: routing fields, free metadata and named encoded tensors."""

    kind: str
    """A registered kind, e.g. `CONTRIBUTION`."""
    run: str
    """Run name; peers drop messages of other runs."""
    round: int
    """Outer round the message belongs to."""
    fragment: int
    """Parameter fragment the message belongs to."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Plain msgpack data: None, bool, int, float (finite), str, bytes, lists and str-keyed maps."""
    tensors: dict[str, EncodedTensor] = field(default_factory=dict)
    """Encoded tensors by name, in frame order."""
    version: int = PROTOCOL_VERSION
    """Protocol version of the frame."""


# ---------------------------------------------------------------------------------------
# validation: raise _Invalid(reason) inside, become Rejected(reason) at the boundary


class _Invalid(Exception):
    pass


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise _Invalid(
            f"{what} must be a string of 1..{MAX_NAME_CHARS} characters, got {_short(value)}"
        )
    return value


def _check_uint(value: Any, what: str, high: int = _U63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise _Invalid(f"{what} must be an int in [0, {high}], got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """A bounded repr of an untrusted value for a rejection reason."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


def _check_plain(value: Any, what: str, depth: int = 0) -> None:
    """Plain msgpack data only: no ext types, no NaN/Inf, bounded nesting."""
    if value is None or isinstance(value, bool | str | bytes):
        return
    if isinstance(value, int):
        if not -_U63 <= value < 1 << 64:
            raise _Invalid(f"{what} is an int out of msgpack range")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Invalid(f"{what} is a non-finite float")
        return
    if depth >= MAX_META_DEPTH and isinstance(value, list | tuple | dict):
        raise _Invalid(f"{what} nests deeper than {MAX_META_DEPTH} levels")
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{what}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_name(key, f"key of {what}")
            _check_plain(item, f"{what}.{key}", depth + 1)
        return
    raise _Invalid(f"{what} has unsupported type {type(value).__name__}")


def _check_field_type(value: Any, kind: str, what: str) -> None:
    ok = {
        "int": not isinstance(value, bool) and isinstance(value, int),
        "uint": not isinstance(value, bool) and isinstance(value, int) and 0 <= value < _U63,
        "float": not isinstance(value, bool) and isinstance(value, int | float),
        "str": isinstance(value, str),
        "bytes": isinstance(value, bytes),
        "bool": isinstance(value, bool),
        "list": isinstance(value, list | tuple),
        "any": True,
    }[kind]
    if not ok:
        raise _Invalid(f"{what} must be {kind}, got {_short(value)}")


def _check_meta(meta: Any, kind: MessageKind) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise _Invalid(f"header field 'meta' must be a map, got {_short(meta)}")
    _check_plain(meta, "meta")
    for key, type_name in kind.required.items():
        if key not in meta:
            raise _Invalid(f"{kind.name} message lacks meta field {key!r}")
        _check_field_type(meta[key], type_name, f"meta field {key!r}")
    for key, type_name in kind.optional.items():
        if key in meta:
            _check_field_type(meta[key], type_name, f"meta field {key!r}")
    for key, (low, high) in kind.bounds.items():
        if key in meta and not low <= meta[key] <= high:
            raise _Invalid(
                f"meta field {key!r} must be in [{low}, {high}], got {_short(meta[key])}"
            )
    return meta


def _check_shape(shape: Any, what: str, limits: WireLimits) -> tuple[int, ...]:
    try:
        return check_shape(
            shape,
            max_elements=limits.max_elements_per_tensor,
            max_ndim=limits.max_ndim,
            what=f"{what} shape",
            limit_name="max_elements_per_tensor",
        )
    except ValueError as exc:
        raise _Invalid(str(exc)) from None


@dataclass(frozen=True)
class _Descriptor:
    name: str
    codec: str
    shape: tuple[int, ...]
    meta: dict[str, Any]
    nbytes: int


def _check_descriptors(raw: Any, kind: MessageKind, limits: WireLimits) -> list[_Descriptor]:
    if not isinstance(raw, list | tuple):
        raise _Invalid(f"header field 'tensors' must be a list, got {_short(raw)}")
    if raw and not kind.carries_tensors:
        raise _Invalid(f"{kind.name} messages carry no tensors, got {len(raw)}")
    if len(raw) > limits.max_tensors:
        raise _Invalid(f"{len(raw)} tensors exceed max_tensors={limits.max_tensors}")
    descriptors: list[_Descriptor] = []
    names: set[str] = set()
    total_elements = 0
    for i, desc in enumerate(raw):
        if not isinstance(desc, dict) or set(desc) != _TENSOR_KEYS:
            keys = sorted(map(str, desc)) if isinstance(desc, dict) else _short(desc)
            raise _Invalid(
                f"tensor descriptor {i} must have keys {sorted(_TENSOR_KEYS)}, got {keys}"
            )
        name = _check_name(desc["name"], f"tensor {i} name")
        if name in names:
            raise _Invalid(f"tensor name {name!r} appears twice")
        names.add(name)
        what = f"tensor {name!r}"
        if desc["codec"] not in CODECS:
            raise _Invalid(f"{what} has unknown codec {_short(desc['codec'])}")
        shape = _check_shape(desc["shape"], what, limits)
        total_elements += math.prod(shape)
        if total_elements > limits.max_total_elements:
            raise _Invalid(f"tensors exceed max_total_elements={limits.max_total_elements}")
        meta = desc["meta"]
        if not isinstance(meta, dict):
            raise _Invalid(f"{what} meta must be a map, got {_short(meta)}")
        _check_plain(meta, f"{what} meta")
        nbytes = _check_uint(desc["nbytes"], f"{what} nbytes")
        reason = check_layout(desc["codec"], shape, meta, nbytes)
        if reason is not None:
            raise _Invalid(f"{what}: {reason}")
        descriptors.append(_Descriptor(name, desc["codec"], shape, meta, nbytes))
    return descriptors


def _check_header(header: Any, limits: WireLimits) -> tuple[MessageKind, list[_Descriptor]]:
    """Validate a decoded header map; returns its kind and tensor descriptors."""
    if not isinstance(header, dict):
        raise _Invalid(f"header must be a map, got {_short(header)}")
    # The version first: a newer peer's header may legitimately differ in everything else.
    version = header.get("version")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise _Invalid(
            f"unsupported protocol version {_short(version)} (this peer speaks {PROTOCOL_VERSION})"
        )
    if set(header) != _HEADER_KEYS:
        missing = sorted(_HEADER_KEYS - set(header))
        extra = sorted(map(str, set(header) - _HEADER_KEYS))
        raise _Invalid(f"header fields wrong: missing {missing}, unknown {extra}")
    kind = _KINDS.get(header["kind"]) if isinstance(header["kind"], str) else None
    if kind is None:
        raise _Invalid(f"unknown message kind {_short(header['kind'])}")
    _check_name(header["run"], "run name")
    _check_uint(header["round"], "round", MAX_COUNT)
    _check_uint(header["fragment"], "fragment", MAX_COUNT)
    _check_meta(header["meta"], kind)
    return kind, _check_descriptors(header["tensors"], kind, limits)


# ---------------------------------------------------------------------------------------
# encode / decode


def _header_of(msg: Message) -> dict[str, Any]:
    return {
        "version": msg.version,
        "kind": msg.kind,
        "run": msg.run,
        "round": msg.round,
        "fragment": msg.fragment,
        "meta": msg.meta,
        "tensors": [
            {
                "name": name,
                "codec": enc.codec,
                "shape": list(enc.shape),
                "meta": enc.meta,
                "nbytes": len(enc.payload),
            }
            for name, enc in msg.tensors.items()
        ],
    }


def encode_message(msg: Message) -> bytes:
    """The frame of `msg`; ValueError if `msg` is not one a peer would accept."""
    header = _header_of(msg)
    try:
        _check_header(header, _UNLIMITED)
    except _Invalid as exc:
        raise ValueError(f"cannot encode message: {exc}") from None
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) >= 1 << 32:
        raise ValueError(f"cannot encode message: header of {len(packed)} bytes")
    parts = [_PREFIX.pack(MAGIC, len(packed)), packed]
    parts.extend(enc.payload for enc in msg.tensors.values())
    return b"".join(parts)


def tensor_bytes(frame: bytes) -> int:
    """Bytes of `frame` after its header, i.e. its tensors' payload: 0 for a frame that
    carries none (a reply, a request) and for bytes that are no frame. Reads the prefix
    only (the simulator charges a larger model's bytes to the messages that carry one)."""
    if len(frame) < _PREFIX.size:
        return 0
    magic, header_bytes = _PREFIX.unpack_from(frame)
    return max(len(frame) - _PREFIX.size - header_bytes, 0) if magic == MAGIC else 0


def _refuse_ext(code: int, data: bytes) -> Any:
    raise _Invalid(f"header uses msgpack extension type {code}")


def _decode(data: Any, limits: WireLimits) -> Message:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _Invalid(f"frame must be bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    size = len(view)
    if size > limits.max_frame_bytes:
        raise _Invalid(f"frame of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    if size < _PREFIX.size:
        raise _Invalid(f"truncated frame: {size} bytes, a frame has at least {_PREFIX.size}")
    magic, header_bytes = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise _Invalid(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if header_bytes > limits.max_header_bytes:
        raise _Invalid(
            f"header of {header_bytes} bytes exceeds max_header_bytes={limits.max_header_bytes}"
        )
    body = _PREFIX.size + header_bytes
    if body > size:
        raise _Invalid(
            f"truncated frame: header claims {header_bytes} bytes, "
            f"{size - _PREFIX.size} follow the prefix"
        )
    try:
        # unpackb bounds every string/list/map length by the header size it is given
        header = msgpack.unpackb(
            view[_PREFIX.size : body],
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            timestamp=0,
        )
    except _Invalid:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise _Invalid(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    _kind, descriptors = _check_header(header, limits)
    declared = sum(d.nbytes for d in descriptors)
    if body + declared != size:
        raise _Invalid(
            f"frame length mismatch: header declares {declared} payload bytes, "
            f"frame carries {size - body}"
        )
    tensors = {}
    offset = body
    for desc in descriptors:
        payload = bytes(view[offset : offset + desc.nbytes])
        tensors[desc.name] = EncodedTensor(desc.codec, desc.shape, desc.meta, payload)
        offset += desc.nbytes
    return Message(
        kind=header["kind"],
        run=header["run"],
        round=header["round"],
        fragment=header["fragment"],
        meta=header["meta"],
        tensors=tensors,
        version=header["version"],
    )


def decode_message(data: bytes | bytearray | memoryview, limits: WireLimits) -> Message | Rejected:
    """The message in frame `data`, or why it was refused; never raises on any input."""
    try:
        return _decode(data, limits)
    except _Invalid as exc:
        return Rejected(str(exc))
    except Exception as exc:  # last resort: explicit checks above should leave nothing here
        logger.warning("wire decode failed unexpectedly error=%r", exc)
        return Rejected(f"malformed frame: {type(exc).__name__}: {exc}")


def decode_tensors(
    msg: Message,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    *,
    max_total_elements: int = compress.MAX_DECODE_ELEMENTS,
) -> dict[str, torch.Tensor] | Rejected:
    """Decode every tensor of `msg` to fp32; Rejected if any is invalid or not finite.

    With `shapes` (name -> shape: the layout the caller expects) the names and shapes are
    checked before anything is allocated; without, at most `max_total_elements` elements
    over all tensors are. Never raises on any input.
    """
    return _tensors_of(msg, compress.decode_tensors, shapes, max_total_elements)


def lazy_tensors(
    msg: Message,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    *,
    max_total_elements: int = compress.MAX_DECODE_ELEMENTS,
) -> compress.LazyTensors | Rejected:
    """`decode_tensors`' checks, keeping the tensors encoded (decoded again on each access):
    what a synchronizer holds until the merge, so its memory does not grow as M × fp32."""
    return _tensors_of(msg, compress.lazy_tensors, shapes, max_total_elements)


def _tensors_of(
    msg: Message,
    build: Callable[..., Any],
    shapes: Mapping[str, tuple[int, ...]] | None,
    max_total_elements: int,
) -> Any:
    """`build(msg.tensors, ...)` (compress's decode_tensors or lazy_tensors), or why not."""
    if not isinstance(msg, Message):
        return Rejected(f"expected a Message, got {type(msg).__name__}")
    try:
        return build(msg.tensors, shapes=shapes, max_total_elements=max_total_elements)
    except ValueError as exc:
        return Rejected(str(exc))
    except Exception as exc:  # last resort, as in decode_message
        logger.warning("tensor decode failed unexpectedly error=%r", exc)
        return Rejected(f"malformed tensors: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------
# chunked streams


