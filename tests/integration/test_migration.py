"""Moving a live peer between stages: POST /migrate on real in-process daemons."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest

from swarmd.daemon import Daemon
from swarmd.errors import SwarmdError
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.swarms import CORPUS_BYTES, MICRO, TINY, TRAINING, config


async def wait_for(predicate, timeout: float = 20.0, state=lambda: None) -> None:
    """Until ``predicate()``; failing after ``timeout`` with what ``state()`` says."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"condition not met in time: {state()}"
        await asyncio.sleep(0.05)


def peers(daemons: list[Daemon]) -> list[tuple]:
    """Each daemon's id, stage, step, digest, samples held, whether it is averaging, and backwards served
    (for failure messages)."""
    return [(d.peer_id and d.peer_id[:12], d.stage, d.executor and d.executor.step,
             d.executor and d.executor.digest[:12], d.executor and d.executor.grad_samples,
             d.executor and d.executor.averaging, d.data_plane and d.data_plane.served["backward"]) for d in daemons]


async def test_post_migrate_moves_a_peer_and_refuses_to_empty_a_stage() -> None:
    daemons: list[Daemon] = []
    try:
        founder = Daemon(config(0, TINY, TRAINING))
        daemons.append(founder)
        await founder.start()
        for stage in (0, 1):  # stage 0: founder + mover; stage 1: one peer
            d = Daemon(config(stage, TINY, TRAINING, (founder.dht.address,)))
            daemons.append(d)
            await d.start()
        founder_, mover, lone = daemons
        run = TrainerConfig(api=f"http://{founder.status()['api_addr']}", steps=2, sync=True, codec="none",
                            microbatch_size=MICRO, val_every=0, max_corpus_bytes=CORPUS_BYTES)
        await Trainer(run).run()

        async with httpx.AsyncClient(base_url=f"http://{mover.status()['api_addr']}") as api:
            for bad in ({}, {"stage": -1}, {"stage": "x"}, {"stage": 1, "extra": 1}, {"stage": 1, "force": "maybe"}):
                r = await api.post("/migrate", json=bad)
                assert r.status_code == 422, (bad, r.text)
            r = await api.post("/migrate", json={"stage": 9})
            assert r.status_code == 422 and "does not exist" in r.json()["message"]
            r = await api.post("/migrate", json={"stage": 0})
            assert r.status_code == 409 and "already serves" in r.json()["message"]
            r = await api.post("/migrate", json={"stage": 1})
            assert r.status_code == 202 and r.json()["to"] == 1
            await wait_for(lambda: (mover.migration or {}).get("phase") in ("done", "failed"))
            status = (await api.get("/status")).json()
        assert status["migration"]["phase"] == "done" and status["stage"] == 1 and status["state"] == "serving"
        # it serves stage 1's trained parameters, not fresh ones
        assert mover.executor.step == lone.executor.step == 2
        assert mover.executor.digest == lone.executor.digest and mover.synced_from == lone.peer_id

        # the founder is now alone on stage 0: moving it would empty the stage
        async with httpx.AsyncClient(base_url=f"http://{founder_.status()['api_addr']}") as api:
            r = await api.post("/migrate", json={"stage": 1})
            assert r.status_code == 409 and "would empty it" in r.json()["message"]
            assert founder_.stage == 0

        # training goes on with the new layout, and stage 1's two peers stay identical
        summary = await Trainer(replace(run, seed=1)).run()
        assert summary.microbatches_issued == summary.microbatches_completed
        assert {d.executor.step for d in daemons} == {4}
        assert mover.executor.digest == lone.executor.digest
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons))  # at once: ~1 s each one by one


async def test_a_live_swarm_heals_an_imbalanced_stage_while_training() -> None:
    from swarmd.config import RebalanceConfig

    rebalance = RebalanceConfig(policy="adaptive", period_s=2.0, cooldown_s=5.0)
    daemons: list[Daemon] = []
    try:
        founder = Daemon(config(0, TINY, TRAINING, rebalance=rebalance))
        daemons.append(founder)
        await founder.start()
        for stage in (0, 0, 1):  # three peers forced onto stage 0, one on stage 1
            d = Daemon(config(stage, TINY, TRAINING, (founder.dht.address,), rebalance=rebalance))
            daemons.append(d)
            await d.start()
        run = TrainerConfig(api=f"http://{founder.status()['api_addr']}", steps=60, sync=True, codec="none",
                            microbatch_size=MICRO, val_every=0, max_corpus_bytes=CORPUS_BYTES)
        trainer = Trainer(run)
        training = asyncio.create_task(trainer.run())
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while sum(d.stage == 1 for d in daemons) < 2:
                assert loop.time() < deadline, "no peer moved to the starved stage within 30 s"
                assert not training.done(), training.exception() if training.done() else None
                await asyncio.sleep(0.2)
            mover = next(d for d in daemons[:3] if d.stage == 1)
            await wait_for(lambda: mover.state == "serving" and mover.migration["phase"] == "done")
            assert "rebalance: adaptive" in mover.migration["reason"]
            # its parameters then match its stage-mates', and training goes on through it (the policy may
            # move other peers meanwhile, the lone one of stage 1 included: compare with whoever shares its stage)
            served_before = mover.data_plane.served["backward"]
            step_at_move = mover.executor.step

            def mates_at_its_step() -> list[Daemon]:
                return [d for d in daemons if d is not mover and d.stage == mover.stage
                        and d.executor.step == mover.executor.step]

            await wait_for(lambda: mover.executor.step >= step_at_move + 3 and bool(mates_at_its_step())
                           and mover.data_plane.served["backward"] > served_before, timeout=30,
                           state=lambda: (step_at_move, served_before, peers(daemons)))
            assert {d.executor.digest for d in mates_at_its_step()} == {mover.executor.digest}, (
                step_at_move, peers(daemons))
            assert sum(d.stage == 0 for d in daemons) >= 1  # no stage was emptied
            summary = await training  # the run finishes all its steps
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        assert summary.steps == 60 and summary.microbatches_issued == summary.microbatches_completed
        assert summary.step_losses[-1] < summary.step_losses[0]
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons))  # at once: ~1 s each one by one


async def test_an_api_token_guards_mutating_endpoints_and_reads_from_other_machines(tmp_path) -> None:
    from swarmd.api.app import create_app
    from swarmd.config import ApiConfig

    token = "s3cret-token-of-enough-length"
    d = Daemon(replace(config(0, TINY, TRAINING), api=ApiConfig(host="127.0.0.1", port=0, token=token)))
    await d.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{d.status()['api_addr']}") as api:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
                assert (await api.post("/migrate", json={"stage": 1}, headers=headers)).status_code == 401
                assert (await api.post("/trainers", json={}, headers=headers)).status_code == 401
            assert (await api.get("/status")).status_code == 200  # read-only stays open on loopback
            assert (await api.get("/swarm")).status_code == 200
            good = {"Authorization": f"Bearer {token}"}
        # the same control plane (as the daemon builds it) asked from another machine: reads need the token
        # (no second address to dial from on loopback: the request enters the app through httpx's ASGI transport)
        app = create_app(d, d.trainers, api_token=token, metrics=d.metrics, training=d.training_log)
        for client, local in ((("192.0.2.7", 40000), False), (("::ffff:127.0.0.1", 40000), True),
                              (("::1", 40000), True)):
            far = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client), base_url="http://swarmd")
            async with far:
                for path in ("/status", "/swarm", "/trainers", "/training", "/metrics"):
                    for headers in ({}, {"Authorization": "Bearer wrong"}):
                        r = await far.get(path, headers=headers)
                        assert r.status_code == (200 if local else 401), (client, path, r.text)
                    if not local:
                        assert "Bearer" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
                    assert (await far.get(path, headers=good)).status_code == 200, (client, path)
                for path in ("/healthz", "/", "/openapi.json"):  # liveness, the page (no data), the schema
                    assert (await far.get(path)).status_code == 200, (client, path)
        async with httpx.AsyncClient(base_url=f"http://{d.status()['api_addr']}") as api:
            r = await api.post("/migrate", json={"stage": 1}, headers=good)
            assert r.status_code == 409 and "last one" in r.json()["message"]  # past the guard
            assert (await api.post("/trainers", json={}, headers=good)).status_code == 201
        run = TrainerConfig(api=f"http://{d.status()['api_addr']}", steps=1, sync=True, codec="none",
                            microbatch_size=MICRO, val_every=0, max_corpus_bytes=CORPUS_BYTES)
        with pytest.raises(SwarmdError, match="401"):
            await Trainer(run).run()
    finally:
        await d.shutdown()
