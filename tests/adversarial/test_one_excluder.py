"""Liveness when one stage-mate alone excludes a peer (issue 29): the trainers keep routing to it (exclusion by the
stage takes two), but its samples are never averaged in where it is excluded. Asynchronous trainers must not wait
for those samples for ever: the lease book writes them off and grants them again (``pacing``: a peer a stage-mate
excludes holds nothing the book counts, as a sync trainer tops such a stage up). In-process daemons on loopback,
2 stages x 3 peers of ``tiny``, the all-reduce."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from swarmd.train.trainer import Trainer
from tests.support.checks import SPEC, TRAINING, trainer_config
from tests.support.swarms import fast_swarm

ALLREDUCE = dataclasses.replace(TRAINING, averaging="allreduce")


@pytest.mark.timeout(300)
async def test_a_peer_one_mate_excludes_does_not_stop_the_stage() -> None:
    async with fast_swarm(SPEC, ALLREDUCE, peers_per_stage=3) as daemons:
        stage0 = sorted((d for d in daemons if d.stage == 0), key=lambda d: d.peer_id or "")
        # the coordinator (the smallest id) excludes the largest: no round it plans holds that peer, and the other
        # mate, never refused it in a round, does not exclude it; the trainers, with one accuser, route to it still
        coordinator, excluded = stage0[0], stage0[-1]
        assert coordinator.averager is not None and excluded.peer_id is not None
        coordinator.averager.exclude_hostile(excluded.peer_id, "a test's accusation")
        api = f"http://{daemons[0].status()['api_addr']}"
        summaries = await asyncio.wait_for(asyncio.gather(*(
            Trainer(trainer_config(api, f"t{k}", steps=6, fraction=0.0, seed=k)).run() for k in range(2))), 200)
        for summary in summaries:
            assert summary.microbatches_issued == summary.microbatches_completed
        assert all(d.executor is not None and d.executor.step >= 6 for d in stage0 if d is not excluded)
