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
from tests.support.averaging import ONE, Feeder, leader_stage, wait_for


async def test_a_contributor_that_moved_mid_round_is_spared_not_excluded_as_silent() -> None:
    two = dataclasses.replace(ONE, name="two", n_stages=2)
    async with leader_stage(3, target=12, timeout_s=3.0) as peers:
        leader, mover = peers[0], peers[-1]
        moved = StageExecutor(two, 1, training=mover.ex.training)
        original = StageAverager._contribute_to
        fired: list[str] = []

        async def moving(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self is mover.averager and not fired:  # the move: its averager stops, it serves stage 1
                fired.append(self.peer_id)
                # once the leader's round expects it (or the leader would never open one: 8 of 12 samples)
                await wait_for(lambda: leader.averager._round is not None, 10, "the leader opened its round")
                runtime = mover.plane._runtime()
                runtime.executor, runtime.averager = moved, None
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
            await moved.close()
