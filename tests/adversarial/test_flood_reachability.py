"""A joiner's reachability check is not held up by fake probers (issue #18, item 4).

With no proven member to ask, a joiner asks several members at once; the first that reached it
ends the check, so a prober listed by a fake record (a tarpit that never answers) costs nothing
once an honest one answered. Real aiohttp servers on loopback: the joiner's own ``/v1/ping``, an
honest prober (``ProbeService``) and tarpits that hold every connection.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from swarmd.dht.records import PeerRecord
from swarmd.net import reachability
from swarmd.net.reachability import ProbeService, verdict

JOINER = "a" * 40


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
    try:
        yield f"{host}:{port}"
    finally:
        await runner.cleanup()


def record(peer_id: str, addr: str) -> PeerRecord:
    now = time.time()
    return PeerRecord(peer_id=peer_id, stage=0, state="serving", data_addr=addr, api_addr=addr, throughput=10.0,
                      queue=0, step=0, params_digest=None, version="0.1.0", timestamp=now, expiry=now + 60.0,
                      reachable="yes")


def test_one_prober_that_reached_the_peer_outweighs_every_failure() -> None:
    assert verdict([False, None, True]) == "yes"
    assert verdict([False, None]) == "no"
    assert verdict([None, None]) == "unknown" and verdict([]) == "unknown"


async def test_the_first_prober_that_reached_the_joiner_ends_the_check_while_tarpits_still_hold() -> None:
    holding: list[int] = []

    async def tarpit(request: web.Request) -> web.StreamResponse:
        holding.append(1)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    session_box: list[aiohttp.ClientSession] = []
    joiner_app, prober_app, pit_app = web.Application(), web.Application(), web.Application()
    ProbeService(lambda: JOINER, lambda: None).install(joiner_app)
    ProbeService(lambda: "b" * 40, lambda: session_box[0]).install(prober_app)
    pit_app.router.add_route("*", "/{tail:.*}", tarpit)
    async with serve(joiner_app) as joiner, serve(prober_app) as prober, serve(pit_app) as pit, \
            aiohttp.ClientSession() as session:
        session_box.append(session)
        fakes = [record(f"{i:040x}", pit) for i in range(1, 6)]
        members = [*fakes, record("b" * 40, prober)]
        result = await reachability.check(session, peer_id=JOINER, addr=joiner, members=members,
                                          rng=random.Random(0), probers=reachability.UNPROVEN_PROBERS)
        assert result.status == "yes", result
        assert result.by["b" * 40] == "reached"
        # every fake was asked at once, and none had answered when the check ended: theirs were cancelled
        assert len(holding) >= 1
        assert {result.by[f.peer_id] for f in fakes} == {"not needed: another member reached this peer"}
