"""Signed DHT records: what a peer says about itself, encoded as compact msgpack and signed.

Three record types, all versioned dataclasses validated on construction (petals-style: a decoder
ignores body fields it does not know, so old and new peers coexist, and refuses bad ones with a
typed :class:`~swarmd.errors.RecordError`):

- :class:`PeerRecord`: one peer serving one stage (its state, addresses, load, training step);
  its subkey in the DHT is ``peer_id``;
- :class:`SwarmRecord`: a swarm's model spec and training settings, signed by its founder; its
  subkey is ``founder``.
- :class:`RanksRecord` (``t`` ``"k"``): the data-shard ranks the trainers of one daemon hold, so
  that ranks are unique across the swarm (``swarmd.api.trainer_ranks``); its subkey is ``peer_id``.
- :class:`TrainingRecord` (``t`` ``"l"``): what one daemon's trainers reported lately (step,
  loss, validation loss, samples/s; ``swarmd.training_summary``); its subkey is ``peer_id``.

Envelope
--------
``sign_record`` produces one msgpack map ``{"v": 1, "t": type, "b": body, "k": public key,
"s": signature}``: ``t`` is ``"p"`` (peer) or ``"s"`` (swarm), ``b`` the msgpack-encoded body
(a map with one-letter keys, below), ``k`` the signer's raw 32-byte ed25519 public key and ``s``
its signature of ``b"swarmd-dht\\0" + bytes([v]) + t + b"\\0" + b`` (so a body can be read
neither as another record type nor as another version). ``open_record`` checks, in order: size
(before decoding anything), msgpack, envelope version and type, field types, signature, body,
that the peer id / founder is the key's id, and expiry. ``v`` changes only for an incompatible
envelope; compatible additions are new body fields, which older decoders ignore.

Body keys: PeerRecord ``i`` peer_id (20 raw bytes), ``g`` stage, ``s`` state (its index in
``PEER_STATES``), ``d`` data_addr, ``a`` api_addr, ``h`` throughput, ``q`` queue, ``n`` step,
``p`` params_digest (raw bytes or nil), ``v`` version, ``t`` timestamp, ``e`` expiry, ``r``
reachable (index in ``REACHABILITY``; absent, from older builds, means unknown), ``k`` the
newest checkpoint step the peer holds of its stage (absent: none, or an older build), ``c``
claimed_at (when a newcomer chose its stage, see ``swarmd.pipeline.stage_choice``; absent: the
stage was not chosen by claim), ``o`` held (the newest checkpoint of every stage the peer holds,
as ``[stage, step]`` pairs, at most :data:`MAX_HELD`; absent: none).
SwarmRecord ``w`` swarm, ``m`` spec, ``r`` training, ``f`` founder (20 raw bytes), ``t``
timestamp, ``e`` expiry. Hex fields travel as raw bytes (half the size) and come back as
lowercase hex.

Size
----
A realistic signed PeerRecord (IPv4 data address ``203.0.113.45:31337``, IPv6 API address
``[2001:db8:85a3::8a2e:370:7334]:31338``, a 64-hex params digest, version ``0.1.0``, state
``migrating``, a checkpoint step) is **305 bytes**: 116 of envelope (64 signature, 32 key,
headers) and a 189-byte body. In a bundle each record costs 3 more bytes (msgpack bin16
header), so one DHT key's 8137-byte bundle holds 26 of them. A SwarmRecord of the tiny preset's spec and three
training settings is 340 bytes. Verifying one costs ~0.1 ms (ed25519), hence :class:`RecordCache`.
(``tests/unit/test_dht_records.py`` pins these numbers.)

Times are unix seconds (``time.time()``): ``expiry`` is absolute, so peers compare it with their
own clocks, and records live at most ``max_ttl_s`` (default one hour) beyond ``now``, so a peer
cannot list itself forever with one publication.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from swarmd.dht.identity import PEER_ID_BYTES, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify
from swarmd.errors import (
    BadSignature,
    MalformedRecord,
    PeerIdMismatch,
    RecordExpired,
    RecordTooLarge,
    UnsupportedRecordVersion,
)
from swarmd.peer_state import ANNOUNCED, usable

__all__ = [
    "ENVELOPE_VERSION",
    "MAX_RECORD_BYTES",
    "MAX_TTL_S",
    "PEER_STATES",
    "PeerRecord",
    "Record",
    "RecordCache",
    "SwarmRecord",
    "RanksRecord",
    "TrainingRecord",
    "bundle_entry_size",
    "bundle_header_size",
    "bundle_size",
    "decode_bundle",
    "encode_bundle",
    "open_record",
    "sign_record",
]

ENVELOPE_VERSION = 1
MAX_RECORD_BYTES = 1024  # a signed record, envelope included; refused unread above this
MAX_TTL_S = 3600.0  # how far in the future an expiry may lie
PEER_STATES = ANNOUNCED  # on the wire: the index; append only (swarmd.peer_state)
REACHABILITY = ("unknown", "yes", "no")  # on the wire: the index; append only

MAX_ADDR_CHARS = 128
MAX_VERSION_CHARS = 32
MAX_SWARM_CHARS = 64
MAX_DIGEST_CHARS = 128
MAX_MAP_ENTRIES = 64
MAX_MAP_KEY_CHARS = 64
MAX_SCALAR_STR_CHARS = 256
MAX_HELD = 16  # stages whose checkpoints one peer record may offer

_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_SIGNING_PREFIX = b"swarmd-dht\x00"
_UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException)

Scalar = None | bool | int | float | str
V = TypeVar("V")


# --- field checks (shared by construction and decoding: one path, one error type) ---------------


def _bad(name: str, value: object, expected: str) -> MalformedRecord:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return MalformedRecord(f"record field {name!r} must be {expected}, got {shown}")


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(name, value, f"an integer in [{lo}, {hi}]")
    return value


def _check_float(name: str, value: object, *, lo: float = 0.0) -> float:
    if not isinstance(value, (int, float)) or type(value) is bool or not math.isfinite(value) or value < lo:
        raise _bad(name, value, f"a finite number >= {lo:g}")
    return float(value)


def _check_str(name: str, value: object, max_chars: int, *, min_chars: int = 0) -> str:
    if type(value) is not str or not min_chars <= len(value) <= max_chars:
        raise _bad(name, value, f"a string of {min_chars} to {max_chars} characters")
    return value


def _check_peer_id(name: str, value: object) -> str:
    if type(value) is not str or not _HEX40.fullmatch(value):
        raise _bad(name, value, "40 lowercase hex characters")
    return value


def _check_scalar_map(name: str, value: object) -> dict[str, Scalar]:
    if not isinstance(value, Mapping) or len(value) > MAX_MAP_ENTRIES:
        raise _bad(name, value, f"a map of at most {MAX_MAP_ENTRIES} entries")
    out: dict[str, Scalar] = {}
    for k, v in value.items():
        if type(k) is not str or not 0 < len(k) <= MAX_MAP_KEY_CHARS:
            raise _bad(f"{name} key", k, f"a string of 1 to {MAX_MAP_KEY_CHARS} characters")
        if v is None or type(v) in (bool, float):
            pass
        elif type(v) is int:
            _check_int(f"{name}[{k!r}]", v, -(2**63), 2**64 - 1)
        elif type(v) is str:
            _check_str(f"{name}[{k!r}]", v, MAX_SCALAR_STR_CHARS)
        else:
            raise _bad(f"{name}[{k!r}]", v, "None, a bool, int, float or string")
        out[k] = v
    return out


def _reachability_of(code: object) -> str:
    if type(code) is not int or not 0 <= code < len(REACHABILITY):
        raise _bad("reachable", code, f"a reachability code in [0, {len(REACHABILITY) - 1}]")
    return REACHABILITY[code]


def _state_of(code: object) -> str:
    if type(code) is not int or not 0 <= code < len(PEER_STATES):
        raise _bad("state", code, f"a state code in [0, {len(PEER_STATES) - 1}]")
    return PEER_STATES[code]


def _check_pairs(name: str, value: object, most: int, key: str, check_key: Callable[[object], int],
                 item: str, check_item: Callable[[object], V]) -> tuple[tuple[int, V], ...]:
    """A list of at most ``most`` ``[key, item]`` pairs with distinct keys, as a tuple of pairs sorted by key."""
    if not isinstance(value, (list, tuple)) or len(value) > most:
        raise _bad(name, value, f"a list of at most {most} [{key}, {item}] pairs")
    out: dict[int, V] = {}
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _bad(name, pair, f"a [{key}, {item}] pair")
        k = check_key(pair[0])
        if k in out:
            raise _bad(name, value, f"distinct {key}s")
        out[k] = check_item(pair[1])
    return tuple(sorted(out.items()))


def _check_held(value: object) -> tuple[tuple[int, int], ...]:
    """``held``: at most MAX_HELD distinct stages, each with the step of its newest checkpoint."""
    return _check_pairs("held", value, MAX_HELD, "stage", lambda v: _check_int("held stage", v, 0, 2**16 - 1),
                        "step", lambda v: _check_int("held step", v, 0, 2**63 - 1))


def _check_times(timestamp: object, expiry: object) -> tuple[float, float]:
    ts = _check_float("timestamp", timestamp)
    exp = _check_float("expiry", expiry)
    if exp < ts:
        raise MalformedRecord(f"record expiry {exp} is before its timestamp {ts}")
    return ts, exp


def _hex_bytes(name: str, value: object, size: int | None = None) -> str:
    if type(value) is not bytes or (size is not None and len(value) != size) or not value:
        raise _bad(name, value, f"{size or 'some'} raw bytes")
    return value.hex()


# --- the records ---------------------------------------------------------------------------------


class _Expiring:
    """What every record has: when it was published (``timestamp``; newer wins per subkey) and
    when it is dropped (``expiry``), both unix times."""

    __slots__ = ()
    timestamp: float
    expiry: float

    def _check_lifetime(self) -> None:
        """The last check of every record's ``__post_init__``: both times floats, the expiry not
        before the timestamp (ints stored as floats)."""
        ts, exp = _check_times(self.timestamp, self.expiry)
        object.__setattr__(self, "timestamp", ts)
        object.__setattr__(self, "expiry", exp)


class _OnePerPeer(_Expiring):
    """A record published by a peer about itself or its daemon, signed by it: one per peer under its key."""

    __slots__ = ()
    peer_id: str

    @property
    def subkey(self) -> str:
        """The record's slot under its DHT key: its publisher's peer id (a peer's, or a daemon's)."""
        return self.peer_id


@dataclass(frozen=True, slots=True)
class PeerRecord(_OnePerPeer):
    """One peer serving one stage: what a router or rebalancer needs to know about it."""

    TYPE: ClassVar[str] = "p"

    peer_id: str
    stage: int
    state: str  # one of PEER_STATES
    data_addr: str  # where the data plane listens, e.g. "203.0.113.45:31337"
    api_addr: str  # where the control plane listens
    throughput: float  # samples per second this peer measured for itself
    queue: int  # requests waiting
    step: int  # the optimizer step it is at
    params_digest: str | None  # lowercase hex digest of its stage parameters, if known
    version: str  # swarmd version
    timestamp: float  # unix time of publication; newer wins per peer
    expiry: float  # absolute unix time after which the record is dropped
    # whether other members could dial data_addr (swarmd.net.reachability): unknown | yes | no
    reachable: str = "unknown"
    # the newest checkpoint step this peer holds of its stage (swarmd.checkpoint); None: none
    checkpoint: int | None = None
    # when this peer claimed its stage as a newcomer (unix time; swarmd.pipeline.stage_choice); None: not by claim
    claimed_at: float | None = None
    # (stage, step) of the newest checkpoint it holds of each stage, any it ever served: offered to the swarm
    held: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _check_peer_id("peer_id", self.peer_id)
        if self.checkpoint is not None:
            _check_int("checkpoint", self.checkpoint, 0, 2**63 - 1)
        if self.claimed_at is not None:
            object.__setattr__(self, "claimed_at", _check_float("claimed_at", self.claimed_at))
        object.__setattr__(self, "held", _check_held(self.held))
        if self.reachable not in REACHABILITY:
            raise _bad("reachable", self.reachable, f"one of {', '.join(REACHABILITY)}")
        _check_int("stage", self.stage, 0, 2**16 - 1)
        if self.state not in PEER_STATES:
            raise _bad("state", self.state, f"one of {', '.join(PEER_STATES)}")
        _check_str("data_addr", self.data_addr, MAX_ADDR_CHARS)
        _check_str("api_addr", self.api_addr, MAX_ADDR_CHARS)
        object.__setattr__(self, "throughput", _check_float("throughput", self.throughput))
        _check_int("queue", self.queue, 0, 2**32 - 1)
        _check_int("step", self.step, 0, 2**63 - 1)
        if self.params_digest is not None:
            if type(self.params_digest) is not str or not (
                len(self.params_digest) <= MAX_DIGEST_CHARS and _HEX.fullmatch(self.params_digest)
            ):
                raise _bad("params_digest", self.params_digest, "None or lowercase hex of even length")
        _check_str("version", self.version, MAX_VERSION_CHARS)
        self._check_lifetime()

    def _body(self) -> dict[str, Any]:
        return {
            "i": bytes.fromhex(self.peer_id),
            "g": self.stage,
            "s": PEER_STATES.index(self.state),
            "d": self.data_addr,
            "a": self.api_addr,
            "h": self.throughput,
            "q": self.queue,
            "n": self.step,
            "p": None if self.params_digest is None else bytes.fromhex(self.params_digest),
            "v": self.version,
            "t": self.timestamp,
            "e": self.expiry,
            "r": REACHABILITY.index(self.reachable),
            **({} if self.checkpoint is None else {"k": self.checkpoint}),
            **({} if self.claimed_at is None else {"c": self.claimed_at}),
            **({"o": [list(pair) for pair in self.held]} if self.held else {}),
        }

    @property
    def usable(self) -> bool:
        """Serving, and not known to be out of reach: what trainers and stage-mates may dial."""
        return usable(self.state, self.reachable)

    @property
    def listed(self) -> bool:
        """In any view at all: every state but ``stopped`` (a graceful stop's withdrawal)."""
        return self.state != "stopped"

    def held_step(self, stage: int) -> int | None:
        """The step of the checkpoint of ``stage`` this peer offers, if any."""
        for s, step in self.held:
            if s == stage:
                return step
        return None

    @classmethod
    def _from_body(cls, body: Mapping[str, Any]) -> PeerRecord:
        digest = body.get("p")
        reach = body.get("r", 0)  # absent in records of older builds: unknown
        return cls(
            peer_id=_hex_bytes("peer_id", body.get("i"), PEER_ID_BYTES),
            stage=body.get("g"),  # type: ignore[arg-type]  # checked in __post_init__
            state=_state_of(body.get("s")),
            data_addr=body.get("d"),  # type: ignore[arg-type]
            api_addr=body.get("a"),  # type: ignore[arg-type]
            throughput=body.get("h"),  # type: ignore[arg-type]
            queue=body.get("q"),  # type: ignore[arg-type]
            step=body.get("n"),  # type: ignore[arg-type]
            params_digest=None if digest is None else _hex_bytes("params_digest", digest),
            version=body.get("v"),  # type: ignore[arg-type]
            timestamp=body.get("t"),  # type: ignore[arg-type]
            expiry=body.get("e"),  # type: ignore[arg-type]
            reachable=_reachability_of(reach),
            checkpoint=body.get("k"),  # absent (older builds, or none held): None
            claimed_at=body.get("c"),  # absent: the stage was given, or an older build
            held=body.get("o", ()),  # checked in __post_init__
        )


@dataclass(frozen=True, slots=True)
class SwarmRecord(_Expiring):
    """A swarm's identity card: the model every stage builds and the training settings."""

    TYPE: ClassVar[str] = "s"

    swarm: str
    spec: dict[str, Scalar]  # a ModelSpec.to_dict()
    training: dict[str, Scalar]  # small free-form settings, string keys to scalars
    founder: str  # peer id of the swarm's founder (the signer)
    timestamp: float
    expiry: float

    def __post_init__(self) -> None:
        _check_str("swarm", self.swarm, MAX_SWARM_CHARS, min_chars=1)
        object.__setattr__(self, "spec", _check_scalar_map("spec", self.spec))
        object.__setattr__(self, "training", _check_scalar_map("training", self.training))
        _check_peer_id("founder", self.founder)
        self._check_lifetime()

    def __hash__(self) -> int:
        return hash((self.swarm, self.founder, self.timestamp, self.expiry))

    @property
    def subkey(self) -> str:
        """The record's slot under a DHT key: one per founder."""
        return self.founder

    def _body(self) -> dict[str, Any]:
        return {
            "w": self.swarm,
            "m": self.spec,
            "r": self.training,
            "f": bytes.fromhex(self.founder),
            "t": self.timestamp,
            "e": self.expiry,
        }

    @classmethod
    def _from_body(cls, body: Mapping[str, Any]) -> SwarmRecord:
        return cls(
            swarm=body.get("w"),  # type: ignore[arg-type]  # checked in __post_init__
            spec=body.get("m"),  # type: ignore[arg-type]
            training=body.get("r"),  # type: ignore[arg-type]
            founder=_hex_bytes("founder", body.get("f"), PEER_ID_BYTES),
            timestamp=body.get("t"),  # type: ignore[arg-type]
            expiry=body.get("e"),  # type: ignore[arg-type]
        )


@dataclass(frozen=True, slots=True)
class TrainingRecord(_OnePerPeer):
    """What the trainers registered with one daemon reported lately (``swarmd.training_summary``):
    a swarm-level loss curve is the merge of every daemon's record, read by any daemon."""

    TYPE: ClassVar[str] = "l"

    peer_id: str  # the publishing daemon (the signer)
    step: int  # the newest step its trainers reported
    samples: int  # samples its trainers have computed, in total
    loss: float | None  # the newest training loss reported (None: no trainer reported one)
    val_loss: float | None  # the newest validation loss reported
    samples_per_s: float  # summed over its live trainers
    trainers: int  # live trainers registered with it
    timestamp: float
    expiry: float

    def __post_init__(self) -> None:
        _check_peer_id("peer_id", self.peer_id)
        _check_int("step", self.step, 0, 2**63 - 1)
        _check_int("samples", self.samples, 0, 2**63 - 1)
        _check_int("trainers", self.trainers, 0, 2**32 - 1)
        for name in ("loss", "val_loss"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check_float(name, value))
        object.__setattr__(self, "samples_per_s", _check_float("samples_per_s", self.samples_per_s))
        self._check_lifetime()

    def _body(self) -> dict[str, Any]:
        return {"i": bytes.fromhex(self.peer_id), "n": self.step, "c": self.samples, "l": self.loss,
                "v": self.val_loss, "h": self.samples_per_s, "r": self.trainers, "t": self.timestamp,
                "e": self.expiry}

    @classmethod
    def _from_body(cls, body: Mapping[str, Any]) -> TrainingRecord:
        return cls(
            peer_id=_hex_bytes("peer_id", body.get("i"), PEER_ID_BYTES),
            step=body.get("n"),  # type: ignore[arg-type]  # checked in __post_init__
            samples=body.get("c"),  # type: ignore[arg-type]
            loss=body.get("l"),
            val_loss=body.get("v"),
            samples_per_s=body.get("h"),  # type: ignore[arg-type]
            trainers=body.get("r"),  # type: ignore[arg-type]
            timestamp=body.get("t"),  # type: ignore[arg-type]
            expiry=body.get("e"),  # type: ignore[arg-type]
        )


MAX_RANKS = 64  # trainers' ranks one daemon's RanksRecord may claim


@dataclass(frozen=True, slots=True)
class RanksRecord(_OnePerPeer):
    """The data-shard ranks the trainers registered with one daemon hold (``swarmd.api.trainer_ranks``):
    read by every daemon, so ranks stay unique across the swarm, not per daemon."""

    TYPE: ClassVar[str] = "k"

    peer_id: str  # the publishing daemon (the signer)
    ranks: tuple[tuple[int, float], ...]  # (rank, unix time it was claimed), sorted by rank
    timestamp: float
    expiry: float

    def __post_init__(self) -> None:
        _check_peer_id("peer_id", self.peer_id)
        object.__setattr__(self, "ranks", _check_pairs(
            "ranks", self.ranks, MAX_RANKS, "rank", lambda v: _check_int("rank", v, 0, 2**31 - 1),
            "claimed_at", lambda v: _check_float("claimed_at", v)))
        self._check_lifetime()

    def _body(self) -> dict[str, Any]:
        return {"i": bytes.fromhex(self.peer_id), "k": [list(p) for p in self.ranks], "t": self.timestamp,
                "e": self.expiry}

    @classmethod
    def _from_body(cls, body: Mapping[str, Any]) -> RanksRecord:
        return cls(
            peer_id=_hex_bytes("peer_id", body.get("i"), PEER_ID_BYTES),
            ranks=body.get("k"),  # type: ignore[arg-type]  # checked in __post_init__
            timestamp=body.get("t"),  # type: ignore[arg-type]
            expiry=body.get("e"),  # type: ignore[arg-type]
        )


Record = PeerRecord | SwarmRecord | TrainingRecord | RanksRecord
RECORD_TYPES: dict[str, type[PeerRecord] | type[SwarmRecord] | type[TrainingRecord] | type[RanksRecord]] = {
    PeerRecord.TYPE: PeerRecord,
    SwarmRecord.TYPE: SwarmRecord,
    TrainingRecord.TYPE: TrainingRecord,
    RanksRecord.TYPE: RanksRecord,
}


# --- envelope ------------------------------------------------------------------------------------


def _signed_message(version: int, record_type: str, body: bytes) -> bytes:
    return _SIGNING_PREFIX + bytes([version]) + record_type.encode() + b"\x00" + body


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except _UNPACK_ERRORS as exc:
        raise MalformedRecord(f"the record {what} is not valid msgpack: {exc}") from exc


def sign_record(identity: Identity, record: Record) -> bytes:
    """``record`` signed by ``identity``, as envelope bytes ready to store in the DHT.

    The record must speak for the signer (its peer_id / founder is ``identity.peer_id``): signing
    for another peer is a programming error (``ValueError``), every reader would refuse it.
    """
    if record.subkey != identity.peer_id:
        raise ValueError(f"record for {record.subkey} cannot be signed by {identity.peer_id}")
    body = msgpack.packb(record._body(), use_bin_type=True)
    message = _signed_message(ENVELOPE_VERSION, record.TYPE, body)
    return msgpack.packb(
        {
            "v": ENVELOPE_VERSION,
            "t": record.TYPE,
            "b": body,
            "k": identity.public_key_bytes,
            "s": identity.sign(message),
        },
        use_bin_type=True,
    )


def open_record(
    data: bytes, *, now: float, max_bytes: int = MAX_RECORD_BYTES, max_ttl_s: float = MAX_TTL_S
) -> Record:
    """Decode, verify and validate one signed record; raise a :class:`RecordError` subclass if
    anything is wrong, never another exception.

    ``now`` is the reader's unix time (records with ``expiry <= now`` are expired).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedRecord(f"a record is bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise RecordTooLarge(f"record of {len(data)} bytes is above the {max_bytes}-byte limit")
    env = _unpack(bytes(data), "envelope")
    if not isinstance(env, dict):
        raise MalformedRecord(f"a record envelope is a map, got {type(env).__name__}")
    version = env.get("v")
    if type(version) is not int:
        raise _bad("v", version, "an integer envelope version")
    if version != ENVELOPE_VERSION:
        if version > ENVELOPE_VERSION:
            raise UnsupportedRecordVersion(
                f"record envelope version {version} is newer than this build reads ({ENVELOPE_VERSION})"
            )
        raise _bad("v", version, f"envelope version {ENVELOPE_VERSION}")
    record_type = env.get("t")
    if type(record_type) is not str:
        raise _bad("t", record_type, "a record type string")
    cls = RECORD_TYPES.get(record_type)
    if cls is None:
        raise UnsupportedRecordVersion(f"unknown record type {record_type[:16]!r} (from a newer build?)")
    body, key, signature = env.get("b"), env.get("k"), env.get("s")
    if type(body) is not bytes:
        raise _bad("b", body, "the body bytes")
    if type(key) is not bytes or len(key) != PUBLIC_KEY_BYTES:
        raise _bad("k", key, f"a {PUBLIC_KEY_BYTES}-byte ed25519 public key")
    if type(signature) is not bytes or len(signature) != SIGNATURE_BYTES:
        raise _bad("s", signature, f"a {SIGNATURE_BYTES}-byte ed25519 signature")
    if not verify(key, _signed_message(version, record_type, body), signature):
        raise BadSignature(f"the signature of a {cls.__name__} does not verify with its key")
    fields = _unpack(body, "body")
    if not isinstance(fields, dict):
        raise MalformedRecord(f"a record body is a map, got {type(fields).__name__}")
    record = cls._from_body(fields)
    signer = peer_id_of(key)
    if record.subkey != signer:
        raise PeerIdMismatch(f"{cls.__name__} names peer {record.subkey} but is signed by {signer}")
    if record.expiry <= now:
        raise RecordExpired(f"{cls.__name__} of {signer} expired {now - record.expiry:.1f} s ago")
    if record.expiry > now + max_ttl_s:
        raise MalformedRecord(
            f"{cls.__name__} of {signer} expires in {record.expiry - now:.0f} s, beyond the {max_ttl_s:.0f} s limit"
        )
    return record


class RecordCache:
    """``open_record`` with memory: records already verified, by their exact bytes.

    A lookup receives the same records from up to k replicas and a storage receives the same
    bundle again on every republish; verifying an ed25519 signature costs ~50-100 us, checking a
    dict costs nothing. Only successes are cached, and expiry is checked again on every hit.
    """

    def __init__(self, maxsize: int = 4096, *, max_bytes: int = MAX_RECORD_BYTES, max_ttl_s: float = MAX_TTL_S) -> None:
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.max_ttl_s = max_ttl_s
        self._records: OrderedDict[bytes, Record] = OrderedDict()

    def open(self, data: bytes, *, now: float) -> Record:
        """Like :func:`open_record`, with the same errors."""
        record = self._records.get(data) if isinstance(data, bytes) else None
        if record is not None:
            self._records.move_to_end(data)
            if record.expiry <= now:
                ago = now - record.expiry
                raise RecordExpired(f"{type(record).__name__} of {record.subkey} expired {ago:.1f} s ago")
            return record
        record = open_record(data, now=now, max_bytes=self.max_bytes, max_ttl_s=self.max_ttl_s)
        self._records[bytes(data)] = record
        if len(self._records) > self.maxsize:
            self._records.popitem(last=False)
        return record

    def __len__(self) -> int:
        return len(self._records)


# --- bundles: many signed records under one DHT key -----------------------------------------------


def bundle_header_size(count: int) -> int:
    """Bytes of the msgpack array header of a bundle of ``count`` records."""
    return 1 if count < 16 else 3 if count < 2**16 else 5


def bundle_entry_size(record_len: int) -> int:
    """Bytes a record of ``record_len`` bytes takes in a bundle (msgpack bin header included)."""
    return (2 if record_len < 2**8 else 3 if record_len < 2**16 else 5) + record_len


def bundle_size(records: Sequence[bytes]) -> int:
    """The exact length of ``encode_bundle(records)``, without encoding it."""
    return bundle_header_size(len(records)) + sum(bundle_entry_size(len(r)) for r in records)


def encode_bundle(records: Sequence[bytes]) -> bytes:
    """A msgpack array of signed records: what one DHT key's value is on the wire."""
    return msgpack.packb(list(records), use_bin_type=True)


def decode_bundle(data: bytes) -> list[bytes]:
    """The signed records of a bundle (each still to be opened); :class:`MalformedRecord` if it is
    not an array of byte strings."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedRecord(f"a bundle is bytes, got {type(data).__name__}")
    items = _unpack(bytes(data), "bundle")
    if not isinstance(items, list) or not all(type(item) is bytes for item in items):
        raise MalformedRecord("a bundle is an array of signed records (byte strings)")
    return items
