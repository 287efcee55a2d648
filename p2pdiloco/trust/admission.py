"""Who may do what in a run: operator certificates and the admission rules built on them.

The run's operator holds one Ed25519 key; its peer id is written in the run manifest.
A certificate is a small value sealed by that key: (run, peer, role, expires_at). The
admission rules of the manifest say, per role, whether anyone is admitted (`open`) or
only peers with an unexpired certificate for that role (`certified`); learners can also
be admitted by an `allowlist` of peer ids. Everything here is pure: the caller passes
`now` (DHT time) and the certificate bytes it was shown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from p2pdiloco.identity import Identity, SignedKind, is_peer_id

ROLES = ("synchronizer", "learner")
SYNCHRONIZER_MODES = ("open", "certified")
LEARNER_MODES = ("open", "certified", "allowlist")
MAX_CERTIFICATE_BYTES = 1024
MAX_CERTIFICATES = 4
"""Certificates a peer may present (one per role is enough)."""


CERTIFICATES = SignedKind("certificate", MAX_CERTIFICATE_BYTES)
"""Certificates, signed by the run's operator."""


@dataclass(frozen=True)
class Certificate:
    """The operator's statement that `peer` may act as `role` in `run` until `expires_at`."""

    run: str
    peer: str
    role: str
    expires_at: float


def issue_certificate(operator: Identity, cert: Certificate) -> bytes:
    """The sealed certificate bytes a peer presents (in its heartbeat and round records)."""
    payload = msgpack.packb([cert.run, cert.peer, cert.role, float(cert.expires_at)], use_bin_type=True)
    return CERTIFICATES.seal(operator, cert.run, payload)


def read_certificate(raw: object, operator: str, run: str) -> Certificate | str:
    """The certificate in `raw` if `operator` sealed it for `run`, else the reason (a string)."""
    payload = CERTIFICATES.open(operator, run, raw)
    if isinstance(payload, str):
        return f"certificate: {payload}"
    try:
        fields = msgpack.unpackb(payload, raw=False, max_array_len=4, max_str_len=256)
    except Exception as exc:  # noqa: BLE001 - signed but malformed: still a rejection
        return f"certificate: undecodable ({type(exc).__name__})"
    if not (isinstance(fields, list) and len(fields) == 4):
        return "certificate: not [run, peer, role, expires_at]"
    cert_run, peer, role, expires_at = fields
    if cert_run != run or role not in ROLES or not is_peer_id(peer):
        return "certificate: wrong run, role or peer id"
    if not isinstance(expires_at, float) or not math.isfinite(expires_at):
        return "certificate: expiry is not a finite time"
    return Certificate(cert_run, peer, role, expires_at)


@dataclass(frozen=True)
class Admission:
    """A run's admission rules (from its manifest; `open` everywhere for a local run)."""

    synchronizers: str = "open"
    learners: str = "open"
    operator: str = ""
    """Peer id of the operator key that signs certificates (required unless all open)."""
    allowlist: frozenset[str] = field(default_factory=frozenset)
    """Learners admitted without a certificate when `learners = "allowlist"`."""

    def __post_init__(self) -> None:
        if self.synchronizers not in SYNCHRONIZER_MODES:
            raise ValueError(f"synchronizers must be one of {SYNCHRONIZER_MODES}")
        if self.learners not in LEARNER_MODES:
            raise ValueError(f"learners must be one of {LEARNER_MODES}")
        needs_operator = self.synchronizers == "certified" or self.learners == "certified"
        if needs_operator and not is_peer_id(self.operator):
            raise ValueError("a certified admission needs the operator's peer id")

    @property
    def is_open(self) -> bool:
        return self.synchronizers == "open" and self.learners == "open"

    def certificate_expiry(
        self, run: str, peer: str, role: str, certificates: Sequence[object]
    ) -> float | str:
        """The latest expiry among the certificates in `certificates` the operator sealed
        for `peer` as `role` in `run`, or why none is (a string). Checks the signatures:
        callers that judge often cache this by (peer, certificates)."""
        reason = f"no {role} certificate"
        if not isinstance(certificates, list | tuple):
            return reason
        latest: float | None = None
        for raw in certificates[:MAX_CERTIFICATES]:
            cert = read_certificate(raw, self.operator, run)
            if isinstance(cert, str):
                reason = cert
            elif cert.peer != peer or cert.role != role:
                reason = f"certificate is for {cert.peer[-8:]} as {cert.role}"
            else:
                latest = cert.expires_at if latest is None else max(latest, cert.expires_at)
        return reason if latest is None else latest

    def _certified(
        self, run: str, peer: str, role: str, certificates: Sequence[object], now: float
    ) -> str | None:
        expiry = self.certificate_expiry(run, peer, role, certificates)
        if isinstance(expiry, str):
            return expiry
        return "certificate expired" if expiry < now else None

    def synchronizer_refusal(
        self, run: str, peer: str, certificates: Sequence[object], now: float
    ) -> str | None:
        """Why `peer` may not synchronize (None: it may)."""
        if self.synchronizers == "open":
            return None
        return self._certified(run, peer, "synchronizer", certificates, now)

    def learner_refusal(
        self, run: str, peer: str, certificates: Sequence[object], now: float
    ) -> str | None:
        """Why `peer`'s contributions are not admitted (None: they are)."""
        if self.learners == "open":
            return None
        if self.learners == "allowlist":
            return None if peer in self.allowlist else "learner not on the run's allowlist"
        return self._certified(run, peer, "learner", certificates, now)
