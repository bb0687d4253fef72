"""A thin async client for the data plane: one call per endpoint, typed errors.

Trainers and peers call stages through this; it knows the wire format and nothing about
routing (that lives in ``swarmd.pipeline.routing``). Every failure surfaces as
``swarmd.errors.PeerError`` carrying the HTTP status (0 when the peer was unreachable), so a
router can tell "this peer refused the request" from "this peer is gone".
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch

from swarmd.errors import PeerError, WireError
from swarmd.net.wire import CONTENT_TYPE, Frame, decode_frame, encode_frame
from swarmd.swarm_key import SwarmKey, signing_middleware


@dataclass(frozen=True)
class StageReply:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


class DataPlaneClient:
    """Owns one aiohttp session; use as ``async with DataPlaneClient() as client``."""

    def __init__(self, timeout_s: float = 60.0, *, swarm_key: SwarmKey | None = None) -> None:
        """``swarm_key``: a private swarm's key; every request is then signed with it."""
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._swarm_key = swarm_key
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> DataPlaneClient:
        self._session = client_session(self._swarm_key, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(
        self,
        addr: str,
        stage: int,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        codec: str = "none",
        model: str | None = None,
        mb: int | None = None,
    ) -> StageReply:
        """``mb``: the microbatch's id; the peer keeps the forward's activations for its backward."""
        tensors = {"inputs": inputs} if targets is None else {"inputs": inputs, "targets": targets}
        return await self._call(addr, "forward", stage, tensors, codec, model, mb=mb)

    async def backward(
        self,
        addr: str,
        stage: int,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        codec: str = "none",
        model: str | None = None,
        step: int | None = None,
        mb: int | None = None,
    ) -> StageReply:
        """``step``: the step this stage's forward reported for the microbatch (None: no check);
        ``mb``: the id its forward was sent with (a hit in that peer's activation cache)."""
        tensors = {"inputs": inputs}
        if grad_outputs is not None:
            tensors["grad_outputs"] = grad_outputs
        if targets is not None:
            tensors["targets"] = targets
        return await self._call(addr, "backward", stage, tensors, codec, model, step, mb=mb)

    async def info(self, addr: str) -> dict[str, Any]:
        try:
            async with self._require_session().get(f"{_base(addr)}/v1/info") as resp:
                if resp.status != 200:
                    raise await _peer_error(resp)
                return await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerError(0, type(exc).__name__, f"{addr} did not answer: {exc}") from exc

    async def _call(
        self,
        addr: str,
        kind: str,
        stage: int,
        tensors: dict[str, torch.Tensor],
        codec: str,
        model: str | None,
        step: int | None = None,
        *,
        mb: int | None = None,
    ) -> StageReply:
        meta: dict[str, Any] = {"stage": stage, "codec": codec}
        if model is not None:
            meta["model"] = model
        if step is not None:
            meta["step"] = step
        if mb is not None:
            meta["mb"] = mb
        body = encode_frame(kind, meta, tensors, codec=codec)
        try:
            async with self._require_session().post(
                # a file-like body streams in chunks instead of one large write on the loop
                f"{_base(addr)}/v1/{kind}", data=io.BytesIO(body), headers={"Content-Type": CONTENT_TYPE}
            ) as resp:
                if resp.status != 200:
                    raise await _peer_error(resp)
                payload = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerError(0, type(exc).__name__, f"{addr} did not answer: {exc}") from exc
        try:
            frame: Frame = decode_frame(payload)
        except WireError as exc:
            raise PeerError(200, type(exc).__name__, f"{addr} sent an undecodable reply: {exc}") from exc
        return StageReply(meta=frame.meta, tensors=frame.tensors)

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use DataPlaneClient as an async context manager")
        return self._session


def client_session(swarm_key: SwarmKey | None, **kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session whose requests are signed with ``swarm_key`` (when given), so that the
    data plane of a private swarm serves them."""
    if swarm_key is not None:
        kwargs["middlewares"] = (*kwargs.get("middlewares", ()), signing_middleware(swarm_key.http()))
    return aiohttp.ClientSession(**kwargs)


def _base(addr: str) -> str:
    return addr if addr.startswith("http") else f"http://{addr}"


async def _peer_error(resp: aiohttp.ClientResponse) -> PeerError:
    try:
        body = await resp.json(content_type=None)
        return PeerError(resp.status, str(body.get("error", "Error")), str(body.get("message", "")))
    except (ValueError, AttributeError, aiohttp.ClientError):
        return PeerError(resp.status, "Error", (await resp.text())[:200])
