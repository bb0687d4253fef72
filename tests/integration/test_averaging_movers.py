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
import dataclasses
from typing import Any

from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.stage.executor import StageExecutor
from tests.support.averaging import ONE, Feeder, leader_stage, move, wait_for


async def test_a_contributor_that_moved_mid_round_is_spared_not_excluded_as_silent() -> None:
    two = dataclasses.replace(ONE, name="two", n_stages=2)
    async with leader_stage(3, target=12, timeout_s=3.0) as peers:
        leader, mover = peers[0], peers[-1]
        moved = StageExecutor(two, 1, training=mover.ex.training)
        original = StageAverager._contribute_to
        fired: list[str] = []
        closing: list[asyncio.Task[None]] = []

        async def moving(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self is mover.averager and not fired:  # the move: its averager stops, it serves stage 1
                fired.append(self.peer_id)
                # once the leader's round expects it (or the leader would never open one: 8 of 12 samples)
                await wait_for(lambda: leader.averager._round is not None, 10, "the leader opened its round")
                closing.append(move(mover, moved))
                raise asyncio.CancelledError  # (its averager's own task: ended here)
            return await original(self, *args, **kwargs)

        StageAverager._contribute_to = moving  # type: ignore[method-assign]
        try:
            feed = Feeder()
            for p in peers:
                await feed(p)
            await wait_for(lambda: fired, 20, "the mover was about to contribute")
            await wait_for(lambda: leader.averager.history, 20, "the leader's round ended without the mover")
            await wait_for(lambda: mover.pid in leader.averager._spared, 10, "the mover was asked and spared")
            assert mover.pid not in leader.averager.excluded() and leader.averager.silent_contributors == 0
        finally:
            StageAverager._contribute_to = original  # type: ignore[method-assign]
            await asyncio.gather(*closing)
            await moved.close()


async def test_contributors_of_a_leader_that_moved_mid_round_keep_their_gradients_at_once() -> None:
    """The leader moves after its contributions arrived, before it answered: its round is cancelled, its
    averager closes (as ``stop_averaging`` closes it) and it serves stage 1. Its contributors are answered
    "aborted" at once and keep their gradients (they were answered a 500, "the peer failed unexpectedly")."""
    from swarmd.pipeline.averaging.leader import RoundLeader

    two = dataclasses.replace(ONE, name="two", n_stages=2)
    directory: dict[str, str] = {}
    async with leader_stage(3, target=12, timeout_s=3.0, directory=directory) as peers:
        leader, mates = peers[0], peers[1:]
        moved = StageExecutor(two, 1, training=leader.ex.training)
        original = RoundLeader._accuse_silent
        fired: list[str] = []
        closing: list[asyncio.Task[None]] = []

        async def moving(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self is leader.averager and not fired:  # contributions in: the leader leaves the stage's rounds
                fired.append(self.peer_id)
                del directory[leader.pid]
                closing.append(move(leader, moved))
                raise asyncio.CancelledError
            return await original(self, *args, **kwargs)

        RoundLeader._accuse_silent = moving  # type: ignore[method-assign]
        try:
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
        finally:
            RoundLeader._accuse_silent = original  # type: ignore[method-assign]
            await asyncio.gather(*closing)
            await moved.close()
