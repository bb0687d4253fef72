"""Backwards without their inputs (issue #30, item 1), through real daemons, HTTP, DHT and torch.

A middle stage's forward is kept by its peer (its reply says ``kept``), so the trainer's backward
to that peer carries the output gradient only: the stage boundary carries 2 tensors per
microbatch, not 3. Counted where the bytes arrive, the peer's own ``/metrics``
(``swarmd_data_plane_received_bytes_total``). A peer that lost the inputs (here: every kept
forward expires before its backward) answers ``InputsNotCached``, the trainer resends them, and the
training is the single-process reference's all the same; one whose forward's peer died goes to
another peer with them.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from swarmd.daemon import Daemon
from swarmd.net.client import DataPlaneClient
from swarmd.pipeline.routing import StageRouter
from swarmd.train.stage_calls import StageCalls
from swarmd.train.summary import TrainSummary
from swarmd.train.timing import Timing
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.conftest import running_daemon
from tests.support.routing import FixedStages, listed
from tests.support.swarms import CORPUS_BYTES, MICRO, TINY, TRAINING, config, reference_run

SPEC = replace(TINY, name="kept", n_stages=3)  # stage 1 is a middle stage: hidden states in, hidden states out
STEPS = 2


@contextlib.asynccontextmanager
async def one_peer_per_stage(**pipeline: Any) -> AsyncIterator[list[Daemon]]:
    """A swarm of ``SPEC``, one daemon per stage, their ``PipelineConfig`` fields as given."""
    daemons: list[Daemon] = []
    try:
        for stage in range(SPEC.n_stages):
            cfg = config(stage, SPEC, TRAINING, (daemons[0].dht.address,) if daemons else ())
            daemons.append(Daemon(replace(cfg, pipeline=replace(cfg.pipeline, **pipeline))))
            await daemons[-1].start()
        yield daemons
    finally:
        for d in daemons:
            await d.shutdown()


@dataclass(frozen=True)
class Received:
    """What a peer's data plane received, from its ``/metrics``."""

    forward_bytes: float
    backward_bytes: float
    forwards: float  # forward requests answered 200 (the microbatches', and the validation's at the end)
    backwards: float  # backward requests answered 200

    @property
    def per_microbatch(self) -> float:
        """Bytes in for one microbatch through the stage: a forward and a backward (every request is of
        ``MICRO`` samples: the run does not taper its steps' ends)."""
        return self.forward_bytes / self.forwards + self.backward_bytes / self.backwards


async def received(daemon: Daemon) -> Received:
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"http://{daemon.status()['api_addr']}/metrics")).text
    got: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            got[(s.name, s.labels.get("endpoint", ""), s.labels.get("codec", s.labels.get("status", "")))] = s.value
    bytes_in = "swarmd_data_plane_received_bytes_total"
    return Received(forward_bytes=got[(bytes_in, "/v1/forward", "none")],
                    backward_bytes=got[(bytes_in, "/v1/backward", "none")],
                    forwards=got[("swarmd_data_plane_requests_total", "/v1/forward", "200")],
                    backwards=got[("swarmd_data_plane_requests_total", "/v1/backward", "200")])


async def train(**pipeline: Any) -> tuple[TrainSummary, Received, dict[str, int]]:
    """A short --sync run; the summary, and what the middle stage's peer received and cached."""
    async with one_peer_per_stage(**pipeline) as daemons:
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=STEPS, sync=True, codec="none",
                            microbatch_size=MICRO, taper=False, window=4, val_every=0, seed=0,
                            max_corpus_bytes=CORPUS_BYTES)
        summary = await Trainer(run).run()
        middle = daemons[1]
        assert all(d.executor.step == STEPS for d in daemons)
        return summary, await received(middle), middle.executor.cache_stats()


async def test_a_middle_stage_receives_two_tensors_per_microbatch_not_three() -> None:
    before, before_in, before_cache = await train(activation_cache_entries=0)  # nothing kept: SWARM's resend
    after, after_in, after_cache = await train()
    for s in (before, after):
        assert s.steps == STEPS and s.microbatches_issued == s.microbatches_completed and s.stale_redos == 0
    assert before.inputs_omitted == 0 and before_cache["held"] == 0
    # every backward to stages 0 and 1 went to the forward's peer, which had kept the inputs
    assert after.inputs_resent == 0 and after.inputs_omitted == 2 * after.microbatches_completed
    assert after_cache["held"] == after_in.backwards == after.microbatches_completed
    tensor = MICRO * SPEC.seq_len * SPEC.d_model * 4  # one float32 [B, T, d_model] activation or gradient
    # a backward carried inputs + grad_outputs; now grad_outputs only (frames: a few hundred bytes of meta)
    assert before_in.backward_bytes / before_in.backwards == pytest.approx(2 * tensor, rel=0.02)
    assert after_in.backward_bytes / after_in.backwards == pytest.approx(tensor, rel=0.02)
    # the boundary into the middle stage: 3 tensors per microbatch before, 2 now
    assert before_in.per_microbatch == pytest.approx(3 * tensor, rel=0.02)
    assert after_in.per_microbatch == pytest.approx(2 * tensor, rel=0.02)
    assert after.step_losses == pytest.approx(before.step_losses, rel=1e-5)  # and it computes the same


async def test_inputs_the_peer_lost_are_resent_and_nothing_is_lost() -> None:
    # every kept forward expires before its backward: each backward sent without its inputs is refused
    # (InputsNotCached, before anything is counted) and resent with them, once
    summary, middle_in, cache = await train(activation_cache_ttl_s=0.0)
    assert summary.steps == STEPS and summary.microbatches_issued == summary.microbatches_completed
    assert summary.samples == STEPS * TRAINING.target_batch_size and summary.duplicates == 0
    assert summary.inputs_omitted == summary.inputs_resent == 2 * summary.microbatches_completed
    assert cache["held"] == 0 and cache["unheld"] == middle_in.backwards == summary.microbatches_completed
    expected, _ = reference_run(SPEC, TRAINING, STEPS, seed=0)
    assert summary.step_losses == pytest.approx(expected, rel=1e-4)  # the single-process training's


async def test_a_backward_whose_forwards_peer_died_goes_to_another_peer_with_the_inputs() -> None:
    x = torch.randn(MICRO, SPEC.seq_len, SPEC.d_model, generator=torch.Generator().manual_seed(0))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    async with running_daemon(1, SPEC) as ran, running_daemon(1, SPEC) as other, DataPlaneClient() as client:
        assert (await client.forward(ran.data_addr, 1, x, mb=11)).kept
        routers = [StageRouter(0), StageRouter(1, rng=random.Random(0))]
        routers[1].update_peers(listed({"ran": ran.data_addr, "other": other.data_addr}, stage=1))
        summary = TrainSummary()
        calls = StageCalls(FixedStages(routers), client, model=SPEC.digest, codec="none", summary=summary,
                           timing=Timing(), request_timeout_s=30.0, stage_wait_timeout_s=30.0)
        await ran.shutdown()  # the forward's peer is gone, and its kept inputs with it
        served = await calls.backward(1, x, grad_outputs=g, step=0, mb=11, prefer="ran", kept_at=ran.data_addr)
        assert served.peer_id == "other" and served.reply.grad_inputs is not None
        # the omitted attempt met no one; the retry elsewhere carried the inputs, and counted once there
        assert (summary.inputs_omitted, summary.inputs_resent, summary.bans) == (1, 0, 1)
        assert summary.claims == summary.claims_unanswered == 1  # the dead peer could not say whether it counted
        stats = other.executor.cache_stats()
        assert other.executor.grad_samples == MICRO and stats["unheld"] == 0 and stats["held"] == 0
