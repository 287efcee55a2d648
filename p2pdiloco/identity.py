"""Peer identities and signatures: Ed25519 keys whose public half *is* the peer id.

A libp2p peer id of an Ed25519 key is the identity multihash of the protobuf-encoded
public key, so anyone holding a peer id holds its public key: a record, heartbeat or
contribution signed by a peer can be checked against the id it claims, with no key
exchange and no registry. The key file is the libp2p protobuf private key that p2pd's
`-id` reads, so the transport and the signer share one identity.

Every signature covers a *domain* (what the bytes are, in which run) before the payload,
so bytes signed as a heartbeat can never be replayed as a round record or into another run.
Each kind of signed value is one `SignedKind`: its domain, its size bound, and the seal,
peek and open that every kind shares (opening returns the reason for a refusal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import base58
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# libp2p protobuf: KeyType field (1, varint) = Ed25519 (1), Data field (2, bytes).
_PUBLIC_PREFIX = b"\x08\x01\x12\x20"  # Ed25519, 32-byte public key
_PRIVATE_PREFIX = b"\x08\x01\x12\x40"  # Ed25519, 64 bytes: seed || public key
_IDENTITY_MULTIHASH = b"\x00\x24"  # identity hash of the 36-byte encoded public key
_SIGNED_PREFIX = b"p2pdiloco-signed-v1\x00"
SIGNATURE_BYTES = 64
MAX_SEALED_BYTES = 1 << 20
"""Largest sealed value accepted (heartbeats and records are a few KB)."""


class SealError(ValueError):
    """Sealed bytes that are malformed, too large, or not signed by the claimed peer."""


def peer_id_of(public_key: bytes) -> str:
    """The base58 libp2p peer id of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise ValueError("an Ed25519 public key has 32 bytes")
    return base58.b58encode(_IDENTITY_MULTIHASH + _PUBLIC_PREFIX + public_key).decode()


@lru_cache(maxsize=4096)
def _public_key(peer_id: str) -> Ed25519PublicKey | None:
    if not isinstance(peer_id, str) or not 40 <= len(peer_id) <= 60:
        return None
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        return None
    head = _IDENTITY_MULTIHASH + _PUBLIC_PREFIX
    if len(raw) != len(head) + 32 or not raw.startswith(head):
        return None
    return Ed25519PublicKey.from_public_bytes(raw[len(head) :])


def is_peer_id(value: object) -> bool:
    """True for a well-formed Ed25519 peer id (the only kind a run accepts)."""
    return isinstance(value, str) and _public_key(value) is not None


def _signed_bytes(domain: str, payload: bytes) -> bytes:
    return _SIGNED_PREFIX + domain.encode() + b"\x00" + payload


@dataclass(frozen=True)
class Identity:
    """A peer's private key and the peer id it proves."""

    key: Ed25519PrivateKey
    peer_id: str

    @classmethod
    def generate(cls) -> Identity:
        return cls.from_key(Ed25519PrivateKey.generate())

    @classmethod
    def from_key(cls, key: Ed25519PrivateKey) -> Identity:
        public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return cls(key, peer_id_of(public))

    def sign(self, domain: str, payload: bytes) -> bytes:
        """A 64-byte signature of `payload` in `domain`."""
        return self.key.sign(_signed_bytes(domain, payload))

    def seal(self, domain: str, payload: bytes) -> bytes:
        """`payload` with this peer's signature attached (see `unseal`)."""
        return msgpack.packb([payload, self.sign(domain, payload)], use_bin_type=True)

    def to_libp2p_bytes(self) -> bytes:
        """The libp2p protobuf private key (what p2pd's `-id` reads)."""
        seed = self.key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        public = self.key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return _PRIVATE_PREFIX + seed + public


def verify(peer_id: str, domain: str, payload: bytes, signature: bytes) -> bool:
    """True when `signature` is `peer_id`'s signature of `payload` in `domain`."""
    public = _public_key(peer_id)
    if public is None or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public.verify(signature, _signed_bytes(domain, payload))
    except InvalidSignature:
        return False
    return True


def _split(sealed: object, max_bytes: int) -> tuple[bytes, bytes]:
    if not isinstance(sealed, bytes | bytearray) or len(sealed) > max_bytes:
        raise SealError("not a sealed value of bounded size")
    try:
        pair = msgpack.unpackb(bytes(sealed), raw=False, max_bin_len=max_bytes, max_array_len=2)
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any decode failure is a rejection
        raise SealError(f"undecodable sealed value: {type(exc).__name__}") from None
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, bytes) for p in pair)):
        raise SealError("sealed value is not [payload, signature]")
    return pair[0], pair[1]


def peek(sealed: object, max_bytes: int = MAX_SEALED_BYTES) -> bytes:
    """The payload of `sealed`, NOT verified: only to learn who must have signed it."""
    return _split(sealed, max_bytes)[0]


def unseal(peer_id: str, domain: str, sealed: object, max_bytes: int = MAX_SEALED_BYTES) -> bytes:
    """The payload of `sealed` if `peer_id` signed it in `domain`; raises `SealError`."""
    payload, signature = _split(sealed, max_bytes)
    if not verify(peer_id, domain, payload, signature):
        raise SealError(f"bad signature for {peer_id[-8:] if isinstance(peer_id, str) else '?'}")
    return payload


@dataclass(frozen=True)
class SignedKind:
    """One kind of value peers sign (round records, heartbeats, contributions, notices,
    certificates): its domain `<name>/<run>` and the largest sealed value accepted.

    Opening never raises: untrusted bytes come back as the payload or a reason (a string).
    """

    name: str
    """First part of the domain: what the signed bytes are."""
    max_bytes: int = MAX_SEALED_BYTES
    """Largest sealed value of this kind accepted (bytes)."""

    def domain(self, run: str) -> str:
        """The domain a value of this kind is signed in for `run`."""
        return f"{self.name}/{run}"

    def seal(
        self, identity: Identity, run: str, payload: bytes, signer: str | None = None
    ) -> bytes:
        """`payload` signed by `identity` for `run`. `signer`, when the payload names the
        peer that signs it, must be `identity` (a value signed by another is a bug)."""
        if signer is not None and signer != identity.peer_id:
            raise ValueError(
                f"a {self.name} value naming {signer[-8:]} is signed by that peer only"
            )
        return identity.seal(self.domain(run), payload)

    def open(
        self, signer: str, run: str, sealed: object, max_bytes: int | None = None
    ) -> bytes | str:
        """The payload of `sealed` if `signer` signed it as this kind for `run`, else the
        reason. `max_bytes` overrides the kind's bound (a contribution's is the run's)."""
        try:
            return unseal(signer, self.domain(run), sealed, self._bound(max_bytes))
        except SealError as exc:
            return str(exc)

    def peek(self, sealed: object, max_bytes: int | None = None) -> bytes | str:
        """The payload of `sealed` NOT verified (only to learn who must have signed it), or
        the reason it is not a sealed value."""
        try:
            return peek(sealed, self._bound(max_bytes))
        except SealError as exc:
            return str(exc)

    def _bound(self, max_bytes: int | None) -> int:
        return self.max_bytes if max_bytes is None else max_bytes


def parse_libp2p_private_key(data: bytes) -> Identity:
    """An identity from a libp2p protobuf Ed25519 private key; raises ValueError otherwise."""
    if len(data) != len(_PRIVATE_PREFIX) + 64 or not data.startswith(_PRIVATE_PREFIX):
        raise ValueError("not a libp2p Ed25519 private key (only Ed25519 identities are supported)")
    seed, public = data[4:36], data[36:]
    identity = Identity.from_key(Ed25519PrivateKey.from_private_bytes(seed))
    if identity.peer_id != peer_id_of(public):
        raise ValueError("key file is inconsistent: its public half does not match its seed")
    return identity


def load_identity(path: str | os.PathLike) -> Identity:
    """Read an identity file; raises ValueError (with the path) when it is not one."""
    with open(path, "rb") as f:
        data = f.read(4096)
    try:
        return parse_libp2p_private_key(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def save_identity(identity: Identity, path: str | os.PathLike) -> None:
    """Write an identity file, mode 0600, atomically (never a half-written key)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(identity.to_libp2p_bytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_or_create_identity(path: str | os.PathLike) -> Identity:
    """The identity in `path`, created there first if the file does not exist."""
    if not os.path.exists(path):
        save_identity(Identity.generate(), path)
    return load_identity(path)
