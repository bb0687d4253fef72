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
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from swarmd.dht.identity import Identity
from swarmd.net.proof import ProofService, Prover
from swarmd.net.server import DataPlane
from swarmd.net.wire import WireLimits
from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.stage.runtime import StageRuntime
from swarmd.pipeline.spec import TrainingSpec
from tests.support.averaging import ONE, Feeder, Peer, wait_for

APPLY_DELAY_S = 1.0  # the contributor's answer arrives and is applied this much after the leader's step


@contextlib.asynccontextmanager
async def delayed_stage(n: int, *, target: int) -> AsyncIterator[list[Peer]]:
    """``n`` peers of one stage with delayed updates, averaging (sorted by id: the first leads)."""
    training = TrainingSpec(target_batch_size=target, delay_updates=True, averaging_timeout_s=5.0, lr=3e-3,
                            warmup_steps=2)
    directory: dict[str, str] = {}

    async def stage_peers(*, fresh: bool = False) -> dict[str, str]:
        return dict(directory)

    peers: list[Peer] = []
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession() as session:
        try:
            for _ in range(n):
                identity = Identity.generate()
                ex = StageExecutor(ONE, 0, training=training)
                runtime = StageRuntime(ex)
                plane = DataPlane(lambda r=runtime: r, limits=WireLimits())
                ProofService(lambda i=identity: i, lambda i=identity: directory.get(i.peer_id),
                             lambda e=ex: e).install(plane.app)
                host, port = await plane.start("127.0.0.1", 0)
                avg = StageAverager(ex, peer_id=identity.peer_id, stage_peers=stage_peers, session=session,
                                    poll_s=0.02, identity=identity, prover=Prover(lambda: session, timeout_s=0.5))
                runtime.averager = avg
                directory[identity.peer_id] = f"{host}:{port}"
                peers.append(Peer(identity, ex, plane, avg, f"{host}:{port}"))
            peers.sort(key=lambda p: p.pid)
            tasks = [asyncio.get_running_loop().create_task(p.averager.run()) for p in peers]
            yield peers
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for p in peers:
                await p.averager.close()
                await p.plane.close()
                await p.ex.close()


def slow_apply(peer: Peer, delay_s: float) -> None:
    """The peer applies every averaged update ``delay_s`` late (its answer on a slow link, a busy worker)."""
    apply = peer.ex.apply_average

    async def late(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(delay_s)
        return await apply(*args, **kwargs)

    peer.ex.apply_average = late  # type: ignore[method-assign]


async def test_the_leader_waits_for_its_contributor_to_apply_the_last_round_before_the_next() -> None:
    async with delayed_stage(2, target=8) as peers:
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
