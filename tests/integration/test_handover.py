"""A peer leaving gracefully hands its accumulated gradients to a stage-mate (POST /v1/gradients)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmd.daemon import Daemon
from swarmd.errors import PeerBehind, RequestError, StaleStep, WrongStage
from swarmd.net.client import client_session
from swarmd.net.handover import GradientsRequest, send_gradients
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.pipeline.stage.step_protocol import StepProtocol
from tests.support.swarms import config

TINY = PRESETS["tiny"]
TRAINING = TrainingSpec(target_batch_size=64, averaging_timeout_s=5.0)


async def test_a_leaving_peer_hands_its_gradients_to_a_stage_mate() -> None:
    daemons: list[Daemon] = []
    try:
        founder = Daemon(config(0, TINY, TRAINING))
        daemons.append(founder)
        await founder.start()
        for _ in range(2):
            d = Daemon(config(1, TINY, TRAINING, (founder.dht.address,)))
            daemons.append(d)
            await d.start()
        leaver, mate = daemons[1], daemons[2]
        assert leaver.executor is not None and mate.executor is not None
        flat = torch.randn(leaver.executor.grad_numel, generator=torch.Generator().manual_seed(0))
        await leaver.executor.add_gradients(flat, 5)

        # the route refuses what does not fit, by type on the client
        async with client_session(None) as session:
            good = GradientsRequest(stage=1, model=TINY.digest, step=0, samples=2, peer_id="x" * 40, grads=flat)
            for bad, error in [(GradientsRequest(**{**good.__dict__, "step": 1}), PeerBehind),
                               (GradientsRequest(**{**good.__dict__, "stage": 0}), WrongStage),
                               (GradientsRequest(**{**good.__dict__, "grads": flat[:-1]}), RequestError)]:
                with pytest.raises(error) as refused:
                    await send_gradients(session, mate.data_addr or "", bad)
                assert 400 <= refused.value.status < 500  # type: ignore[attr-defined]
        assert mate.executor.grad_samples == 0

        await leaver.shutdown()  # SIGTERM's path: drain, hand over, stop
        assert leaver.stage_state.handover["handed_out"] == 5 and leaver.stage_state.handover["to"] == mate.peer_id
        status = mate.status()
        assert status["grad_samples"] == 5 and status["gradient_handover"]["handed_in"] == 5
        taken = await mate.executor.take_contribution()
        assert taken.samples == 5 and taken.grads is not None
        torch.testing.assert_close(taken.grads, flat, rtol=0, atol=0)  # exact: codec none
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons))  # at once: ~1 s each one by one


def test_the_step_protocol_takes_a_hand_over_of_its_own_step_only() -> None:
    protocol = StepProtocol(1)
    protocol.step = 3
    with pytest.raises(StaleStep):
        protocol.receive(2, 4)  # computed on older parameters: never mixed into this step's update
    with pytest.raises(PeerBehind):
        protocol.receive(4, 4)
    protocol.take()
    with pytest.raises(Exception, match="averaging"):
        protocol.receive(3, 4)  # Busy while the gradients are out
    protocol.restore(3, 0)
    protocol.receive(3, 4)
    assert protocol.grad_samples == 4 and protocol.handed_in_samples == 4
