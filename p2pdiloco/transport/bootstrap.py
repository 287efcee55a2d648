"""Bootstrap peer lists: `bootstrap_peers/<run>.txt`, one multiaddr a line, `#` comments.

A run is joined by name: its files (`<run>.toml`, a signed manifest, or `<run>.txt`, the
bootstrap list of an open run) are looked up in `run_folders()`: `./bootstrap_peers/`
first, then the runs shipped inside the package (`p2pdiloco/known_runs/`, package data, so
a plain `pip install` knows them), then a clone's own `bootstrap_peers/`. Every bad line
is an error naming the file and the line, so a typo never turns into a silent solo run.
"""

from __future__ import annotations

from pathlib import Path

from p2pdiloco.errors import NetworkSetupError

LOCAL_DIR = Path("bootstrap_peers")
"""Run files beside the user (relative to the working directory): they win."""
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "known_runs"
"""The known runs shipped with p2pdiloco (package data: in the wheel and in a clone)."""
CLONE_DIR = Path(__file__).resolve().parent.parent.parent / "bootstrap_peers"
"""A clone's `bootstrap_peers/` (absent from an installed wheel): runs an operator added
there by hand are found from any working directory."""
RUN_SUFFIXES = (".toml", ".txt")
"""A run's signed manifest, and the bootstrap list of an open run."""


def run_folders() -> list[Path]:
    """The folders run files are looked up in, first match wins (each folder once)."""
    folders: list[Path] = []
    seen: set[Path] = set()
    for folder in (LOCAL_DIR, SHIPPED_DIR, CLONE_DIR):
        key = folder.resolve()
        if key not in seen:
            seen.add(key)
            folders.append(folder)
    return folders


def check_run_name(run: str) -> bool:
    """A run name is a plain file name: no path separators, not hidden."""
    return bool(run) and "/" not in run and "\\" not in run and not run.startswith(".")


def run_file(run: str, suffix: str) -> Path | None:
    """The first `<run><suffix>` in `run_folders()`, or None."""
    if not check_run_name(run):
        return None
    for folder in run_folders():
        path = folder / f"{run}{suffix}"
        if path.is_file():
            return path
    return None


def known_runs() -> dict[str, list[Path]]:
    """Every run named by a file in `run_folders()`: its files, the one that wins first."""
    runs: dict[str, list[Path]] = {}
    for folder in run_folders():
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.suffix in RUN_SUFFIXES and path.is_file() and check_run_name(path.stem):
                runs.setdefault(path.stem, []).append(path)
    return dict(sorted(runs.items()))


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


def check_announce_maddr(text: str, where: str = "--announce-maddrs") -> str:
    """An address to announce: a multiaddr with an IP or DNS name and an explicit TCP port,
    without `/p2p/` (the node appends its own id). Checked before the transport starts:
    hivemind takes a malformed one for a slow start and fails only at its timeout."""
    from multiaddr import Multiaddr

    try:
        Multiaddr(text)
    except Exception as exc:  # noqa: BLE001 - the parser raises several types
        raise NetworkSetupError(f"{where}: {text!r} is not a valid multiaddr ({type(exc).__name__})") from None
    parts = text.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
        raise NetworkSetupError(f"{where}: {text!r} must look like /ip4/203.0.113.7/tcp/31337")
    if not parts[4].isdigit() or not 0 < int(parts[4]) < 65536:
        raise NetworkSetupError(f"{where}: {text!r} needs an explicit port in 1..65535 (the one peers dial)")
    if "/p2p/" in text:
        raise NetworkSetupError(f"{where}: {text!r}: leave out /p2p/...: the node appends its own peer id")
    return text


def read_bootstrap_file(path: Path) -> list[str]:
    """The multiaddrs listed in a bootstrap file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise NetworkSetupError(
            f"unknown run: {path} does not exist (`p2pdiloco runs` lists the known runs; "
            "pass --initial-peers, or --new-run to start one)"
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
    """Where the bootstrap file of `run` is: the first `<run>.txt` in `run_folders()`, else
    ./bootstrap_peers/<run>.txt (which does not exist: the error names it)."""
    if not check_run_name(run):
        raise NetworkSetupError(f"run name {run!r} must be a plain name like 'community-150m'")
    return run_file(run, ".txt") or LOCAL_DIR / f"{run}.txt"


def resolve_initial_peers(
    run: str, initial_peers: list[str] | None, bootstrap_file: Path | None, new_run: bool
) -> list[str]:
    """Initial peers from the command line, a bootstrap file, or the run's file."""
    if initial_peers:
        return [check_multiaddr(a, "--initial-peers") for a in initial_peers]
    if new_run:
        return []
    return read_bootstrap_file(bootstrap_file or bootstrap_file_for(run))
