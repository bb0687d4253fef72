"""``GET /v1/checkpoint/{stage}``: a peer's own checkpoint of a stage, for a peer that serves it.

A stage's state outlives its peers on their disks (``swarmd.checkpoint``), but a checkpoint is
worth something to the swarm only if the peer that serves the stage next can have it. So every
peer offers the newest checkpoint it holds of each stage (its DHT record lists them,
``PeerRecord.held``), whatever stage it serves now, and streams one on request in the very
format of ``GET /v1/state`` (``swarmd.net.state_transfer``): the receiver checks it, and adopts
it, exactly as it would a live stage-mate's state (``swarmd.pipeline.placement.state_sync``). Which source a
peer takes is ``swarmd.pipeline.placement.resume``'s decision.

One stream at a time: a checkpoint is read from disk and hashed before it is sent, so a second
request while one is under way is refused with 503 ``Busy`` rather than queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from aiohttp import web

from swarmd.errors import Busy, NotHeld, RequestError
from swarmd.net.state_transfer import StateSnapshot, stream_state

__all__ = ["CHECKPOINT_PATH", "CheckpointOffers", "checkpoint_path"]

CHECKPOINT_PATH = "/v1/checkpoint/{stage}"

#: ``stage`` -> the (meta, tensors) of this peer's newest usable checkpoint of it, or None
Loader = Callable[[int], Awaitable[tuple[dict[str, Any], dict[str, torch.Tensor]] | None]]


def checkpoint_path(stage: int) -> str:
    return f"/v1/checkpoint/{stage}"


class CheckpointOffers:
    """Serves this peer's checkpoints on the data plane (installed by the daemon)."""

    def __init__(self, load: Loader) -> None:
        self._load = load
        self._lock = asyncio.Lock()
        self.streams = 0
        self.bytes = 0

    def install(self, app: web.Application) -> None:
        # no HEAD: a streamed state would be written after the HEAD answer, corrupting the connection
        app.router.add_get(CHECKPOINT_PATH, self.handle, allow_head=False)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        text = request.match_info.get("stage", "")
        if not text.isdecimal() or len(text) > 5:
            raise RequestError(f"stage must be a small non-negative integer, got {text[:16]!r}")
        stage = int(text)
        if self._lock.locked():
            raise Busy("this peer is streaming a checkpoint already; ask again shortly")
        async with self._lock:
            loaded = await self._load(stage)
            if loaded is None:
                raise NotHeld(f"this peer holds no usable checkpoint of stage {stage}")
            meta, tensors = loaded
            self.streams += 1

            def sent(n: int) -> None:
                self.bytes += n

            return await stream_state(request, StateSnapshot(meta=meta, tensors=tensors), on_sent=sent)
