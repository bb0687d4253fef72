"""A tarpit listed as a serving peer costs a trainer about one typical request (issue #18, item 1).

Two fake peers are published in a real swarm's DHT, validly signed with fresh identities, both
pointing at little asyncio servers of this test that accept connections and never answer a
compute request: a *plain* tarpit, silent on every path, and a *smart* one that passes every
check that costs it nothing: it answers ``GET /v1/progress`` at its stage's step (idle, away from
the stage's rounds, so the stage does not wait for it: that is the averaging's defence), and
``GET /v1/proof`` with its own identity's signature (so the daemons take it for a proven
stage-mate and keep it listed: swarmd.net.proof), and holds every compute request forever. The
trainer must pay for each one probation attempt at most, bounded by a timeout derived from the
stage's measured latency (not the configured request timeout), hold at most one call on them at a
time, ban them for long, and finish its steps. Counts, not wall-clock times, are asserted: the
servers count what reached them. A third fake mirrors the honest peer's progress and takes part
in its stage's rounds, never contributing: the round waits for it a bounded time, then excludes it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

import aiohttp
from aiohttp import web

from swarmd.dht.identity import Identity
from swarmd.net.proof import ProofClaim, sign_proof
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.fakes import FakePeer, Mirror, identity_after, proven_by, publish_fake
from tests.support.swarms import fast_swarm

SPEC = replace(PRESETS["tiny"], name="tarpit")
TRAINING = TrainingSpec(target_batch_size=8, lr=3e-3, warmup_steps=1, averaging_timeout_s=2.5)
CEILING_S = 20.0  # the trainer's request timeout: what each attempt would cost without per-peer timeouts


class Tarpit(FakePeer):
    """An HTTP server that never answers a POST; with ``progress_from``, it answers progress polls
    with what that (honest) peer answers."""

    def __init__(self, progress_from: str | None = None, identity: Identity | None = None, stage: int = 0) -> None:
        self.progress_from = progress_from
        self.identity = identity or Identity.generate()
        self.stage = stage
        self.requests: Counter[str] = Counter()
        self.holding = 0
        self.max_holding = 0
        self._never = asyncio.Event()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests[f"{request.method} {request.path}"] += 1
        if request.method == "GET" and request.path in ("/v1/progress", "/v1/proof") and self.progress_from:
            async with aiohttp.ClientSession() as s, s.get(f"http://{self.progress_from}/v1/progress",
                                                          params=request.query if "wait_step" in request.query
                                                          else None) as r:
                progress = await r.json(content_type=None)
            if request.path == "/v1/progress":  # at the stage's step, idle, and out of the stage's rounds
                return web.json_response({**progress, "peer_id": self.identity.peer_id, "samples": 0, "away": True,
                                          "averaging": False, "leader": None, "round": None, "round_expected": None,
                                          "round_contributors": None})
            claim = ProofClaim(nonce=request.query.get("nonce", ""), peer_id=self.identity.peer_id, addr=self.addr,
                               stage=self.stage, step=progress["step"], params_digest=progress.get("params_digest"))
            return web.json_response(sign_proof(self.identity, claim).to_json())
        compute = request.method == "POST" and request.path in ("/v1/forward", "/v1/backward", "/v1/reserve")
        self.holding += compute
        self.max_holding = max(self.max_holding, self.holding)
        try:
            await self._never.wait()  # until the client gives up (the handler is cancelled) or shutdown
        finally:
            self.holding -= compute
        raise AssertionError("unreachable")

    @property
    def posts(self) -> int:
        """Compute requests (a trainer's); the daemons' own probes and proofs are theirs, not counted."""
        return sum(self.requests[f"POST /v1/{kind}"] for kind in ("forward", "backward", "reserve"))


async def test_tarpits_listed_as_serving_peers_cost_one_probation_attempt_each() -> None:
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=1) as daemons:
        honest = next(d for d in daemons if d.stage == 0)
        assert honest.peer_id is not None and honest.data_addr is not None
        async with Tarpit(honest.data_addr, identity_after(honest.peer_id)) as smart, \
                Tarpit(None, identity_after(honest.peer_id)) as plain, \
                Mirror(honest.data_addr, identity_after(honest.peer_id), stage=0) as mirror:
            api = f"http://{daemons[0].status()['api_addr']}"
            fakes = {await publish_fake(daemons[0].dht, "train-test", 0, pit.addr, pit.identity): pit
                     for pit in (smart, plain)}
            # a proven fake that mirrors the honest peer's progress and takes part in its rounds, never
            # contributing: the round waits for it a bounded time, then excludes it (item 2; 2 peers: test_flood_silent)
            await publish_fake(daemons[0].dht, "train-test", 0, mirror.addr, mirror.identity)
            await proven_by(honest, mirror)
            async with aiohttp.ClientSession() as s:  # the swarm lists them as serving peers of stage 0
                for _ in range(100):
                    async with s.get(f"{api}/swarm") as r:
                        listed = {p["peer_id"] for st in (await r.json())["stages"] for p in st["peers"]}
                    if set(fakes) <= listed:
                        break
                    await asyncio.sleep(0.1)
                assert set(fakes) <= listed
            trainer = Trainer(TrainerConfig(
                api=api, steps=3, microbatch_size=4, window=1, codec="none", val_every=0, val_batches=1,
                max_corpus_bytes=1 << 20, refresh_s=0.5, request_timeout_s=CEILING_S, verify_fraction=0.0))
            summary = await trainer.run()
            assert summary.steps == 3 and summary.microbatches_issued == summary.microbatches_completed
            router = trainer.routers[0]
            # the plain tarpit never answers a progress poll, so it is never sent a compute request; the
            # smart one (it answers polls) holds one request, once, and is banned
            assert plain.posts == 0 and plain.requests["GET /v1/progress"] >= 1, (plain.requests, smart.requests)
            assert smart.posts == 1 and smart.max_holding == 1, smart.requests
            # the smart tarpit's timeout; probation calls: its and the honest peer's
            assert summary.timeouts == 1 and summary.probation_calls >= 2, (
                smart.requests, summary.bans, summary.retries, summary.probation_calls, router.snapshot())
            ids = {pit: fake_id for fake_id, pit in fakes.items()}
            smart_stats, plain_stats = router.stats(ids[smart]), router.stats(ids[plain])
            # the smart one held its call until its timeout: a probation ban (30 s)
            assert not smart_stats.proven and smart_stats.banned_for(time.monotonic()) > 20.0
            assert smart_stats.timeouts >= 1
            # the plain one never answered a poll, so it was never alive and never called; its poll
            # (left running in the background) ends with a probation ban, if the run lasted that long
            assert not plain_stats.proven and not plain_stats.alive and plain_stats.picks == 0
            assert plain_stats.failures == 0 or plain_stats.banned_for(time.monotonic()) > 20.0
            # the smart tarpit's forward was given up by the stage's latency, not by the HTTP timeout
            assert trainer.calls is not None and "typical latency" in trainer.calls.failures[0][smart.addr].message
            # what the smart tarpit's attempt could cost: a few typical requests, not the configured timeout
            assert router.timeout_for(next(p for p, t in fakes.items() if t is smart), 4, "forward") < CEILING_S / 4
            assert router.stats(honest.peer_id).proven and router.stats(honest.peer_id).failures == 0
            averaging = honest.status()["averaging"]
            assert averaging["silent_contributors"] >= 1 and mirror.identity.peer_id in str(averaging["excluded"])
            assert averaging["rounds_ok"] >= 3 and averaging["rounds_aborted"] <= 2, averaging
