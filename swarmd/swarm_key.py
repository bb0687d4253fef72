"""Private swarms: a pre-shared swarm key (``--swarm-key FILE``) that authenticates every DHT
datagram and every data-plane request.

(Not to be confused with :func:`swarmd.dht.keys.swarm_key`, the DHT key of a swarm's record.)

Create one with ``head -c 32 /dev/urandom | base64 > swarm.key; chmod 600 swarm.key`` and give the
same file to every daemon and trainer of the swarm. The file's content (whitespace stripped) is
the secret; it must be at least 16 bytes. Two subkeys are derived from it with HMAC-SHA256, one
per channel (domain separation), so a MAC of one channel is never valid on the other.

What it gives: an outsider without the key can neither talk to the DHT (its datagrams are dropped
unanswered, so it can neither join, read nor write the swarm's records) nor call a stage (401).
A message captured on the wire cannot be replayed: each carries a timestamp that must be within
``WINDOW_S`` of the receiver's clock and a nonce the receiver remembers for that long. Every
member shares the key, so the key says "a member sent this", not which one: peer records stay
signed with each peer's own ed25519 key, so no member can impersonate another. It authenticates;
it does not encrypt (an on-path observer still sees the traffic: use a VPN or TLS for that).

Wire formats
    DHT datagram (25 bytes added to rpcudp's datagram)::

        0xA5 | timestamp (8 B, big-endian unix milliseconds) | mac (16 B) | rpcudp datagram

    ``mac`` = HMAC-SHA256(dht subkey, tag + timestamp + datagram), truncated to 16 bytes. The
    datagram holds rpcudp's random 20-byte message id, so every MAC is unique: the MAC itself is
    the nonce the replay cache remembers.

    Data-plane request: one header (about 95 bytes)::

        X-Swarm-Auth: <unix ms>.<nonce: 32 hex>.<mac: 32 hex>

    ``mac`` = HMAC-SHA256(http subkey, method, path?query, timestamp, nonce, sha256(body)) (joined
    by newlines), truncated to 16 bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import hmac
import logging
import os
import re
import stat
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmd.errors import ConfigError

__all__ = [
    "AUTH_HEADER",
    "DATAGRAM_OVERHEAD",
    "MIN_SECRET_BYTES",
    "REASONS",
    "WINDOW_S",
    "Authenticator",
    "DatagramAuth",
    "HttpAuth",
    "ReplayCache",
    "SwarmKey",
    "SwarmKeyError",
    "signing_middleware",
]

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
WINDOW_S = 30.0  # a message's timestamp must be within this of the receiver's clock (both ways)
DEFAULT_REPLAY_ENTRIES = 1 << 15  # nonces remembered per channel (memory: a few MB at most)
MAC_BYTES = 16
TS_BYTES = 8
DATAGRAM_TAG = 0xA5  # neither 0x00 nor 0x01 (rpcudp's request/response kinds)
DATAGRAM_OVERHEAD = 1 + TS_BYTES + MAC_BYTES  # 25
AUTH_HEADER = "X-Swarm-Auth"
NONCE_BYTES = 16
REASONS = ("missing", "malformed", "stale", "bad_mac", "replay")
LOG_EVERY = 1000  # after the first refusal per address, one log line per this many refusals
_MAX_LOGGED_ADDRS = 4096
_NEW_LINES_PER_MIN = 20
_HASH_IN_THREAD = 1 << 20  # bodies above this are hashed off the event loop
_HEADER_RE = re.compile(rf"([0-9]{{1,16}})\.([0-9a-f]{{{2 * NONCE_BYTES}}})\.([0-9a-f]{{{2 * MAC_BYTES}}})", re.ASCII)


_HINTS = {
    "missing": "the sender has no --swarm-key: it is not a member of this private swarm",
    "malformed": "the sender is not a member of this private swarm",
    "bad_mac": "the sender has another --swarm-key, or the message was altered",
    "stale": "its timestamp is off by more than 30 s: check the sender's clock",
    "replay": "a copy of a message already received",
}


class SwarmKeyError(ConfigError):
    """The swarm key file cannot be used (the CLI prints this and exits 2)."""


class SwarmKey:
    """The swarm's pre-shared secret and the subkeys derived from it. Never logged or shown."""

    def __init__(self, secret: bytes, *, source: str = "") -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise SwarmKeyError(f"a swarm key must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.source = source

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwarmKey:
        """Read the key from ``path`` (whitespace stripped); SwarmKeyError if it is unusable."""
        p = Path(path)
        hint = "create one with: head -c 32 /dev/urandom | base64 > swarm.key; chmod 600 swarm.key"
        try:
            mode = os.stat(p).st_mode
            if not stat.S_ISREG(mode):  # a directory, or a FIFO that would block the open
                raise SwarmKeyError(f"--swarm-key {p} is not a regular file ({hint})")
            with open(p, "rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            raise SwarmKeyError(f"cannot read --swarm-key {p}: {exc.strerror or exc} ({hint})") from exc
        if len(raw) > MAX_SECRET_BYTES:
            raise SwarmKeyError(f"--swarm-key {p} is larger than {MAX_SECRET_BYTES} bytes; is it the right file?")
        secret = raw.strip()
        if not secret:
            raise SwarmKeyError(f"--swarm-key {p} is empty ({hint})")
        if len(secret) < MIN_SECRET_BYTES:
            raise SwarmKeyError(
                f"--swarm-key {p} holds {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}: "
                f"use a long random secret ({hint})"
            )
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("--swarm-key %s is readable by other users (mode %o); chmod 600 it", p, stat.S_IMODE(mode))
        return cls(secret, source=str(p))

    def subkey(self, label: str) -> bytes:
        """HMAC-SHA256(secret, label): one independent key per use."""
        return hmac.new(self._secret, f"swarmd/1 {label}".encode(), hashlib.sha256).digest()

    @property
    def key_id(self) -> str:
        """A short public fingerprint (to check two peers hold the same key); reveals nothing of it."""
        return self.subkey("key id").hex()[:12]

    def dht(self, **kwargs: Any) -> DatagramAuth:
        return DatagramAuth(self.subkey("dht"), **kwargs)

    def http(self, **kwargs: Any) -> HttpAuth:
        return HttpAuth(self.subkey("http"), **kwargs)

    def __repr__(self) -> str:  # never the secret
        return f"SwarmKey(id={self.key_id}, source={self.source!r})"


class ReplayCache:
    """Nonces seen within the freshness window, bounded in size.

    Entries expire once their timestamp is older than ``window_s``. When more than
    ``max_entries`` fresh ones are held, the oldest is evicted and every timestamp up to its
    one is refused from then on (``floor``): memory stays bounded and a replay is never
    accepted, at worst a legitimate message as old as the evicted ones is refused.
    """

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = DEFAULT_REPLAY_ENTRIES,
                 clock: Callable[[], float] = time.time) -> None:
        if max_entries < 1 or window_s <= 0:
            raise ValueError("max_entries must be >= 1 and window_s > 0")
        self.window_s = window_s
        self.max_entries = max_entries
        self.clock = clock
        self._seen: set[bytes] = set()
        self._order: list[tuple[float, bytes]] = []  # heap of (timestamp, nonce)
        self.floor = float("-inf")

    def __len__(self) -> int:
        return len(self._seen)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._order and (self._order[0][0] < horizon or len(self._order) > self.max_entries):
            ts, nonce = heapq.heappop(self._order)
            self._seen.discard(nonce)
            if ts >= horizon:  # evicted while still fresh: refuse anything this old from now on
                self.floor = max(self.floor, ts)

    def check(self, nonce: bytes, ts: float) -> str | None:
        """Why ``(nonce, ts)`` must be refused ("stale" or "replay"), or None; records nothing."""
        now = self.clock()
        if not (now - self.window_s <= ts <= now + self.window_s):
            return "stale"
        if ts <= self.floor or nonce in self._seen:
            return "replay"
        return None

    def add(self, nonce: bytes, ts: float) -> str | None:
        """Check and remember ``nonce``: None if it is fresh and new (now recorded), else why not."""
        self._expire(self.clock())
        why = self.check(nonce, ts)
        if why is None:
            self._seen.add(nonce)
            heapq.heappush(self._order, (ts, nonce))
            self._expire(self.clock())
        return why


class Authenticator:
    """One channel's MAC key, replay cache and refusal counters (with rate-limited log lines)."""

    channel = "message"

    def __init__(self, key: bytes, *, window_s: float = WINDOW_S, max_entries: int = DEFAULT_REPLAY_ENTRIES,
                 clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self.clock = clock
        self.replay = ReplayCache(window_s, max_entries, clock)
        self.refused: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self._logged: set[tuple[str, str]] = set()
        self._minute, self._new_lines = -1, 0
        self._since_log = 0

    def mac(self, *parts: bytes) -> bytes:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.digest()[:MAC_BYTES]

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def refuse(self, reason: str, addr: object, detail: str = "") -> str:
        """Count a refusal; log the first one per (address, reason), at most ``_NEW_LINES_PER_MIN``
        such lines a minute (UDP source addresses are easy to forge), and every ``LOG_EVERY``-th."""
        self.refused[reason] += 1
        who = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        self._since_log += 1
        minute = int(time.monotonic() // 60)
        if minute != self._minute:
            self._minute, self._new_lines = minute, 0
        new = (who, reason) not in self._logged and self._new_lines < _NEW_LINES_PER_MIN
        if new or self._since_log >= LOG_EVERY:
            if len(self._logged) >= _MAX_LOGGED_ADDRS:
                self._logged.clear()
            self._logged.add((who, reason))
            self._new_lines += new
            total = sum(self.refused.values())
            log.warning("refused a %s from %s: %s%s (%s); %d refused so far", self.channel, who, reason,
                        f", {detail}" if detail else "", _HINTS.get(reason, ""), total)
            self._since_log = 0
        return reason

    def counts(self) -> dict[str, int]:
        return {reason: self.refused[reason] for reason in REASONS}


class DatagramAuth(Authenticator):
    """Wraps and unwraps DHT datagrams (module docstring)."""

    channel = "DHT datagram"

    def wrap(self, datagram: bytes) -> bytes:
        head = bytes([DATAGRAM_TAG]) + self.now_ms().to_bytes(TS_BYTES, "big")
        return head + self.mac(head, datagram) + datagram

    def unwrap(self, data: bytes, addr: object) -> bytes | None:
        """The inner datagram, or None (refused: counted and logged) if it is not authentic."""
        if not data or data[0] != DATAGRAM_TAG:
            self.refuse("missing", addr)
            return None
        if len(data) < DATAGRAM_OVERHEAD:
            self.refuse("malformed", addr, f"{len(data)} bytes")
            return None
        head, mac, inner = data[: 1 + TS_BYTES], data[1 + TS_BYTES : DATAGRAM_OVERHEAD], data[DATAGRAM_OVERHEAD:]
        ts = int.from_bytes(head[1:], "big") / 1000
        why = self.replay.check(mac, ts)
        if why is not None:
            self.refuse(why, addr)
            return None
        if not hmac.compare_digest(mac, self.mac(head, inner)):
            self.refuse("bad_mac", addr)
            return None
        why = self.replay.add(mac, ts)
        if why is not None:
            self.refuse(why, addr)
            return None
        return inner


class HttpAuth(Authenticator):
    """Signs and checks data-plane requests (the ``X-Swarm-Auth`` header, module docstring)."""

    channel = "data-plane request"

    def _mac(self, method: str, path_qs: str, ts: str, nonce: str, body_sha256: bytes) -> bytes:
        return self.mac(method.upper().encode(), b"\n", path_qs.encode(), b"\n", ts.encode(), b"\n",
                        nonce.encode(), b"\n", body_sha256)

    def header(self, method: str, path_qs: str, body_sha256: bytes) -> str:
        ts, nonce = str(self.now_ms()), os.urandom(NONCE_BYTES).hex()
        return f"{ts}.{nonce}.{self._mac(method, path_qs, ts, nonce, body_sha256).hex()}"

    def precheck(self, value: str | None, addr: object) -> tuple[str, str, bytes] | str:
        """Cheap checks before the body is read: ``(ts, nonce, mac)``, or the refusal reason."""
        if not value:
            return self.refuse("missing", addr, f"no {AUTH_HEADER} header")
        match = _HEADER_RE.fullmatch(value.strip())
        if match is None:
            return self.refuse("malformed", addr, f"a bad {AUTH_HEADER} header")
        ts, nonce, mac_hex = match.groups()
        mac = bytes.fromhex(mac_hex)
        why = self.replay.check(bytes.fromhex(nonce), int(ts) / 1000)
        if why is not None:
            return self.refuse(why, addr)
        return ts, nonce, mac

    def verify(self, checked: tuple[str, str, bytes], method: str, path_qs: str, body_sha256: bytes,
               addr: object) -> str | None:
        """After :meth:`precheck` and reading the body: None if authentic (nonce now recorded)."""
        ts, nonce, mac = checked
        if not hmac.compare_digest(mac, self._mac(method, path_qs, ts, nonce, body_sha256)):
            return self.refuse("bad_mac", addr)
        why = self.replay.add(bytes.fromhex(nonce), int(ts) / 1000)
        if why is not None:
            return self.refuse(why, addr)
        return None


async def body_sha256(body: bytes) -> bytes:
    if len(body) > _HASH_IN_THREAD:  # hashlib releases the GIL: don't stall the loop on big frames
        return (await asyncio.to_thread(hashlib.sha256, body)).digest()
    return hashlib.sha256(body).digest()


def signing_middleware(auth: HttpAuth) -> Any:
    """An aiohttp client middleware that signs every request of a session with ``auth``.

    The MAC covers the exact body bytes sent (a bytes or ``io.BytesIO`` body is read without
    being consumed; aiohttp >= 3.12 rewinds it before sending).
    """
    import aiohttp

    async def sign(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        body = request.body
        data = await body.as_bytes() if body else b""
        request.headers[AUTH_HEADER] = auth.header(request.method, request.url.raw_path_qs, await body_sha256(data))
        return await handler(request)

    return sign
