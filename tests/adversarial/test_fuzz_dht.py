"""Hypothesis against a real DHTNode over real UDP on 127.0.0.1 (issue #6).

Two nodes run on an event loop in a background thread; the test's thread is the attacker, with a
plain UDP socket. After each generated datagram it pings the node and waits for the answer, so
every datagram has been handled (one at a time, in order, the node never has a backlog that
could overflow its receive buffer) before the next example. The invariant checked for every
datagram: it is either answered or dropped and counted under exactly one reason, never both,
never a handler error; and the node keeps answering. ``tests/integration/test_dht_node.py`` feeds the
protocol object directly and checks hand-picked junk over UDP; this is the same over the wire,
generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kademlia.utils import digest

from swarmd.dht import MAX_DATAGRAM, DHTNode, Identity
from swarmd.dht.records import encode_bundle, open_record
from swarmd.errors import RecordError
from tests.support.dht import peer_record

T = TypeVar("T")

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SENDER = os.urandom(20)  # the attacker's node id in its well-formed requests: one routing-table contact
INT64 = st.integers(-(2**63), 2**64 - 1)
VALUES = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=12) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner,
                                                                 max_size=4),
    max_leaves=12,
)
STR_KEYED = st.recursive(  # what the node can unpack (it refuses non-string map keys as malformed)
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=12) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
IDS = st.binary(min_size=20, max_size=20)
BAD_IDS = st.binary(max_size=40).filter(lambda b: len(b) != 20) | INT64 | st.text(min_size=20, max_size=20)
RPCS = ["ping", "store", "find_node", "find_value"]


class Nodes:
    def __init__(self, loop: asyncio.AbstractEventLoop, target: DHTNode, other: DHTNode) -> None:
        self.loop, self.target, self.other = loop, target, other

    def call(self, coro: Awaitable[T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]


@contextlib.contextmanager
def two_nodes() -> Iterator[Nodes]:
    """A node to attack and a second one joined to it, on a loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzzed-dht", daemon=True)
    thread.start()
    target = DHTNode(Identity.generate(), rpc_timeout=0.5)
    other = DHTNode(Identity.generate(), rpc_timeout=0.5)
    nodes = Nodes(loop, target, other)
    try:
        nodes.call(target.start())
        nodes.call(other.start([target.address]))
        yield nodes
    finally:
        try:
            nodes.call(other.stop())
            nodes.call(target.stop())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()


class Attacker:
    """A bare UDP socket; counts the answers to the datagrams it sent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(5.0)

    def close(self) -> None:
        self.sock.close()

    def send(self, datagram: bytes) -> None:
        self.sock.sendto(datagram, self.target)

    def ping(self) -> tuple[bytes, list[bytes]]:
        """Ping the node; its id, and every other answer that arrived before this one's."""
        msg_id = os.urandom(20)
        self.send(b"\x00" + msg_id + msgpack.packb(["ping", [SENDER]]))
        others = []
        while True:
            data = self.sock.recv(65536)  # socket.timeout fails the test: the node stopped answering
            if data[1:21] == msg_id:
                return msgpack.unpackb(data[21:]), others
            if data[:1] == b"\x01":  # an answer (the node may also call us: it took us for a contact)
                others.append(data)

    def call(self, name: str, *args: Any) -> Any:
        msg_id = os.urandom(20)
        self.send(b"\x00" + msg_id + msgpack.packb([name, list(args)]))
        while True:
            data = self.sock.recv(65536)
            if data[1:21] == msg_id:
                return msgpack.unpackb(data[21:], raw=False)


def _header(kind: int) -> bytes:
    return bytes([kind]) + os.urandom(20)


@st.composite
def datagrams(draw: st.DrawFn) -> tuple[str, bytes]:
    """(family, datagram): hostile datagrams of every kind the node must survive."""
    family = draw(st.sampled_from(["bytes", "header+msgpack", "rpc", "response", "oversized"]))
    if family == "bytes":
        prefix = draw(st.sampled_from([b"", b"\x00", b"\x01", b"\x02", b"\xff"]))
        return family, prefix + draw(st.binary(max_size=300))
    if family == "header+msgpack":
        return family, _header(draw(st.sampled_from([0, 1, 7]))) + msgpack.packb(draw(VALUES))
    if family == "rpc":  # a known RPC (mostly) with arguments of the wrong number, types or sizes
        name = draw(st.sampled_from(RPCS) | st.sampled_from(["", "rpc_ping", "__init__", "stun"]) | st.text(max_size=8))
        args = draw(st.lists(IDS | BAD_IDS | STR_KEYED, max_size=4))
        message: Any = [name, args] if draw(st.integers(0, 9)) else draw(st.sampled_from([[name], [name, args, 1],
                                                                                         {name: args}, [args, name]]))
        return family, _header(0) + msgpack.packb(message)
    if family == "response":  # an answer to a call never made
        return family, _header(1) + msgpack.packb(draw(STR_KEYED | IDS))
    return family, _header(0) + b"\x90" * (MAX_DATAGRAM - 20 + draw(st.integers(0, 2000)))


def test_any_datagram_is_answered_or_dropped_and_counted_and_the_node_keeps_working() -> None:
    with two_nodes() as nodes:
        target = nodes.target
        attacker = Attacker(target.address)
        families: Counter[str] = Counter()
        try:
            node_id, _ = attacker.ping()
            assert node_id == target.node.id

            @FUZZ
            @given(datagrams())
            def fuzz(case: tuple[str, bytes]) -> None:
                family, datagram = case
                families[family] += 1
                before = Counter(target.stats()["dropped_datagrams"])
                attacker.send(datagram)
                answer_id, answered = attacker.ping()  # handled in order: the junk is dealt with now
                assert answer_id == target.node.id
                dropped = Counter(target.stats()["dropped_datagrams"])
                dropped.subtract(before)
                change = +dropped  # the reasons that moved, and by how much
                assert dropped["handler_error"] == 0, datagram
                assert len(answered) + sum(change.values()) == 1, (datagram, answered, change)
                if family == "response":
                    assert change == {"unsolicited": 1}
                elif family == "oversized":
                    assert change == {"oversized": 1}
                elif family == "rpc" and not answered:
                    assert set(change) <= {"bad_request", "unknown_rpc"}, change

            fuzz()
        finally:
            attacker.close()
        stats = target.stats()
        assert stats["dropped_datagrams"].get("handler_error", 0) == 0
        assert stats["dropped_datagrams"]["unsolicited"] >= families["response"] > 0
        assert stats["dropped_datagrams"]["bad_request"] > 0 and stats["dropped_datagrams"]["malformed"] > 0
        # a legit store through the second node, read back through both
        alice = Identity.generate()
        assert nodes.call(nodes.other.store("fuzzed", peer_record(alice))) >= 1
        assert alice.peer_id in nodes.call(target.get("fuzzed"))
        assert alice.peer_id in nodes.call(nodes.other.get("fuzzed"))


@st.composite
def bundles(draw: st.DrawFn, good: bytes) -> tuple[str, bytes]:
    """A ``store`` value that is not a bundle of valid records."""
    family = draw(st.sampled_from(["bytes", "msgpack", "records", "mutated"]))
    if family == "bytes":
        return family, draw(st.binary(max_size=600))
    if family == "msgpack":
        return family, msgpack.packb(draw(VALUES))
    if family == "records":  # an array of byte strings that are not signed records
        return family, encode_bundle(draw(st.lists(st.binary(max_size=300) | VALUES.map(msgpack.packb), min_size=1,
                                                   max_size=4)))
    raw = bytearray(good)  # a valid record with a few bytes changed, cut or appended
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] = draw(st.integers(0, 255).filter(lambda b, old=raw[i]: b != old))
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))] + draw(st.binary(max_size=4))
    return family, encode_bundle([bytes(raw)])


def is_empty_array(bundle: bytes) -> bool:
    try:
        return msgpack.unpackb(bundle, strict_map_key=False) == []
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError):
        return False


def test_garbage_bundles_stored_over_udp_are_refused_counted_and_never_held() -> None:
    """The record decoder behind a real ``store`` RPC: only what ``open_record`` accepts is held."""
    with two_nodes() as nodes:
        target = nodes.target
        attacker = Attacker(target.address)
        alice = Identity.generate()
        good = peer_record(alice)
        key = digest("fuzzed-bundles")
        try:

            @FUZZ
            @given(bundles(good))
            def fuzz(case: tuple[str, bytes]) -> None:
                family, bundle = case
                before = sum(target.storage.rejected.values())
                held = target.storage.records(key)
                answer = attacker.call("store", SENDER, key, bundle)
                if answer is True:  # a mutation that still verifies (e.g. an ignored field appended)
                    assert family == "mutated" and all(_valid(r) for r in msgpack.unpackb(bundle))
                    assert set(target.storage.records(key)) == {alice.peer_id}
                    return
                assert answer is False
                assert target.storage.records(key) == held, (family, bundle)
                empty = is_empty_array(bundle)  # no record to refuse (random bytes may be one too: b"\x90")
                assert empty or sum(target.storage.rejected.values()) > before, (family, bundle)

            fuzz()
            assert attacker.call("store", SENDER, key, encode_bundle([good])) is True
        finally:
            attacker.close()
        assert list(target.storage.records(key)) == [alice.peer_id]
        assert target.stats()["dropped_datagrams"].get("handler_error", 0) == 0
        assert set(target.stats()["rejected"]) >= {"malformed", "signature"}


def _valid(raw: bytes) -> bool:
    try:
        open_record(raw, now=time.time())
    except RecordError:
        return False
    return True
