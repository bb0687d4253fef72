"""A leader does not step alone while its last round's contributor still applies the answer (issue 28).

Under delayed updates a stage keeps accumulating while its round is on the wire, so the round's
leader often holds a full batch on its own again by the time it has stepped. Its contributor is
one step behind until the answer has arrived and been applied (a second or more over a 100 ms
link): a leader that opened its next round then would step without it and leave it behind, to
resync and drop its samples (bench_wan at wan100: one peer of each stage in 1 round of 10).
Real executors, averagers and data planes in one process; the contributor's apply is slowed down.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.support.averaging import Feeder, Peer, leader_stage, wait_for

APPLY_DELAY_S = 1.0  # the contributor's answer arrives and is applied this much after the leader's step


def slow_apply(peer: Peer, delay_s: float) -> None:
    """The peer applies every averaged update ``delay_s`` late (its answer on a slow link, a busy worker)."""
    apply = peer.ex.apply_average

    async def late(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(delay_s)
        return await apply(*args, **kwargs)

    peer.ex.apply_average = late  # type: ignore[method-assign]


async def test_the_leader_waits_for_its_contributor_to_apply_the_last_round_before_the_next() -> None:
    async with leader_stage(2, target=8, delay_updates=True) as peers:
        leader, mate = peers
        slow_apply(mate, APPLY_DELAY_S)
        feed = Feeder()
        await feed(leader)
        await feed(mate)
        await wait_for(lambda: leader.ex.step == 1, 20, "the leader at step 1")
        # the leader alone holds the next batch at once, while its contributor still applies step 0's mean
        await feed(leader, 8)
        assert mate.ex.step == 0
        await wait_for(lambda: leader.ex.step == 2 and mate.ex.step == 2, 20, "both at step 2")
        rounds = [(r["step"], r["status"], r["contributors"]) for r in leader.averager.history]
        assert rounds == [(0, "ok", 2), (1, "ok", 2)], rounds  # without the wait: (1, "ok", 1), the mate left behind
        assert leader.ex.digest == mate.ex.digest
        # the mate applied the answer (a resync would leave it at 1); it counts the round a moment after it steps
        await wait_for(lambda: mate.averager.rounds_ok == 2, 10, "the mate's second round counted")
