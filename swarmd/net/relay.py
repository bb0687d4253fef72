"""Relays: a peer nobody can dial (behind a NAT or a firewall) serves its stage through one that can.

A peer whose reachability check failed (``swarmd.net.reachability``) opens one outbound,
long-lived WebSocket to a reachable member (its *relay*) and announces the relayed address
``<its peer id>@<relay host:port>`` instead of its own. Whoever dials it (trainers, stage-mates,
the reachability probe) sends the request to the relay's data plane with the header
``X-Swarm-Relay: <peer id>`` (``swarmd.net.addresses.dial_target``); the relay passes it down the
WebSocket unchanged, the relayed peer serves it exactly as a direct request, through its own
data plane, and the answer comes back up (streamed, for state downloads). So routing, backward
affinity, averaging contributions and state downloads work the same, and in a private swarm the
``X-Swarm-Auth`` signature travels end to end: the relay checks it (it is a member and refuses
unsigned or forged requests before relaying) and so does the relayed peer, against its own
replay cache. A relay can delay, drop or misroute a request; it cannot forge or alter one
without the key.

Why a WebSocket: aiohttp speaks it on both ends (no new dependency), it multiplexes many
requests over the one connection the NAT lets out, its pings keep the NAT's mapping alive, and a
dead relay is seen at once as a closed connection (every request in flight through it then fails
like any failed peer and is retried elsewhere by the caller: nothing is lost).

Messages are msgpack maps, one per WebSocket binary message::

    relay -> peer   {"t": "challenge", "nonce": 32 bytes, "relay": relay peer id}
    peer -> relay   {"t": "hello", "key": ed25519 public key, "sig": sign(b"swarmd-relay\\0" + nonce + relay id)}
    relay -> peer   {"t": "welcome", "addr": the relayed address to announce}
    relay -> peer   {"t": "req", "id": n, "m": method, "p": path?query, "h": {header: value}, "b": body}
    peer -> relay   {"t": "res", "id": n, "s": status, "h": {header: value}, "b": bytes, "end": bool}
    peer -> relay   {"t": "body", "id": n, "b": bytes, "end": bool}          (more of a streamed answer)

The hello proves the relayed peer holds the key of the peer id it claims, so nobody can attach
as another peer and capture its traffic. Limits (relay side): at most ``max_peers`` relayed
peers, a byte budget per second over all of them (requests beyond it get 503 and go elsewhere),
a bounded request size (the data plane's frame limit) and a per-request deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from swarmd.dht.identity import Identity, peer_id_of, verify
from swarmd.dht.records import PeerRecord
from swarmd.finite import json_response, strict_json_dumps
from swarmd.net.addresses import RELAY_ATTACH_PATH, format_relayed

log = logging.getLogger(__name__)

ATTACH_PATH = RELAY_ATTACH_PATH
DEFAULT_MAX_PEERS = 8
DEFAULT_BUDGET_BYTES_S = 50 * 2**20  # 50 MiB/s over all relayed peers
REQUEST_TIMEOUT_S = 120.0  # a relayed request must be answered within this
HANDSHAKE_TIMEOUT_S = 10.0
CHUNK_BYTES = 1 << 20  # a streamed answer goes down the WebSocket in pieces of this size
MAX_MESSAGE_BYTES = 300 * 2**20  # above the data plane's frame limit, with room for msgpack
_FORWARDED_HEADERS = ("content-type", "x-swarm-auth", "accept")
_ANSWER_HEADERS = ("content-type", "cache-control")
_SIGNED = b"swarmd-relay\0"


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else b""


def _pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack(data: bytes) -> dict[str, Any] | None:
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return message if isinstance(message, dict) and isinstance(message.get("t"), str) else None


# ---- the relay's side ----------------------------------------------------------------------------


@dataclass
class _Relayed:
    peer_id: str
    ws: web.WebSocketResponse
    attached_at: float = field(default_factory=time.time)
    requests: int = 0
    bytes: int = 0
    pending: dict[int, asyncio.Queue[dict[str, Any] | None]] = field(default_factory=dict)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_id: int = 0


class _Budget:
    """A token bucket of bytes per second (one second of burst)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        self._tokens = rate
        self._at = clock()

    def take(self, n: int) -> bool:
        now = self._clock()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < n and self._tokens < self.rate:  # one large request may pass on a full bucket
            return False
        self._tokens -= n
        return True


class RelayServer:
    """Relays requests to the peers attached to it (installed on a reachable peer's data plane)."""

    def __init__(self, identity: Callable[[], Identity | None], *, addr: Callable[[], str | None],
                 enabled: Callable[[], bool], max_peers: int = DEFAULT_MAX_PEERS,
                 budget_bytes_s: float = DEFAULT_BUDGET_BYTES_S) -> None:
        self._identity = identity
        self._addr = addr
        self._enabled = enabled
        self.max_peers = max_peers
        self.budget = _Budget(budget_bytes_s)
        self.budget_bytes_s = budget_bytes_s
        self.peers: dict[str, _Relayed] = {}
        self.refused: dict[str, int] = {}  # attach refusals by reason
        self.over_budget = 0  # relayed requests refused because the byte budget was spent
        self.relayed_requests = 0
        self.relayed_bytes = 0

    def install(self, app: web.Application) -> None:
        app.router.add_get(ATTACH_PATH, self.attach, allow_head=False)

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self._enabled(),
            "max_peers": self.max_peers,
            "budget_bytes_s": self.budget_bytes_s,
            "peers": {pid: {"since": r.attached_at, "requests": r.requests, "bytes": r.bytes}
                      for pid, r in self.peers.items()},
            "requests": self.relayed_requests,
            "bytes": self.relayed_bytes,
            "over_budget": self.over_budget,
            "refused": dict(self.refused),
        }

    def _refuse(self, reason: str, status: int, message: str) -> web.Response:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return json_response({"error": "RelayRefused", "message": message}, status=status)

    async def attach(self, request: web.Request) -> web.StreamResponse:
        """A relayed peer's WebSocket (see the module docstring for the handshake)."""
        me = self._identity()
        if me is None or not self._enabled():
            return self._refuse("disabled", 503,
                                "this peer does not relay (unreachable itself, or --relay-max-peers 0)")
        if len(self.peers) >= self.max_peers:
            return self._refuse("full", 503, f"this peer relays for {self.max_peers} peers already")
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        nonce = secrets.token_bytes(32)
        await ws.send_bytes(_pack({"t": "challenge", "nonce": nonce, "relay": me.peer_id}))
        try:
            msg = await ws.receive(timeout=HANDSHAKE_TIMEOUT_S)
        except asyncio.TimeoutError:
            await ws.close(message=b"no hello in time")
            return ws
        hello = _unpack(msg.data) if msg.type == aiohttp.WSMsgType.BINARY else None
        key, sig = (hello or {}).get("key"), (hello or {}).get("sig")
        if not (hello and hello["t"] == "hello" and isinstance(key, bytes) and isinstance(sig, bytes)
                and verify(key, _SIGNED + nonce + bytes.fromhex(me.peer_id), sig)):
            self.refused["bad_hello"] = self.refused.get("bad_hello", 0) + 1
            await ws.close(message=b"bad hello")
            return ws
        peer_id = peer_id_of(key)
        if peer_id == me.peer_id:
            await ws.close(message=b"cannot relay for itself")
            return ws
        old = self.peers.get(peer_id)
        if old is not None:  # the same peer again (its old connection is dead or dying): the new one wins
            await old.ws.close(message=b"replaced by a newer connection")
        entry = _Relayed(peer_id, ws)
        self.peers[peer_id] = entry
        addr = self._addr()
        await ws.send_bytes(_pack({"t": "welcome", "addr": format_relayed(peer_id, addr) if addr else None}))
        log.info("relaying for peer %s", peer_id[:12])
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                answer = _unpack(msg.data)
                rid = answer.get("id") if answer else None
                queue = entry.pending.get(rid) if isinstance(rid, int) else None
                if queue is not None and answer is not None:
                    queue.put_nowait(answer)
        finally:
            if self.peers.get(peer_id) is entry:
                del self.peers[peer_id]
            for queue in entry.pending.values():
                queue.put_nowait(None)  # every request in flight through it fails now
            log.info("stopped relaying for peer %s", peer_id[:12])
        return ws

    async def forward(self, request: web.Request, target: str, body: bytes) -> web.StreamResponse:
        """Pass ``request`` (for ``target``, body already read) to the attached peer; its answer back."""
        entry = self.peers.get(target)
        if entry is None:
            return json_response({"error": "NotRelayed",
                                      "message": f"peer {target[:12]} is not relayed here (any more)"}, status=502)
        if not self.budget.take(len(body)):
            self.over_budget += 1
            return json_response({"error": "Busy", "message": "this relay's byte budget is spent; retry elsewhere"},
                                     status=503)
        entry.next_id += 1
        rid = entry.next_id
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        entry.pending[rid] = queue
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        entry.requests += 1
        self.relayed_requests += 1
        try:
            async with entry.send_lock:
                await entry.ws.send_bytes(_pack({"t": "req", "id": rid, "m": request.method,
                                                 "p": request.rel_url.raw_path_qs, "h": headers, "b": body}))
            first = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
            if first is None or first.get("t") != "res" or type(first.get("s")) is not int:
                return json_response({"error": "RelayFailed", "message": "the relayed peer went away"}, status=502)
            out_headers = {k: v for k, v in (first.get("h") or {}).items()
                           if isinstance(k, str) and isinstance(v, str) and k.lower() in _ANSWER_HEADERS}
            chunk = _bytes(first.get("b"))
            if first.get("end", True):
                self._count(entry, len(body) + len(chunk))
                return web.Response(status=first["s"], body=chunk, headers=out_headers)
            resp = web.StreamResponse(status=first["s"], headers=out_headers)
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            sent = len(chunk)
            await resp.write(chunk)
            while True:
                more = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
                if more is None or more.get("t") != "body":
                    if request.transport is not None:
                        request.transport.close()  # a truncated stream, never a silently short one
                    return resp
                piece = _bytes(more.get("b"))
                await resp.write(piece)
                sent += len(piece)
                if more.get("end", True):
                    break
            await resp.write_eof()
            self._count(entry, len(body) + sent)
            return resp
        except asyncio.TimeoutError:
            return json_response({"error": "RelayFailed", "message": "the relayed peer did not answer in time"},
                                     status=504)
        except ConnectionError:
            return json_response({"error": "RelayFailed", "message": "the relayed peer went away"}, status=502)
        finally:
            entry.pending.pop(rid, None)

    def _count(self, entry: _Relayed, n: int) -> None:
        entry.bytes += n
        self.relayed_bytes += n

    async def close(self) -> None:
        for entry in list(self.peers.values()):
            await entry.ws.close(message=b"the relay is shutting down")


# ---- the relayed peer's side ---------------------------------------------------------------------


@dataclass
class RelayStatus:
    """Whether and through whom this peer is relayed (``/status`` → ``relay``)."""

    state: str = "direct"  # direct | searching | relayed | none (nobody can relay)
    relay_id: str | None = None
    relay_addr: str | None = None
    relayed_addr: str | None = None  # what this peer announces while relayed
    since: float | None = None
    requests: int = 0
    why: str | None = None  # while searching or none: why the last attempts failed

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "relay_id": self.relay_id, "relay_addr": self.relay_addr,
                "relayed_addr": self.relayed_addr, "since": self.since, "requests": self.requests, "why": self.why}


class RelayClient:
    """Keeps this (unreachable) peer attached to one relay, and serves what comes down it.

    ``candidates()`` lists the members that may relay (reachable, direct, serving);
    ``local_base`` is this peer's own data plane as it can dial it itself; ``on_change`` is told
    whenever the relayed address changes (None: not relayed), to re-announce at once.
    """

    def __init__(self, identity: Identity, session: aiohttp.ClientSession, *, local_base: Callable[[], str],
                 candidates: Callable[[], Awaitable[Sequence[PeerRecord]]],
                 on_change: Callable[[str | None], Coroutine[Any, Any, None]], retry_s: float = 5.0) -> None:
        self.identity = identity
        self.session = session
        self.local_base = local_base
        self.candidates = candidates
        self.on_change = on_change
        self.retry_s = retry_s
        self.status = RelayStatus()
        self._tasks: set[asyncio.Task[None]] = set()
        self._local: aiohttp.ClientSession | None = None  # to this peer's own data plane (unsigned: the
        # relayed requests carry their callers' signatures)

    async def run(self) -> None:
        """Attach, serve until the relay goes away, attach to another; until cancelled."""
        self.status.state = "searching"
        tried: dict[str, float] = {}  # relay peer id -> when it last failed us
        self._local = aiohttp.ClientSession(auto_decompress=False)
        try:
            while True:
                now = time.monotonic()
                members = [r for r in await self.candidates() if r.peer_id != self.identity.peer_id]
                fresh = [r for r in members if now - tried.get(r.peer_id, -1e9) > 4 * self.retry_s]
                random.shuffle(fresh)
                if not fresh:
                    self.status.state = "none"
                    self.status.why = self.status.why or (
                        "no reachable member to relay through" if not members else "every possible relay refused")
                    log.error("nobody can relay for this peer (%s): it serves no one until a reachable member "
                              "that relays joins; open its data port or give --announce", self.status.why)
                    await asyncio.sleep(self.retry_s)
                    continue
                for relay in fresh:
                    try:
                        await self._serve_through(relay)
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                        self.status.why = f"{relay.peer_id[:12]} at {relay.data_addr}: {type(exc).__name__}: {exc}"
                        log.warning("relay %s failed: %s", relay.peer_id[:12], self.status.why)
                    tried[relay.peer_id] = time.monotonic()
                    if self.status.state == "relayed":
                        self.status.state = "searching"
                        await self.on_change(None)
                await asyncio.sleep(0.5)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._local.close()
            self.status = RelayStatus(state="direct")

    async def _serve_through(self, relay: PeerRecord) -> None:
        url = f"http://{relay.data_addr}{ATTACH_PATH}"
        async with self.session.ws_connect(url, heartbeat=20.0, max_msg_size=MAX_MESSAGE_BYTES,
                                           timeout=aiohttp.ClientWSTimeout(ws_close=5.0)) as ws:
            challenge = _unpack((await ws.receive(timeout=HANDSHAKE_TIMEOUT_S)).data or b"")
            nonce, relay_id = (challenge or {}).get("nonce"), (challenge or {}).get("relay")
            if not (challenge and challenge["t"] == "challenge" and isinstance(nonce, bytes)
                    and isinstance(relay_id, str) and relay_id == relay.peer_id):
                raise ValueError("the relay's challenge is malformed or names another peer")
            sig = self.identity.sign(_SIGNED + nonce + bytes.fromhex(relay_id))
            await ws.send_bytes(_pack({"t": "hello", "key": self.identity.public_key_bytes, "sig": sig}))
            welcome = _unpack((await ws.receive(timeout=HANDSHAKE_TIMEOUT_S)).data or b"")
            if not (welcome and welcome["t"] == "welcome"):
                raise ValueError(f"the relay refused (WebSocket close code {ws.close_code})")
            relayed = format_relayed(self.identity.peer_id, relay.data_addr)
            self.status = RelayStatus(state="relayed", relay_id=relay.peer_id, relay_addr=relay.data_addr,
                                      relayed_addr=relayed, since=time.time())
            log.info("relayed through %s at %s: announcing %s", relay.peer_id[:12], relay.data_addr, relayed)
            # told in a task of its own: it checks reachability through the relay, whose probes come down
            # this very WebSocket, which is read only below
            self._spawn(self.on_change(relayed))
            lock = asyncio.Lock()
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                req = _unpack(msg.data)
                if not req or req["t"] != "req" or type(req.get("id")) is not int:
                    continue
                self._spawn(self._answer(ws, lock, req))
            self.status.why = f"the connection to {relay.peer_id[:12]} closed ({ws.close_code})"

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a relayed request failed", exc_info=task.exception())

    async def _answer(self, ws: Any, lock: asyncio.Lock, req: dict[str, Any]) -> None:
        """Serve one relayed request through this peer's own data plane; stream the answer back up."""
        rid = req["id"]
        method, path = req.get("m"), req.get("p")
        headers: dict[Any, Any] = req["h"] if isinstance(req.get("h"), dict) else {}
        body = req.get("b") if isinstance(req.get("b"), bytes) else b""
        self.status.requests += 1

        async def send(message: dict[str, Any]) -> None:
            async with lock:
                await ws.send_bytes(_pack(message))

        if method not in ("GET", "POST") or not isinstance(path, str) or not path.startswith("/v1/"):
            await send({"t": "res", "id": rid, "s": 400, "h": {"Content-Type": "application/json"},
                        "b": b'{"error": "RequestError", "message": "not a data-plane request"}', "end": True})
            return
        clean = {k: v for k, v in headers.items() if isinstance(k, str) and isinstance(v, str)
                 and k.lower() in _FORWARDED_HEADERS}
        assert self._local is not None  # created in run() before anything is served
        try:
            async with self._local.request(method, f"{self.local_base()}{path}", data=body, headers=clean,
                                           timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                out = {k: v for k, v in resp.headers.items() if k.lower() in _ANSWER_HEADERS}
                first = True
                while True:
                    piece = await resp.content.read(CHUNK_BYTES)
                    end = resp.content.at_eof() or not piece
                    if first:
                        await send({"t": "res", "id": rid, "s": resp.status, "h": out, "b": piece, "end": end})
                        first = False
                    else:
                        await send({"t": "body", "id": rid, "b": piece, "end": end})
                    if end:
                        return
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await send({"t": "res", "id": rid, "s": 502, "h": {"Content-Type": "application/json"},
                            "b": _pack_error(f"the relayed peer could not serve it: {type(exc).__name__}"),
                            "end": True})


def _pack_error(message: str) -> bytes:
    return strict_json_dumps({"error": "RelayFailed", "message": message}).encode()
