"""Durable training end to end: real ``swarmd`` processes stopped and restarted on their state dirs.

Two runs of the same 2-stage swarm, side by side (sync mode, codec none, so the losses are exact): one trains
6 steps uninterrupted; the other trains 3, has every daemon SIGTERMed (each writes a last
checkpoint), restarts them on the same state dirs (the founder without ``--model`` or training
flags: it re-founds from its checkpoint; the joiner with ``--stage auto``: it picks the stage it
holds), and trains 3 more. The resumed run's per-step losses equal the uninterrupted run's.
After its 6 steps, the uninterrupted run's only peer of stage 1 is SIGKILLed and restarted from its
state dir: the stage comes back from its checkpoint, not from fresh parameters.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from swarmd.local_swarm import DaemonProcess, stop_all
from swarmd.train.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.timeout(360)  # eight daemon starts in the second test: minutes on a busy 2-core machine

COMMON = ["--swarm", "resume", "--announce-period", "1", "--bootstrap-timeout", "20", "--drain-timeout", "5"]
FOUNDING = ["--model", "tiny", "--stage", "0", "--target-batch-size", "8", "--lr", "3e-3", "--warmup-steps", "1",
            "--averaging-timeout", "10"]


def start(workdir: Path, name: str, *args: str) -> DaemonProcess:
    ready = workdir / f"{name}.json"
    ready.unlink(missing_ok=True)  # a restart: wait for the new ready file, not the old one
    return DaemonProcess([*COMMON, "--checkpoint-every", "2", *args], workdir, name=name)


async def train(api: str, steps: int, seed: int) -> list[float]:
    summary = await Trainer(TrainerConfig(api=api, steps=steps, sync=True, codec="none", microbatch_size=4, window=4,
                                          val_every=0, seed=seed, max_corpus_bytes=1 << 20)).run()
    assert summary.steps == steps
    return summary.step_losses


async def swarm_of_two(workdir: Path, *, founder_args: list[str], joiner_args: list[str]) -> list[DaemonProcess]:
    founder = start(workdir, "peer0", *founder_args)
    try:
        await founder.wait_ready_async()
        joiner = start(workdir, "peer1", "--join", founder.info["dht_addr"], *joiner_args)
    except BaseException:
        founder.kill()
        raise
    try:
        await joiner.wait_ready_async()
    except BaseException:
        await asyncio.to_thread(stop_all, [founder, joiner])
        raise
    return [founder, joiner]


async def uninterrupted(workdir: Path) -> list[float]:
    """6 steps straight (3 with seed 0, the 3 whose losses count with seed 1); then stage 1's only
    peer is SIGKILLed and restarted from its state dir, and trains on. The last 3 losses."""
    peers = await swarm_of_two(workdir, founder_args=FOUNDING, joiner_args=["--stage", "1"])
    try:
        await train(peers[0].api, 3, seed=0)
        expected = await train(peers[0].api, 3, seed=1)

        # every peer of stage 1 killed (its only one), restarted from its state dir
        for _ in range(300):  # its checkpoint of step 6 is written off the loop, a moment after the step
            before = peers[1].status()
            if ((before["checkpoint"] or {}).get("newest") or {}).get("step") == 6:
                break
            await asyncio.sleep(0.1)
        assert before["step"] == 6 and before["checkpoint"]["newest"]["step"] == 6
        peers[1].kill()
        peers[1] = start(workdir, "peer1", "--join", peers[0].info["dht_addr"], "--stage", "1")
        await peers[1].wait_ready_async()
        after = peers[1].status()
        assert after["peer_id"] == before["peer_id"]  # same state dir, same identity
        assert after["step"] == 6 and after["params_digest"] == before["params_digest"]
        assert after["checkpoint"]["resumed_from_step"] == 6 and after["synced_from"] is None
        assert "resumed stage 1 from checkpoint" in peers[1].log()
        await train(peers[0].api, 1, seed=2)  # and it trains on
        assert await asyncio.to_thread(stop_all, peers) == [0, 0]
    finally:
        await asyncio.to_thread(stop_all, peers)
    return expected


async def interrupted(workdir: Path) -> tuple[list[float], list[float]]:
    """3 steps (seed 0), SIGTERM everyone, restart on the same state dirs, 3 steps (seed 1): the
    losses of both halves."""
    peers = await swarm_of_two(workdir, founder_args=FOUNDING, joiner_args=["--stage", "1"])
    try:
        first = await train(peers[0].api, 3, seed=0)
        assert await asyncio.to_thread(stop_all, peers) == [0, 0]  # SIGTERM: drain, last checkpoint, exit 0
        for name in ("peer0", "peer1"):
            assert (workdir / name / "checkpoints" / f"s{name[-1]}-0000000003.json").exists()
        peers = await swarm_of_two(workdir, founder_args=["--stage", "0"], joiner_args=[])
        founder, joiner = (p.status() for p in peers)
        assert founder["step"] == joiner["step"] == 3 and joiner["stage"] == 1
        assert founder["checkpoint"]["resumed_from_step"] == 3 and joiner["checkpoint"]["resumed_from_step"] == 3
        assert "re-founding swarm 'resume' with the model" in peers[0].log()
        got = await train(peers[0].api, 3, seed=1)
    finally:
        await asyncio.to_thread(stop_all, peers)
    return first, got


async def test_a_swarm_stopped_and_restarted_resumes_exactly(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    # the two runs are independent swarms (each its own DHT): run side by side, they share the waits
    expected, (first, got) = await asyncio.gather(uninterrupted(straight), interrupted(resumed))
    assert len(first) == 3 and first[-1] < first[0]
    assert got == pytest.approx(expected, rel=1e-6)


async def test_no_stage_is_reset_while_its_state_exists_anywhere(tmp_path: Path) -> None:
    """The issue's restart: a peer holding only checkpoints of stage 1, restarted on stage 0, is moved to the
    empty stage 1 and must resume it from its own checkpoint, not serve fresh parameters; a fresh peer
    serving stage 1 takes another peer's offered checkpoint; with no state anywhere, a move there is refused
    and a joiner waits, saying the stage is lost, until a peer that holds it comes back."""
    policy = ["--rebalance-policy", "none"]  # nothing moves by itself: each source is exercised on purpose
    peers = await swarm_of_two(tmp_path, founder_args=[*FOUNDING, *policy], joiner_args=["--stage", "1", *policy])
    extra: list[DaemonProcess] = []
    try:
        await train(peers[0].api, 3, seed=0)
        trained = peers[1].status()
        assert trained["stage"] == 1 and trained["step"] == 3
        assert await asyncio.to_thread(stop_all, peers) == [0, 0]

        # both come back on stage 0: the founder as before, peer1 (it holds only stage 1's checkpoint) by --stage 0
        peers = await swarm_of_two(tmp_path, founder_args=["--stage", "0", *policy],
                                   joiner_args=["--stage", "0", *policy])
        founder, holder = peers
        status = holder.status()
        assert status["stage"] == 0 and status["step"] == 3 and status["state_source"] == "live"
        for _ in range(100):  # the founder's view of stage 1 (refreshed every announce period): empty, not lost
            stages = {s["stage"]: s for s in founder.status()["stages"]}
            if stages[1]["health"] == "empty":
                break
            await asyncio.sleep(0.1)
        assert stages[1]["health"] == "empty" and stages[1]["checkpoint"] == 3, stages
        assert "no peer serves stage 1" in stages[1]["hint"]

        # a fresh peer that serves stage 1 takes the checkpoint peer1 offers: step 3, the same parameters
        fresh = start(tmp_path, "peer2", "--join", founder.info["dht_addr"], "--stage", "1", *policy)
        extra.append(fresh)
        await fresh.wait_ready_async()
        got = fresh.status()
        assert (got["step"], got["params_digest"], got["state_source"]) == (3, trained["params_digest"], "offered")
        assert f"stage 1 resumed from the checkpoint of step 3 that peer {holder.info['peer_id'][:12]}" in fresh.log()

        # it leaves (withdrawn at once); peer1 moves to the empty stage 1 by hand: its own checkpoint, not step 0
        assert fresh.stop() == 0
        async with httpx.AsyncClient(base_url=holder.api) as c:
            # right after a peer left, a DHT lookup can miss a record the nodes still hold (seen in CI: the holder's
            # view of stage 0 without the founder, then without itself): the move is refused as emptying stage 0,
            # and asked again once the view has the founder back (a user would do the same); at most 10 s
            for _ in range(50):
                r = await c.post("/migrate", json={"stage": 1})
                if r.status_code != 409 or "last one serving" not in r.text:
                    break
                await asyncio.sleep(0.2)
            assert r.status_code == 202, (r.text, json.dumps((await c.get("/swarm")).json()["stages"]))
            for _ in range(300):
                moved = holder.status()
                if (moved["migration"] or {}).get("phase") in ("done", "failed"):
                    break
                await asyncio.sleep(0.1)
        assert moved["migration"]["phase"] == "done", moved["migration"]
        assert (moved["stage"], moved["step"], moved["params_digest"]) == (1, 3, trained["params_digest"])
        assert moved["state_source"] in ("own", "offered")  # its own checkpoint (or peer2's copy of it)
        await train(founder.api, 1, seed=1)  # and the pipeline trains on from step 3
        for _ in range(300):  # its checkpoint of step 4 (--checkpoint-every 2) written
            if ((holder.status()["checkpoint"] or {}).get("newest") or {}).get("step") == 4:
                break
            await asyncio.sleep(0.1)
        h = holder.status()
        assert h["checkpoint"]["newest"]["step"] == 4, (h["step"], h["checkpoint"], holder.log()[-4000:])

        # stage 1's only peer dies and takes its state with it (its checkpoints and peer2's are on no live peer):
        # the stage is lost; a move there is refused, a joiner waits and says so; the holder's return ends it
        holder.kill()
        # a move asked at once, while the dead holder's records still offer stage 1's state (they outlive it by up to
        # their lifetime, and the founder's view still trusts it): the move dials the holders first, so it is refused
        # now, not accepted and then failed (seen in CI when this was asked later, in a race with the view)
        async with httpx.AsyncClient(base_url=founder.api) as c:
            r = await c.post("/migrate", json={"stage": 1, "force": True})
        assert r.status_code == 409 and "stage 1's state is nowhere" in r.text, r.text
        lost = start(tmp_path, "peer3", "--join", founder.info["dht_addr"], "--stage", "1", *policy)
        extra.append(lost)
        for _ in range(300):
            if "stage 1's state is lost for now" in lost.log():
                break
            await asyncio.sleep(0.1)
        assert "stage 1's state is lost for now" in lost.log() and "restart a peer that served stage 1" in lost.log()
        peers[1] = start(tmp_path, "peer1", "--join", founder.info["dht_addr"], *policy)  # --stage auto
        await peers[1].wait_ready_async()
        back = peers[1].status()
        assert (back["stage"], back["step"], back["state_source"]) == (1, 4, "own"), (back, peers[1].log()[-3000:])
        await lost.wait_ready_async()
        assert lost.status()["step"] == 4 and "stage 1's state is back" in lost.log()
    finally:
        await asyncio.to_thread(stop_all, [*peers, *extra])
