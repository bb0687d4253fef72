"""A peer's identity: one ed25519 key pair, kept across restarts.

The peer id is derived from the public key (the first 20 bytes of its SHA-256, as 40 hex
characters), so a DHT record can carry its signer's public key and anyone can check both the
signature and that the record speaks for the peer id it names. The same 20 bytes are the
node's Kademlia id (Maymounkov & Mazières, section 2.1: 160-bit identifiers), which keeps a
restarted peer at the same place in everyone's routing tables.

The private key is stored raw (32 bytes) in ``<state_dir>/identity.key`` with mode 0600. It is
created atomically (written to a temporary file, then hard-linked into place), so two daemons
started at once on the same state directory end up sharing one key instead of each keeping a
different one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from swarmd.errors import ConfigError

__all__ = [
    "IDENTITY_FILE",
    "PEER_ID_BYTES",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "peer_id_of",
    "verify",
]

log = logging.getLogger(__name__)

IDENTITY_FILE = "identity.key"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PEER_ID_BYTES = 20  # 160 bits: the size of a Kademlia node id


def peer_id_of(public_key: bytes) -> str:
    """The peer id of an ed25519 public key: hex of the first 20 bytes of its SHA-256."""
    return hashlib.sha256(public_key).digest()[:PEER_ID_BYTES].hex()


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s ed25519 signature of ``data``; never raises."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An ed25519 key pair and the peer id derived from it."""

    __slots__ = ("_private", "public_key_bytes", "peer_id")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key_bytes: bytes = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.peer_id: str = peer_id_of(self.public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh, unsaved identity (tests, throwaway nodes)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        """The identity whose raw 32-byte private key is ``raw``."""
        if len(raw) != 32:
            raise ValueError(f"an ed25519 private key is 32 bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    @classmethod
    def load_or_create(cls, state_dir: Path) -> Identity:
        """This peer's identity from ``state_dir``, creating (and saving) one on the first run."""
        state_dir = Path(state_dir)
        path = state_dir / IDENTITY_FILE
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not path.exists():
                cls._create(path)
            raw = path.read_bytes()
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError as exc:
            raise ConfigError(f"cannot use the identity file {path}: {exc}") from exc
        if len(raw) != 32:
            raise ConfigError(
                f"the identity file {path} is corrupt ({len(raw)} bytes, expected a raw 32-byte "
                "ed25519 key); remove it to start as a new peer"
            )
        if mode & 0o077:
            log.warning("the identity file %s is readable by others (mode %o); chmod 600 it", path, mode)
        identity = cls.from_private_bytes(raw)
        log.debug("peer id %s from %s", identity.peer_id, path)
        return identity

    @staticmethod
    def _create(path: Path) -> None:
        raw = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic, and fails if another process got there first
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)

    @property
    def node_id(self) -> bytes:
        """The 20-byte Kademlia node id: the peer id's bytes."""
        return bytes.fromhex(self.peer_id)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte ed25519 signature of ``data``."""
        return self._private.sign(data)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"
