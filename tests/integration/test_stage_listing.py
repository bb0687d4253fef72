"""A daemon's listing of its stage's peers as its averaging loop reads it (``Daemon.stage_mates``):
cached briefly, its age counted from when a read answered, and an expired answer still taken while
another read is under way (on a long link a DHT lookup outlasts the cache, and a lone peer keeps one
going in the background: swarmd.pipeline.averaging.round), so the loop never waits on a second one."""

from __future__ import annotations

import asyncio

from tests.conftest import running_daemon


async def test_an_expired_listing_is_taken_while_a_read_of_it_is_under_way() -> None:
    async with running_daemon(0) as daemon:
        dht = daemon.dht
        assert dht is not None
        real = dht.get_stage_peers
        reads: list[int] = []
        release = asyncio.Event()

        async def slow(swarm: str, stage: int):  # type: ignore[no-untyped-def]
            reads.append(stage)
            await release.wait()  # a lookup across long links
            return await real(swarm, stage)

        listed = await daemon.stage_mates(max_age_s=0.0)
        assert list(listed) == [daemon.peer_id]
        dht.get_stage_peers = slow  # type: ignore[method-assign]
        background = asyncio.create_task(daemon.stage_mates(fresh=True))
        await asyncio.sleep(0.05)
        # the cache is older than the caller allows, but a read is under way: the cached answer, at once
        assert await asyncio.wait_for(daemon.stage_mates(max_age_s=0.0), 1.0) == listed and reads == [0]
        await asyncio.sleep(0.3)
        release.set()
        assert await background == listed
        # its age counts from that read's answer (it began 0.35 s ago) ...
        assert await asyncio.wait_for(daemon.stage_mates(max_age_s=0.2), 1.0) == listed and reads == [0]
        # ... and with none under way, an expired cache is read again
        assert await daemon.stage_mates(max_age_s=0.0) == listed and reads == [0, 0]
