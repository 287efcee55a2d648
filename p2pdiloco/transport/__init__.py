"""Transports: one narrow interface (`Transport`), implementations imported lazily.

hivemind and py-libp2p cannot be imported in the same process (both register the
protobuf symbol `crypto.pb.KeyType`), so `make_transport` imports only the one asked for.
Each real transport's stack is an extra of the package (`pip install 'p2pdiloco[hivemind]'`,
`'p2pdiloco[libp2p]'`): a volunteer installs one, and asking for a transport whose stack
is missing is one line naming the extra (`TransportUnavailable`), not a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
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
    "TransportUnavailable",
    "TRANSPORT_KINDS",
    "transfer_timeout_s",
    "make_transport",
    "require_stack",
]

TRANSPORT_KINDS = ("hivemind", "libp2p", "memory")

_CLASSES = {
    "hivemind": ("p2pdiloco.transport.hivemind", "HivemindTransport"),
    "libp2p": ("p2pdiloco.transport.libp2p", "Libp2pTransport"),
    "memory": ("p2pdiloco.transport.memory", "MemoryTransport"),
}
STACKS = {"hivemind": ("hivemind",), "libp2p": ("libp2p", "trio"), "memory": ()}
"""The top-level packages each transport's extra installs and its modules import."""


class TransportUnavailable(TransportStartError):
    """The transport's stack is not installed; the message names the extra to install (a
    `NetworkSetupError`: the command line prints it as one line)."""

    def __init__(self, kind: str, missing: str) -> None:
        super().__init__(
            f"the {kind} transport needs {missing}, which is not installed here: "
            f"pip install 'p2pdiloco[{kind}]'"
        )
        self.kind, self.missing = kind, missing


def require_stack(kind: str) -> None:
    """Raise TransportUnavailable if the stack of transport `kind` is not installed, without
    importing it (cheap: a command can check before it starts any work)."""
    for package in STACKS.get(kind, ()):
        if importlib.util.find_spec(package) is None:
            raise TransportUnavailable(kind, package)


def make_transport(kind: str, **options: Any) -> Transport:
    """Build a transport of `kind` ("hivemind", "libp2p" or "memory") from its options,
    importing only that one; TransportUnavailable if its stack is not installed.

    "memory" needs `network=MemoryNetwork(...)`; see each class for its options.
    """
    if kind not in _CLASSES:
        raise ValueError(
            f"transport kind must be one of {', '.join(TRANSPORT_KINDS)}, got {kind!r}"
        )
    require_stack(kind)
    module_name, class_name = _CLASSES[kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or "a package"
        if missing.partition(".")[0] == "p2pdiloco":
            raise
        # a package the stack itself needs (py-libp2p's own dependencies, say)
        raise TransportUnavailable(kind, missing) from None
    return getattr(module, class_name)(**options)
