"""A node's share of the DHT: signed records merged per subkey under each key.

Kademlia (section 2.3, ``STORE``) overwrites a key's value; kademlia's ``ForgetfulStorage``
does the same. For membership that loses peers: every peer of a stage writes under the same
key. Here one DHT key holds many *subkeys* (a record's peer_id, or a swarm record's founder),
and what a ``store`` RPC delivers is a *bundle*, a msgpack array of signed records
(:func:`~swarmd.dht.records.encode_bundle`), merged record by record:

- a record is accepted only after :func:`~swarmd.dht.records.open_record` has verified it;
  refused ones are dropped and counted in :attr:`RecordStorage.rejected` by reason (the
  ``reason`` of the :class:`~swarmd.errors.RecordError` subclass, plus ``full`` and
  ``key_limit`` for the caps below);
- per subkey, the newest ``timestamp`` wins (ties: the larger raw bytes, so every replica keeps
  the same one);
- each subkey expires on its own (its record's absolute ``expiry``); reads never return it;
- caps: at most ``max_subkeys`` subkeys per key and ``max_bundle_bytes`` for the key's bundle
  (default :data:`~swarmd.dht.protocol.MAX_BUNDLE_BYTES` = 8137, so that a ``find_value`` answer
  and a hand-over ``store`` fit in one datagram: about 26 realistic PeerRecords of ~305 bytes),
  and ``max_keys`` keys per node. A record that would exceed a cap is refused when its subkey is
  new or it grows the bundle: members already listed keep refreshing, newcomers wait until
  someone expires (no churn among the incumbents, and the same outcome on every replica);
- ``get(key)`` returns the merged bundle of the live records: what kademlia sends in answer to
  ``find_value`` and hands over to new neighbours.

It implements kademlia's ``IStorage`` interface (``__setitem__`` merges, ``get``,
``__getitem__``, ``iter_older_than``, ``__iter__``) so ``KademliaProtocol`` can use it as is.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kademlia.storage import IStorage

from swarmd.dht.protocol import MAX_BUNDLE_BYTES
from swarmd.dht.records import Record, RecordCache, bundle_entry_size, bundle_header_size, decode_bundle, encode_bundle
from swarmd.errors import MalformedRecord, RecordError

__all__ = ["DEFAULT_MAX_KEYS", "DEFAULT_MAX_SUBKEYS", "MergeResult", "RecordStorage"]

DEFAULT_MAX_SUBKEYS = 64  # the byte cap binds first for realistic records (~26)
DEFAULT_MAX_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class MergeResult:
    """What became of a stored bundle's records."""

    accepted: int = 0  # new subkeys, or newer than what was held
    current: int = 0  # the same as, or older than, what is held (nothing to do)
    rejected: int = 0  # invalid, or refused by a cap

    @property
    def ok(self) -> bool:
        """Every record of the bundle is held now (the answer to a ``store`` RPC)."""
        return self.rejected == 0 and self.accepted + self.current > 0


@dataclass(slots=True)
class _Slot:
    record: Record
    raw: bytes


@dataclass(slots=True)
class _Entry:
    slots: dict[str, _Slot] = field(default_factory=dict)
    payload: int = 0  # sum over slots of bin header + raw length
    updated: float = 0.0  # monotonic time of the last accepted record

    def size(self, count: int | None = None, payload: int | None = None) -> int:
        """The encoded bundle size (of the current slots, or of a hypothetical change)."""
        count = len(self.slots) if count is None else count
        return bundle_header_size(count) + (self.payload if payload is None else payload)

    def purge(self, now: float) -> None:
        for subkey in [s for s, slot in self.slots.items() if slot.record.expiry <= now]:
            self.payload -= _cost(self.slots.pop(subkey).raw)


def _cost(raw: bytes) -> int:
    return bundle_entry_size(len(raw))


class RecordStorage(IStorage):
    """Merging, validating, capped storage of signed record bundles (module docstring)."""

    def __init__(
        self,
        *,
        max_subkeys: int = DEFAULT_MAX_SUBKEYS,
        max_bundle_bytes: int = MAX_BUNDLE_BYTES,
        max_keys: int = DEFAULT_MAX_KEYS,
        cache: RecordCache | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < max_bundle_bytes <= MAX_BUNDLE_BYTES:
            raise ValueError(f"max_bundle_bytes must be in (0, {MAX_BUNDLE_BYTES}], got {max_bundle_bytes}")
        self.max_subkeys = max_subkeys
        self.max_bundle_bytes = max_bundle_bytes
        self.max_keys = max_keys
        self.cache = cache if cache is not None else RecordCache()
        self.clock = clock
        self.rejected: Counter[str] = Counter()
        self._entries: dict[bytes, _Entry] = {}

    # --- writes ------------------------------------------------------------------------------

    def merge(self, key: bytes, bundle: bytes, *, now: float | None = None) -> MergeResult:
        """Merge a bundle of signed records into ``key`` (see the module docstring for the rules)."""
        now = self.clock() if now is None else now
        try:
            raws = decode_bundle(bundle)
        except MalformedRecord:
            self.rejected[MalformedRecord.reason] += 1
            return MergeResult(rejected=1)
        entry = self._entries.get(key)
        if entry is not None:
            entry.purge(now)
        accepted = current = rejected = 0
        for raw in raws:
            try:
                record = self.cache.open(raw, now=now)
            except RecordError as exc:
                self.rejected[exc.reason] += 1
                rejected += 1
                continue
            if entry is None:
                if len(self._entries) >= self.max_keys:
                    self.cull(now)
                if len(self._entries) >= self.max_keys:
                    self.rejected["key_limit"] += 1
                    rejected += 1
                    continue
                entry = self._entries[key] = _Entry()
            held = entry.slots.get(record.subkey)
            if held is not None and (held.record.timestamp, held.raw) >= (record.timestamp, raw):
                current += 1
                continue
            count = len(entry.slots) + (held is None)
            payload = entry.payload + _cost(raw) - (_cost(held.raw) if held is not None else 0)
            if count > self.max_subkeys or entry.size(count, payload) > self.max_bundle_bytes:
                self.rejected["full"] += 1
                rejected += 1
                continue
            entry.slots[record.subkey] = _Slot(record, raw)
            entry.payload = payload
            entry.updated = time.monotonic()
            accepted += 1
        if entry is not None and not entry.slots:
            self._entries.pop(key, None)
        return MergeResult(accepted, current, rejected)

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.merge(key, value)

    def cull(self, now: float | None = None) -> int:
        """Drop every expired record (and keys left empty); the number of keys dropped."""
        now = self.clock() if now is None else now
        dead = []
        for key, entry in self._entries.items():
            entry.purge(now)
            if not entry.slots:
                dead.append(key)
        for key in dead:
            del self._entries[key]
        return len(dead)

    # --- reads -------------------------------------------------------------------------------

    def _live(self, key: bytes, now: float | None = None) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.purge(self.clock() if now is None else now)
        if not entry.slots:
            del self._entries[key]
            return None
        return entry

    def records(self, key: bytes, *, now: float | None = None) -> dict[str, Record]:
        """The live records under ``key``, by subkey."""
        entry = self._live(key, now)
        return {} if entry is None else {s: slot.record for s, slot in entry.slots.items()}

    def get(self, key: bytes, default: Any = None) -> Any:
        """The merged bundle of ``key``'s live records, or ``default``."""
        entry = self._live(key)
        return default if entry is None else encode_bundle([slot.raw for slot in entry.slots.values()])

    def __getitem__(self, key: bytes) -> bytes:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._live(key) is not None

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, bytes]]:
        """(key, bundle) of the keys no record was accepted for in ``seconds_old`` seconds."""
        self.cull()
        horizon = time.monotonic() - seconds_old
        return [
            (key, encode_bundle([s.raw for s in entry.slots.values()]))
            for key, entry in self._entries.items()
            if entry.updated <= horizon
        ]

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        self.cull()
        return iter([(k, encode_bundle([s.raw for s in e.slots.values()])) for k, e in self._entries.items()])

    def keys(self) -> list[bytes]:
        """The keys holding at least one live record."""
        self.cull()
        return list(self._entries)

    def __len__(self) -> int:
        """Keys holding at least one live record (expired ones are dropped first)."""
        self.cull()
        return len(self._entries)

    def record_count(self) -> int:
        """Live records over all keys."""
        self.cull()
        return sum(len(e.slots) for e in self._entries.values())
