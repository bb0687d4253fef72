"""A peer alone in its stage reads the stage's listing afresh before it steps alone (a mate that began
serving since may hold samples of the step: swarmd.pipeline.averaging.round._newly_listed). While its batch
builds up it keeps that read fresh in the background, so the step does not wait on the DHT: a read that ended
within LISTING_FRESH_S (or within as long as it took) counts, a read in flight is awaited, and otherwise one is
made first."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import torch

from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.averaging.round import LISTING_FRESH_S, LISTING_PERIOD_S
from swarmd.pipeline.stage.executor import StageExecutor
from tests.support.swarms import TINY, TRAINING


class _Listing:
    """The stage's listing as the daemon reads it (``stage_mates``: ``cached`` unless fresh), counting the
    fresh reads."""

    def __init__(self) -> None:
        self.peers = {"a": "127.0.0.1:1"}
        self.cached = dict(self.peers)
        self.fresh_reads: list[float] = []

    async def __call__(self, *, fresh: bool = False) -> dict[str, str]:
        if not fresh:
            return dict(self.cached)
        self.fresh_reads.append(time.monotonic())
        await asyncio.sleep(0.01)  # a DHT read takes a while
        return dict(self.peers)


@contextlib.asynccontextmanager
async def lone_peer() -> AsyncIterator[tuple[StageExecutor, _Listing, StageAverager]]:
    """A stage's executor and averager alone in the stage's listing (peer ``a``), closed at the end."""
    ex = StageExecutor(TINY, 0, training=TRAINING)
    listing = _Listing()
    averager = StageAverager(ex, peer_id="a", stage_peers=listing, session=None)  # type: ignore[arg-type]
    try:
        yield ex, listing, averager
    finally:
        await averager.close()
        await ex.close()


async def test_a_lone_peer_steps_on_a_listing_read_in_the_background_while_it_is_fresh() -> None:
    async with lone_peer() as (ex, listing, averager):
        assert await averager._trusted_mates() == {}  # nothing held: nothing read ahead
        await asyncio.sleep(0.05)
        assert listing.fresh_reads == []
        await ex.add_gradients(torch.zeros(ex.grad_numel), 4)  # a batch builds up
        await averager._trusted_mates()
        await averager._trusted_mates()  # read ahead once a period, not once a tick
        await asyncio.sleep(0.05)
        assert len(listing.fresh_reads) == 1
        assert not await averager._newly_listed() and len(listing.fresh_reads) == 1  # that read counted
        listing.peers["b"] = "127.0.0.1:2"  # a mate begins serving (not in the cached listing yet)
        await asyncio.sleep(LISTING_PERIOD_S)
        await averager._trusted_mates()  # its record appeared before this read began: seen
        await asyncio.sleep(0.05)
        assert len(listing.fresh_reads) == 2 and await averager._newly_listed()
        del listing.peers["b"]
        await asyncio.sleep(LISTING_FRESH_S + 0.05)  # no tick since: the last read is stale
        listing.peers["c"] = "127.0.0.1:3"
        assert await averager._newly_listed() and len(listing.fresh_reads) == 3  # read again, then decided


async def test_a_read_in_flight_is_awaited_and_reads_go_on_between_batches() -> None:
    async with lone_peer() as (ex, listing, averager):
        slow = listing.__call__

        async def slow_read(*, fresh: bool = False) -> dict[str, str]:
            if fresh:
                await asyncio.sleep(0.2)  # a DHT lookup across a long link
            return await slow(fresh=fresh)

        averager.stage_peers = slow_read
        await ex.add_gradients(torch.zeros(ex.grad_numel), 4)
        await averager._trusted_mates()  # a read begins
        await asyncio.sleep(0.05)
        listing.peers["b"] = "127.0.0.1:2"  # published before that read answers: the step waits for its answer
        assert await averager._newly_listed() and len(listing.fresh_reads) == 1
        await ex.take_contribution()  # the batch is out (the step): nothing held any more ...
        await asyncio.sleep(LISTING_PERIOD_S)
        await averager._trusted_mates()  # ... and the next batch's listing is read all the same
        await asyncio.sleep(0.3)
        assert len(listing.fresh_reads) == 2


async def test_a_slow_read_stays_fresh_as_long_as_it_took() -> None:
    async with lone_peer() as (ex, listing, averager):
        await ex.add_gradients(torch.zeros(ex.grad_numel), 4)
        now = time.monotonic()
        # a DHT lookup across long links took 1.5 s and ended 1 s ago: the step takes it (reads go on back to back
        # there, so the one before the step always ended within as long as the next one takes)
        averager._listing = (now - 2.5, now - 1.0, dict(listing.peers))
        listing.peers["b"] = "127.0.0.1:2"
        assert not await averager._newly_listed() and listing.fresh_reads == []
        # a quick read that ended as long ago is stale: read again, then decided
        averager._listing = (now - 1.1, now - 1.0, {"a": "127.0.0.1:1"})
        assert LISTING_FRESH_S < 1.0 and await averager._newly_listed() and len(listing.fresh_reads) == 1
