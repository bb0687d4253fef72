"""Stages of one-stage peers for averaging tests: real executors and averagers, fed text microbatches."""



from __future__ import annotations

import asyncio
import pathlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from swarmd.dht.identity import Identity
from swarmd.net.server import DataPlane
from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.spec import PRESETS

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
