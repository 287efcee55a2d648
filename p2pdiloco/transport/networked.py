"""What the two real transports (hivemind, libp2p) share beyond `TransportBase`.

They take the same options, so a run's `network.transport` swaps one for the other and
nothing else changes; they read the same Ed25519 key file, so a peer keeps its peer id
on both (an ephemeral peer's key lives in a scratch folder, removed at shutdown); a start
checks its listen port first, so a taken port is one clear `AddressInUse`; and a start
that fails releases whatever it had already started.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import tempfile
from abc import abstractmethod
from typing import Any, ClassVar

from p2pdiloco.identity import load_or_create_identity
from p2pdiloco.transport.base import AddressInUse, TransportBase, TransportStartError
from p2pdiloco.transport.dialback import DIAL_BACK, serve_dial_back
from p2pdiloco.transport.ratelimit import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_PER_CALLER

logger = logging.getLogger(__name__)


def check_port_free(host: str, port: int) -> None:
    """Raise AddressInUse if something listens on host:port (port 0 is always free)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AddressInUse(
                    f"cannot listen on {host}:{port}: address already in use; "
                    "pick another port or pass port=0"
                ) from None
            raise TransportStartError(f"cannot listen on {host}:{port}: {e.strerror}") from None


class NetworkedTransport(TransportBase):
    """A transport on a real network; subclasses implement `_join()` and `_leave()`.

    `initial_peers`: multiaddrs (with `/p2p/<id>`) to bootstrap from (empty: a new swarm).
    `host`/`port`: listen address (port 0: any free port). `client_mode`: do not accept
    incoming connections (behind NAT). `identity_path`: persistent Ed25519 key file,
    created if missing, so the peer id survives restarts. `announce_maddrs`: addresses to
    advertise instead of the listen ones. `startup_timeout_s`: bound on start and
    bootstrap, s. `dht_timeout_s`: bound on one store/get, s. `idle_timeout_s`: a stream
    that moves no byte for this long is dropped, s. `shutdown_timeout_s`: bound on each
    step of shutdown, s. `record_rules`: the run's record validator.
    `max_in_flight` / `max_per_caller`: as for `TransportBase`. `use_relay`: reach peers
    through circuit relays and relay for others once found public; `use_auto_relay`: in
    client mode, take a slot on a relay and announce the relayed address (hivemind's
    options of the same names; docs/join.md, "NAT and reachability"); `relay_service`: a
    node known to be public (a bootstrap node) relays for others at once, without waiting
    for the daemon's own AutoNAT to call it public.
    A started server-mode peer answers `reach.dial_back` (`dialback.py`).
    """

    listens_in_client_mode: ClassVar[bool] = False
    """Whether start opens host:port even in client mode (hivemind's p2pd does), so the
    port is checked free first."""

    def __init__(
        self,
        initial_peers: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        client_mode: bool = False,
        identity_path: str | None = None,
        announce_maddrs: list[str] | None = None,
        startup_timeout_s: float = 60,
        dht_timeout_s: float = 30,
        idle_timeout_s: float = 60,
        shutdown_timeout_s: float = 10,
        record_rules: Any = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_per_caller: int = DEFAULT_MAX_PER_CALLER,
        use_relay: bool = True,
        use_auto_relay: bool = True,
        relay_service: bool = False,
    ) -> None:
        super().__init__(client_mode, max_in_flight, max_per_caller)
        self.use_relay = use_relay
        self.use_auto_relay = use_auto_relay
        self.relay_service = relay_service
        self.initial_peers = list(initial_peers)
        self.host = host
        self.port = port
        self.identity_path = identity_path
        self.announce_maddrs = list(announce_maddrs) if announce_maddrs else None
        self.startup_timeout_s = startup_timeout_s
        self.dht_timeout_s = dht_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.record_rules = record_rules
        self._scratch_dir: str | None = None

    async def start(self) -> None:
        await super().start()
        if not self._client_mode and DIAL_BACK not in self._handlers:
            await serve_dial_back(self)

    async def _start(self) -> None:
        if self.listens_in_client_mode or not self._client_mode:
            check_port_free(self.host, self.port)
        self._load_identity()
        try:
            await self._join()
        except BaseException:
            await self.shutdown()
            raise

    async def _stop(self) -> None:
        await self._leave()
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)

    def _load_identity(self) -> None:
        if self.identity_path is None:
            # An ephemeral peer still signs its records: its key lives in a private scratch dir.
            self._scratch_dir = tempfile.mkdtemp(prefix="p2pdiloco-id-")
            self.identity_path = os.path.join(self._scratch_dir, "identity.key")
        created = not os.path.isfile(self.identity_path)
        try:
            self._identity = load_or_create_identity(self.identity_path)
        except (OSError, ValueError) as e:
            raise TransportStartError(f"cannot use identity {self.identity_path}: {e}") from None
        if created and self._scratch_dir is None:
            logger.info("identity_created path=%s", self.identity_path)

    @abstractmethod
    async def _join(self) -> None:
        """Start the network side (the identity is loaded); on failure, `start()` shuts
        the transport down."""

    @abstractmethod
    async def _leave(self) -> None:
        """Stop the network side, whatever part of it started; never raises."""
