"""The one exception tree for user and operator errors.

    P2PDilocoError            base: the CLI prints its message on one line, exit code 2
    ├── ConfigError           a bad config value, file or override (names the dotted field)
    ├── DataError             missing, empty or unreadable training data (names the path)
    ├── DeviceError           a device that was asked for and is not available
    ├── NetworkSetupError     bad multiaddr, unknown run, port in use, no peers reachable
    └── PreflightError        this machine cannot hold the run (RAM, disk, device memory)

Peer and network *faults* (a malformed delta, a dead synchronizer) are never raised
into the training loop: they become a `Rejected(reason)` at the boundary, see `wire`.
"""

from __future__ import annotations


class P2PDilocoError(Exception):
    """An error the user or operator can fix; its message says where and what to do."""


class ConfigError(P2PDilocoError, ValueError):
    """A config value, file or `--set` override is invalid."""


class DataError(P2PDilocoError):
    """Training data is missing, empty or unreadable."""


class DeviceError(P2PDilocoError):
    """The requested compute device is not available on this machine."""


class NetworkSetupError(P2PDilocoError):
    """The peer cannot join: bad address, unknown run, port in use, nobody reachable."""


class PreflightError(P2PDilocoError):
    """A preflight check failed (`p2pdiloco.peer.preflight`): the peer would not get far here."""
