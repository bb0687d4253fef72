"""Stages of one-stage peers for averaging tests: real executors and averagers, fed text microbatches."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import torch

from swarmd.dht.identity import Identity
from swarmd.net.proof import ProofService, Prover
from swarmd.net.server import DataPlane
from swarmd.net.wire import WireLimits
from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.stage.runtime import StageRuntime

MICRO = 4
ONE = replace(PRESETS["tiny"], name="one", n_stages=1, layers_per_stage=1)


_TEXT = torch.tensor(list(b"".join(p.read_bytes() for p in sorted(pathlib.Path(asyncio.__file__).parent.glob("*.py")))),
                     dtype=torch.long)


async def wait_for(condition: Callable[[], Awaitable[Any] | Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


@dataclass
class Peer:
    identity: Identity
    ex: StageExecutor
    plane: DataPlane
    averager: StageAverager
    addr: str
    given: int = 0  # samples given to it

    @property
    def pid(self) -> str:
        return self.identity.peer_id


class Feeder:
    """Real text microbatches, backpropagated on a chosen peer at its current step."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    async def __call__(self, peer: Peer, n: int = MICRO) -> None:
        x, y = text_batch(self.rng, n)
        await peer.ex.backward(x, None, y, step=peer.ex.step)
        peer.given += n




def text_batch(rng: random.Random, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = [rng.randrange(len(_TEXT) - ONE.seq_len - 1) for _ in range(n)]
    x = torch.stack([_TEXT[s:s + ONE.seq_len] for s in starts])
    y = torch.stack([_TEXT[s + 1:s + ONE.seq_len + 1] for s in starts])
    return x, y


@contextlib.asynccontextmanager
async def leader_stage(n: int, *, target: int, delay_updates: bool = False, timeout_s: float = 5.0,
                       directory: dict[str, str] | None = None) -> AsyncIterator[list[Peer]]:
    """``n`` proven peers of one stage averaging through a single leader, running (sorted by id: the first
    leads); ``directory``: the stage's records, peer id -> address, filled here (a test may drop one)."""
    training = TrainingSpec(target_batch_size=target, delay_updates=delay_updates, averaging_timeout_s=timeout_s,
                            lr=3e-3, warmup_steps=2, averaging="leader")
    listing: dict[str, str] = {} if directory is None else directory

    async def stage_peers(*, fresh: bool = False) -> dict[str, str]:
        return dict(listing)

    peers: list[Peer] = []
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession() as session:
        try:
            for _ in range(n):
                identity = Identity.generate()
                ex = StageExecutor(ONE, 0, training=training)
                runtime = StageRuntime(ex)
                plane = DataPlane(lambda r=runtime: r, limits=WireLimits())
                ProofService(lambda i=identity: i, lambda i=identity: listing.get(i.peer_id),
                             lambda e=ex: e).install(plane.app)
                host, port = await plane.start("127.0.0.1", 0)
                avg = StageAverager(ex, peer_id=identity.peer_id, stage_peers=stage_peers, session=session,
                                    poll_s=0.02, identity=identity, prover=Prover(lambda: session, timeout_s=0.5))
                runtime.averager = avg
                listing[identity.peer_id] = f"{host}:{port}"
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
