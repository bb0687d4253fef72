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
import pytest
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

# The modes a test of both runs in. The single leader is the mode that is no longer the default (``--averaging
# leader``, and swarms founded before the all-reduce): its variants of the long end-to-end tests run with ``-m slow``
# (about 70 s of the short run's time); its own checks keep their tests in the short run (test_averaging_checks,
# test_averaging_faults, test_liars_sync, test_accountable_contributions' recomputation tests).
AVERAGING_MODES = [pytest.param("leader", marks=pytest.mark.slow), "allreduce"]
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


async def serving_peer(training: TrainingSpec, listing: dict[str, str],
                       averager: Callable[[StageExecutor, Identity], StageAverager]) -> Peer:
    """A peer of ``ONE``'s stage serving on a loopback port (its proofs too), averaging with what
    ``averager(executor, identity)`` builds, listed in ``listing`` (peer id -> address)."""
    identity = Identity.generate()
    ex = StageExecutor(ONE, 0, training=training)  # no threads=: process-wide
    runtime = StageRuntime(ex)
    plane = DataPlane(lambda r=runtime: r, limits=WireLimits())
    ProofService(lambda i=identity: i, lambda i=identity: listing.get(i.peer_id), lambda e=ex: e).install(plane.app)
    host, port = await plane.start("127.0.0.1", 0)
    runtime.averager = avg = averager(ex, identity)
    listing[identity.peer_id] = f"{host}:{port}"
    return Peer(identity, ex, plane, avg, f"{host}:{port}")


def move(peer: Peer, executor: StageExecutor, averager: StageAverager | None = None) -> asyncio.Task[None]:
    """``peer`` moves to ``executor``'s stage, as a migration swaps a daemon's runtime: its data plane serves
    that executor (and ``averager``: None while it takes part in no round) at the same address; its old
    averager closes as ``stop_averaging`` closes it, in a task returned to await (the caller may be that
    averager's own round, which it ends by raising ``CancelledError``)."""
    runtime = peer.plane._runtime()
    old = runtime.averager
    runtime.executor, runtime.averager = executor, averager
    return asyncio.get_running_loop().create_task(old.close() if old is not None else asyncio.sleep(0))


@contextlib.asynccontextmanager
async def leader_stage(n: int, *, target: int, delay_updates: bool = False, timeout_s: float = 5.0,
                       codec: str = "none", directory: dict[str, str] | None = None,
                       extra: dict[str, str] | None = None, unlisted_s: float = 0.0,
                       run: bool = True) -> AsyncIterator[list[Peer]]:
    """``n`` proven peers of one stage averaging through a single leader (sorted by id: the first leads),
    their averagers running unless ``run`` is False. ``directory``: the stage's records, peer id ->
    address, filled here (a test may drop one); ``extra``: more listed "stage-mates" (fakes), id ->
    address; ``unlisted_s``: for that long after the first listing, a cached listing names nobody (a
    daemon's listing is a DHT read cached for a second), until some peer asks for a fresh one."""
    training = TrainingSpec(target_batch_size=target, delay_updates=delay_updates, averaging_timeout_s=timeout_s,
                            grad_codec=codec, lr=3e-3, warmup_steps=2, averaging="leader")
    listing: dict[str, str] = {} if directory is None else directory
    stale_until: list[float] = []

    async def stage_peers(*, fresh: bool = False) -> dict[str, str]:
        if not stale_until:
            stale_until.append(time.monotonic() + unlisted_s)
        if fresh:
            stale_until[0] = 0.0
        if time.monotonic() < stale_until[0]:
            return {}
        return {**listing, **(extra or {})}

    peers: list[Peer] = []
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession() as session:
        try:
            for _ in range(n):
                peers.append(await serving_peer(training, listing, lambda ex, identity: StageAverager(
                    ex, peer_id=identity.peer_id, stage_peers=stage_peers, session=session, poll_s=0.02,
                    identity=identity, prover=Prover(lambda: session, timeout_s=0.5))))
            peers.sort(key=lambda p: p.pid)
            if run:
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
