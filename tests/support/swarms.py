"""In-process swarms for tests: daemons on loopback with port 0, real DHT, real HTTP, real torch.

``swarm`` starts the founder then the others one by one and waits until stage-mates proved each other;
``fast_swarm`` starts the others at once; ``started`` runs given configs; ``config`` and ``_config`` build
the daemons' configs; ``reference_run`` trains the same stages in one process for equivalence tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from swarmd.config import ApiConfig, Config, DHTConfig, NetConfig, PipelineConfig, RebalanceConfig
from swarmd.daemon import Daemon
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.stage.optimizer import build_optimizer
from swarmd.pipeline.spec import PRESETS, ModelSpec, TrainingSpec
from swarmd.train.data import BatchSampler, load_corpus
from swarmd.train.reference import single_process_step

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


@contextlib.asynccontextmanager
async def fast_swarm(spec: ModelSpec, training: TrainingSpec, peers_per_stage: int) -> AsyncIterator[list[Daemon]]:
    """In-process daemons on loopback, ``peers_per_stage`` per stage: the founder first, then all the
    others at once (joining one by one costs seconds per peer), and shut down all at once."""
    daemons: list[Daemon] = []
    try:
        founder = Daemon(config(0, spec, training))
        daemons.append(founder)
        await founder.start()
        join = (founder.dht.address,)
        others = [Daemon(config(i % spec.n_stages, spec, training, join))
                  for i in range(1, spec.n_stages * peers_per_stage)]
        daemons += others
        await asyncio.gather(*(d.start() for d in others))
        yield daemons
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons), return_exceptions=True)


def _config(stage: int, join: tuple = (), *, host: str = "127.0.0.1", dht_host: str = "127.0.0.1",
            announce: tuple[str | None, int | None] = (None, None), relay_max_peers: int = 8) -> Config:
    return Config(
        swarm="addr-test",
        net=NetConfig(host=host, port=0, drain_timeout_s=5.0, announce_host=announce[0], announce_port=announce[1],
                      relay_max_peers=relay_max_peers),
        api=ApiConfig(host="127.0.0.1", port=0),
        dht=DHTConfig(host=dht_host, join=join, announce_period_s=1.0, bootstrap_timeout_s=10.0),
        rebalance=RebalanceConfig(policy="none"),
        pipeline=PipelineConfig(spec=None if join else TINY, stage=stage, training=None if join else TRAINING),
    )


@contextlib.asynccontextmanager
async def started(*configs: Config) -> AsyncIterator[list[Daemon]]:
    daemons: list[Daemon] = []
    try:
        for cfg in configs:
            d = Daemon(cfg)
            daemons.append(d)
            await d.start()
        yield daemons
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons))  # at once: ~1 s each one by one
