"""A stage-mate that moves to another stage mid-round is not excluded as silent (single leader).

A move (``swarmd.pipeline.placement.migration``) stops the mover's averager wherever its round is, and
the mover then serves another stage at the same address. Its old stage's leader expected its
contribution and waited for it in vain: it used to exclude it as silent, and a daemon leaves the peers
its averager excludes out of its whole view of the swarm, so the trainers asking that daemon never
used the mover on its new stage. The leader asks a missing contributor before accusing it, and spares
one that says it serves another stage (once per peer in ``SPARE_MOVER_EVERY_S``). The all-reduce's
counterparts are in ``tests/integration/test_allreduce.py``. Real executors, averagers and data planes
in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.stage.executor import StageExecutor
from tests.support.averaging import ONE, Feeder, Peer, leader_stage, move, wait_for

TWO = dataclasses.replace(ONE, name="two", n_stages=2)


@contextlib.asynccontextmanager
async def moves_at(cls: Any, method: str, peer: Peer, first: Callable[[], Awaitable[None]]) -> AsyncIterator[list[str]]:
    """``cls.method`` hooked: its first call on ``peer``'s averager awaits ``first()``, then moves ``peer`` to
    stage 1 (``move``: its averager stops and closes, it serves that stage at the same address) and ends
    the averager's task there; every other call runs on. Yields the list the move appends ``peer``'s id to."""
    moved = StageExecutor(TWO, 1, training=peer.ex.training)
    original = getattr(cls, method)
    fired: list[str] = []
    closing: list[asyncio.Task[None]] = []

    async def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is peer.averager and not fired:
            fired.append(self.peer_id)
            await first()
            closing.append(move(peer, moved))
            raise asyncio.CancelledError  # (its averager's own task: ended here)
        return await original(self, *args, **kwargs)

    setattr(cls, method, hooked)
    try:
        yield fired
    finally:
        setattr(cls, method, original)
        await asyncio.gather(*closing)
        await moved.close()


async def test_a_contributor_that_moved_mid_round_is_spared_not_excluded_as_silent() -> None:
    async with leader_stage(3, target=12, timeout_s=3.0) as peers:
        leader, mover = peers[0], peers[-1]

        async def first() -> None:  # once the leader's round expects it (or it never opens one: 8 of 12 samples)
            await wait_for(lambda: leader.averager._round is not None, 10, "the leader opened its round")

        async with moves_at(StageAverager, "_contribute_to", mover, first) as fired:
            feed = Feeder()
            for p in peers:
                await feed(p)
            await wait_for(lambda: fired, 20, "the mover was about to contribute")
            await wait_for(lambda: leader.averager.history, 20, "the leader's round ended without the mover")
            await wait_for(lambda: mover.pid in leader.averager._spared, 10, "the mover was asked and spared")
            assert mover.pid not in leader.averager.excluded() and leader.averager.silent_contributors == 0


async def test_contributors_of_a_leader_that_moved_mid_round_keep_their_gradients_at_once() -> None:
    """The leader moves after its contributions arrived, before it answered: its round is cancelled, its
    averager closes (as ``stop_averaging`` closes it) and it serves stage 1. Its contributors are answered
    "aborted" at once and keep their gradients (they were answered a 500, "the peer failed unexpectedly")."""
    from swarmd.pipeline.averaging.leader import RoundLeader

    directory: dict[str, str] = {}
    async with leader_stage(3, target=12, timeout_s=3.0, directory=directory) as peers:
        leader, mates = peers[0], peers[1:]

        async def first() -> None:  # contributions in: the leader leaves the stage's rounds
            del directory[leader.pid]

        async with moves_at(RoundLeader, "_accuse_silent", leader, first) as fired:
            feed = Feeder()
            for p in peers:
                await feed(p)
            await wait_for(lambda: fired, 20, "the leader had its contributions")
            await wait_for(lambda: all(m.averager.history and not m.ex.averaging for m in mates), 10,
                           "the contributors settled without the moved leader's answer")
            assert all(m.ex.step == 0 and m.ex.grad_samples == 4 for m in mates), [
                (m.ex.step, m.ex.grad_samples) for m in mates]
            assert all(m.averager.history[-1]["status"] == "aborted" for m in mates)
            assert all(m.averager.history[-1]["reason"] == "the leader left the stage's rounds" for m in mates), [
                m.averager.history[-1] for m in mates]
