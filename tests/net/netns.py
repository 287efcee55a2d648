"""A small internet made of Linux network namespaces: a public LAN and a home router doing NAT.

    public hosts ──┐                                   ┌── private host 0
    (one netns     ├── bridge (switch netns) ── router ─┤   (192.168.x.10+i, default
     each)        ─┘      192.0.0.64/26      wan│NAT lan└── private host 1   route: router)

The router masquerades the private subnet behind its public address (iptables
`MASQUERADE`) and drops every connection that starts on the public side, as a home
router does; the public hosts have no route to the private subnet at all. A private host
can therefore dial any public host, and no public host can dial it: the NAT a volunteer
sits behind.

Everything is made by the test and removed by `NatLab.close()` (a context manager), even
when a test fails: the processes left in the namespaces are killed by pid (the harness's
reaper has killed the peers' groups already), then the namespaces are deleted, which
deletes their links. Needs root and iproute2; `netns_problem()` says why not, for a skip.
Namespace and link names carry a per-lab tag, so labs of parallel tests never collide.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from .harness import REPO_ROOT, PeerProcess

__all__ = ["Host", "NatLab", "launch_in", "netns_problem"]

PUBLIC_NET, PUBLIC_FIRST, PUBLIC_MASK = "192.0.0", 64, 26
"""The public LAN, 192.0.0.64/26 (each lab has its own namespaces, so labs may share it):
an IETF protocol block that no internet route carries (RFC 6890), which go-libp2p yet
counts public (its unroutable ranges stop at 192.0.0.0/26), so p2pd behaves as on the
internet: AutoNAT finds public hosts public, and autorelay announces the relayed
addresses it takes on them. The namespaces have no link to the host's own network."""
PRIVATE_NET = "192.168.231"
"""The home network behind the router, a /24."""
ROUTER_WAN_IP = f"{PUBLIC_NET}.{PUBLIC_FIRST + 2}"
"""The router's public address: the source every private host's connections show."""
COMMAND_S = 20.0
"""Deadline of one `ip` / `iptables` command."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_S, check=check)


def netns_problem() -> str:
    """Why this machine cannot build a lab ("" when it can): not root, no `ip`, no iptables,
    or a namespace cannot be made and entered."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"pdprobe{uuid.uuid4().hex[:6]}"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()[:200]}"
        entered = _run("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up", check=False)
        if entered.returncode != 0:
            return f"`ip netns exec` failed: {entered.stderr.strip()[:200]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` is unavailable: {exc}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return ""


@dataclass(frozen=True)
class Host:
    """One machine of the lab: a network namespace with one address."""

    netns: str
    ip: str

    def argv(self, args: Sequence[str]) -> list[str]:
        """`args` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *map(str, args)]


class NatLab:
    """`num_public` hosts on a public LAN, and `num_private` hosts behind one NAT router."""

    def __init__(self, num_public: int, num_private: int) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.namespaces: list[str] = []
        self.public = [
            Host(self._name(f"p{i}"), f"{PUBLIC_NET}.{PUBLIC_FIRST + 10 + i}") for i in range(num_public)
        ]
        self.private = [
            Host(self._name(f"n{i}"), f"{PRIVATE_NET}.{10 + i}") for i in range(num_private)
        ]
        self.router = Host(self._name("rt"), ROUTER_WAN_IP)
        self.switch = self._name("sw")

    def _name(self, role: str) -> str:
        return f"pd{self.tag}{role}"

    def __enter__(self) -> NatLab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ---- building ------------------------------------------------------------------------

    def build(self) -> None:
        """Make the namespaces, links, addresses, routes and the router's NAT rules."""
        for netns in [
            self.switch,
            self.router.netns,
            *(h.netns for h in self.public + self.private),
        ]:
            _run("ip", "netns", "add", netns)
            self.namespaces.append(netns)
            self._in(netns, "ip", "link", "set", "lo", "up")
        self._bridge(self.switch, "br0")
        for i, host in enumerate(self.public):
            self._wire(host.netns, "eth0", f"{host.ip}/{PUBLIC_MASK}", self.switch, f"v{i}", "br0")
        self._wire(self.router.netns, "wan", f"{ROUTER_WAN_IP}/{PUBLIC_MASK}", self.switch, "vrt", "br0")
        self._bridge(self.router.netns, "lan", f"{PRIVATE_NET}.1/24")
        for i, host in enumerate(self.private):
            self._wire(host.netns, "eth0", f"{host.ip}/24", self.router.netns, f"v{i}", "lan")
            self._in(host.netns, "ip", "route", "add", "default", "via", f"{PRIVATE_NET}.1")
        rt = self.router.netns
        self._in(rt, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._in(rt, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{PRIVATE_NET}.0/24",
                 "-o", "wan", "-j", "MASQUERADE")  # fmt: skip
        # a home router: answers to connections from inside pass, new ones from outside do not
        self._in(rt, "iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack",
                 "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        self._in(rt, "iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP")

    def _in(self, netns: str, *argv: str) -> None:
        _run("ip", "netns", "exec", netns, *argv)

    def _bridge(self, netns: str, name: str, address: str = "") -> None:
        self._in(netns, "ip", "link", "add", name, "type", "bridge")
        if address:
            self._in(netns, "ip", "addr", "add", address, "dev", name)
        self._in(netns, "ip", "link", "set", name, "up")

    def _wire(self, netns: str, dev: str, address: str, hub: str, port: str, bridge: str) -> None:
        """A veth from `dev` (with `address`) in `netns` to `port` on `bridge` in `hub`."""
        veth = ["type", "veth", "peer", "name", port, "netns", hub]
        _run("ip", "link", "add", "name", dev, "netns", netns, *veth)
        self._in(netns, "ip", "addr", "add", address, "dev", dev)
        self._in(netns, "ip", "link", "set", dev, "up")
        self._in(hub, "ip", "link", "set", port, "master", bridge)
        self._in(hub, "ip", "link", "set", port, "up")

    # ---- removing ------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what still runs in the lab's namespaces, then delete them (and their links).
        Safe to call twice; never raises."""
        for netns in self.namespaces:
            try:
                listed = _run("ip", "netns", "pids", netns, check=False).stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                listed = []
            for pid in listed:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ValueError, OSError):
                    pass
        for netns in reversed(self.namespaces):
            try:
                _run("ip", "netns", "del", netns, check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.namespaces.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this lab that still exist (empty after `close()`)."""
        listed = _run("ip", "netns", "list", check=False).stdout
        return [line.split()[0] for line in listed.splitlines() if line.startswith(f"pd{self.tag}")]


def launch_in(host: Host, args: Sequence[str], name: str) -> PeerProcess:
    """Launch `python <args...>` inside `host`'s namespace, as the harness launches a peer
    (its own process group, events read from stdout), without waiting for it."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return PeerProcess.spawn(
        host.argv([sys.executable, *args]),
        name,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": pythonpath},
        stdin=True,
    )
