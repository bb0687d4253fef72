"""A proven fake that mirrors a stage-mate's progress but names another leader (issue #29).

A round opens only once the stage-mates at its step agree on who leads it (the leader's rule)
or coordinates it (the all-reduce's): a mate naming another one means the views of the stage
differ, a peer joined or left, and they agree again within a poll or two. A fake passes the proof
(its own key at its own address), answers ``GET /v1/progress`` with an honest stage-mate's step,
params digest and samples under its own id, and names a leader no honest peer would choose: itself.
It never contributes. Waiting for the views to agree would stall the stage for as long as the fake
keeps answering, so a mate that names another leader is waited for a bounded time (the stage's
patience, ``swarmd.pipeline.averaging.patience.Dissent``), then left out of the rounds, its samples
not counted, until it names this peer's leader again. Real in-process daemons on loopback, a real
trainer; the fake is a little aiohttp server of this test published with a validly signed record.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from swarmd.pipeline.spec import PRESETS, TrainingSpec
from tests.support.fakes import proven_mirror, trainer_beside
from tests.support.swarms import fast_swarm

SPEC = replace(PRESETS["tiny"], name="dissent", n_stages=1, layers_per_stage=1)  # one stage: its rounds are all
STEPS = 4


@pytest.mark.parametrize("averaging", ["allreduce", pytest.param("leader", marks=pytest.mark.slow)])
async def test_a_proven_fake_naming_another_leader_does_not_stall_the_stage(averaging: str) -> None:
    training = TrainingSpec(target_batch_size=16, lr=3e-3, warmup_steps=1, averaging_timeout_s=2.5,
                            averaging=averaging)
    async with fast_swarm(SPEC, training, peers_per_stage=2) as daemons:
        async with proven_mirror(daemons, names_itself=True) as (fake, stage0):
            summary = await asyncio.wait_for(trainer_beside(daemons[0], STEPS).run(), 90)
            assert summary.steps == STEPS
            statuses = [d.status()["averaging"] for d in stage0]
            assert fake.polls >= 1
            # the honest peers stepped together, the fake's mirrored samples never counted
            assert max(a["rounds_ok"] for a in statuses) >= STEPS, statuses
            assert all(a["rounds_aborted"] <= 1 for a in statuses), statuses
            assert sum(a["dissenting_mates"] for a in statuses) >= 1, statuses
            assert stage0[0].executor is not None and stage0[1].executor is not None
            assert stage0[0].executor.step == stage0[1].executor.step >= STEPS
            assert stage0[0].executor.digest == stage0[1].executor.digest
