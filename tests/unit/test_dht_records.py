"""Signed DHT records, bundles and the merging storage: pure functions, no sockets."""

from __future__ import annotations

import asyncio
import os
import stat
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from rpcudp.exceptions import MalformedMessage
from rpcudp.protocol import RPCProtocol

from swarmd.dht.identity import IDENTITY_FILE, Identity, peer_id_of, verify
from swarmd.dht.protocol import MAX_BUNDLE_BYTES, MAX_DATAGRAM, RPC_MAX_PAYLOAD
from swarmd.dht.records import (
    MAX_RECORD_BYTES,
    PEER_STATES,
    PeerRecord,
    RecordCache,
    SwarmRecord,
    _signed_message,
    bundle_entry_size,
    bundle_size,
    decode_bundle,
    encode_bundle,
    open_record,
    sign_record,
)
from swarmd.dht.storage import RecordStorage
from swarmd.errors import (
    BadSignature,
    ConfigError,
    DHTError,
    MalformedRecord,
    PeerIdMismatch,
    RecordError,
    RecordExpired,
    RecordTooLarge,
    SwarmdError,
    UnsupportedRecordVersion,
)
from swarmd.pipeline.spec import PRESETS

NOW = 1_700_000_000.0
ALICE = Identity.from_private_bytes(bytes(range(32)))
BOB = Identity.from_private_bytes(bytes(range(1, 33)))


def peer(identity: Identity = ALICE, *, t: float = NOW, ttl: float = 90.0, **changes: Any) -> PeerRecord:
    """A realistic record: IPv4 data plane, IPv6 control plane, a sha256 params digest."""
    fields: dict[str, Any] = dict(
        peer_id=identity.peer_id,
        stage=3,
        state="migrating",
        data_addr="203.0.113.45:31337",
        api_addr="[2001:db8:85a3::8a2e:370:7334]:31338",
        throughput=123.456,
        queue=7,
        step=123456,
        params_digest="ab" * 32,
        version="0.1.0",
        timestamp=t,
        expiry=t + ttl,
        checkpoint=123450,
    )
    fields.update(changes)
    return PeerRecord(**fields)


def swarm(identity: Identity = ALICE, *, t: float = NOW, ttl: float = 300.0) -> SwarmRecord:
    return SwarmRecord(
        swarm="test-swarm",
        spec=PRESETS["tiny"].to_dict(),
        training={"lr": 3e-4, "batch_size": 64, "announce_period_s": 30.0},
        founder=identity.peer_id,
        timestamp=t,
        expiry=t + ttl,
    )


def envelope(identity: Identity, body: Any, *, v: int = 1, t: str = "p", **extra: Any) -> bytes:
    """A hand-made envelope whose signature is valid for ``body`` (whatever it contains)."""
    raw_body = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    signature = identity.sign(_signed_message(v, t, raw_body))
    return msgpack.packb({"v": v, "t": t, "b": raw_body, "k": identity.public_key_bytes, "s": signature, **extra})


def unpacked(raw: bytes) -> dict[str, Any]:
    return msgpack.unpackb(raw, raw=False)


# --- identity -------------------------------------------------------------------------------------


def test_identity_persists_with_private_mode(tmp_path):
    state = tmp_path / "state" / "nested"
    first = Identity.load_or_create(state)
    key_file = state / IDENTITY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.stat().st_size == 32
    again = Identity.load_or_create(state)
    assert again.peer_id == first.peer_id and again.public_key_bytes == first.public_key_bytes
    assert len(first.peer_id) == 40 and first.peer_id == peer_id_of(first.public_key_bytes)
    assert first.node_id == bytes.fromhex(first.peer_id)
    assert [p.name for p in state.iterdir()] == [IDENTITY_FILE]  # no temporary file left behind


def test_identity_corrupt_file_is_a_config_error(tmp_path):
    (tmp_path / IDENTITY_FILE).write_bytes(b"short")
    with pytest.raises(ConfigError, match="corrupt"):
        Identity.load_or_create(tmp_path)


def test_sign_and_verify():
    sig = ALICE.sign(b"data")
    assert verify(ALICE.public_key_bytes, b"data", sig)
    assert not verify(ALICE.public_key_bytes, b"dat4", sig)
    assert not verify(BOB.public_key_bytes, b"data", sig)
    assert not verify(b"short", b"data", sig)
    assert not verify(ALICE.public_key_bytes, b"data", sig[:-1])
    assert not verify(b"\xff" * 32, b"data", sig)  # not a curve point


# --- round trips and sizes ---------------------------------------------------------------------------


def test_peer_record_round_trip_and_size():
    record = peer()
    raw = sign_record(ALICE, record)
    assert open_record(raw, now=NOW) == record
    # Pinned in the module docstrings of records.py and node.py: keep them in sync.
    assert len(raw) == 305
    assert len(unpacked(raw)["b"]) == 189
    assert bundle_entry_size(len(raw)) == 308


def test_peer_record_without_digest_round_trips():
    record = peer(params_digest=None, state="joining", throughput=0, api_addr="")
    assert open_record(sign_record(ALICE, record), now=NOW) == record
    assert isinstance(record.throughput, float)


@pytest.mark.parametrize("state", PEER_STATES)
def test_every_state_round_trips(state):
    assert open_record(sign_record(ALICE, peer(state=state)), now=NOW).state == state


def test_swarm_record_round_trip_and_size():
    record = swarm()
    raw = sign_record(ALICE, record)
    opened = open_record(raw, now=NOW)
    assert opened == record and isinstance(opened, SwarmRecord)
    assert opened.spec == PRESETS["tiny"].to_dict()
    assert type(PRESETS["tiny"]).from_dict(opened.spec) == PRESETS["tiny"]
    assert len(raw) == 340


def test_claims_and_held_checkpoints_round_trip_and_fit_the_bundle() -> None:
    record = peer(claimed_at=NOW - 0.5, held=((0, 350), (1, 300), (3, 123450)))
    raw = sign_record(ALICE, record)
    opened = open_record(raw, now=NOW)
    assert opened == record and opened.held_step(1) == 300 and opened.held_step(2) is None
    assert len(raw) <= len(sign_record(ALICE, peer())) + 40  # a few bytes each: a bundle still holds ~24
    # a record held as a list (as msgpack gives it back) is normalised to sorted pairs
    assert peer(held=[[1, 5], [0, 7]]).held == ((0, 7), (1, 5))


@pytest.mark.parametrize("held", [[[0, 1], [0, 2]], [[0]], [[-1, 3]], [[0, -3]], [["0", 3]], "x",
                                  [[s, 1] for s in range(17)]])
def test_bad_held_checkpoints_are_refused(held: Any) -> None:
    with pytest.raises(MalformedRecord):
        peer(held=held)
    env = unpacked(sign_record(ALICE, peer()))
    body = msgpack.unpackb(env["b"], raw=False)
    body["o"] = held
    env["b"] = msgpack.packb(body)
    env["s"] = ALICE.sign(_signed_message(1, "p", env["b"]))
    with pytest.raises(MalformedRecord):
        open_record(msgpack.packb(env), now=NOW)


def test_a_stopped_record_is_not_listed() -> None:
    assert not peer(state="stopped").listed and not peer(state="stopped").usable
    assert all(peer(state=s).listed for s in PEER_STATES if s != "stopped")


@settings(max_examples=60, deadline=None)
@given(
    stage=st.integers(0, 2**16 - 1),
    state=st.sampled_from(PEER_STATES),
    addr=st.text(max_size=128),
    throughput=st.floats(0, 1e12, allow_nan=False),
    queue=st.integers(0, 2**32 - 1),
    step=st.integers(0, 2**63 - 1),
    digest=st.none() | st.binary(min_size=1, max_size=64).map(bytes.hex),
    ttl=st.floats(0.001, 3600),
)
def test_peer_record_round_trip_property(stage, state, addr, throughput, queue, step, digest, ttl):
    record = peer(
        stage=stage, state=state, data_addr=addr, throughput=throughput, queue=queue, step=step,
        params_digest=digest, ttl=ttl,
    )
    assert open_record(sign_record(ALICE, record), now=NOW) == record


# --- every way a record is refused --------------------------------------------------------------------


def test_forged_signature():
    raw = sign_record(ALICE, peer())
    env = unpacked(raw)
    env["s"] = BOB.sign(_signed_message(1, "p", env["b"]))  # a real signature, by someone else
    with pytest.raises(BadSignature):
        open_record(msgpack.packb(env), now=NOW)
    env["s"] = bytes(64)
    with pytest.raises(BadSignature):
        open_record(msgpack.packb(env), now=NOW)


def test_tampered_body():
    env = unpacked(sign_record(ALICE, peer()))
    body = msgpack.unpackb(env["b"], raw=False)
    body["g"] = 0  # claim another stage
    env["b"] = msgpack.packb(body)
    with pytest.raises(BadSignature):
        open_record(msgpack.packb(env), now=NOW)


def test_record_type_is_covered_by_the_signature():
    env = unpacked(sign_record(ALICE, peer()))
    env["t"] = "s"
    with pytest.raises(BadSignature):
        open_record(msgpack.packb(env), now=NOW)


def test_key_and_peer_id_mismatch():
    body = peer(BOB)._body()  # names Bob ...
    with pytest.raises(PeerIdMismatch):
        open_record(envelope(ALICE, body), now=NOW)  # ... signed by Alice
    founder_body = swarm(BOB)._body()
    with pytest.raises(PeerIdMismatch):
        open_record(envelope(ALICE, founder_body, t="s"), now=NOW)
    with pytest.raises(ValueError):
        sign_record(ALICE, peer(BOB))


def test_expired_and_too_far_expiry():
    raw = sign_record(ALICE, peer(ttl=10))
    assert open_record(raw, now=NOW + 9.9)
    with pytest.raises(RecordExpired):
        open_record(raw, now=NOW + 10)
    with pytest.raises(MalformedRecord, match="beyond"):
        open_record(raw, now=NOW - 3600)


def test_oversized():
    raw = sign_record(ALICE, peer())
    with pytest.raises(RecordTooLarge):
        open_record(raw, now=NOW, max_bytes=len(raw) - 1)
    body = {**peer()._body(), "padding": b"x" * MAX_RECORD_BYTES}  # validly signed, but too big
    with pytest.raises(RecordTooLarge):
        open_record(envelope(ALICE, body), now=NOW)
    with pytest.raises(RecordTooLarge):
        open_record(b"\x00" * (MAX_RECORD_BYTES + 1), now=NOW)


def test_unknown_version_and_type():
    body = peer()._body()
    with pytest.raises(UnsupportedRecordVersion):
        open_record(envelope(ALICE, body, v=2), now=NOW)
    with pytest.raises(UnsupportedRecordVersion):
        open_record(msgpack.packb({"v": 7}), now=NOW)  # a newer envelope may change everything else
    with pytest.raises(UnsupportedRecordVersion):
        open_record(envelope(ALICE, body, t="zone"), now=NOW)
    with pytest.raises(MalformedRecord):
        open_record(envelope(ALICE, body, v=0), now=NOW)


def test_decoder_ignores_unknown_fields():
    body = {**peer()._body(), "zz": [1, 2, 3], "new_field": "from a newer build"}
    assert open_record(envelope(ALICE, body, extra_envelope_field=b"?"), now=NOW) == peer()
    swarm_body = {**swarm()._body(), "x": 1}
    assert open_record(envelope(ALICE, swarm_body, t="s"), now=NOW) == swarm()


@pytest.mark.parametrize(
    "change",
    [
        {"g": -1},
        {"g": "3"},
        {"g": True},
        {"s": 9},
        {"s": "serving"},
        {"h": float("nan")},
        {"h": -1.0},
        {"q": -1},
        {"n": 2**63},
        {"i": b"\x01" * 19},
        {"p": "ab" * 32},
        {"p": b""},
        {"d": b"203.0.113.45:1"},
        {"d": "x" * 129},
        {"v": None},
        {"t": "yesterday"},
        {"e": NOW - 1},  # before its own timestamp
        {"e": float("inf")},
    ],
)
def test_bad_field_values_are_malformed(change):
    body = {**peer()._body(), **change}
    with pytest.raises(MalformedRecord):
        open_record(envelope(ALICE, body), now=NOW)


@pytest.mark.parametrize("missing", ["i", "g", "s", "d", "a", "h", "q", "n", "v", "t", "e"])
def test_missing_fields_are_malformed(missing):
    body = peer()._body()
    del body[missing]
    with pytest.raises(MalformedRecord):
        open_record(envelope(ALICE, body), now=NOW)


@pytest.mark.parametrize(
    "env",
    [
        [1, "p"],
        {"v": "1"},
        {"v": 1, "t": 1},
        {"v": 1, "t": "p", "b": "text", "k": bytes(32), "s": bytes(64)},
        {"v": 1, "t": "p", "b": b"", "k": bytes(31), "s": bytes(64)},
        {"v": 1, "t": "p", "b": b"", "k": bytes(32), "s": bytes(63)},
    ],
)
def test_bad_envelopes_are_malformed(env):
    with pytest.raises(MalformedRecord):
        open_record(msgpack.packb(env), now=NOW)


@pytest.mark.parametrize("body", [b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({"m": {1: 2}})])
def test_signed_garbage_bodies_are_malformed(body):
    with pytest.raises(MalformedRecord):
        open_record(envelope(ALICE, body, t="s"), now=NOW)


@pytest.mark.parametrize("value", [{"nested": {}}, {"k": [1]}, {"": 1}, {"k": b"bytes"}])
def test_swarm_maps_hold_scalars_only(value):
    body = {**swarm()._body(), "r": value}
    with pytest.raises(MalformedRecord):
        open_record(envelope(ALICE, body, t="s"), now=NOW)


def test_truncated_records_are_malformed():
    raw = sign_record(ALICE, peer())
    for cut in range(len(raw)):
        with pytest.raises(MalformedRecord):
            open_record(raw[:cut], now=NOW)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2 * MAX_RECORD_BYTES))
def test_garbage_raises_only_record_errors(data):
    with pytest.raises(RecordError):
        open_record(data, now=NOW)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_records_raise_only_record_errors(data):
    original = sign_record(ALICE, peer())
    raw = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    assume(bytes(raw) != original)  # two flips of one byte can cancel out
    with pytest.raises(RecordError):
        open_record(bytes(raw), now=NOW)


def test_not_bytes_is_malformed():
    with pytest.raises(MalformedRecord):
        open_record("a string", now=NOW)  # type: ignore[arg-type]


def test_invalid_local_records_raise_the_same_errors():
    with pytest.raises(MalformedRecord):
        peer(state="sleeping")
    with pytest.raises(MalformedRecord):
        peer(peer_id="ABC")
    with pytest.raises(MalformedRecord):
        swarm().__class__("", {}, {}, ALICE.peer_id, NOW, NOW + 1)


def test_error_tree():
    classes = (MalformedRecord, UnsupportedRecordVersion, BadSignature, PeerIdMismatch, RecordTooLarge, RecordExpired)
    for cls in classes:
        assert issubclass(cls, RecordError) and issubclass(cls, DHTError) and issubclass(cls, SwarmdError)
    reasons = [c.reason for c in classes]
    assert len(set(reasons)) == len(reasons)


def test_cache_rechecks_expiry_and_remembers_successes_only():
    cache = RecordCache(maxsize=2)
    raw = sign_record(ALICE, peer(ttl=10))
    assert cache.open(raw, now=NOW) == peer(ttl=10)
    assert cache.open(raw, now=NOW + 5) == peer(ttl=10)
    with pytest.raises(RecordExpired):
        cache.open(raw, now=NOW + 10)
    with pytest.raises(MalformedRecord):
        cache.open(b"junk", now=NOW)
    for i in range(3):
        cache.open(sign_record(ALICE, peer(t=NOW + i)), now=NOW)
    assert len(cache) == 2


# --- bundles and the wire limits they derive from --------------------------------------------------------


@given(st.lists(st.binary(max_size=70_000), max_size=20))
@settings(max_examples=40, deadline=None)
def test_bundle_size_is_exact(records):
    assert bundle_size(records) == len(encode_bundle(records))
    assert decode_bundle(encode_bundle(records)) == records


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([b"ok", "text"]), msgpack.packb([1])]
)
def test_bad_bundles_are_malformed(data):
    with pytest.raises(MalformedRecord):
        decode_bundle(data)


async def test_rpcudp_request_limit_is_what_the_caps_derive_from():
    """Measure rpcudp's real limit: a ``store`` of a MAX_BUNDLE_BYTES value is the largest it sends."""

    class Capture:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def sendto(self, data: bytes, addr: Any) -> None:
            self.sent.append(data)

    rpc = RPCProtocol(wait_timeout=5)
    rpc.transport = Capture()
    try:
        rpc.store(("127.0.0.1", 9), b"\0" * 20, b"\0" * 20, b"\0" * MAX_BUNDLE_BYTES)
        with pytest.raises(MalformedMessage, match="8K"):
            rpc.store(("127.0.0.1", 9), b"\0" * 20, b"\0" * 20, b"\0" * (MAX_BUNDLE_BYTES + 1))
    finally:
        for future, timer in rpc._outstanding.values():
            timer.cancel()
            future.cancel()
    (datagram,) = rpc.transport.sent
    assert len(datagram) == MAX_DATAGRAM == 21 + RPC_MAX_PAYLOAD == 8213
    assert MAX_BUNDLE_BYTES == 8137
    await asyncio.sleep(0)


# --- storage: merge semantics -------------------------------------------------------------------------

KEY = b"k" * 20
IDS = [Identity.from_private_bytes(os.urandom(32)) for _ in range(40)]


def bundle(*records: tuple[Identity, PeerRecord | SwarmRecord]) -> bytes:
    return encode_bundle([sign_record(i, r) for i, r in records])


def test_newest_wins_per_subkey():
    store = RecordStorage(clock=lambda: NOW)
    assert store.merge(KEY, bundle((ALICE, peer(t=NOW, step=1)), (BOB, peer(BOB, t=NOW, step=1)))).accepted == 2
    result = store.merge(KEY, bundle((ALICE, peer(t=NOW - 1, step=0)), (BOB, peer(BOB, t=NOW + 1, step=2))))
    assert (result.accepted, result.current, result.rejected, result.ok) == (1, 1, 0, True)
    held = store.records(KEY)
    assert held[ALICE.peer_id].step == 1 and held[BOB.peer_id].step == 2
    assert store.merge(KEY, bundle((ALICE, peer(t=NOW, step=1)))).ok  # the same again: held, fine
    assert store.rejected == {}


def test_equal_timestamps_converge_on_every_replica():
    a, b = sign_record(ALICE, peer(step=1)), sign_record(ALICE, peer(step=2))
    one, two = RecordStorage(clock=lambda: NOW), RecordStorage(clock=lambda: NOW)
    one.merge(KEY, encode_bundle([a]))
    one.merge(KEY, encode_bundle([b]))
    two.merge(KEY, encode_bundle([b]))
    two.merge(KEY, encode_bundle([a]))
    assert one.get(KEY) == two.get(KEY)


def test_subkeys_expire_on_their_own():
    clock = [NOW]
    store = RecordStorage(clock=lambda: clock[0])
    store.merge(KEY, bundle((ALICE, peer(ttl=5)), (BOB, peer(BOB, ttl=50))))
    assert set(store.records(KEY)) == {ALICE.peer_id, BOB.peer_id}
    clock[0] = NOW + 5
    assert set(store.records(KEY)) == {BOB.peer_id}
    assert decode_bundle(store.get(KEY)) == [sign_record(BOB, peer(BOB, ttl=50))]
    clock[0] = NOW + 50
    assert store.get(KEY) is None and len(store) == 0 and list(store) == []
    with pytest.raises(KeyError):
        store[KEY]


def test_kademlia_storage_interface():
    clock = [NOW]
    store = RecordStorage(clock=lambda: clock[0])
    store[KEY] = bundle((ALICE, peer()))  # kademlia's rpc_store path: merge, not overwrite
    store[KEY] = bundle((BOB, peer(BOB)))
    assert len(decode_bundle(store[KEY])) == 2
    assert [k for k, _ in store] == [KEY] and KEY in store
    assert store.iter_older_than(3600) == []
    assert [k for k, _ in store.iter_older_than(0)] == [KEY]
    assert store.record_count() == 2


def test_rejections_are_counted_by_reason():
    store = RecordStorage(clock=lambda: NOW)
    good = sign_record(ALICE, peer())
    env = unpacked(good)
    forged = msgpack.packb({**env, "s": bytes(64)})
    mismatched = envelope(ALICE, peer(BOB)._body())
    expired = sign_record(BOB, peer(BOB, t=NOW - 100, ttl=10))
    oversized = envelope(BOB, {**peer(BOB)._body(), "pad": b"x" * 2000})
    newer = envelope(BOB, peer(BOB)._body(), v=3)
    result = store.merge(KEY, encode_bundle([good, forged, mismatched, expired, oversized, newer, b"junk"]))
    assert (result.accepted, result.rejected, result.ok) == (1, 6, False)
    assert store.merge(KEY, b"not a bundle").rejected == 1
    assert dict(store.rejected) == {
        "signature": 1, "peer_id": 1, "expired": 1, "oversized": 1, "version": 1, "malformed": 2
    }
    assert list(store.records(KEY)) == [ALICE.peer_id]


def test_subkey_cap_keeps_incumbents():
    store = RecordStorage(max_subkeys=3, clock=lambda: NOW)
    for ident in IDS[:3]:
        assert store.merge(KEY, bundle((ident, peer(ident)))).ok
    assert not store.merge(KEY, bundle((IDS[3], peer(IDS[3])))).ok
    assert store.rejected == {"full": 1}
    assert store.merge(KEY, bundle((IDS[0], peer(IDS[0], t=NOW + 1)))).accepted == 1  # refreshes still fit
    assert set(store.records(KEY)) == {i.peer_id for i in IDS[:3]}


def test_byte_cap_fits_26_realistic_peer_records_per_key():
    store = RecordStorage(clock=lambda: NOW)
    held = 0
    for ident in IDS:
        if store.merge(KEY, bundle((ident, peer(ident)))).ok:
            held += 1
    assert held == 26  # 8137 // 308, pinned in node.py's docstring
    assert store.rejected == {"full": len(IDS) - 26}
    assert len(store.get(KEY)) <= MAX_BUNDLE_BYTES
    # a record that grows its slot past the cap is refused, the smaller refresh is accepted
    member = next(i for i in IDS if i.peer_id in store.records(KEY))
    assert not store.merge(KEY, bundle((member, peer(member, t=NOW + 1, api_addr="x" * 128, data_addr="x" * 128)))).ok
    assert store.merge(KEY, bundle((member, peer(member, t=NOW + 1, version="0.1")))).ok


def test_space_frees_up_when_records_expire():
    clock = [NOW]
    store = RecordStorage(max_subkeys=1, clock=lambda: clock[0])
    store.merge(KEY, bundle((ALICE, peer(ttl=5))))
    assert not store.merge(KEY, bundle((BOB, peer(BOB, ttl=60)))).ok
    clock[0] = NOW + 5
    assert store.merge(KEY, bundle((BOB, peer(BOB, t=NOW + 5, ttl=60)))).ok


def test_key_cap():
    clock = [NOW]
    store = RecordStorage(max_keys=2, clock=lambda: clock[0])
    assert store.merge(b"a" * 20, bundle((ALICE, peer(ttl=5)))).ok
    assert store.merge(b"b" * 20, bundle((ALICE, peer(ttl=50)))).ok
    assert not store.merge(b"c" * 20, bundle((ALICE, peer(ttl=50)))).ok
    assert store.rejected == {"key_limit": 1}
    clock[0] = NOW + 6  # the first key's only record expired: its place is free again
    assert store.merge(b"c" * 20, bundle((ALICE, peer(t=NOW + 6, ttl=50)))).ok


def test_mixed_record_types_under_one_key():
    store = RecordStorage(clock=lambda: NOW)
    store.merge(KEY, bundle((ALICE, swarm()), (BOB, peer(BOB))))
    held = store.records(KEY)
    assert isinstance(held[ALICE.peer_id], SwarmRecord) and isinstance(held[BOB.peer_id], PeerRecord)


def test_storage_checks_its_byte_cap():
    with pytest.raises(ValueError):
        RecordStorage(max_bundle_bytes=MAX_BUNDLE_BYTES + 1)


def test_records_dont_hash_their_dicts():
    assert hash(swarm()) == hash(swarm())
