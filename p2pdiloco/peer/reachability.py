"""Can other peers dial this one? Asked once at join; a peer nobody can dial goes on as a
client-mode learner by itself.

Most volunteers sit behind a home NAT. They can dial out, so they join the DHT and call
other peers without a hitch, and nothing they see tells them that nobody can dial *them*.
Left a server, such a peer is a DHT node that others route requests to, a donor
candidate and, in an open run, a synchronizer candidate, and every one of those calls
fails. So, once its transport is up, a peer asks up to `ASK_PEERS` of its initial peers
(the run's bootstrap list, then its address book) to dial it back at its advertised
addresses (`reach.dial_back`, `transport/dialback.py`), and `decide`s:

- one "yes" is enough: reachable (a lying "no" cannot demote a peer someone dialled);
- a "no" and no "yes": unreachable;
- no definite answer (the run's first peer has nobody to ask; peers of an older version,
  busy or rate-limited ones cannot tell): it stays as configured, a server.

With `peer.reachability = "auto"` (the default), an unreachable peer goes on in client
mode: its transport restarts in client mode (hivemind: a DHT node cannot change mode, so
the DHT process and p2pd start again under the same identity) and its heartbeats say
`client_mode`, which keeps it out of `synchronizer_candidates`, `holder_order` and the
donors on every peer. `public` skips the check; `client` (or `client_mode`) starts in
client mode without asking. See docs/join.md, "NAT and reachability".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any

from p2pdiloco.config import PeerConfig, RunConfig
from p2pdiloco.peer.clock import peer_ids_of
from p2pdiloco.peer.preflight import Finding, address_scope
from p2pdiloco.transport.base import Transport, TransportError
from p2pdiloco.transport.dialback import (
    DIAL_BACK,
    DIAL_S,
    QUEUE_S,
    decode_answer,
    encode_request,
)

log = logging.getLogger(__name__)

ASK_PEERS = 3
"""Peers asked to dial back, at most."""
ASK_S = DIAL_S + QUEUE_S + 10.0
"""Deadline of one question: the answerer may wait for a dial slot, then dials."""
MAX_ANSWER_BYTES = 1024


@dataclass(frozen=True)
class Answer:
    """What one asked peer said: True (it dialled us), False (it could not), None (it did
    not try, or did not answer), and why."""

    peer_id: str
    reachable: bool | None
    reason: str


@dataclass(frozen=True)
class Verdict:
    """The decision: whether this peer counts as reachable, and the one-line reason."""

    reachable: bool
    reason: str
    answers: tuple[Answer, ...] = ()

    @property
    def checked(self) -> bool:
        """Whether some peer gave a definite answer (else the verdict is the default)."""
        return any(a.reachable is not None for a in self.answers)


def decide(answers: Sequence[Answer]) -> Verdict:
    """Reachable if any peer dialled us back; unreachable if one could not and none
    could; otherwise (nobody asked, nobody could tell) reachable by default."""
    answers = tuple(answers)
    yes = [a for a in answers if a.reachable is True]
    no = [a for a in answers if a.reachable is False]
    if yes:
        return Verdict(True, f"…{yes[0].peer_id[-6:]} dialled it back ({yes[0].reason})", answers)
    if no:
        return Verdict(
            False,
            f"{len(no)} of {len(answers)} peers asked could not dial it back: {no[0].reason}",
            answers,
        )
    if not answers:
        return Verdict(
            True, "no other peer to ask (the run's first peer): counted reachable", answers
        )
    why = answers[0].reason or "no answer"
    return Verdict(
        True, f"unverified: none of the {len(answers)} peers asked could tell ({why})", answers
    )


def wants_client_mode(peer: PeerConfig) -> bool:
    """Whether this peer starts in client mode without asking (`--client-mode`, or
    `--reachability client`)."""
    return peer.client_mode or peer.reachability == "client"


def listen_warning(host: str, initial_peers: Sequence[str]) -> Finding | None:
    """A warning when the peer listens on loopback only while its initial peers are on
    other machines: they can be dialled, it cannot (None when that is not the case)."""
    try:
        loopback = host == "localhost" or ip_address(host).is_loopback
    except ValueError:
        return None
    elsewhere = [m for m in initial_peers if address_scope(m) != "loopback"]
    if not loopback or not elsewhere:
        return None
    return Finding(
        "listen",
        "warn",
        f"you listen on {host} only, but your initial peers are on other machines "
        f"({elsewhere[0]}{f' +{len(elsewhere) - 1}' if len(elsewhere) > 1 else ''}): none of them can dial you",
        "to serve the run, --host 0.0.0.0 (and --announce-maddrs /ip4/<public ip>/tcp/<port>); "
        "else this peer goes on as a client-mode learner",
    )


def reach_finding(verdict: Verdict) -> Finding:
    """The doctor's line for a dial-back check."""
    if not verdict.checked:
        return Finding("dial-back", "skip", verdict.reason)
    if verdict.reachable:
        return Finding("dial-back", "ok", f"the run's peers can dial you: {verdict.reason}")
    return Finding(
        "dial-back",
        "warn",
        f"the run's peers cannot dial you: {verdict.reason}",
        "`join` still works: you go on as a client-mode learner (never synchronizer); to serve, "
        "forward your port and pass --announce-maddrs /ip4/<public ip>/tcp/<port>",
    )


def peers_to_ask(transport: Transport, initial_peers: Sequence[str]) -> list[str]:
    """Up to `ASK_PEERS` peer ids from the transport's initial peers (the run's list and
    the address book), else from `initial_peers`, never this peer's own."""
    known = list(getattr(transport, "initial_peers", None) or initial_peers)
    return [p for p in peer_ids_of(known) if p != transport.peer_id][:ASK_PEERS]


async def ask(transport: Transport, peer_id: str, maddrs: list[str], timeout_s: float) -> Answer:
    """Ask `peer_id` to dial us back at `maddrs`; never raises."""
    try:
        raw = await transport.call(
            peer_id,
            DIAL_BACK,
            encode_request(maddrs),
            timeout_s,
            max_response_bytes=MAX_ANSWER_BYTES,
        )
        reachable, reason = decode_answer(raw)
    except TransportError as exc:
        return Answer(peer_id, None, (str(exc).splitlines() or [type(exc).__name__])[0][:200])
    except ValueError as exc:
        return Answer(peer_id, None, f"bad answer: {exc}")
    return Answer(peer_id, reachable, reason)


async def check_reachability(
    transport: Transport, peer_ids: Sequence[str], timeout_s: float = ASK_S
) -> Verdict:
    """Ask every peer of `peer_ids` at once to dial us back; their answers decided."""
    maddrs = transport.visible_maddrs()
    answers = await asyncio.gather(*(ask(transport, p, maddrs, timeout_s) for p in peer_ids))
    return decide(answers)


async def settle_reachability(
    config: RunConfig,
    transport: Transport,
    emit: Callable[[dict[str, Any]], None] = lambda event: None,
) -> RunConfig:
    """`config` as this peer goes on with it: `peer.client_mode` set when it is configured
    a client, or found unreachable in `auto` mode (its transport then restarted in client
    mode). Emits one `reachability` event. Bounded by `ASK_S` plus a transport restart."""
    peer = config.peer
    warning = listen_warning(peer.host, peer.initial_peers)
    if warning is not None:
        log.warning("listen_scope %s", warning.line())
    if wants_client_mode(peer):
        emit(
            {"event": "reachability", "mode": "client", "client_mode": True, "reason": "configured"}
        )
        return _as_client(config)
    if peer.reachability == "public":
        emit(
            {
                "event": "reachability",
                "mode": "public",
                "client_mode": False,
                "reason": "configured",
            }
        )
        log.info("reachability=public (configured): not checked")
        return config
    verdict = await check_reachability(transport, peers_to_ask(transport, peer.initial_peers))
    emit({"event": "reachability", "mode": "auto", "client_mode": not verdict.reachable,
          "reachable": verdict.reachable, "reason": verdict.reason,
          "asked": [a.peer_id for a in verdict.answers]})  # fmt: skip
    if verdict.reachable:
        log.info("reachability=reachable reason=%r", verdict.reason)
        return config
    log.warning(
        "reachability=unreachable: going on as a client-mode learner (never synchronizer, holder "
        "or donor) because %s; `--reachability public` overrides this",
        verdict.reason,
    )
    if not await transport.restart_as_client():
        log.warning("this transport cannot switch to client mode: it keeps serving as it is")
    return _as_client(config)


def _as_client(config: RunConfig) -> RunConfig:
    if config.peer.client_mode:
        return config
    return dataclasses.replace(config, peer=dataclasses.replace(config.peer, client_mode=True))
