"""Fake peers for adversarial tests: servers that answer like peers (or never), and their records."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from swarmd.dht.identity import Identity
from swarmd.dht.records import PeerRecord, sign_record
from swarmd.net.proof import ProofClaim, sign_proof
from swarmd.train.trainer import Trainer, TrainerConfig


class FakePeer:
    """An HTTP server on a loopback port that answers every request with its ``_handle``: the
    fake peers below differ only in that."""

    addr = ""
    _runner: web.AppRunner | None = None

    async def __aenter__(self: _Fake) -> _Fake:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
        self.addr = f"{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


class Mirror(FakePeer):
    """Answers ``/v1/proof`` with its own signature and ``/v1/progress`` with ``mirror``'s answer
    under its own id (naming ``names`` its stage's leader, if given: a view of the stage no honest
    peer shares); every other request has its connection cut (it never contributes)."""

    def __init__(self, mirror: str, identity: Identity, stage: int, names: str | None = None) -> None:
        self.mirror, self.identity, self.stage, self.names = mirror, identity, stage, names
        self.polls = 0
        self.proofs = 0
        self.dropped = 0

    async def _mirrored(self, query: Any) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"http://{self.mirror}/v1/progress", params=query) as r:
            return dict(await r.json(content_type=None))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET" and request.path == "/v1/progress":
            self.polls += 1
            progress = await self._mirrored(request.query)
            named = {} if self.names is None else {"leader": self.names}
            return web.json_response({**progress, "peer_id": self.identity.peer_id, "round": None,
                                      "round_expected": None, "round_contributors": None, **named})
        if request.method == "GET" and request.path == "/v1/proof":
            self.proofs += 1
            progress = await self._mirrored({})
            claim = ProofClaim(nonce=request.query.get("nonce", ""), peer_id=self.identity.peer_id, addr=self.addr,
                               stage=self.stage, step=progress["step"], params_digest=progress.get("params_digest"))
            return web.json_response(sign_proof(self.identity, claim).to_json())
        self.dropped += 1  # a trainer's call (a tarpit's cost to trainers is tests/adversarial/test_tarpit.py's): cut at once
        assert request.transport is not None
        request.transport.close()
        return web.Response(status=500)  # never reaches the client: the connection is gone


async def proven_by(daemon: Any, fake: Mirror) -> None:
    """Until ``daemon``'s averager holds a valid proof of ``fake`` (it asks at its stage's ticks)."""
    for _ in range(200):
        averager = daemon.averager
        if averager is not None and averager.prover is not None \
                and averager.prover.proven({fake.identity.peer_id: fake.addr}):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{daemon.peer_id} never proved the fake ({fake.proofs} proofs asked)")


def identity_after(peer_id: str) -> Identity:
    """A fresh identity whose id sorts after ``peer_id`` (so the honest peer is the first one a
    fresh router probes, and the fakes are tried as newcomers to a running trainer)."""
    identity = Identity.generate()
    while identity.peer_id <= peer_id:
        identity = Identity.generate()
    return identity


async def publish_fake(daemon_dht: object, swarm: str, stage: int, addr: str, identity: Identity) -> str:
    """A validly signed ``serving`` record for ``addr`` under ``identity``."""
    now = time.time()
    record = PeerRecord(peer_id=identity.peer_id, stage=stage, state="serving", data_addr=addr, api_addr=addr,
                        throughput=1000.0, queue=0, step=0, params_digest=None, version="0.0.0", timestamp=now,
                        expiry=now + 120.0, reachable="yes")
    accepted = await daemon_dht.store_peer(swarm, sign_record(identity, record))  # type: ignore[attr-defined]
    assert accepted >= 1
    return identity.peer_id


@contextlib.asynccontextmanager
async def proven_mirror(daemons: list[Any], *,
                        names_itself: bool = False) -> AsyncIterator[tuple[Mirror, list[Any]]]:
    """A :class:`Mirror` of the second peer (by id) of stage 0 of a ``fast_swarm`` of swarm ``train-test``,
    published with a validly signed record and proven by every peer of stage 0 (a stage-mate like any
    other now); ``names_itself``: its every answer names itself the stage's leader. Yields it and the
    stage's honest peers, sorted by id."""
    stage0 = sorted((d for d in daemons if d.stage == 0), key=lambda d: d.peer_id or "")
    mate = stage0[1]
    assert mate.peer_id is not None and mate.data_addr is not None
    identity = identity_after(mate.peer_id)
    async with Mirror(mate.data_addr, identity, stage=0, names=identity.peer_id if names_itself else None) as fake:
        await publish_fake(daemons[0].dht, "train-test", 0, fake.addr, fake.identity)
        for d in stage0:
            await proven_by(d, fake)
        yield fake, stage0


def trainer_beside(daemon: Any, steps: int) -> Trainer:
    """A trainer of ``steps`` steps through ``daemon``'s control plane, as the flood tests run one beside
    their fakes (short requests, no spot checks: what is tested is the stage's rounds)."""
    return Trainer(TrainerConfig(api=f"http://{daemon.status()['api_addr']}", steps=steps, microbatch_size=4, window=4,
                                 codec="none", val_every=0, val_batches=1, max_corpus_bytes=1 << 20, refresh_s=0.5,
                                 request_timeout_s=20.0, verify_fraction=0.0))


_Fake = TypeVar("_Fake", bound="FakePeer")
