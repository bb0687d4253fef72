"""A proven fake that mirrors a stage-mate's progress and never contributes (issue #18, item 2).

Identities are free, so a fake can pass the proof (``GET /v1/proof`` signed with its own key at
its announced address) and then answer ``GET /v1/progress`` with what an honest stage-mate
answers: the same step, params digest and samples held, under its own id, taking part in the
stage's rounds. The stage's leader then counts samples the fake does not hold and waits for a
contribution that never comes. Real in-process daemons on loopback, a real trainer; the fake is
a little aiohttp server of this test published in the swarm's DHT with a validly signed record.
The stage must keep stepping: a round waits for a silent proven contributor only a bounded time
(``swarmd.pipeline.averaging.patience``), then goes on without it and excludes it with growing periods.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from swarmd.pipeline.spec import PRESETS, TrainingSpec
from tests.support.fakes import proven_mirror, trainer_beside
from tests.support.swarms import fast_swarm

SPEC = replace(PRESETS["tiny"], name="silent", n_stages=1, layers_per_stage=1)  # one stage: its books are all
TRAINING = TrainingSpec(target_batch_size=16, lr=3e-3, warmup_steps=1, averaging_timeout_s=2.5)
STEPS = 4


@pytest.mark.slow  # ~12 s, most of it starting four daemons; the default run's variant: tests/adversarial/test_tarpit.py
async def test_a_proven_silent_fake_stage_mate_is_waited_for_a_bounded_time_then_excluded() -> None:
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=2) as daemons:
        async with proven_mirror(daemons) as (fake, stage0):  # to whichever honest peer leads the rounds
            leader, mate = stage0
            summary = await asyncio.wait_for(trainer_beside(daemons[0], STEPS).run(), 90)
            assert summary.steps == STEPS
            statuses = [d.status()["averaging"] for d in stage0]
            assert fake.polls >= 1
            # whoever led the stage's rounds waited for the fake once, then excluded it
            assert any(fake.identity.peer_id in str(a["excluded"]) for a in statuses), statuses
            assert sum(a["silent_contributors"] for a in statuses) >= 1, statuses
            # the fake costs at most a round or two (waited for, then excluded), not one per step
            assert max(a["rounds_ok"] for a in statuses) >= STEPS, statuses
            assert all(a["rounds_aborted"] <= 2 for a in statuses), statuses
            assert leader.executor is not None and mate.executor is not None
            assert leader.executor.digest == mate.executor.digest
