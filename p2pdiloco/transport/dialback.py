"""`reach.dial_back`: a peer asks another to dial it back, and learns whether it can be dialled.

A peer behind NAT can dial out, so it joins the DHT and calls others without trouble; only
a fresh connection *to* it fails. It cannot see that from inside, so at join it sends a
few known peers its advertised addresses and each one tries a new connection to it
(`peer/reachability.py` asks and decides). The answer is yes, no, or "could not tell",
with a one-line reason, and nothing else.

A service that dials on request must not become a tool for scanning or flooding someone
else (libp2p's AutoNAT has the same rules):

- it dials only addresses that name the caller's own peer id (`.../p2p/<caller>`): the
  connection's handshake then proves the caller's key, so a foreign address fails there;
- it dials only direct addresses (no relay circuit) whose IP is the one the caller's own
  connection to us comes from: a caller can point it at its own host and nowhere else.
  A peer behind NAT advertises its private address and calls from the router's: "no";
- at most `MAX_DIALS` addresses, a token bucket per caller and one for everyone, at most
  `MAX_CONCURRENT` dials at once (a request waits `QUEUE_S` at most for its turn), each
  bounded by `DIAL_S` (a dial that could not finish in time is "could not tell", not
  "no": a slow dialer must not demote a reachable peer);
- the dial is a *new* connection from a separate dialer (the transport's `dial_fresh`):
  the caller's own connection to us would otherwise carry the "dial" and prove nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Sequence

import msgpack

from p2pdiloco.transport.base import Transport
from p2pdiloco.transport.ratelimit import RateLimiter

logger = logging.getLogger(__name__)

DIAL_BACK = "reach.dial_back"
"""The RPC's name."""
MAX_REQUEST_BYTES = 4096
MAX_ADDRS = 8
"""Addresses of a request looked at (the rest are ignored)."""
MAX_ADDR_CHARS = 256
MAX_DIALS = 4
"""Addresses dialled for one request, at most."""
DIAL_S = 10.0
"""Bound on one dial back, seconds (a separate dialer's start and its connection)."""
QUEUE_S = 10.0
"""Longest a request waits for one of the `MAX_CONCURRENT` dial slots, seconds."""
MAX_CONCURRENT = 2
"""Dials back running at once."""
PER_CALLER_BURST, PER_CALLER_PER_S = 2.0, 1 / 30
"""A caller may ask twice at once (a peer restarted at once asks again), then once in 30 s."""
OVERALL_BURST, OVERALL_PER_S = 8.0, 1 / 5
"""Everyone together: 8 at once (peers started together), then one every 5 s on average,
so free identities cannot keep this peer dialling."""


# --- the messages ------------------------------------------------------------------------


def encode_request(maddrs: Sequence[str]) -> bytes:
    """A dial-back request: the caller's advertised addresses (at most `MAX_ADDRS`)."""
    return msgpack.packb({"maddrs": [str(m) for m in list(maddrs)[:MAX_ADDRS]]}, use_bin_type=True)


def decode_request(raw: bytes) -> list[str]:
    """The addresses of a request; ValueError for anything malformed."""
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - any bytes from the network
        raise ValueError(f"not msgpack ({type(exc).__name__})") from None
    maddrs = body.get("maddrs") if isinstance(body, dict) else None
    if not isinstance(maddrs, list):
        raise ValueError("no list of maddrs")
    return [m for m in maddrs[:MAX_ADDRS] if isinstance(m, str) and len(m) <= MAX_ADDR_CHARS]


def encode_answer(reachable: bool | None, reason: str) -> bytes:
    """An answer: True (dialled you), False (could not), None (did not try), and why."""
    return msgpack.packb({"reachable": reachable, "reason": reason[:300]}, use_bin_type=True)


def decode_answer(raw: bytes) -> tuple[bool | None, str]:
    """(reachable, reason) of an answer; ValueError for anything malformed."""
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - any bytes from the network
        raise ValueError(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, dict) or body.get("reachable") not in (True, False, None):
        raise ValueError("not a dial-back answer")
    reason = body.get("reason")
    return body["reachable"], reason[:300] if isinstance(reason, str) else ""


# --- which addresses may be dialled (pure) -------------------------------------------------


def direct_host(maddr: str) -> str | None:
    """The host a direct address points at: its IP (normalised) for `/ip4|ip6/...`, the
    peer for the in-memory fake's `/memory/<id>`; None for anything else (DNS names,
    relay circuits, garbage), which is never dialled."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[0] != "" or "p2p-circuit" in parts:
        return None
    if parts[1] == "memory":
        return parts[2] or None
    if parts[1] not in ("ip4", "ip6"):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    if ip.version != (4 if parts[1] == "ip4" else 6) or ip.is_unspecified or ip.is_multicast:
        return None
    return str(ip)


LIBP2P_NOT_PUBLIC = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16",
        "169.254.0.0/16", "0.0.0.0/8", "192.0.0.0/26", "192.0.2.0/24", "192.88.99.0/24",
        "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
        "255.255.255.255/32", "::1/128", "fc00::/7", "fe80::/10", "ff00::/8", "2001:db8::/32",
    )
)  # fmt: skip
"""go-multiaddr's private and unroutable ranges (`manet.IsPublicAddr` is false in them)."""


def libp2p_public(maddr: str) -> bool:
    """Whether go-libp2p counts `maddr` public: a DNS name, or an IP outside its private
    and unroutable ranges. p2pd's autorelay announces relayed addresses only through
    relays it counts public, and its AutoNAT calls a host public only on such addresses."""
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("dns", "dns4", "dns6", "dnsaddr"):
        return True
    host = direct_host(maddr)
    if host is None or parts[1] == "memory":
        return False
    ip = ipaddress.ip_address(host)
    return not any(ip.version == net.version and ip in net for net in LIBP2P_NOT_PUBLIC)


def _has_port(maddr: str) -> bool:
    parts = maddr.split("/")
    if parts[1] == "memory":
        return True
    return (
        len(parts) > 4
        and parts[3] in ("tcp", "udp")
        and parts[4].isdigit()
        and 0 < int(parts[4]) < 65536
    )


def dialable(
    caller: str, requested: Sequence[str], observed: Sequence[str]
) -> tuple[list[str], str]:
    """The addresses of `requested` that may be dialled for `caller` (at most `MAX_DIALS`),
    and, when there is none, why: the caller's own (`.../p2p/<caller>`, no other peer id),
    direct, with a port, on a host that one of its connections comes from (`observed`)."""
    suffix = f"/p2p/{caller}"
    own = [m for m in requested if m.endswith(suffix) and m.count("/p2p/") == 1]
    if not own:
        return [], f"none of the addresses given names your peer id (…{suffix[-12:]})"
    direct = [m for m in own if direct_host(m) is not None and _has_port(m)]
    if not direct:
        return [], "no direct address given (relay circuits and DNS names are not dialled)"
    seen = {h for h in map(direct_host, observed) if h is not None}
    targets = list(dict.fromkeys(m for m in direct if direct_host(m) in seen))[:MAX_DIALS]
    if not targets:
        where = ", ".join(sorted(seen)) or "an address this peer cannot read"
        return [], (
            f"none of your addresses ({', '.join(direct_host(m) or '?' for m in direct[:3])}) is "
            f"where your connection comes from ({where}): behind NAT?"
        )
    return targets, ""


# --- the service ---------------------------------------------------------------------------


class DialBackService:
    """Answers `reach.dial_back` for `transport` (see the module for the rules)."""

    def __init__(
        self,
        transport: Transport,
        clock: Callable[[], float] = time.monotonic,
        dial_s: float = DIAL_S,
        queue_s: float = QUEUE_S,
        max_concurrent: int = MAX_CONCURRENT,
    ) -> None:
        self.transport = transport
        self.dial_s = dial_s
        self.queue_s = queue_s
        self.per_caller = RateLimiter(PER_CALLER_PER_S, PER_CALLER_BURST, clock)
        self.overall = RateLimiter(OVERALL_PER_S, OVERALL_BURST, clock)
        self._slots = asyncio.Semaphore(max_concurrent)

    async def handle(self, caller: str, request: bytes) -> bytes:
        """The RPC handler: dial `caller` back at its own addresses; bad input is an answer."""
        if not self.per_caller.allow(caller):
            return encode_answer(None, "rate limited: you asked too often, ask again later")
        if not self.overall.allow(""):
            return encode_answer(None, "busy: too many dial-back requests, ask again later")
        try:
            requested = decode_request(request)
        except ValueError as exc:
            return encode_answer(None, f"bad request: {exc}")
        observed = await self.transport.observed_addrs(caller)
        if not any(direct_host(m) for m in observed):
            return encode_answer(None, "cannot tell which address your connection comes from")
        targets, reason = dialable(caller, requested, observed)
        if not targets:
            logger.info("dial_back caller=%s reachable=False reason=%r", caller, reason)
            return encode_answer(False, reason)
        try:
            async with asyncio.timeout(self.queue_s):
                await self._slots.acquire()
        except TimeoutError:
            return encode_answer(None, "busy: no dial slot free, ask again later")
        try:
            async with asyncio.timeout(self.dial_s):
                problem = await self.transport.dial_fresh(caller, targets, self.dial_s)
        except TimeoutError:
            problem = None
        finally:
            self._slots.release()
        verdict = None if problem is None else not problem
        logger.info(
            "dial_back caller=%s reachable=%s targets=%s problem=%r",
            caller,
            verdict,
            targets,
            problem,
        )
        if problem is None:  # our dialer's failure or slowness says nothing about the caller
            return encode_answer(None, f"could not finish a dial within {self.dial_s:g} s")
        if problem:
            return encode_answer(False, f"could not dial {', '.join(targets)}: {problem}")
        return encode_answer(True, f"dialled {', '.join(targets)}")


async def serve_dial_back(transport: Transport) -> DialBackService:
    """Register `reach.dial_back` on `transport` (started; once), served by a new service."""
    service = DialBackService(transport)
    await transport.register_handler(DIAL_BACK, service.handle, max_request_bytes=MAX_REQUEST_BYTES)
    return service
