"""Bootstrap peer lists: `bootstrap_peers/<run>.txt`, one multiaddr a line, `#` comments.

A run is joined by name: the file is looked up in `./bootstrap_peers/` first, then in the
`bootstrap_peers/` folder shipped beside the package. Every bad line is an error naming
the file and the line, so a typo never turns into a silent solo run.
"""

from __future__ import annotations

from pathlib import Path

from p2pdiloco.errors import NetworkSetupError

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "bootstrap_peers"


def check_multiaddr(text: str, where: str) -> str:
    """A bootstrap multiaddr must parse and name its peer (`.../p2p/<peer id>`)."""
    from multiaddr import Multiaddr

    try:
        Multiaddr(text)
    except Exception as exc:  # noqa: BLE001 - the parser raises several types
        raise NetworkSetupError(f"{where}: {text!r} is not a valid multiaddr ({exc})") from None
    if "/p2p/" not in text:
        raise NetworkSetupError(
            f"{where}: {text!r} lacks its peer id: it must end in /p2p/12D3Koo..."
        )
    return text


def read_bootstrap_file(path: Path) -> list[str]:
    """The multiaddrs listed in a bootstrap file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise NetworkSetupError(
            f"unknown run: {path} does not exist (pass --initial-peers, or --new-run to start one)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NetworkSetupError(
            f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    addrs = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if text:
            addrs.append(check_multiaddr(text, f"{path}:{number}"))
    if not addrs:
        raise NetworkSetupError(
            f"{path} lists no bootstrap peers: run `p2pdiloco bootstrap` and add the line it prints"
        )
    return addrs


def bootstrap_file_for(run: str) -> Path:
    """Where the bootstrap file of `run` is: ./bootstrap_peers/<run>.txt, else the shipped one."""
    if not run or "/" in run or run.startswith("."):
        raise NetworkSetupError(f"run name {run!r} must be a plain name like 'community-150m'")
    local = Path("bootstrap_peers") / f"{run}.txt"
    if local.exists():
        return local
    shipped = SHIPPED_DIR / f"{run}.txt"
    return shipped if shipped.exists() else local


def resolve_initial_peers(
    run: str, initial_peers: list[str] | None, bootstrap_file: Path | None, new_run: bool
) -> list[str]:
    """Initial peers from the command line, a bootstrap file, or the run's file."""
    if initial_peers:
        return [check_multiaddr(a, "--initial-peers") for a in initial_peers]
    if new_run:
        return []
    return read_bootstrap_file(bootstrap_file or bootstrap_file_for(run))
