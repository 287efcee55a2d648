"""Transports: one narrow interface (`Transport`), implementations imported lazily.

hivemind and py-libp2p cannot be imported in the same process (both register the
protobuf symbol `crypto.pb.KeyType`), so `make_transport` imports only the one asked for.
"""

from __future__ import annotations

from typing import Any

from p2pdiloco.transport.base import (
    CHUNK_BYTES,
    DEFAULT_MAX_BYTES,
    MIN_LINK_BYTES_PER_S,
    AddressInUse,
    CallTimeout,
    ClockReading,
    ClockSkew,
    Handler,
    PeerUnreachable,
    RemoteError,
    RequestTooLarge,
    ResponseTooLarge,
    Transport,
    TransportClosed,
    TransportError,
    TransportStartError,
    transfer_timeout_s,
)

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_MAX_BYTES",
    "MIN_LINK_BYTES_PER_S",
    "AddressInUse",
    "CallTimeout",
    "ClockReading",
    "ClockSkew",
    "Handler",
    "PeerUnreachable",
    "RemoteError",
    "RequestTooLarge",
    "ResponseTooLarge",
    "Transport",
    "TransportClosed",
    "TransportError",
    "TransportStartError",
    "TRANSPORT_KINDS",
    "transfer_timeout_s",
    "make_transport",
]

TRANSPORT_KINDS = ("hivemind", "libp2p", "memory")


def make_transport(kind: str, **options: Any) -> Transport:
    """Build a transport of `kind` ("hivemind", "libp2p" or "memory") from its options.

    "memory" needs `network=MemoryNetwork(...)`; see each class for its options.
    """
    if kind == "hivemind":
        from p2pdiloco.transport.hivemind import HivemindTransport

        return HivemindTransport(**options)
    if kind == "libp2p":
        from p2pdiloco.transport.libp2p import Libp2pTransport

        return Libp2pTransport(**options)
    if kind == "memory":
        from p2pdiloco.transport.memory import MemoryTransport

        return MemoryTransport(**options)
    raise ValueError(f"transport kind must be one of {', '.join(TRANSPORT_KINDS)}, got {kind!r}")
