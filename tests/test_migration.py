"""Moving a live peer between stages: POST /migrate on real in-process daemons."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx

from swarmd.daemon import Daemon
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.test_training import CORPUS_BYTES, MICRO, TINY, TRAINING, config


async def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


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
        for d in reversed(daemons):
            await d.shutdown()
