"""Announced addresses, whoami and the reachability check, on loopback (issue #11).

Separate hosts (namespaces, 0.0.0.0 on real interfaces) are in tests/system/test_hosts.py; these tests
cover the same logic where loopback can: the pure choice of the announced host, the DHT's
``whoami`` over real UDP, a wildcard-bound daemon that must not announce 0.0.0.0, a peer with a
wrong ``--announce`` reported unreachable and never used, IPv6 end to end, and hostile probes.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from swarmd.daemon import Daemon
from swarmd.dht.identity import Identity
from swarmd.dht.node import DHTNode
from swarmd.errors import ConfigError
from swarmd.net.addresses import choose_host, format_addr, loopback_mismatch, parse_host_port, route_source
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.train.trainer import Trainer, TrainerConfig, TrainerError
from tests.support.swarms import _config, started

TINY = PRESETS["tiny"]
TRAINING = TrainingSpec(target_batch_size=8, lr=3e-3, warmup_steps=1, averaging_timeout_s=10.0)


# ---- the choice, pure ------------------------------------------------------------------------


def test_an_announce_flag_wins_then_a_specific_bound_host() -> None:
    assert choose_host(bound="0.0.0.0", flag="198.51.100.7", observed=["10.1.1.1", "10.1.1.1"]).how == "flag"
    a = choose_host(bound="10.0.0.5", observed=["10.9.9.9", "10.9.9.9"], route="10.0.0.5")
    assert (a.host, a.how) == ("10.0.0.5", "bound")


def test_a_wildcard_takes_what_two_contacts_agree_on_else_the_route_never_the_wildcard() -> None:
    a = choose_host(bound="0.0.0.0", observed=["10.2.0.7", "10.2.0.7", "10.3.0.1"], route="10.2.0.9")
    assert (a.host, a.how) == ("10.2.0.7", "observed")
    one = choose_host(bound="0.0.0.0", observed=["10.2.0.7"], route="10.2.0.9")  # one contact is not enough
    assert (one.host, one.how) == ("10.2.0.9", "route")
    split = choose_host(bound="::", observed=["fd00::1", "fd00::2"], route="fd00::3")
    assert (split.host, split.how) == ("fd00::3", "route")
    nothing = choose_host(bound="0.0.0.0", observed=["0.0.0.0", "0.0.0.0"], route=None)
    assert (nothing.host, nothing.how) == ("127.0.0.1", "loopback")
    assert choose_host(bound="::").host == "::1"


def test_a_loopback_address_never_goes_into_a_swarm_beyond_loopback() -> None:
    assert loopback_mismatch("127.0.0.1", [("127.0.0.1", 31337), ("localhost", 1)]) is None
    assert loopback_mismatch("10.0.0.5", [("10.0.0.9", 31337)]) is None
    problem = loopback_mismatch("127.0.0.1", [("10.0.0.9", 31337)])
    assert problem is not None and "10.0.0.9:31337" in problem and "--announce" in problem
    assert loopback_mismatch("::1", [("2001:db8::1", 7000)]) is not None


@pytest.mark.parametrize("text, expected", [
    ("10.0.0.1:7000", ("10.0.0.1", 7000)), ("10.0.0.1", ("10.0.0.1", None)),
    ("[2001:db8::1]:7000", ("2001:db8::1", 7000)),
    ("2001:db8::1", ("2001:db8::1", None)), ("[::1]", ("::1", None)), ("peer.example:80", ("peer.example", 80)),
])
def test_host_port_parsing(text: str, expected: tuple) -> None:
    assert parse_host_port(text) == expected
    host, port = expected
    if port is not None:
        assert parse_host_port(format_addr((host, port)) or "") == expected  # round trip


@pytest.mark.parametrize("text", ["", ":7000", "[::1", "[::1]x", "10.0.0.1:0", "10.0.0.1:99999", "10.0.0.1:http"])
def test_bad_host_port_is_a_sentence(text: str) -> None:
    with pytest.raises(ValueError):
        parse_host_port(text)


def test_the_route_source_towards_loopback_is_loopback() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("not-an-ip") is None


# ---- whoami over real UDP ----------------------------------------------------------------------


async def test_whoami_tells_a_node_the_address_its_datagrams_come_from() -> None:
    a = DHTNode(Identity.generate(), host="127.0.0.1", port=0, rpc_timeout=1.0)
    b = DHTNode(Identity.generate(), host="0.0.0.0", port=0, rpc_timeout=1.0)  # a wildcard: it cannot tell
    await a.start()
    try:
        await b.start([a.address])
        seen = await b.observe_self(extra=[a.address])
        assert seen == [(a.address, "127.0.0.1")]
        assert b._proto().sent["whoami"] == 1
    finally:
        await b.stop()
        await a.stop()


# ---- daemons ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:  # bound and closed: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_daemon_bound_to_the_wildcard_never_announces_it() -> None:
    async with started(_config(0)) as (founder,):
        join = (founder.dht.address,)
        async with started(_config(1, join, host="0.0.0.0", dht_host="0.0.0.0")) as (wild,):
            status = wild.status()
            assert status["data_addr"].startswith("127.0.0.1:"), status["addresses"]
            assert status["addresses"]["data_bound"].startswith("0.0.0.0:")
            assert status["addresses"]["how"] == "route"  # one contact: the route to the bootstrap peer
            assert status["dht_addr"].startswith("127.0.0.1:")
            assert status["reachability"]["status"] == "yes"  # the founder dialled it
            view = await founder.swarm_view()
            addrs = [p["data_addr"] for s in view["stages"] for p in s["peers"]]
            assert not any(a.startswith("0.0.0.0") for a in addrs), addrs


async def test_a_peer_with_a_wrong_announce_is_reported_unreachable_and_never_used() -> None:
    # nobody relays here (tests/integration/test_relay.py: with a relay, such a peer serves through it)
    wrong = _free_port()
    async with started(_config(0, relay_max_peers=0)) as (founder,):
        join = (founder.dht.address,)
        async with started(_config(1, join, relay_max_peers=0),
                           _config(1, join, announce=("127.0.0.1", wrong))) as (good, bad):
            assert good.reachability.status == "yes"
            assert bad.reachability.status == "no", bad.reachability
            assert bad.data_addr == f"127.0.0.1:{wrong}"
            why = " ".join(bad.reachability.by.values())
            assert "cannot connect" in why, why
            view = await founder.swarm_view()
            listed = {p["peer_id"]: p["reachable"] for s in view["stages"] for p in s["peers"]}
            assert listed[bad.peer_id] == "no" and listed[good.peer_id] == "yes"
            run = TrainerConfig(api=f"http://{founder.status()['api_addr']}", steps=3, sync=True, codec="none",
                                microbatch_size=4, val_every=0, max_corpus_bytes=1 << 20)
            summary = await Trainer(run).run()
            assert summary.steps == 3
            assert bad.status()["served"]["forward"] == 0 and bad.status()["served"]["backward"] == 0
            assert good.status()["served"]["backward"] > 0
            assert good.status()["step"] == 3


async def test_ipv6_addresses_in_records_and_on_the_wire() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    v6 = dict(host="::1", dht_host="::1")
    async with started(_config(0, **v6)) as (founder,):
        join = (founder.dht.address,)
        async with started(_config(1, join, **v6)) as (peer,):
            assert peer.data_addr.startswith("[::1]:") and peer.status()["dht_addr"].startswith("[::1]:")
            view = await founder.swarm_view()
            assert {p["data_addr"] for s in view["stages"] for p in s["peers"]} == {founder.data_addr, peer.data_addr}
            run = TrainerConfig(api=f"http://{founder.status()['api_addr']}", steps=2, sync=True, codec="8bit",
                                microbatch_size=4, val_every=0, max_corpus_bytes=1 << 20)
            assert (await Trainer(run).run()).steps == 2
            assert peer.status()["step"] == 2 and peer.reachability.status == "yes"


def test_a_loopback_peer_joining_beyond_loopback_is_refused_before_anything_is_bound() -> None:
    d = Daemon(_config(1, (("198.51.100.20", 31337),)))  # TEST-NET-2: nothing is sent there
    with pytest.raises(ConfigError, match="loopback address 127.0.0.1"):
        asyncio.run(d.start())


async def test_hostile_probes_get_4xx_and_dial_nothing_but_ip_literals() -> None:
    async with started(_config(0)) as (d,):
        url = f"http://{d.data_addr}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            good = {"peer_id": "ab" * 20, "nonce": "cd" * 16}
            for body in ([], {"addr": "127.0.0.1:1"}, {**good, "addr": "localhost:80"}, {**good, "addr": "0.0.0.0:80"},
                         {**good, "addr": "127.0.0.1"}, {**good, "addr": "x" * 100}, {**good, "nonce": "zz"},
                         {**good, "addr": "127.0.0.1:1", "peer_id": 5}):
                r = await c.post("/v1/probe", json=body)
                assert r.status_code == 422, (body, r.status_code, r.text)
            assert (await c.post("/v1/probe", content=b"\xff\x00not json")).status_code == 422
            assert (await c.post("/v1/probe", content=b"{" * 5000)).status_code == 413
            assert (await c.get("/v1/ping", params={"nonce": "bad"})).status_code == 422
            r = await c.get("/v1/ping", params={"nonce": "ab" * 8})
            assert r.json() == {"peer_id": d.peer_id, "nonce": "ab" * 8}
            # a probe of an address where another peer (this one) answers: not the asker, so not reached
            r = await c.post("/v1/probe", json={**good, "addr": d.data_addr})
            assert r.status_code == 200 and r.json()["reachable"] is False
            assert "another" in r.json()["reason"]
        assert d.status()["state"] == "serving"


async def test_a_trainer_whose_stage_nobody_can_dial_gives_up_in_one_sentence_naming_the_address() -> None:
    wrong = _free_port()
    async with started(_config(0, relay_max_peers=0)) as (founder,):
        async with started(_config(1, (founder.dht.address,), announce=("127.0.0.1", wrong))) as (bad,):
            assert bad.reachability.status == "no"
            run = TrainerConfig(api=f"http://{founder.status()['api_addr']}", steps=1, sync=True, codec="none",
                                microbatch_size=4, val_every=0, max_corpus_bytes=1 << 20, stage_wait_timeout_s=2.0)
            with pytest.raises(TrainerError) as caught:
                await Trainer(run).run()
    message = str(caught.value)
    assert "stage 1" in message and f"127.0.0.1:{wrong}" in message and "--announce" in message, message
