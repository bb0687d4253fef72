"""Training through a real swarm: in-process daemons on 127.0.0.1, real DHT, real HTTP, real torch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
import torch

from swarmd.config import ApiConfig, Config, DHTConfig, NetConfig, PipelineConfig, RebalanceConfig
from swarmd.daemon import Daemon
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.optimizer import build_optimizer
from swarmd.pipeline.spec import PRESETS, ModelSpec, TrainingSpec
from swarmd.train.data import BatchSampler, load_corpus
from swarmd.train.reference import single_process_step
from swarmd.train.trainer import Trainer, TrainerConfig

TINY = PRESETS["tiny"]
TRAINING = TrainingSpec(target_batch_size=16, lr=3e-3, warmup_steps=2, averaging_timeout_s=10.0)
CORPUS_BYTES = 1 << 20
MICRO = 4


def config(
    stage: int, spec: ModelSpec, training: TrainingSpec, join: tuple = (), rebalance: RebalanceConfig | None = None
) -> Config:
    return Config(
        swarm="train-test",
        net=NetConfig(host="127.0.0.1", port=0, drain_timeout_s=5.0),
        api=ApiConfig(host="127.0.0.1", port=0),
        dht=DHTConfig(join=join, announce_period_s=1.0, bootstrap_timeout_s=10.0),
        rebalance=rebalance or RebalanceConfig(policy="none"),
        pipeline=PipelineConfig(spec=spec if not join else None, stage=stage, training=training if not join else None),
    )


@contextlib.asynccontextmanager
async def swarm(spec: ModelSpec, training: TrainingSpec, peers_per_stage: int = 2) -> AsyncIterator[list[Daemon]]:
    """``peers_per_stage`` in-process daemons per stage; the first founds the swarm."""
    daemons: list[Daemon] = []
    try:
        founder = Daemon(config(0, spec, training))
        daemons.append(founder)
        await founder.start()
        join = (founder.dht.address,)
        for i in range(1, spec.n_stages * peers_per_stage):
            d = Daemon(config(i % spec.n_stages, spec, training, join))
            daemons.append(d)
            await d.start()
        if peers_per_stage > 1:
            # stage-mates average only with peers that answered their signed challenge (swarmd.net.proof):
            # tests that count rounds start once every peer has proven a stage-mate
            deadline = asyncio.get_running_loop().time() + 30
            while not all(d.averager.prover.table.status()["proven"] >= 1 for d in daemons):
                assert asyncio.get_running_loop().time() < deadline, [d.averager.prover.table.status() for d in daemons]
                await asyncio.sleep(0.1)
        yield daemons
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons))  # at once: ~1 s each one by one


def reference_run(spec: ModelSpec, training: TrainingSpec, steps: int, seed: int) -> tuple[list[float], list]:
    """Single-process training of the same stages on the same microbatches with the same optimizer."""
    corpus = load_corpus(None, max_bytes=CORPUS_BYTES, seed=seed, seq_len=spec.seq_len)
    sampler = BatchSampler(corpus.train, spec.seq_len, seed=seed)
    stages = [build_stage(spec, k) for k in range(spec.n_stages)]
    optimizers = [build_optimizer(training, s.named_parameters()) for s in stages]
    losses = []
    for step in range(steps):
        microbatches = [sampler.sample(MICRO) for _ in range(training.target_batch_size // MICRO)]
        losses.append(single_process_step(stages, optimizers, training, microbatches, step))
    return losses, stages


EQUIVALENCE_SPECS = {
    "plain": replace(TINY, name="eq", layers_per_stage=2),
    "share_layers": replace(TINY, name="eq", layers_per_stage=2, share_layers=True),
    # Llama-style blocks (RMSNorm, rotary positions, SwiGLU, grouped-query attention) in unequal stages
    "llama_unequal": replace(PRESETS["llama-tiny"], name="eq", layers_per_stage=2, partition=(3, 1)),
}


@pytest.mark.parametrize("variant", sorted(EQUIVALENCE_SPECS))
async def test_swarm_training_equals_single_process_training(variant: str) -> None:
    spec = EQUIVALENCE_SPECS[variant]
    steps, seed = 5, 0
    async with swarm(spec, TRAINING) as daemons:
        founder = daemons[0]
        per_step: list[set[tuple[int, int, str]]] = []

        def on_step(step: int, loss: float, info: dict) -> None:  # every peer has stepped by now
            per_step.append({(d.stage, d.executor.step, d.executor.digest) for d in daemons})

        trainer = Trainer(TrainerConfig(
            api=f"http://{founder.status()['api_addr']}", steps=steps, sync=True, codec="none",
            microbatch_size=MICRO, window=4, val_every=0, seed=seed, max_corpus_bytes=CORPUS_BYTES,
            verify_fraction=0.0,  # a paired check's sample weighs twice in its step (issue 29)
        ), on_step=on_step)
        summary = await trainer.run()
        digests = {(d.stage, d.executor.digest) for d in daemons}
        params = {d.stage: {n: p.detach().clone() for n, p in d.executor.module.named_parameters()}
                  for d in daemons}
        assert all(d.executor.step == steps for d in daemons)
        assert all(d.averager.rounds_ok == steps for d in daemons)
    expected, stages = reference_run(spec, TRAINING, steps, seed)

    assert summary.steps == steps and summary.microbatches_issued == summary.microbatches_completed
    assert summary.stale_redos == 0
    assert len(summary.step_losses) == steps
    for got, want in zip(summary.step_losses, expected):
        assert got == pytest.approx(want, rel=1e-4)
    assert expected[-1] < expected[0]  # it learns
    assert len(digests) == spec.n_stages  # the two peers of each stage are bit-identical
    # ... after every step, not just at the end
    assert [sorted((k, at) for k, at, _ in seen) for seen in per_step] == [
        [(k, step) for k in range(spec.n_stages)] for step in range(1, steps + 1)
    ]
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            torch.testing.assert_close(params[k][name], p.detach(), rtol=1e-4, atol=1e-5)


async def test_trainer_registration_and_listing() -> None:
    async with swarm(TINY, TRAINING, peers_per_stage=1) as daemons:
        api = f"http://{daemons[0].status()['api_addr']}"
        async with httpx.AsyncClient(base_url=api) as c:
            r = await c.post("/trainers", json={"name": "alice"})
            assert r.status_code == 201
            body = r.json()
            assert body["model"]["digest"] == TINY.digest and body["training"]["target_batch_size"] == 16
            assert (await c.post(f"/trainers/{body['trainer_id']}/heartbeat")).status_code == 204
            assert (await c.post("/trainers/nope/heartbeat")).status_code == 404
            listed = (await c.get("/trainers")).json()
            assert [t["name"] for t in listed] == ["alice"] and listed[0]["last_seen_s"] >= 0
            assert (await c.post("/trainers", json={"name": 5})).status_code == 422


async def test_peer_joining_mid_run_serves_its_stage_digest_at_once() -> None:
    async with swarm(TINY, TRAINING, peers_per_stage=1) as daemons:
        founder = daemons[0]
        api = f"http://{founder.status()['api_addr']}"
        run = TrainerConfig(api=api, steps=3, sync=True, codec="none", microbatch_size=MICRO,
                            val_every=0, max_corpus_bytes=CORPUS_BYTES)
        await Trainer(run).run()
        assert founder.executor.step == 3
        late = Daemon(config(0, TINY, TRAINING, (founder.dht.address,)))
        daemons.append(late)
        await late.start()
        # at its first serving moment it already holds the stage's trained state
        assert late.state == "serving" and late.synced_from == founder.peer_id
        assert late.executor.step == 3 and late.executor.digest == founder.executor.digest
        await Trainer(replace(run, steps=2, seed=1)).run()
        stage0 = [d for d in daemons if d.stage == 0]
        assert {d.executor.step for d in stage0} == {5}
        assert len({d.executor.digest for d in stage0}) == 1


# 8-bit activations are lossy: after 8 steps the loss may differ from the raw run's by at most
# this much (relative). Measured in this very setting on 2026-11-29: 2.5e-5 (5.562 -> 4.1134
# raw, 4.1133 8-bit); the margin leaves 40x room for other CPUs and torch builds.
EIGHT_BIT_LOSS_MARGIN = 1e-3


async def test_8bit_activations_stay_within_the_documented_margin_of_raw() -> None:
    finals = {}
    for codec in ("none", "8bit"):
        async with swarm(TINY, TRAINING, peers_per_stage=1) as daemons:
            run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=8, sync=True, codec=codec,
                                microbatch_size=MICRO, val_every=0, max_corpus_bytes=CORPUS_BYTES)
            summary = await Trainer(run).run()
            finals[codec] = summary.step_losses[-1]
            assert summary.step_losses[-1] < summary.step_losses[0]
    assert finals["8bit"] != finals["none"]  # the codec really was lossy
    assert abs(finals["8bit"] - finals["none"]) <= EIGHT_BIT_LOSS_MARGIN * finals["none"], finals


async def test_delayed_updates_keep_serving_and_keep_peers_identical() -> None:
    delayed = replace(TRAINING, delay_updates=True)
    async with swarm(TINY, delayed) as daemons:
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=6, codec="none",
                            microbatch_size=MICRO, window=6, val_every=0, max_corpus_bytes=CORPUS_BYTES)
        summary = await Trainer(run).run()
        # delayed updates leave a window of microbatches in flight across a step (nothing paces them): what is in
        # flight when the sixth step lands is finished, and may complete a seventh, which the summary then counts
        assert summary.steps in (6, 7) and summary.microbatches_issued == summary.microbatches_completed
        assert summary.step_losses[-1] < summary.step_losses[0]
        for _ in range(100):  # let the last round settle everywhere
            by_stage = {}
            for d in daemons:
                by_stage.setdefault(d.stage, set()).add((d.executor.step, d.executor.digest))
            if all(len(v) == 1 for v in by_stage.values()):
                break
            await asyncio.sleep(0.1)
        assert all(len(v) == 1 for v in by_stage.values()), by_stage
        assert sum(d.executor.stale_dropped for d in daemons) <= summary.stale_redos


async def test_a_forgotten_trainer_registers_again_once_and_heartbeats_its_new_id() -> None:
    """The daemon drops registrations without heartbeats (a restart forgets them all): the trainer
    registers again and then renews the *new* registration, instead of re-registering forever."""
    async with swarm(TINY, TRAINING, peers_per_stage=1) as daemons:
        d = daemons[0]
        registry = d._api_server.config.app.state.trainers
        run = TrainerConfig(api=f"http://{d.status()['api_addr']}", steps=10_000, sync=True, codec="none",
                            microbatch_size=MICRO, window=2, val_every=0, max_corpus_bytes=CORPUS_BYTES,
                            heartbeat_s=0.05)
        trainer = Trainer(run)
        task = asyncio.create_task(trainer.run())
        try:
            for _ in range(400):
                if trainer.trainer_id is not None and registry.live():
                    break
                await asyncio.sleep(0.05)
            first = trainer.trainer_id
            assert [t["trainer_id"] for t in registry.live()] == [first]
            registry._trainers.clear()  # what a daemon restart or a long silence does
            for _ in range(400):
                if trainer.trainer_id != first:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # twenty heartbeats
            assert trainer.trainer_id != first
            assert [t["trainer_id"] for t in registry.live()] == [trainer.trainer_id]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
