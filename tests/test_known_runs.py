"""A run is joined by name from a plain install: the known runs ship inside the package,
`./bootstrap_peers/` still wins, and `p2pdiloco runs` lists what `join --run NAME` knows.

The last test builds the wheel, installs it into a fresh venv outside the repository and
runs the installed command there: what a volunteer gets from `pip install p2pdiloco`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from p2pdiloco.cli.main import main
from p2pdiloco.config import PeerConfig
from p2pdiloco.errors import NetworkSetupError
from p2pdiloco.identity import Identity
from p2pdiloco.transport.bootstrap import (
    SHIPPED_DIR,
    bootstrap_file_for,
    known_runs,
    read_bootstrap_file,
    resolve_initial_peers,
)
from p2pdiloco.trust.manifest import find_manifest, manifest_file_for, read_manifest

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["--set", "model.preset='tiny'", "--set", "sync.inner_steps=10"]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """A working directory outside the repository, with its own key store."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("P2PDILOCO_HOME", str(tmp_path / "home"))
    return tmp_path


def a_maddr() -> str:
    return f"/ip4/127.0.0.1/tcp/31337/p2p/{Identity.generate().peer_id}"


def test_every_shipped_run_file_is_valid_and_lives_in_the_package() -> None:
    files = sorted(SHIPPED_DIR.iterdir())
    assert any(f.name == "local.txt" for f in files)
    for path in files:
        assert path.suffix in (".toml", ".txt"), path
        if path.suffix == ".toml":
            read_manifest(path)  # signed and verified
        else:  # every line a valid multiaddr (the `local` example has none yet)
            try:
                read_bootstrap_file(path)
            except NetworkSetupError as exc:
                assert "lists no bootstrap peers" in str(exc)


def test_a_shipped_run_is_found_from_any_working_directory(elsewhere) -> None:
    assert bootstrap_file_for("local") == SHIPPED_DIR / "local.txt"
    assert "local" in known_runs()


def test_a_run_file_in_the_working_directory_wins_over_the_shipped_one(elsewhere) -> None:
    maddr = a_maddr()
    (elsewhere / "bootstrap_peers").mkdir()
    (elsewhere / "bootstrap_peers" / "local.txt").write_text(f"# mine\n{maddr}\n")
    assert resolve_initial_peers("local", None, None, new_run=False) == [maddr]
    assert known_runs()["local"][0] == Path("bootstrap_peers") / "local.txt"


def test_an_unknown_run_points_at_the_list_of_known_runs(elsewhere) -> None:
    with pytest.raises(NetworkSetupError, match="p2pdiloco runs"):
        resolve_initial_peers("no-such-run", None, None, new_run=False)
    assert manifest_file_for("no-such-run") is None
    assert manifest_file_for("../escape") is None


def test_runs_lists_shipped_and_local_runs_with_what_they_are(elsewhere, capsys) -> None:
    assert (
        main(
            [
                "run",
                "init",
                "mine",
                "--operator-key",
                str(elsewhere / "op.key"),
                "--bootstrap",
                a_maddr(),
                *TINY_RUN,
            ]
        )
        == 0
    )
    (elsewhere / "bootstrap_peers" / "broken.toml").write_text("[run]\nname = 'broken'\n")
    capsys.readouterr()
    assert main(["runs", "--json"]) == 0
    runs = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
    assert runs["local"]["kind"] == "open" and runs["local"]["file"] == str(
        SHIPPED_DIR / "local.txt"
    )
    assert runs["mine"]["kind"] == "manifest" and runs["mine"]["model"] == "tiny"
    assert runs["mine"]["bootstrap"] == 1
    assert "problem" in runs["broken"]
    assert main(["runs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("mine ") and "signed manifest, model tiny" in line for line in lines)
    assert any(line.startswith("local ") and "open run" in line for line in lines)


def test_manifest_flag_still_names_a_manifest_anywhere(elsewhere) -> None:
    out = elsewhere / "somewhere" / "mine.toml"
    assert (
        main(
            [
                "run",
                "init",
                "mine",
                "--operator-key",
                str(elsewhere / "op.key"),
                "--out",
                str(out),
                *TINY_RUN,
            ]
        )
        == 0
    )
    manifest = find_manifest(PeerConfig(manifest=str(out)))
    assert manifest is not None and manifest.name == "mine"


# --- the wheel, installed outside the repository ------------------------------------------


def _run(
    argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def borrowed_site_dirs() -> list[str]:
    """The folders this interpreter imports installed packages from, in its order: its
    own site-packages and those it inherits (a venv made with system site packages, a
    conda env, a uv venv, the user site). Not the checkout, not the standard library."""
    own = {str(Path(p).resolve()) for p in (sysconfig.get_paths()["stdlib"], REPO_ROOT)}
    dirs = []
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if path.name in ("site-packages", "dist-packages") and path.is_dir():
            if str(path) not in own and str(path) not in dirs:
                dirs.append(str(path))
    return dirs


def borrow_site_packages(python: Path) -> None:
    """Let the venv of `python` import this interpreter's dependencies.

    `venv.create(system_site_packages=True)` is not the way: it borrows the *base*
    interpreter's packages, and when this one is itself a virtualenv (a user's venv, uv,
    conda) the base has none of the project's dependencies. Instead a `.pth` file in the
    new venv lists this interpreter's site folders as plain paths: they come after the
    venv's own site-packages (so the wheel installed there is the `p2pdiloco` imported),
    and their own `.pth` files are not run, so an editable install of the checkout in
    this interpreter does not leak into the venv."""
    site_dir = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        REPO_ROOT,
        dict(os.environ),
    ).stdout.strip()
    assert site_dir, f"{python} names no site-packages"
    Path(site_dir, "_borrowed_from_the_test_interpreter.pth").write_text(
        "".join(f"{d}\n" for d in borrowed_site_dirs())
    )


@pytest.mark.timeout(240)
def test_the_installed_wheel_knows_the_shipped_runs_outside_the_repository(tmp_path) -> None:
    """About 10-20 s: a wheel built from a copy of the sources (the checkout is left as
    it is), a venv that borrows this interpreter's dependencies (torch is not installed
    again; `borrow_site_packages` says how, whatever installed this interpreter), and the
    installed `p2pdiloco` command run from a folder that is not the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["P2PDILOCO_HOME"] = str(tmp_path / "home")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(
        REPO_ROOT / "p2pdiloco", source / "p2pdiloco", ignore=shutil.ignore_patterns("__pycache__")
    )
    # a signed manifest shipped beside `local.txt`, as an operator's pull request adds one
    made = _run(
        [sys.executable, "-m", "p2pdiloco", "run", "init", "shipped-run", "--operator-key", str(tmp_path / "op.key"),
         "--out", str(source / "p2pdiloco" / "known_runs" / "shipped-run.toml"), *TINY_RUN],
        tmp_path, env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    built = _run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist")],
        tmp_path, env, timeout=180,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("p2pdiloco-*.whl")
    venv.create(tmp_path / "venv", with_pip=True)
    bin_dir = tmp_path / "venv" / ("Scripts" if os.name == "nt" else "bin")
    borrow_site_packages(bin_dir / "python")
    installed = _run(
        [
            str(bin_dir / "python"),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        tmp_path,
        env,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = tmp_path / "elsewhere"
    where.mkdir()
    imported = _run(
        [str(bin_dir / "python"), "-c", "import p2pdiloco; print(p2pdiloco.__file__)"], where, env
    )
    assert str(tmp_path / "venv") in imported.stdout, (
        imported.stdout + imported.stderr
    )  # not the checkout
    command = str(bin_dir / "p2pdiloco")

    listed = _run([command, "runs"], where, env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert any(line.startswith("local ") and "known_runs/local.txt" in line for line in lines), (
        listed.stdout
    )
    assert any(
        line.startswith("shipped-run ") and "signed manifest, model tiny" in line for line in lines
    )
    for run in ("local", "shipped-run"):
        helped = _run([command, "join", "--run", run, "--help"], where, env)
        assert helped.returncode == 0 and "--manifest" in helped.stdout, helped.stderr
    shown = _run([command, "run", "show", "shipped-run"], where, env)
    assert shown.returncode == 0 and "model tiny" in shown.stdout, shown.stderr
    # joining reads the shipped file (whose example line is still commented out)
    joined = _run([command, "join", "--run", "local"], where, env)
    assert joined.returncode == 2
    assert "known_runs/local.txt lists no bootstrap peers" in joined.stderr, joined.stderr
