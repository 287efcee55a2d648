"""Where a peer keeps its checkpoints: on by default, in a folder of the user's data directory.

`peer.checkpoint_dir` says where:

- `"auto"` (the default): `<data>/<run>/<name>/checkpoints`, where `<data>` is
  `$P2PDILOCO_DATA_HOME`, else `$XDG_DATA_HOME/p2pdiloco`, else
  `~/.local/share/p2pdiloco`; `<name>` is the peer id of `--identity` (the same key
  finds the same folder after a restart), or `default` for a peer without one (a
  second such peer of the same run on this machine takes `default-2`, and so on: two
  live processes never write one folder);
- `""` or `"none"` (`join --no-checkpoint`): no checkpoints;
- any other value: that folder.

Pure path rules plus one small owner file (`owner.pid`) that says which live process
writes a folder; nothing here imports the network.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from p2pdiloco.config import PeerConfig, RunConfig
from p2pdiloco.errors import ConfigError
from p2pdiloco.identity import load_or_create_identity

log = logging.getLogger(__name__)

AUTO = "auto"
"""`peer.checkpoint_dir` value: a folder of the user's data directory (the default)."""
OFF = ("", "none")
"""`peer.checkpoint_dir` values that turn checkpoints off."""
DATA_HOME_ENV = "P2PDILOCO_DATA_HOME"
"""Environment variable naming the data directory (tests point it at a temporary one)."""
ANONYMOUS = "default"
"""Folder name of a peer without `--identity` (its peer id changes at every start)."""
MAX_ANONYMOUS_SLOTS = 16
"""Peers without identity of one run on one machine that each get a folder."""
OWNER_FILE = "owner.pid"


def data_home(environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """The user's p2pdiloco data directory (see the module docstring)."""
    if environ.get(DATA_HOME_ENV):
        return Path(environ[DATA_HOME_ENV]).expanduser()
    xdg = environ.get("XDG_DATA_HOME")
    base = (
        Path(xdg).expanduser()
        if xdg
        else Path(environ.get("HOME") or Path.home()) / ".local" / "share"
    )
    return base / "p2pdiloco"


def is_off(value: str) -> bool:
    """Whether `peer.checkpoint_dir = value` turns checkpoints off."""
    return value.strip().lower() in OFF


def concrete_dir(peer: PeerConfig) -> str:
    """`peer.checkpoint_dir` when it names a folder; "" when off or not resolved yet
    (`auto`): for code that only reads a folder that a `join` resolved."""
    value = peer.checkpoint_dir
    return "" if is_off(value) or value == AUTO else value


def run_dir(run: str, environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """The folder of one run's peers on this machine (`<data>/<run>`)."""
    return data_home(environ) / run


def _owner(directory: Path) -> int | None:
    """The pid of the live process (not this one) that owns `directory`, if any."""
    try:
        pid = int((directory / OWNER_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if pid == os.getpid() or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid  # alive, another user's
    return pid


def claim(directory: Path) -> int | None:
    """Make `directory` (created) this process's; returns the pid of another live owner
    instead (then nothing is written). ConfigError when it cannot be created."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"peer.checkpoint_dir: cannot create {directory}: {exc.strerror or exc}"
        ) from None
    other = _owner(directory)
    if other is not None:
        return other
    try:
        (directory / OWNER_FILE).write_text(f"{os.getpid()}\n")
    except OSError as exc:
        raise ConfigError(
            f"peer.checkpoint_dir: cannot write in {directory}: {exc.strerror or exc}"
        ) from None
    return None


def resolve(
    peer: PeerConfig, peer_id: str = "", environ: dict[str, str] | os._Environ = os.environ
) -> str:
    """The folder this peer checkpoints into ("" for none), claimed for this process.

    `peer_id` is the id of `peer.identity_path` (empty without one). ConfigError when an
    explicit or identity-named folder is being written by another live process (two
    processes with one identity or one folder would overwrite each other's state).
    """
    value = peer.checkpoint_dir
    if is_off(value):
        return ""
    if value != AUTO:
        directory = Path(value).expanduser()
        candidates = [directory]
    elif peer_id:
        candidates = [run_dir(peer.run, environ) / peer_id / "checkpoints"]
    else:
        names = [ANONYMOUS] + [f"{ANONYMOUS}-{i}" for i in range(2, MAX_ANONYMOUS_SLOTS + 1)]
        candidates = [run_dir(peer.run, environ) / name / "checkpoints" for name in names]
    for directory in candidates:
        other = claim(directory)
        if other is None:
            log.info("checkpoint dir=%s", directory)
            return str(directory)
    if len(candidates) > 1:
        log.warning("every default checkpoint folder of run=%s is in use: no checkpoints", peer.run)
        return ""
    raise ConfigError(
        f"peer.checkpoint_dir: {candidates[0]} is in use by another peer (pid {other}); "
        "give this one another --checkpoint-dir (or --identity)"
    )


def with_checkpoint_dir(config: RunConfig) -> RunConfig:
    """`config` with `peer.checkpoint_dir` resolved and claimed (`resolve`): the peer id of
    `peer.identity_path` names the default folder."""
    peer = config.peer
    peer_id = ""
    if peer.checkpoint_dir == AUTO and peer.identity_path:
        try:
            peer_id = load_or_create_identity(peer.identity_path).peer_id
        except (OSError, ValueError) as exc:
            raise ConfigError(f"peer.identity_path: {exc}") from None
    return dataclasses.replace(
        config, peer=dataclasses.replace(peer, checkpoint_dir=resolve(peer, peer_id))
    )


def checkpoint_location(peer: PeerConfig) -> str:
    """Where this peer's checkpoints will be, for checks before it starts (`doctor`): the
    folder, the run's folder in the data directory for "auto", "" when off. Claims nothing."""
    if is_off(peer.checkpoint_dir):
        return ""
    return str(run_dir(peer.run)) if peer.checkpoint_dir == AUTO else peer.checkpoint_dir
