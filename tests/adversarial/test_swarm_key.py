"""Private swarms (``--swarm-key``): authenticated DHT datagrams and data-plane requests.

Real sockets only: keyed DHT nodes on 127.0.0.1, a keyed in-process daemon, and a private swarm
started through the real CLI that an outsider (no key, or another key) cannot join or call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgpack
import pytest
import torch

from swarmd.config import ApiConfig, Config, DHTConfig, NetConfig, PipelineConfig, RebalanceConfig
from swarmd.daemon import Daemon
from swarmd.dht import DHTNode, Identity
from swarmd.errors import BootstrapError
from swarmd.net.addresses import format_addr
from swarmd.net.client import DataPlaneClient, client_session
from swarmd.net.wire import CONTENT_TYPE, encode_frame
from swarmd.pipeline.spec import TrainingSpec
from swarmd.swarm_key import (
    AUTH_HEADER,
    DATAGRAM_OVERHEAD,
    ReplayCache,
    SwarmKey,
    SwarmKeyError,
)
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.conftest import TINY, daemon_config, swarmd_command

KEY = SwarmKey(b"correct horse battery staple, 32B")
OTHER = SwarmKey(b"another swarm's secret, also long")
RPC_TIMEOUT = 0.4


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def write_key(path: Path, content: bytes = b"c2VjcmV0IHN3YXJtIGtleSBvZiAzMiBieXRlcyEhIQ==\n") -> Path:
    path.write_bytes(content)
    path.chmod(0o600)
    return path


# --- the key file ---------------------------------------------------------------------------------


def test_load_strips_whitespace_and_refuses_unusable_files(tmp_path: Path, caplog) -> None:
    key = SwarmKey.load(write_key(tmp_path / "ok.key", b"  0123456789abcdef0123\n\n"))
    assert key.key_id == SwarmKey(b"0123456789abcdef0123").key_id
    assert "0123456789abcdef" not in repr(key) and key.key_id in repr(key)

    with pytest.raises(SwarmKeyError, match="cannot read --swarm-key"):
        SwarmKey.load(tmp_path / "missing.key")
    with pytest.raises(SwarmKeyError, match="is empty"):
        SwarmKey.load(write_key(tmp_path / "empty.key", b" \n"))
    with pytest.raises(SwarmKeyError, match="fewer than 16"):
        SwarmKey.load(write_key(tmp_path / "short.key", b"tooshort\n"))
    with pytest.raises(SwarmKeyError, match="not a regular file"):
        SwarmKey.load(tmp_path)

    loose = write_key(tmp_path / "loose.key", b"0123456789abcdef0123")
    loose.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="swarmd.swarm_key"):
        SwarmKey.load(loose)
    assert any("readable by other users" in r.getMessage() for r in caplog.records)


def test_subkeys_are_separate_per_channel_and_per_key() -> None:
    assert KEY.subkey("dht") != KEY.subkey("http") != OTHER.subkey("http")
    assert KEY.key_id != OTHER.key_id
    head = b"x" * 9
    # the same bytes MACed on the two channels give different tags: one never passes for the other
    assert KEY.dht().mac(head, b"payload") != KEY.http().mac(head, b"payload")


# --- signing and checking ---------------------------------------------------------------------------


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def test_http_signatures_verify_and_every_forgery_is_refused_by_reason() -> None:
    clock = Clock()
    client, server = KEY.http(clock=clock), KEY.http(clock=clock)
    body = b"frame bytes"

    def check(header: str | None, method: str = "POST", path: str = "/v1/forward", payload: bytes = body) -> str | None:
        checked = server.precheck(header, ("10.0.0.1", 1))
        if isinstance(checked, str):
            return checked
        return server.verify(checked, method, path, digest(payload), ("10.0.0.1", 1))

    good = client.header("POST", "/v1/forward", digest(body))
    assert check(good) is None
    assert check(good) == "replay"  # the very same header again
    assert check(client.header("POST", "/v1/forward", digest(body))) is None  # a fresh nonce is fine
    assert check(client.header("POST", "/v1/forward", digest(body)), payload=b"frame bytez") == "bad_mac"
    assert check(client.header("POST", "/v1/forward", digest(body)), path="/v1/backward") == "bad_mac"
    assert check(client.header("POST", "/v1/forward", digest(body)), method="GET") == "bad_mac"
    assert check(OTHER.http(clock=clock).header("POST", "/v1/forward", digest(body))) == "bad_mac"
    assert check(None) == "missing" and check("") == "missing"
    for junk in ("1.2.3", "x" * 90, good.upper(), good + ".0", good.replace(".", ":")):
        assert check(junk) == "malformed", junk

    old = client.header("POST", "/v1/forward", digest(body))
    clock.now += 31  # the window is 30 s each way
    assert check(old) == "stale"
    future = client.header("POST", "/v1/forward", digest(body))
    clock.now -= 62
    assert check(future) == "stale"
    assert server.counts() == {"missing": 2, "malformed": 5, "stale": 2, "bad_mac": 4, "replay": 1}


def test_a_replay_racing_its_original_is_refused_at_commit() -> None:
    server = KEY.http()
    header = KEY.http().header("GET", "/v1/info", digest(b""))
    first, second = server.precheck(header, "a"), server.precheck(header, "b")  # both before either verifies
    assert not isinstance(first, str) and not isinstance(second, str)
    assert server.verify(first, "GET", "/v1/info", digest(b""), "a") is None
    assert server.verify(second, "GET", "/v1/info", digest(b""), "b") == "replay"


def test_datagrams_wrap_unwrap_and_forgeries_are_refused() -> None:
    clock = Clock()
    sender, receiver = KEY.dht(clock=clock), KEY.dht(clock=clock)
    inner = b"\x00" + os.urandom(20) + msgpack.packb(["ping", [os.urandom(20)]])
    wrapped = sender.wrap(inner)
    assert len(wrapped) == len(inner) + DATAGRAM_OVERHEAD == len(inner) + 25
    assert receiver.unwrap(wrapped, ("h", 1)) == inner
    assert receiver.unwrap(wrapped, ("h", 1)) is None  # replayed
    assert receiver.unwrap(inner, ("h", 1)) is None  # not wrapped at all
    assert receiver.unwrap(wrapped[:20], ("h", 1)) is None  # cut short
    clock.now += 0.01  # a new timestamp: a datagram identical to a seen one is a replay
    tampered = bytearray(sender.wrap(inner))
    tampered[-1] ^= 1
    assert receiver.unwrap(bytes(tampered), ("h", 1)) is None
    assert receiver.unwrap(OTHER.dht(clock=clock).wrap(inner), ("h", 1)) is None
    old = sender.wrap(inner)
    clock.now += 40
    assert receiver.unwrap(old, ("h", 1)) is None
    assert receiver.counts() == {"missing": 1, "malformed": 1, "stale": 1, "bad_mac": 2, "replay": 1}


def test_refusals_are_counted_but_logged_sparingly(caplog) -> None:
    auth = KEY.dht()
    with caplog.at_level(logging.WARNING, logger="swarmd.swarm_key"):
        for _ in range(2500):
            auth.unwrap(b"\x00junk", ("10.0.0.1", 5))  # one sender: its first, then every 1000th
        first = len(caplog.records)
        for i in range(500):
            auth.unwrap(b"\x00junk", (f"10.1.{i // 256}.{i % 256}", 5))  # forged source addresses
    assert auth.counts()["missing"] == 3000
    assert first == 3  # refusals 1, 1001 and 2001
    assert len(caplog.records) - first <= 20 + 1  # new senders: at most 20 lines a minute


def test_the_replay_cache_is_bounded_and_never_accepts_an_evicted_nonce() -> None:
    clock = Clock()
    cache = ReplayCache(window_s=30, max_entries=100, clock=clock)
    nonces = [os.urandom(16) for _ in range(1000)]
    for i, nonce in enumerate(nonces):
        clock.now += 0.001
        assert cache.add(nonce, clock.now) is None, i
        assert len(cache) <= 100
    assert cache.add(nonces[0], clock.now - 0.999) == "replay"  # evicted long ago, still refused
    assert cache.add(nonces[-1], clock.now) == "replay"  # still held
    clock.now += 31  # everything expires
    assert cache.add(os.urandom(16), clock.now) is None
    assert len(cache) == 1
    assert cache.add(os.urandom(16), clock.now - 31) == "stale"


# --- the DHT -------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def keyed_dht(n: int, key: SwarmKey | None = KEY) -> AsyncIterator[list[DHTNode]]:
    nodes: list[DHTNode] = []
    try:
        for i in range(n):
            node = DHTNode(Identity.generate(), rpc_timeout=RPC_TIMEOUT, swarm_key=key)
            nodes.append(node)
            await node.start([] if i == 0 else [nodes[0].address])
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


def signed_swarm_record(identity: Identity) -> bytes:
    from swarmd.dht.records import SwarmRecord, sign_record

    now = time.time()
    record = SwarmRecord(swarm="private", spec=TINY.to_dict(), training={}, founder=identity.peer_id,
                         timestamp=now, expiry=now + 60)
    return sign_record(identity, record)


async def test_members_with_the_key_store_and_read_records() -> None:
    async with keyed_dht(4) as nodes:
        identity = Identity.generate()
        assert await nodes[1].store("swarm/private", signed_swarm_record(identity)) >= 1
        got = await nodes[3].get("swarm/private")
        assert list(got) == [identity.peer_id]
        for node in nodes:
            stats = node.stats()
            assert stats["auth_refused"] == {"missing": 0, "malformed": 0, "stale": 0, "bad_mac": 0, "replay": 0}
            assert stats["routing_table_size"] >= 1 and stats["dropped_datagrams_total"] == 0


@pytest.mark.parametrize("outsider_key", [None, OTHER], ids=["no-key", "other-key"])
async def test_an_outsider_cannot_bootstrap_into_a_private_dht(outsider_key: SwarmKey | None, caplog) -> None:
    async with keyed_dht(2) as members:
        outsider = DHTNode(Identity.generate(), rpc_timeout=RPC_TIMEOUT, swarm_key=outsider_key)
        with caplog.at_level(logging.WARNING, logger="swarmd"):
            with pytest.raises(BootstrapError) as err:
                await outsider.start([members[0].address], deadline_s=1.0, backoff_s=0.1)
        assert "--swarm-key" in str(err.value) and "no answer" in str(err.value)
        assert not outsider.running
        refused = members[0].stats()["auth_refused"]
        reason = "missing" if outsider_key is None else "bad_mac"
        assert refused[reason] >= 2 and sum(refused.values()) == refused[reason]
        lines = [r.getMessage() for r in caplog.records if "refused a DHT datagram" in r.getMessage()]
        assert len(lines) == 1 and reason in lines[0]  # one line per address, not one per datagram
        assert members[0].neighbors() == [members[1].address]  # the outsider never got in


class RawPeer(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: list[bytes] = []

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received.append(data)


@contextlib.asynccontextmanager
async def raw_peer() -> AsyncIterator[tuple[asyncio.DatagramTransport, RawPeer]]:
    loop = asyncio.get_running_loop()
    transport, peer = await loop.create_datagram_endpoint(RawPeer, local_addr=("127.0.0.1", 0))
    try:
        yield transport, peer  # type: ignore[misc]
    finally:
        transport.close()


def request(name: str, *args: Any) -> bytes:
    return b"\x00" + os.urandom(20) + msgpack.packb([name, list(args)], use_bin_type=True)


async def test_an_outsider_can_neither_read_nor_write_records_and_replays_are_dropped() -> None:
    async with keyed_dht(2) as members, raw_peer() as (transport, peer):
        node = members[0]
        identity = Identity.generate()
        dkey = hashlib.sha1(b"swarm/private").digest()
        from swarmd.dht.records import encode_bundle

        bundle = encode_bundle([signed_swarm_record(identity)])
        me = os.urandom(20)
        # without the key: a store, a find_value and a ping get no answer and change nothing
        for datagram in (request("store", me, dkey, bundle), request("find_value", me, dkey), request("ping", me)):
            transport.sendto(datagram, node.address)
            transport.sendto(OTHER.dht().wrap(datagram), node.address)
        await asyncio.sleep(0.3)
        assert peer.received == [] and len(node.storage) == 0
        assert node.stats()["auth_refused"]["missing"] == 3 and node.stats()["auth_refused"]["bad_mac"] == 3

        # with the key the same store is answered (True) and held; replaying its bytes does nothing
        store = KEY.dht().wrap(request("store", me, dkey, bundle))
        transport.sendto(store, node.address)
        for _ in range(50):
            if peer.received:
                break
            await asyncio.sleep(0.02)
        answer = KEY.dht().unwrap(peer.received[0], node.address)
        assert answer is not None and msgpack.unpackb(answer[21:]) is True
        assert len(node.storage) == 1
        transport.sendto(store, node.address)
        await asyncio.sleep(0.3)
        assert len(peer.received) == 1 and node.stats()["auth_refused"]["replay"] == 1


async def test_a_node_without_a_key_drops_a_private_swarms_datagrams(caplog) -> None:
    async with keyed_dht(1, key=None) as (open_node,), keyed_dht(1) as (member,):
        with caplog.at_level(logging.WARNING, logger="swarmd.dht"):
            assert await member._proto().ping_address(open_node.address, timeout=0.3) is None
        assert open_node.stats()["dropped_datagrams"] == {"private_swarm": 1}
        assert open_node.stats()["auth_refused"] is None
        assert any("private swarm" in r.getMessage() for r in caplog.records)


# --- the data plane --------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def private_daemon(stage: int = 0) -> AsyncIterator[Daemon]:
    daemon = Daemon(replace(daemon_config(stage), swarm_key=KEY))
    try:
        await daemon.start()
        yield daemon
    finally:
        await daemon.shutdown()


def forward_body(seed: int = 0) -> bytes:
    x = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    return encode_frame("forward", {"stage": 0}, {"inputs": x})


async def raw_post(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    async with session.post(url, data=body, headers={"Content-Type": CONTENT_TYPE, **headers}) as r:
        return r.status, (await r.json(content_type=None) if r.status != 200 else None)


async def test_a_private_data_plane_serves_only_signed_requests() -> None:
    async with private_daemon() as d, aiohttp.ClientSession() as raw, \
            DataPlaneClient(swarm_key=KEY) as member, DataPlaneClient(swarm_key=OTHER) as stranger:
        base = f"http://{d.data_addr}"
        body = forward_body()
        status, err = await raw_post(raw, f"{base}/v1/forward", body, {})
        assert status == 401 and err["error"] == "Unauthorized" and "--swarm-key" in err["message"]
        for path in ("/v1/info", "/v1/progress", "/v1/state"):  # nothing is served to a stranger
            async with raw.get(base + path) as r:
                assert r.status == 401, path

        reply = await member.forward(d.data_addr, 0, torch.zeros(2, 8, dtype=torch.long))
        assert reply.outputs.shape == (2, 8, TINY.d_model)
        assert (await member.info(d.data_addr)).stage == 0
        async with client_session(KEY) as signed:  # the query string is covered too
            async with signed.get(f"{base}/v1/info", params={"probe": "a b/1"}) as r:
                assert r.status == 200
        with pytest.raises(Exception) as refused:
            await stranger.forward(d.data_addr, 0, torch.zeros(2, 8, dtype=torch.long))
        assert getattr(refused.value, "status", None) == 401

        # a signed request captured on the wire is served once, and refused when replayed
        header = {AUTH_HEADER: KEY.http().header("POST", "/v1/forward", hashlib.sha256(body).digest())}
        assert (await raw_post(raw, f"{base}/v1/forward", body, header))[0] == 200
        status, err = await raw_post(raw, f"{base}/v1/forward", body, header)
        assert status == 401 and "replay" in err["message"]
        # ...and a fresh signature over another body does not cover this one
        header = {AUTH_HEADER: KEY.http().header("POST", "/v1/forward", hashlib.sha256(body).digest())}
        assert (await raw_post(raw, f"{base}/v1/forward", forward_body(1), header))[0] == 401

        async with httpx.AsyncClient() as api:
            status_doc = (await api.get(f"http://{format_addr(d.api_addr)}/status")).json()
        auth = status_doc["auth"]
        assert auth["private"] is True and auth["key_id"] == KEY.key_id
        assert auth["refused"]["data_plane"] == {"missing": 4, "malformed": 0, "stale": 0, "bad_mac": 2, "replay": 1}
        assert set(auth["refused"]["dht"]) == {"missing", "malformed", "stale", "bad_mac", "replay"}
        assert d.data_plane is not None and d.data_plane.served["forward"] == 2


async def test_an_open_daemon_says_it_is_not_private() -> None:
    daemon = Daemon(daemon_config(0))
    try:
        await daemon.start()
        assert daemon.status()["auth"] == {"private": False, "key_id": None, "refused": {"dht": {}, "data_plane": {}}}
        async with aiohttp.ClientSession() as raw:  # and serves unsigned requests as before
            assert (await raw_post(raw, f"http://{daemon.data_addr}/v1/forward", forward_body(), {}))[0] == 200
    finally:
        await daemon.shutdown()


def member_config(stage: int, join: tuple = ()) -> Config:
    training = TrainingSpec(target_batch_size=8, lr=3e-3, warmup_steps=1, averaging_timeout_s=10.0)
    return Config(
        swarm="private-inproc",
        net=NetConfig(host="127.0.0.1", port=0, drain_timeout_s=5.0),
        api=ApiConfig(host="127.0.0.1", port=0),
        dht=DHTConfig(join=join, announce_period_s=1.0, bootstrap_timeout_s=10.0),
        rebalance=RebalanceConfig(policy="none"),
        pipeline=PipelineConfig(spec=None if join else TINY, stage=stage, training=None if join else training),
        swarm_key=KEY,
    )


async def test_stage_mates_average_and_hand_over_state_with_signed_requests() -> None:
    """Averaging (GET /v1/progress, POST /v1/average) and state download (GET /v1/state) between
    members all go through their signed sessions: a private swarm works like an open one."""
    daemons: list[Daemon] = []
    try:
        for i in range(4):
            d = Daemon(member_config(i % 2, () if not daemons else (daemons[0].dht.address,)))
            daemons.append(d)
            await d.start()
        # stage-mates average only with peers that answered their signed challenge (swarmd.net.proof):
        # both rounds below count two contributors once each has proven the other
        deadline = asyncio.get_running_loop().time() + 30
        while not all(d.averager.prover.table.status()["proven"] >= 1 for d in daemons):
            assert asyncio.get_running_loop().time() < deadline, [d.averager.prover.table.status() for d in daemons]
            await asyncio.sleep(0.1)
        trainer = Trainer(TrainerConfig(api=f"http://{format_addr(daemons[0].api_addr)}", steps=2, sync=True,
                                        codec="none", microbatch_size=4, window=2, val_every=0,
                                        max_corpus_bytes=1 << 18, swarm_key=KEY))
        summary = await trainer.run()
        assert summary.steps == 2
        assert all(d.executor.step == 2 and d.averager.rounds_ok == 2 for d in daemons)
        assert all(d.averager.last_round["contributors"] == 2 for d in daemons), [d.averager.last_round for d in daemons]
        assert len({(d.stage, d.executor.digest) for d in daemons}) == 2  # stage-mates agree

        late = Daemon(member_config(0, (daemons[0].dht.address,)))
        daemons.append(late)
        await late.start()
        assert late.synced_from in {daemons[0].peer_id, daemons[2].peer_id}
        assert late.executor.step == 2 and late.executor.digest == daemons[0].executor.digest
        for d in daemons:
            refused = d.status()["auth"]["refused"]
            assert sum(refused["dht"].values()) == 0 and sum(refused["data_plane"].values()) == 0, refused
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons))  # at once: ~1 s each one by one


# --- through the real CLI ----------------------------------------------------------------------------------


def run_cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*swarmd_command(), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("content", [None, b"", b"   \n", b"short\n"], ids=["missing", "empty", "blank", "short"])
def test_an_unusable_key_file_exits_2_with_one_sentence(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "swarm.key"
    if content is not None:
        write_key(path, content)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commands = (["--state-dir", str(tmp_path / "state")], ["train"])
    procs = [subprocess.Popen([*swarmd_command(), *command, "--swarm-key", str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for command in commands]  # side by side
    for proc, (_, stderr) in [(proc, proc.communicate(timeout=90)) for proc in procs]:
        assert proc.returncode == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "--swarm-key" in lines[0] and "error:" in lines[0], stderr


def test_help_mentions_the_swarm_key() -> None:
    assert "--swarm-key" in run_cli("--help").stdout
    assert "--swarm-key" in run_cli("train", "--help").stdout


def test_a_private_swarm_trains_and_outsiders_cannot_join_or_call_it(spawn, tmp_path: Path) -> None:
    key = write_key(tmp_path / "swarm.key")
    other = write_key(tmp_path / "other.key", b"a different secret of the other swarm\n")
    founder = spawn("--stage", "0", "--model", "tiny", "--swarm", "private", "--swarm-key", str(key),
                    "--target-batch-size", "16")
    info = founder.wait_ready()
    member = spawn("--stage", "1", "--join", info["dht_addr"], "--swarm", "private", "--swarm-key", str(key))
    member.wait_ready()
    assert "private swarm" in founder.log()

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(p.read_text() for p in sorted(Path("swarmd").rglob("*.py"))[:12]))
    train = ["train", "--api", founder.api, "--data", str(corpus), "--steps", "2", "--microbatch-size", "4",
             "--val-every", "0", "--json"]
    out = run_cli(*train, "--swarm-key", str(key), timeout=110)
    assert out.returncode == 0, out.stderr + founder.log()[-3000:]

    # a daemon with another key, or none, cannot join: no member answers it (started now, they
    # start up while the keyless trainer below runs)
    outsiders = [spawn("--join", info["dht_addr"], "--swarm", "private", "--bootstrap-timeout", "2", *extra)
                 for extra in (["--swarm-key", str(other)], [])]

    # a trainer without the key is refused by the first stage it calls, and says why (no hang)
    started = time.monotonic()
    out = run_cli(*train, "--stage-wait-timeout", "10", timeout=60)
    assert out.returncode == 1 and "Unauthorized" in out.stderr and "--swarm-key" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert time.monotonic() - started < 60

    for outsider in outsiders:
        code = outsider.proc.wait(60)
        log = outsider.log()
        assert code == 1, log
        assert "no DHT bootstrap address answered" in log and "--swarm-key" in log, log

    status = httpx.get(f"{founder.api}/status").json()
    refused = status["auth"]["refused"]
    assert status["auth"]["private"] is True
    assert refused["dht"]["bad_mac"] >= 1 and refused["dht"]["missing"] >= 1, refused
    assert refused["data_plane"]["missing"] >= 1, refused
    assert "refused a DHT datagram" in founder.log() and "refused a data-plane request" in founder.log()
    swarm = httpx.get(f"{founder.api}/swarm").json()
    assert sum(len(s["peers"]) for s in swarm["stages"]) == 2  # only the two members
    assert founder.terminate() == 0 and member.terminate() == 0
