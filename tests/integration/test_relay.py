"""Relays on loopback (issue #12): a peer nobody can dial serves its stage through one that can.

"Nobody can dial it" is made with a wrong ``--announce`` (a port nothing listens on): its
reachability check fails exactly as behind a NAT. The NAT itself (a router namespace that
masquerades) is in tests/system/test_hosts.py.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from swarmd.daemon import Daemon
from swarmd.net.addresses import is_relayed
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.swarms import _config, started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


def trainer_config(daemon: Daemon, steps: int) -> TrainerConfig:
    return TrainerConfig(api=f"http://{daemon.status()['api_addr']}", steps=steps, sync=True, codec="none",
                         microbatch_size=4, val_every=0, max_corpus_bytes=1 << 20)


async def test_an_unreachable_peer_serves_its_stage_through_a_relay() -> None:
    hidden = ("127.0.0.1", _free_port())
    async with started(_config(0), ) as (founder,):
        join = (founder.dht.address,)
        async with started(_config(1, join)) as (direct,), started(_config(1, join, announce=hidden)) as (natted,):
            await wait_for(lambda: natted.relayed_addr is not None and natted.reachability.status == "yes", 20,
                           "the unreachable peer is relayed and reachable through its relay")
            relay_id = natted.relay_client.status.relay_id
            assert is_relayed(natted.data_addr) and natted.data_addr.startswith(natted.peer_id + "@")
            relay = next(d for d in (founder, direct) if d.peer_id == relay_id)
            assert natted.peer_id in relay.status()["relay"]["server"]["peers"]
            summary = await Trainer(trainer_config(founder, 6)).run()
            assert summary.steps == 6
            assert summary.bans == 0 and summary.retries == 0, summary  # nothing wasted on the relayed peer
            assert natted.status()["served"]["backward"] > 0, natted.status()["served"]
            assert relay.status()["relay"]["server"]["requests"] > 0
            await wait_for(lambda: natted.status()["step"] == direct.status()["step"] == 6, 10, "both at step 6")
            assert natted.status()["params_digest"] == direct.status()["params_digest"]
            # a relayed peer never leads while a direct one can
            assert natted.averager is not None and natted.averager.rounds_ok > 0
            leaders = {r["leader"] for r in natted.status()["averaging"]["recent"] if r.get("status") == "ok"}
            assert natted.peer_id not in leaders, leaders


async def test_a_peer_that_nobody_can_relay_for_says_so_and_is_not_listed_reachable() -> None:
    hidden = ("127.0.0.1", _free_port())
    no_relays = _config(0)
    no_relays = no_relays.__class__(**{**no_relays.__dict__, "net": no_relays.net.__class__(
        **{**no_relays.net.__dict__, "relay_max_peers": 0})})
    async with started(no_relays) as (founder,):
        async with started(_config(1, (founder.dht.address,), announce=hidden)) as (natted,):
            await wait_for(lambda: natted.relay_client is not None and natted.relay_client.status.state == "none",
                           20, "the peer gives up finding a relay")
            status = natted.status()
            assert status["reachability"]["status"] == "no"
            assert status["relay"]["client"]["state"] == "none" and status["relay"]["client"]["why"]
            view = await founder.swarm_view()
            listed = {p["peer_id"]: p for s in view["stages"] for p in s["peers"]}
            assert listed[natted.peer_id]["reachable"] == "no"


async def test_a_relay_refuses_garbage_and_a_hello_for_another_peer() -> None:
    async with started(_config(0)) as (d,):
        async with httpx.AsyncClient(base_url=f"http://{d.data_addr}", timeout=10) as c:
            r = await c.post("/v1/forward", headers={"X-Swarm-Relay": "ab" * 20}, content=b"x")
            assert r.status_code == 502 and r.json()["error"] == "NotRelayed"
            r = await c.get("/v1/relay")  # not a WebSocket upgrade
            assert 400 <= r.status_code < 500 or r.status_code == 503
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(f"http://{d.data_addr}/v1/relay") as ws:
                await ws.receive(timeout=5)  # the challenge
                await ws.send_bytes(b"\x93garbage")
                msg = await ws.receive(timeout=5)
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        assert d.relay_server.refused.get("bad_hello") == 1
        assert d.status()["state"] == "serving"


async def test_in_a_private_swarm_signatures_travel_end_to_end_and_the_relay_refuses_unsigned_requests() -> None:
    from dataclasses import replace

    from swarmd.swarm_key import SwarmKey

    key = SwarmKey(b"a relay test's swarm secret, 32B")
    hidden = ("127.0.0.1", _free_port())
    keyed = [replace(c, swarm_key=key) for c in (_config(0),)]
    async with started(*keyed) as (founder,):
        join = (founder.dht.address,)
        async with started(replace(_config(1, join), swarm_key=key),
                           replace(_config(1, join, announce=hidden), swarm_key=key)) as (direct, natted):
            await wait_for(lambda: natted.relayed_addr is not None and natted.reachability.status == "yes", 20,
                           "relayed in the private swarm")
            relay = next(d for d in (founder, direct) if d.peer_id == natted.relay_client.status.relay_id)
            run = replace(trainer_config(founder, 3), swarm_key=key)
            summary = await Trainer(run).run()
            assert summary.steps == 3 and summary.bans == 0
            assert natted.status()["served"]["backward"] > 0
            # an unsigned request for the relayed peer: the relay (a member) refuses it before relaying
            def refused(d: Daemon) -> int:
                return sum(d.status()["auth"]["refused"]["data_plane"].values())

            before_relay, before_natted = refused(relay), refused(natted)
            async with httpx.AsyncClient(base_url=f"http://{relay.data_addr}", timeout=10) as c:
                r = await c.get("/v1/info", headers={"X-Swarm-Relay": natted.peer_id})
            assert r.status_code == 401
            assert refused(relay) == before_relay + 1 and refused(natted) == before_natted  # refused at the relay


@pytest.mark.timeout(240)  # the training's own bound below (120 s) is reached first, and says where it stands
async def test_losing_the_relay_mid_training_loses_nothing_and_the_peer_is_relayed_again() -> None:
    from dataclasses import replace

    hidden = ("127.0.0.1", _free_port())
    founder_cfg = _config(0)
    founder_cfg = replace(founder_cfg, net=replace(founder_cfg.net, relay_max_peers=0))  # relays for nobody
    async with started(founder_cfg) as (founder,):
        join = (founder.dht.address,)
        others = [Daemon(c) for c in (_config(0, join), _config(1, join), _config(1, join, announce=hidden))]
        try:
            for d in others:
                await d.start()
            second, direct, natted = others
            await wait_for(lambda: natted.relayed_addr is not None and natted.reachability.status == "yes", 20,
                           "relayed")
            first_relay = natted.relay_client.status.relay_id
            relay = next(d for d in (second, direct) if d.peer_id == first_relay)
            trainer = Trainer(trainer_config(founder, 12))
            training = asyncio.create_task(trainer.run())
            await wait_for(lambda: natted.status()["step"] >= 3, 60, "three steps through the relay")
            await relay.shutdown()  # its relayed peer loses its connection mid-training
            try:
                summary = await asyncio.wait_for(training, 120)
            except TimeoutError:
                where = {d.peer_id[:12]: (d.stage, d.status()["step"], d.status()["state"]) for d in (founder, *others)
                         if d is not relay}
                raise AssertionError(f"training did not end within 120 s after the relay left: trainer {trainer.progress()}"
                                     f", routers {[r.snapshot() for r in trainer.routers]}, daemons {where}") from None
            await wait_for(lambda: natted.relay_client.status.state == "relayed"
                           and natted.relay_client.status.relay_id not in (None, first_relay), 30,
                           "relayed again, through another peer")
        finally:
            await asyncio.gather(*(d.shutdown() for d in others))  # at once: ~1 s each one by one
    assert summary.steps == 12
    assert summary.microbatches_issued == summary.microbatches_completed
