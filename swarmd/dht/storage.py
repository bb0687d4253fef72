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
- sources (issue 18, :mod:`swarmd.dht.sources`): every record is accounted to the *source group*
  of the node that delivered it (``merge(..., source=...)``, from ``rpc_store``'s sender; ``None``
  is this node's own store). One group places at most ``max_per_source`` new records under a key
  (refused as ``source_quota``), and a full key is shared fairly: a newcomer from a group that
  holds fewer records than another may evict that group's youngest record
  (:func:`~swarmd.dht.sources.choose_victims`, counted in :attr:`RecordStorage.evicted`). A
  flood of validly signed records from one address can thus neither crowd out nor evict the
  records of peers that announce from their own addresses. Refusals are counted per source
  (:meth:`RecordStorage.flood_stats`) and logged, one line per source per minute;
- ``get(key)`` returns the merged bundle of the live records: what kademlia sends in answer to
  ``find_value`` and hands over to new neighbours.

It implements kademlia's ``IStorage`` interface (``__setitem__`` merges, ``get``,
``__getitem__``, ``iter_older_than``, ``__iter__``) so ``KademliaProtocol`` can use it as is.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kademlia.storage import IStorage

from swarmd.dht.protocol import MAX_BUNDLE_BYTES
from swarmd.dht.records import Record, RecordCache, bundle_entry_size, bundle_header_size, decode_bundle, encode_bundle
from swarmd.dht.sources import DEFAULT_MAX_PER_SOURCE, LOCAL, Held, RateLimiter, choose_victims
from swarmd.errors import MalformedRecord, RecordError

__all__ = ["DEFAULT_MAX_KEYS", "DEFAULT_MAX_PER_SOURCE", "DEFAULT_MAX_SUBKEYS", "MergeResult", "RecordStorage"]

log = logging.getLogger(__name__)
MAX_TRACKED_SOURCES = 1024  # refusals are counted per source for this many sources, then as "other"

DEFAULT_MAX_SUBKEYS = 64  # the byte cap binds first for realistic records (~26)
DEFAULT_MAX_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class MergeResult:
    """What became of a stored bundle's records."""

    accepted: int = 0  # new subkeys, or newer than what was held
    current: int = 0  # the same as, or older than, what is held (nothing to do)
    rejected: int = 0  # invalid, or refused by a cap or a source's quota
    evicted: int = 0  # records of over-represented sources evicted to make room (fair share)

    @property
    def ok(self) -> bool:
        """Every record of the bundle is held now (the answer to a ``store`` RPC)."""
        return self.rejected == 0 and self.accepted + self.current > 0


@dataclass(slots=True)
class _Slot:
    record: Record
    raw: bytes
    group: str = LOCAL  # the source group that delivered the held version (swarmd.dht.sources)
    born: int = 0  # when this subkey arrived on this node (storage-wide order): larger is younger


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
        max_per_source: int = DEFAULT_MAX_PER_SOURCE,
        cache: RecordCache | None = None,
        clock: Callable[[], float] = time.time,
        log_period_s: float = 60.0,
    ) -> None:
        """``max_per_source``: new records one source group may place under one key (module
        docstring); ``log_period_s``: at most one log line per source per that many seconds."""
        if not 0 < max_bundle_bytes <= MAX_BUNDLE_BYTES:
            raise ValueError(f"max_bundle_bytes must be in (0, {MAX_BUNDLE_BYTES}], got {max_bundle_bytes}")
        if max_per_source < 1:
            raise ValueError(f"max_per_source must be >= 1, got {max_per_source}")
        self.max_subkeys = max_subkeys
        self.max_bundle_bytes = max_bundle_bytes
        self.max_keys = max_keys
        self.max_per_source = max_per_source
        self.cache = cache if cache is not None else RecordCache()
        self.clock = clock
        self.rejected: Counter[str] = Counter()
        self.evicted: Counter[str] = Counter()  # by the evicted record's source group
        self.refused_sources: Counter[str] = Counter()  # over quota or full, by source group (bounded)
        self._log_limit = RateLimiter(log_period_s)
        self._born = 0
        self._entries: dict[bytes, _Entry] = {}

    # --- writes ------------------------------------------------------------------------------

    def merge(self, key: bytes, bundle: bytes, *, now: float | None = None, source: str | None = None) -> MergeResult:
        """Merge a bundle of signed records into ``key`` (see the module docstring for the rules).

        ``source``: the source group of the node that sent it (:func:`~swarmd.dht.sources.source_group`
        of ``rpc_store``'s sender); None for this node's own records, which no quota limits.
        """
        now = self.clock() if now is None else now
        group = LOCAL if source is None else source
        try:
            raws = decode_bundle(bundle)
        except MalformedRecord:
            self.rejected[MalformedRecord.reason] += 1
            return MergeResult(rejected=1)
        entry = self._entries.get(key)
        if entry is not None:
            entry.purge(now)
        accepted = current = evicted = 0
        refused: Counter[str] = Counter()
        for raw in raws:
            try:
                record = self.cache.open(raw, now=now)
            except RecordError as exc:
                self.rejected[exc.reason] += 1
                refused[exc.reason] += 1
                continue
            if entry is None:
                if len(self._entries) >= self.max_keys:
                    self.cull(now)
                if len(self._entries) >= self.max_keys:
                    self.rejected["key_limit"] += 1
                    refused["key_limit"] += 1
                    continue
                entry = self._entries[key] = _Entry()
            held = entry.slots.get(record.subkey)
            if held is not None and (held.record.timestamp, held.raw) >= (record.timestamp, raw):
                current += 1
                continue
            if held is not None:  # a refresh: incumbents always keep their place
                payload = entry.payload + _cost(raw) - _cost(held.raw)
                if entry.size(None, payload) > self.max_bundle_bytes:
                    self.rejected["full"] += 1
                    refused["full"] += 1
                    continue
                entry.slots[record.subkey] = _Slot(record, raw, group, held.born)
                entry.payload = payload
            else:
                if source is not None and sum(s.group == group for s in entry.slots.values()) >= self.max_per_source:
                    self.rejected["source_quota"] += 1
                    refused["source_quota"] += 1
                    continue
                victims = self._room_for(entry, group, _cost(raw))
                if victims is None:
                    self.rejected["full"] += 1
                    refused["full"] += 1
                    continue
                for subkey in victims:
                    gone = entry.slots.pop(subkey)
                    entry.payload -= _cost(gone.raw)
                    self.evicted[self._tracked(gone.group)] += 1
                    evicted += 1
                self._born += 1
                entry.slots[record.subkey] = _Slot(record, raw, group, self._born)
                entry.payload += _cost(raw)
            entry.updated = time.monotonic()
            accepted += 1
        if entry is not None and not entry.slots:
            self._entries.pop(key, None)
        if refused and source is not None:
            self._note_refusals(source, key, refused)
        if evicted:
            log.info("DHT storage: a record from %s took the place of %d record(s) of over-represented sources "
                     "under key %s (fair share)", group, evicted, key.hex()[:12])
        return MergeResult(accepted, current, sum(refused.values()), evicted)

    def _room_for(self, entry: _Entry, group: str, cost: int) -> list[str] | None:
        """The subkeys to evict so that a new record of ``cost`` bytes from ``group`` fits
        (``[]``: it fits as is), or None: the key is full and sharing it fairly makes no room."""

        def fits(evicted: list[str]) -> bool:
            count = len(entry.slots) - len(evicted) + 1
            payload = entry.payload + cost - sum(_cost(entry.slots[s].raw) for s in evicted)
            return count <= self.max_subkeys and entry.size(count, payload) <= self.max_bundle_bytes

        if fits([]):
            return []
        return choose_victims((Held(s, slot.group, slot.born) for s, slot in entry.slots.items()), group, fits)

    def _tracked(self, group: str) -> str:
        """``group``, or "other" once :data:`MAX_TRACKED_SOURCES` sources are counted (bounded memory)."""
        if group in self.refused_sources or len(self.refused_sources) < MAX_TRACKED_SOURCES:
            return group
        return "other"

    def _note_refusals(self, source: str, key: bytes, refused: Counter[str]) -> None:
        """Count a source's refused records and say so in the log, once per source per period."""
        self.refused_sources[self._tracked(source)] += sum(refused.values())
        if not (refused["source_quota"] or refused["full"]):
            return  # invalid records: counted in ``rejected`` (and by the protocol), not a flood
        if self._log_limit.allow(source):
            more = self._log_limit.take_suppressed(source)
            reasons = ", ".join(f"{n} {why}" for why, n in sorted(refused.items()))
            log.warning("DHT storage refused records from %s under key %s (%s; quota %d new records per source "
                        "per key)%s", source, key.hex()[:12], reasons, self.max_per_source,
                        f"; {more} more refusals from it since the last line" if more else "")

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

    def sources(self, key: bytes) -> dict[str, str]:
        """The source group each live record under ``key`` was delivered by, by subkey."""
        entry = self._live(key)
        return {} if entry is None else {s: slot.group for s, slot in entry.slots.items()}

    def flood_stats(self, top: int = 8) -> dict[str, Any]:
        """What the source quota and fair sharing did (for /status and /metrics)."""
        return {
            "max_per_source": self.max_per_source,
            "refused_over_quota": self.rejected["source_quota"],
            "refused_full": self.rejected["full"],
            "evicted": sum(self.evicted.values()),
            "top_refused_sources": [{"source": g, "refused": n} for g, n in self.refused_sources.most_common(top)],
        }

    def record_count(self) -> int:
        """Live records over all keys."""
        self.cull()
        return sum(len(e.slots) for e in self._entries.values())
