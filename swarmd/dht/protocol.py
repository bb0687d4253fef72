"""Kademlia's four RPCs over UDP (Maymounkov & Mazières, section 2.3), hardened for untrusted input,
plus ``whoami``: the answering node returns the ``[ip, port]`` it saw the request come from (as
a STUN binding response does), so that a daemon bound to ``0.0.0.0`` learns the address others
reach it at (``swarmd.net.addresses``). A node of an older build drops it as an unknown RPC,
which counts as no answer.

The framing is rpcudp 5.0.1's, unchanged, so every message is one datagram::

    kind (1 B: 0x00 request, 0x01 response) | msg_id (20 B) | msgpack([name, args]) or msgpack(result)

rpcudp refuses to send a request whose msgpack part exceeds ``RPC_MAX_PAYLOAD`` = 8192 bytes
(``MalformedMessage: Total length of function name and arguments cannot exceed 8K``), so the
largest datagram a peer ever needs to send is ``MAX_DATAGRAM`` = 21 + 8192 = 8213 bytes (under
macOS's default 9216-byte UDP limit; on the internet it travels as ~6 IP fragments). A ``store``
request spends 55 of those bytes on its name, node id and key, which leaves
``MAX_BUNDLE_BYTES`` = 8137 bytes for a DHT value: the storage never holds more under one key,
so that both a ``find_value`` answer and kademlia's key hand-over to a new neighbour (section
2.5, a ``store`` of the whole value) fit in one datagram.

In a private swarm (``--swarm-key``, :mod:`swarmd.swarm_key`) every datagram is wrapped in 25 more
bytes (a tag, a timestamp and a MAC; ``MAX_DATAGRAM`` and ``MAX_BUNDLE_BYTES`` still bound the
rpcudp datagram inside) and checked before anything in it is parsed: an unauthenticated, stale or
replayed one is dropped unanswered and counted in ``auth.refused``. A node without a key drops
the wrapped datagrams it receives (``dropped["private_swarm"]``), so keyed and unkeyed nodes never
talk.

What :class:`DHTProtocol` overrides, and why (everything else is kademlia's):

``datagram_received`` / ``_solve_datagram`` / ``_accept_request`` / ``_accept_response`` (rpcudp)
    rpcudp starts an un-owned task per datagram and another per request, and parses inside them,
    so garbage raises in a task nobody awaits. Kademlia's handlers are all synchronous, so here a
    datagram is parsed and answered inside ``datagram_received``: no task per datagram at all.
    Oversized, short, non-msgpack datagrams, unknown RPCs and arguments of the wrong shape are
    dropped and counted in ``dropped`` (by reason) before any handler runs.
``__getattr__`` / ``_timeout`` (rpcudp)
    rpcudp turns *any* unknown attribute into a remote call; that is removed (a typo is an
    ``AttributeError`` again) and calls go through :meth:`DHTProtocol._call`, which keeps
    rpcudp's msg-id/timer scheme but answers ``(False, None)`` at once once the protocol is
    closed and resolves every outstanding call on :meth:`DHTProtocol.aclose`.
``call_ping`` / ``call_store`` / ``call_find_node`` / ``call_find_value`` (kademlia)
    The answer is checked against the shape kademlia's crawlers rely on (a list of
    ``[id, ip, port]``, ``{"value": bytes}``, ...); a malformed answer counts as no answer, so it
    is dropped, counted and its sender evicted instead of raising inside a lookup.
``rpc_store`` (kademlia)
    The value is a *bundle* (msgpack array of signed records) merged into
    :class:`~swarmd.dht.storage.RecordStorage`, accounted to the sender's source group
    (:func:`~swarmd.dht.sources.source_group` of the datagram's address, under ``source_grouping``:
    kademlia hands ``rpc_store`` the sender, which the storage uses to bound what one address may
    place under a key, issue 18); the answer is ``True`` only if every record of it is now held
    (invalid, capped or over-quota records make it ``False``).
``welcome_if_new`` (kademlia, section 2.5)
    Hand-over of stored keys to a new close neighbour runs as owned tasks; it also fixes
    kademlia 2.2.3 hashing the (already hashed) key a second time before measuring distances,
    hands over when the table holds fewer than k nodes, and ignores this node's own id.
``call_store`` / ``call_find_value``, continued
    At most ``max_bulk_rpcs`` (default 8) of them are in flight per node, so that the answers
    (up to 8 KB each) never overflow the socket's receive buffer (see ``DEFAULT_MAX_BULK_RPCS``).
``RoutingTable.add_contact`` (kademlia, section 2.2/4.1)
    The "ping the least recently seen node of a full bucket" step is an owned task, at most one
    per node at a time.
``RoutingTable.find_neighbors`` (kademlia, section 2.1)
    Exact k-nearest by XOR distance: kademlia 2.2.3's bucket walk can stop early and return
    too few nodes (even none), so ``store`` kept records locally only.
"""

from __future__ import annotations

import asyncio
import heapq
import ipaddress
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgpack
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.routing import RoutingTable

from swarmd.dht.sources import Grouping, source_group
from swarmd.swarm_key import DATAGRAM_OVERHEAD, DATAGRAM_TAG, DatagramAuth

__all__ = [
    "DEFAULT_MAX_BULK_RPCS",
    "HEADER_BYTES",
    "MAX_BUNDLE_BYTES",
    "MAX_DATAGRAM",
    "RECV_BUFFER_BYTES",
    "RPC_MAX_PAYLOAD",
    "DHTProtocol",
    "MergeOutcome",
    "TaskSet",
]

log = logging.getLogger(__name__)

RPC_MAX_PAYLOAD = 8192  # rpcudp.protocol.RPCProtocol.__getattr__.func refuses larger requests
HEADER_BYTES = 21  # kind byte + 20-byte msg id
MAX_DATAGRAM = HEADER_BYTES + RPC_MAX_PAYLOAD
_REQUEST, _RESPONSE = 0x00, 0x01
_PRIVATE_TAG = bytes([DATAGRAM_TAG])  # the first byte of a private swarm's datagrams
_ID_BYTES = 20


def _store_overhead() -> int:
    """Bytes a ``store`` request adds around its value (a bin16 one: values are >= 256 bytes)."""
    probe = 1000
    return len(msgpack.packb(["store", [b"\0" * _ID_BYTES, b"\0" * _ID_BYTES, b"\0" * probe]])) - probe


MAX_BUNDLE_BYTES = RPC_MAX_PAYLOAD - _store_overhead()  # 8137

# At most this many ``find_value``/``store`` calls of one node in flight: their datagrams can be
# 8 KB each, and a burst of them (a lookup asks up to k nodes at once, ``get_stage_peers`` runs
# one lookup per bucket, a new neighbour receives every key it should hold) overflows a UDP
# receive buffer of Linux's default size (212992 bytes, ~25 such datagrams): the kernel drops
# the excess, the calls time out and their nodes are evicted from the routing table. Measured on
# a 100-node loopback DHT: a 4-bucket stage read lost ~30 datagrams and took one rpc_timeout
# without this cap, and none with it.
DEFAULT_MAX_BULK_RPCS = 8
RECV_BUFFER_BYTES = 1 << 20  # asked for (best effort: the kernel caps it at net.core.rmem_max)


class MergeOutcome(Protocol):
    """What the storage says about a stored bundle (see ``RecordStorage.merge``)."""

    @property
    def ok(self) -> bool: ...


class BundleStorage(Protocol):
    def merge(self, key: bytes, bundle: bytes, *, source: str | None = None) -> MergeOutcome: ...
    def get(self, key: bytes, default: Any = None) -> Any: ...
    def keys(self) -> list[bytes]: ...


class TaskSet:
    """Tasks with one owner: spawned here, cancelled and awaited by :meth:`aclose`.

    A task that fails is logged with its traceback when it ends (its exception is retrieved, so
    asyncio never reports "Task exception was never retrieved").
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any] | None:
        """Run ``coro`` as an owned task; after :meth:`aclose` it is closed unrun and None returned."""
        if self._closed:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: task %s failed", self.name, task.get_name(), exc_info=task.exception())

    async def aclose(self) -> None:
        """Refuse new tasks, cancel the running ones and wait until every one has ended."""
        self._closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)


T = TypeVar("T")


async def gather_all(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that waits for every awaitable before raising the first error."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


# --- shapes of requests and answers (remote input: checked, never asserted) ---------------------


def _is_id(x: object) -> bool:
    return type(x) is bytes and len(x) == _ID_BYTES


def _is_contact(x: object) -> bool:
    return (
        isinstance(x, list)
        and len(x) == 3
        and _is_id(x[0])
        and type(x[1]) is str
        and 0 < len(x[1]) <= 255
        and type(x[2]) is int
        and 0 < x[2] < 65536
    )


def _is_contact_list(x: object) -> bool:
    return isinstance(x, list) and all(_is_contact(c) for c in x)


def _is_value_or_contacts(x: object) -> bool:
    if isinstance(x, dict):
        value = x.get("value")
        return type(value) is bytes and len(value) <= MAX_BUNDLE_BYTES
    return _is_contact_list(x)


def unmapped(ip: str) -> str:
    """``::ffff:10.0.0.1`` (an IPv4 peer on a dual-stack socket) → ``10.0.0.1``; others unchanged."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else str(addr)


def _is_bool(x: object) -> bool:
    return type(x) is bool


def _is_observed(x: object) -> bool:
    """A ``whoami`` answer: ``[ip, port]`` as the answering node saw the request come from."""
    if not (isinstance(x, list) and len(x) == 2 and type(x[0]) is str and type(x[1]) is int):
        return False
    try:
        ipaddress.ip_address(x[0])
    except ValueError:
        return False
    return 0 < x[1] < 65536


_REQUESTS: dict[str, Callable[[list[Any]], bool]] = {
    "ping": lambda a: len(a) == 1 and _is_id(a[0]),
    "store": lambda a: len(a) == 3 and _is_id(a[0]) and _is_id(a[1]) and type(a[2]) is bytes,
    "find_node": lambda a: len(a) == 2 and _is_id(a[0]) and _is_id(a[1]),
    "find_value": lambda a: len(a) == 2 and _is_id(a[0]) and _is_id(a[1]),
    "whoami": lambda a: len(a) == 1 and _is_id(a[0]),
}
_UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException)


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[tuple[bool, Any]]
    timer: asyncio.TimerHandle
    name: str


class _OwnedRoutingTable(RoutingTable):
    """kademlia's routing table, with an exact ``find_neighbors`` and the full-bucket ping run as
    an owned task."""

    protocol: DHTProtocol

    def find_neighbors(self, node: Node, k: int | None = None, exclude: Node | None = None) -> list[Node]:
        """The ``k`` contacts closest to ``node`` by XOR distance (section 2.1).

        kademlia 2.2.3 walks buckets outwards with ``TableTraverser``, which stops as soon as the
        buckets on the right run out, even when buckets on the left remain (a node with 22
        contacts found 0 neighbours for some keys), and keeps the first k nodes walked rather than
        the k closest. A routing table holds at most a few hundred contacts: scan them all.
        """
        self.buckets[self.get_bucket_for(node)].touch_last_updated()  # a lookup refreshes it (2.3)
        candidates = (
            contact
            for bucket in self.buckets
            for contact in bucket.nodes.values()
            if contact.id != node.id and (exclude is None or not contact.same_home_as(exclude))
        )
        return heapq.nsmallest(k or self.ksize, candidates, key=node.distance_to)

    def add_contact(self, node: Node) -> None:
        index = self.get_bucket_for(node)
        bucket = self.buckets[index]
        if bucket.add_node(node):
            return
        # Per section 4.2 of the paper, split if the bucket has this node in its range or if
        # the depth is not congruent to 0 mod 5 (kademlia.routing.RoutingTable.add_contact).
        if bucket.has_in_range(self.node) or bucket.depth() % 5 != 0:
            self.split_bucket(index)
            self.add_contact(node)
        else:
            self.protocol.ping_head(bucket.head())


class DHTProtocol(KademliaProtocol):
    """kademlia's protocol with owned tasks, checked input and merge-on-store (module docstring)."""

    def __init__(
        self,
        source_node: Node,
        storage: BundleStorage,
        ksize: int,
        *,
        rpc_timeout: float = 2.0,
        max_bulk_rpcs: int = DEFAULT_MAX_BULK_RPCS,
        auth: DatagramAuth | None = None,
        source_grouping: Grouping = "auto",
    ) -> None:
        source_group(None, source_grouping)  # an unknown grouping is a ValueError here, not per datagram
        super().__init__(source_node, storage, ksize)
        self.source_grouping: Grouping = source_grouping
        self.auth = auth  # a private swarm's key: every datagram is wrapped and checked (swarmd.swarm_key)
        self._private_senders: set[str] = set()
        self._bulk = asyncio.Semaphore(max_bulk_rpcs)
        self.router = _OwnedRoutingTable(self, ksize, source_node)
        self.storage: BundleStorage = storage
        self.ksize = ksize
        self.rpc_timeout = rpc_timeout
        self.tasks = TaskSet("dht protocol")
        self.dropped: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()  # requests sent, by RPC name
        self.timed_out: Counter[str] = Counter()  # requests that got no answer in time, by RPC name
        self._outstanding: dict[bytes, _Pending] = {}
        self._pinging: set[bytes] = set()
        self._closed = False
        self._lost: asyncio.Future[None] | None = None

    def __getattr__(self, name: str) -> Any:
        # rpcudp.RPCProtocol.__getattr__ would turn this into a remote call named ``name``.
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- transport events -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._lost = asyncio.get_running_loop().create_future()
        sock = transport.get_extra_info("socket")
        if sock is not None and RECV_BUFFER_BYTES:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES)
            except OSError as exc:
                log.debug("could not enlarge the DHT socket's receive buffer: %s", exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def error_received(self, exc: Exception) -> None:
        # An ICMP error (port unreachable...) for some earlier datagram; the call it belonged
        # to (if any) ends by timeout. A UDP socket cannot say which destination it was.
        log.debug("DHT socket error: %s", exc)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self._closed:
            return
        if self.auth is not None:  # a private swarm: authenticate before parsing anything
            if len(data) > MAX_DATAGRAM + DATAGRAM_OVERHEAD:
                return self._drop("oversized", addr)
            inner = self.auth.unwrap(data, addr)
            if inner is None:
                return  # counted (by reason) and logged by the authenticator
            data = inner
        elif data[:1] == _PRIVATE_TAG:
            return self._drop_private(addr)
        if len(data) > MAX_DATAGRAM:
            return self._drop("oversized", addr)
        if len(data) < HEADER_BYTES + 1:
            return self._drop("short", addr)
        kind, msg_id = data[0], data[1:HEADER_BYTES]
        try:
            message = msgpack.unpackb(data[HEADER_BYTES:], raw=False)
        except _UNPACK_ERRORS:
            return self._drop("malformed", addr)
        if kind == _REQUEST:
            self._handle_request(msg_id, message, addr)
        elif kind == _RESPONSE:
            self._handle_response(msg_id, message, addr)
        else:
            self._drop("unknown_kind", addr)

    def _drop(self, reason: str, addr: object) -> None:
        self.dropped[reason] += 1
        log.debug("dropped a DHT datagram from %s: %s", addr, reason)

    def _drop_private(self, addr: object) -> None:
        """A member of a private swarm wrote to this node, which has no swarm key."""
        self.dropped["private_swarm"] += 1
        who = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        if who not in self._private_senders and len(self._private_senders) < 1024:
            self._private_senders.add(who)
            log.warning("dropped a DHT datagram from %s: it belongs to a private swarm, and this node has no "
                        "--swarm-key", who)

    def _handle_request(self, msg_id: bytes, message: object, addr: tuple[Any, ...]) -> None:
        if not (isinstance(message, list) and len(message) == 2):
            return self._drop("bad_request", addr)
        name, args = message
        if type(name) is not str or not isinstance(args, list):
            return self._drop("bad_request", addr)
        check = _REQUESTS.get(name)
        if check is None:
            return self._drop("unknown_rpc", addr)
        if not check(args):
            return self._drop("bad_request", addr)
        try:
            response = getattr(self, f"rpc_{name}")(addr, *args)
            payload = msgpack.packb(response, use_bin_type=True)
        except Exception:  # a bug in a handler must cost one request, not the socket
            log.exception("DHT %s request from %s failed", name, addr)
            return self._drop("handler_error", addr)
        self._send(bytes([_RESPONSE]) + msg_id + payload, addr)

    def _handle_response(self, msg_id: bytes, data: object, addr: tuple[Any, ...]) -> None:
        pending = self._outstanding.pop(msg_id, None)
        if pending is None:
            return self._drop("unsolicited", addr)  # late (after its timeout) or forged
        pending.timer.cancel()
        if not pending.future.done():
            pending.future.set_result((True, data))

    def _send(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self.transport is not None and not self._closed:
            if self.auth is not None:
                data = self.auth.wrap(data)
            self.transport.sendto(data, addr)  # type: ignore[attr-defined]

    # --- outgoing calls -------------------------------------------------------------------------

    def _call(
        self, address: tuple[str, int], name: str, *args: Any, timeout: float | None = None
    ) -> asyncio.Future[tuple[bool, Any]]:
        """Send request ``name(*args)``; the future resolves to ``(True, answer)`` or ``(False, None)``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        if self._closed or self.transport is None:
            future.set_result((False, None))
            return future
        payload = msgpack.packb([name, list(args)], use_bin_type=True)
        if len(payload) > RPC_MAX_PAYLOAD:  # storage caps values below this; a bug if reached
            raise ValueError(f"DHT {name} request of {len(payload)} bytes exceeds {RPC_MAX_PAYLOAD}")
        msg_id = os.urandom(_ID_BYTES)
        self.sent[name] += 1
        timer = loop.call_later(self.rpc_timeout if timeout is None else timeout, self._on_timeout, msg_id)
        self._outstanding[msg_id] = _Pending(future, timer, name)
        self._send(bytes([_REQUEST]) + msg_id + payload, address)
        return future

    def _on_timeout(self, msg_id: bytes) -> None:
        pending = self._outstanding.pop(msg_id, None)
        if pending is not None and not pending.future.done():
            self.timed_out[pending.name] += 1
            pending.future.set_result((False, None))

    def _checked(self, result: tuple[bool, Any], shape: Callable[[object], bool], node: Node) -> tuple[bool, Any]:
        if result[0] and not shape(result[1]):
            self._drop("bad_response", (node.ip, node.port))
            return (False, None)
        return result

    async def ping_address(self, address: tuple[str, int], *, timeout: float | None = None) -> bytes | None:
        """The node id answering at ``address``, or None if nothing valid came back in time."""
        ok, answer = await self._call(address, "ping", self.source_node.id, timeout=timeout)
        if not ok:
            return None
        if not _is_id(answer):
            self._drop("bad_response", address)
            return None
        return answer

    async def observed_from(self, address: tuple[str, int], *, timeout: float | None = None) -> tuple[str, int] | None:
        """The address this node's datagrams come from, as the node at ``address`` sees it (its
        ``whoami`` answer, like a STUN binding response), or None without a valid answer in time."""
        ok, answer = await self._call(address, "whoami", self.source_node.id, timeout=timeout)
        if not ok:
            return None
        if not _is_observed(answer):
            self._drop("bad_response", address)
            return None
        return unmapped(answer[0]), answer[1]

    def rpc_whoami(self, sender: tuple[Any, ...], nodeid: bytes) -> list[Any]:
        """Answer with the address the request came from, so a node bound to a wildcard address
        (or behind a NAT) learns how others see it. Like ``ping``, it also welcomes the sender."""
        self.welcome_if_new(Node(nodeid, sender[0], sender[1]))
        return [unmapped(str(sender[0])), int(sender[1])]

    async def call_ping(self, node_to_ask: Node) -> tuple[bool, Any]:
        result = await self._call((node_to_ask.ip, node_to_ask.port), "ping", self.source_node.id)
        return self.handle_call_response(self._checked(result, _is_id, node_to_ask), node_to_ask)

    async def call_store(self, node_to_ask: Node, key: bytes, value: bytes) -> tuple[bool, Any]:
        async with self._bulk:
            result = await self._call((node_to_ask.ip, node_to_ask.port), "store", self.source_node.id, key, value)
        return self.handle_call_response(self._checked(result, _is_bool, node_to_ask), node_to_ask)

    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        result = await self._call((node_to_ask.ip, node_to_ask.port), "find_node", self.source_node.id, node_to_find.id)
        return self.handle_call_response(self._checked(result, _is_contact_list, node_to_ask), node_to_ask)

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        async with self._bulk:  # its answer may be a full 8 KB datagram
            address = (node_to_ask.ip, node_to_ask.port)
            result = await self._call(address, "find_value", self.source_node.id, node_to_find.id)
        return self.handle_call_response(self._checked(result, _is_value_or_contacts, node_to_ask), node_to_ask)

    def handle_call_response(self, result: tuple[bool, Any], node: Node) -> tuple[bool, Any]:
        # kademlia's, with its per-call INFO/WARNING lines lowered to DEBUG.
        if not result[0]:
            log.debug("no valid answer from %s, removing it from the routing table", node)
            self.router.remove_contact(node)
            return result
        self.welcome_if_new(node)
        return result

    def ping_head(self, node: Node) -> None:
        """Ping the least recently seen node of a full bucket (evicted if it does not answer)."""
        if node.id not in self._pinging:
            self._pinging.add(node.id)
            self.tasks.spawn(self._ping_head(node), name="dht ping bucket head")

    async def _ping_head(self, node: Node) -> None:
        try:
            await self.call_ping(node)
        finally:
            self._pinging.discard(node.id)

    # --- handlers -------------------------------------------------------------------------------

    def rpc_store(
        self, sender: tuple[Any, ...], nodeid: bytes, key: bytes, value: bytes
    ) -> bool:
        self.welcome_if_new(Node(nodeid, sender[0], sender[1]))
        return self.storage.merge(key, value, source=source_group(sender, self.source_grouping)).ok

    def welcome_if_new(self, node: Node) -> None:
        """Add a new contact; hand over the keys it should now store (section 2.5)."""
        if node.id == self.source_node.id or not self.router.is_new_node(node):
            return
        for key in self.storage.keys():
            keynode = Node(key)  # kademlia 2.2.3 uses Node(digest(key)): key is already a digest
            neighbors = self.router.find_neighbors(keynode)
            if neighbors:
                farthest = neighbors[-1].distance_to(keynode)
                new_node_close = len(neighbors) < self.ksize or node.distance_to(keynode) < farthest
                this_closest = self.source_node.distance_to(keynode) < neighbors[0].distance_to(keynode)
            if not neighbors or (new_node_close and this_closest):
                value = self.storage.get(key)  # encoded only for the keys handed over
                if value is not None:
                    self.tasks.spawn(self.call_store(node, key, value), name="dht hand-over")
        self.router.add_contact(node)

    # --- shutdown ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def outstanding(self) -> int:
        """Calls waiting for an answer."""
        return len(self._outstanding)

    async def aclose(self) -> None:
        """Answer every outstanding call with ``(False, None)``, end every owned task, close the socket."""
        self._closed = True
        for pending in self._outstanding.values():
            pending.timer.cancel()
            if not pending.future.done():
                pending.future.set_result((False, None))
        self._outstanding.clear()
        await self.tasks.aclose()
        if self.transport is not None:
            self.transport.close()
            if self._lost is not None:
                await self._lost
