"""Many trainers at once (issue 13): sample reservations pace them together, every sample counts once.

Real daemons (in-process, and child processes where one is SIGKILLed), real trainers, real torch.
The books are exact: every step of the first stage aggregates exactly the target batch, every
microbatch issued completes, and the samples the trainers computed are exactly those the stages
stepped on, still hold, or lost with a killed peer (written off by the lease book).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import httpx
import pytest

from swarmd.local_swarm import DaemonProcess
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import ReserveRequest
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.train.events import CallDone, StepDone
from swarmd.train.trainer import Trainer, TrainerConfig, TrainSummary
from tests.test_training import swarm

SPEC = replace(PRESETS["tiny"], name="many")
TARGET = 32
MICRO = 8
TRAINING = TrainingSpec(target_batch_size=TARGET, lr=1e-3, warmup_steps=1, averaging_timeout_s=5.0)


def trainer_config(api: str, name: str, steps: int, **kw: Any) -> TrainerConfig:
    return TrainerConfig(api=api, steps=steps, microbatch_size=MICRO, window=4, codec="none", seed=hash(name) % 997,
                         val_every=0, val_batches=1, max_corpus_bytes=1 << 20, name=name, refresh_s=0.5,
                         heartbeat_s=1.0, request_timeout_s=20.0, stage_wait_timeout_s=60.0, **kw)


def strict(summary: TrainSummary) -> dict[str, Any]:
    """The --json line, parsed back by a strict parser (no NaN/Infinity)."""
    line = json.dumps(summary.to_json(), allow_nan=False)
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def rounds(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in (status["averaging"] or {}).get("recent", []) if r["status"] == "ok"]


async def test_three_trainers_pace_through_reservations_and_every_step_is_exactly_the_batch() -> None:
    async with swarm(SPEC, TRAINING, peers_per_stage=1) as daemons:
        api = f"http://{daemons[0].api_addr[0]}:{daemons[0].api_addr[1]}"
        midway = asyncio.Event()

        def on_step(done: int, loss: float, progress: dict) -> None:
            if done == 3:
                midway.set()

        async def list_trainers() -> list[dict[str, Any]]:
            await midway.wait()
            async with httpx.AsyncClient() as http:
                return (await http.get(f"{api}/trainers")).json()

        trainers = [Trainer(trainer_config(api, f"t{i}", steps=6), on_step=on_step if i == 0 else None)
                    for i in range(3)]
        listing = asyncio.create_task(list_trainers())
        summaries = await asyncio.gather(*(t.run() for t in trainers))
        listed = await listing
        async with httpx.AsyncClient() as http:
            after = (await http.get(f"{api}/trainers")).json()
        statuses = [d.status() for d in daemons]
    lines = [strict(s) for s in summaries]
    issued = sum(s.microbatches_issued for s in summaries)
    assert issued == sum(s.microbatches_completed for s in summaries)
    redos = sum(s.stale_redos for s in summaries)
    assert redos <= 0.05 * issued, (redos, issued)
    for status in statuses:  # every step of every stage aggregated exactly the target batch
        assert rounds(status) and all(r["samples"] == TARGET for r in rounds(status)), rounds(status)
    stage0 = statuses[0]
    stepped = sum(r["samples"] for r in rounds(stage0))
    assert sum(s.samples for s in summaries) == stepped + stage0["grad_samples"]  # each sample counted once
    assert stage0["exactly_once"] == {"duplicates": 0, "late_refused": 0}
    book = stage0["reservations"]
    assert book["granted"] == sum(s.leases for s in summaries) and book["granted_samples"] == sum(
        s.samples for s in summaries) - redos * MICRO
    assert book["expired"] == 0 and book["written_off"] == 0
    # the trainers' shares of each step they all saw add up to the batch
    steps = min(len(line["step_samples"]) for line in lines)
    assert steps >= 6 and all(sum(line["step_samples"][k] for line in lines) == TARGET for k in range(steps - 1))
    assert sorted(line["shard"] for line in lines) == [0, 1, 2]  # disjoint data shards by rank
    assert sorted(t["rank"] for t in listed) == [0, 1, 2]  # while they train
    assert all({"samples", "steps_seen", "loss", "samples_per_s"} <= set(t) for t in listed)
    assert len(after) == 3 and all(t["finished"] for t in after)  # listed until they expire, as finished


async def test_a_trainer_killed_holding_reservations_stalls_the_swarm_no_longer_than_its_lease() -> None:
    async with swarm(SPEC, TRAINING, peers_per_stage=1) as daemons:
        api = f"http://{daemons[0].api_addr[0]}:{daemons[0].api_addr[1]}"
        stage0 = daemons[0].data_addr
        async with DataPlaneClient() as client:  # a trainer that reserves the whole step, then dies
            grant = await client.reserve(stage0, ReserveRequest(stage=0, trainer="dead", step=0, size=MICRO,
                                                                count=TARGET // MICRO, lease_s=1.5))
        assert sum(n for _, n in grant.leases) == TARGET and grant.reserved == TARGET
        began = time.monotonic()
        summary = await Trainer(trainer_config(api, "alive", steps=2)).run()
        elapsed = time.monotonic() - began
        book = daemons[0].status()["reservations"]
    assert summary.steps == 2 and summary.full_waits >= 1
    assert book["expired"] == TARGET // MICRO and book["expired_samples"] == TARGET
    assert elapsed < 30.0


async def test_a_second_sync_trainer_is_refused_with_a_sentence() -> None:
    async with swarm(SPEC, TRAINING, peers_per_stage=1) as daemons:
        api = f"http://{daemons[0].api_addr[0]}:{daemons[0].api_addr[1]}"
        async with httpx.AsyncClient() as http:
            first = await http.post(f"{api}/trainers", json={"name": "a", "sync": True})
            second = await http.post(f"{api}/trainers", json={"name": "b", "sync": True})
            other = await http.post(f"{api}/trainers", json={"name": "c"})
    assert first.status_code == 201 and first.json()["rank"] == 0
    assert second.status_code == 409 and other.status_code == 409
    assert "needs the swarm to itself" in second.json()["message"]


async def test_three_trainers_and_a_sigkilled_peer_keep_the_books(spawn) -> None:
    period = "1"
    founder = spawn("--model", "tiny", "--stage", "0", "--announce-period", period, "--rebalance-policy", "none",
                    "--target-batch-size",
                    str(TARGET), "--averaging-timeout", "3", "--lr", "0.001")
    info = founder.wait_ready()
    others = [spawn("--join", info["dht_addr"], "--stage", str(i % 2), "--announce-period", period,
                    "--rebalance-policy", "none")
              for i in range(1, 4)]
    for d in others:
        d.wait_ready()
    peers: list[DaemonProcess] = [founder, *others]
    first = {d: await d.status_async() for d in peers}
    stage0 = sorted((d for d in peers if first[d]["stage"] == 0), key=lambda d: first[d]["peer_id"])
    book, victim = stage0  # the lease book is the smallest id's; the other stage-0 peer dies
    killed: list[int] = []
    stepped_twice = asyncio.Event()

    def on_event(event: object) -> None:  # killed right after it accumulated a backward: it holds samples
        if isinstance(event, StepDone) and event.done >= 2:
            stepped_twice.set()
        if (isinstance(event, CallDone) and stepped_twice.is_set() and not killed and event.stage == 0
                and event.kind == "backward" and event.peer_id == first[victim]["peer_id"]):
            victim.proc.kill()
            killed.append(1)

    api = others[0].api  # a stage-1 peer: it outlives the kill
    trainers = [Trainer(trainer_config(api, f"k{i}", steps=7), events=on_event) for i in range(3)]
    summaries = await asyncio.gather(*(t.run() for t in trainers))
    statuses = {d: await d.status_async() for d in peers if d is not victim}
    assert killed
    for s in summaries:
        strict(s)
        assert s.microbatches_issued == s.microbatches_completed
    kept = statuses[book]
    lost = kept["reservations"]["written_off"]
    # every step of the paced stage aggregated exactly the target batch, also the one the victim's death cut short
    assert rounds(kept) and all(r["samples"] == TARGET for r in rounds(kept)), rounds(kept)
    for status in statuses.values():  # the last stage had counted the victim's samples: their redo is its only excess
        assert all(r["samples"] >= TARGET for r in rounds(status))
        assert sum(r["samples"] - TARGET for r in rounds(status)) <= lost, rounds(status)
    stepped = sum(r["samples"] for r in rounds(kept)) + kept["grad_samples"]
    computed = sum(s.samples for s in summaries)
    # each sample counted at most once; the ones not counted died with the victim, and the book wrote them off
    assert lost > 0 and stepped <= computed <= stepped + lost, (stepped, computed, lost)
    issued = sum(s.microbatches_issued for s in summaries)
    assert sum(s.stale_redos for s in summaries) <= 0.1 * issued
