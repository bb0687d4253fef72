"""Many trainers at once (issue 13): sample reservations pace them together, every sample counts once.

Real daemons (in-process, and child processes where one is SIGKILLed), real trainers, real torch.
The books are exact: every step of the first stage aggregates exactly the target batch, every
microbatch issued completes, and the samples the trainers computed are exactly those the stages
stepped on, still hold, or lost with a killed peer (written off by the lease book).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from swarmd.local_swarm import DaemonProcess
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import ReserveRequest
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.train import trainer as trainer_module
from swarmd.train.swarm_client import SwarmClient
from swarmd.train.trainer import Trainer, TrainSummary
from tests.support.rounds import ok_rounds
from tests.support.swarms import swarm
from tests.support.trainers import MICRO, trainer_config

SPEC = replace(PRESETS["tiny"], name="many")
TARGET = 32
TRAINING = TrainingSpec(target_batch_size=TARGET, lr=1e-3, warmup_steps=1, averaging_timeout_s=5.0)


def strict(summary: TrainSummary) -> dict[str, Any]:
    """The --json line, parsed back by a strict parser (no NaN/Infinity)."""
    line = json.dumps(summary.to_json(), allow_nan=False)
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def rounds(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in (status["averaging"] or {}).get("recent", []) if r["status"] == "ok"]


async def test_three_trainers_pace_through_reservations_and_every_step_is_exactly_the_batch(monkeypatch) -> None:
    splits: list[tuple[list[str], list[str]]] = []  # each trainer's corpus: its train and held-out documents
    real_load = trainer_module.load_corpus

    def load_corpus(*args: Any, **kwargs: Any) -> Any:
        corpus = real_load(*args, **kwargs)
        splits.append((list(corpus.train_files), list(corpus.val_files)))
        return corpus

    monkeypatch.setattr(trainer_module, "load_corpus", load_corpus)
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
    assert stage0["exactly_once"] == {"duplicates": 0, "late_refused": 0, "fenced_refused": 0, "claims": 0,
                                      "claims_counted": 0}
    book = stage0["reservations"]
    assert book["granted"] == sum(s.leases for s in summaries) and book["granted_samples"] == sum(
        s.samples for s in summaries) - redos * MICRO
    assert book["expired"] == 0 and book["written_off"] == 0
    # the trainers' shares of each step they all saw add up to the batch
    steps = min(len(line["step_samples"]) for line in lines)
    assert steps >= 6 and all(sum(line["step_samples"][k] for line in lines) == TARGET for k in range(steps - 1))
    # ... and each trainer has its fair share of each of them (swarmd.pipeline.fair_share): their windows of 4
    # each hold a whole step, and granted first come one trainer took whole steps while another got nothing in
    # all 6 (a loaded full-suite run). The first steps may still go first come: a trainer claims its share by
    # asking, and one whose registration or corpus came later may ask only once a step or two went by
    shares = [[line["step_samples"][k] for line in lines] for k in range(2, steps - 1)]
    assert all(n > 0 for step in shares for n in step), [line["step_samples"] for line in lines]
    assert sorted(line["shard"] for line in lines) == [0, 1, 2]  # disjoint data shards by rank ...
    assert len(splits) == 3 and all(split == splits[0] for split in splits)  # ... of one split, whatever their seeds
    assert sorted(t["rank"] for t in listed) == [0, 1, 2]  # while they train
    assert all({"samples", "steps_seen", "loss", "samples_per_s"} <= set(t) for t in listed)
    assert len(after) == 3 and all(t["finished"] for t in after)  # listed until they expire, as finished
    by_name = {t["name"]: t for t in after}  # the last report: what each trainer contributed, as it counted it
    assert [by_name[f"t{i}"]["samples"] for i in range(3)] == [s.samples for s in summaries], after
    # samples_per_s spans the last 30 s of steps (from the registration on), so a final report just after a
    # heartbeat does not say 0, nor does that of a trainer whose samples all came before its first step ended
    print("/trainers after the run:", json.dumps(after))  # whole: pytest cuts a long assertion message
    assert all(by_name[f"t{i}"]["steps_seen"] >= 6 and by_name[f"t{i}"]["samples_per_s"] > 0 for i in range(3)), after


async def test_a_trainer_whose_samples_all_came_in_its_first_step_reports_a_rate_above_zero() -> None:
    """The pacing test above saw a trainer that drew its only 32 samples before its first step ended
    report 0 samples/s: the rate's window began at the first step seen, so those samples never counted.
    It begins at the registration now."""
    async with swarm(SPEC, TRAINING, peers_per_stage=1) as daemons:
        api = f"http://{daemons[0].api_addr[0]}:{daemons[0].api_addr[1]}"
        async with aiohttp.ClientSession() as http, DataPlaneClient(timeout_s=5.0) as data:
            client = SwarmClient(api, http=http, data=data)
            await client.register()
            await asyncio.sleep(0.05)
            client.observe_step(0, 5.0, TARGET)  # its first step seen: all its samples are already in
            await asyncio.sleep(0.05)
            assert 0 < client.samples_per_s() <= TARGET / 0.1
            assert await client.heartbeat()
            await client.aclose()
            async with httpx.AsyncClient() as h:
                listed = (await h.get(f"{api}/trainers")).json()
            assert [t["samples"] for t in listed] == [TARGET] and listed[0]["samples_per_s"] > 0, listed


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


# In every child daemon: the peer whose pid the control file names SIGKILLs itself inside the handler
# of a backward it just accumulated, once it is at step >= min_step and holds more than min_samples
# (so samples of other microbatches die with it, not only this one's). Killed from the trainer's side
# instead (after the reply), the peer could first hand those samples to a round that had just filled
# (a loaded machine gives it the time): then nothing was lost and the write-off went untested.
KILL_HOOK = """
import json, os, signal
_CTL = os.environ.get("SWARMD_TEST_KILL_CTL")
if _CTL:
    from swarmd.net import server as _server
    _backward = _server.DataPlane._backward
    async def _killing_backward(self, request):
        resp = await _backward(self, request)
        try:
            with open(_CTL) as f:
                ctl = json.load(f)
        except (OSError, ValueError):
            ctl = {}
        ex = self._current().executor
        if (ctl.get("pid") == os.getpid() and resp.status == 200 and ex.step >= ctl["min_step"]
                and ex.grad_samples > ctl["min_samples"]):
            with open(_CTL + ".fired", "w") as f:
                json.dump({"step": ex.step, "held": ex.grad_samples}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        return resp
    _server.DataPlane._backward = _killing_backward
"""


async def settled(peers: list[DaemonProcess], timeout_s: float = 30.0) -> tuple[dict[DaemonProcess, Any],
                                                                                dict[DaemonProcess, int]]:
    """Every peer's status and dropped samples once no round is under way: a round still averaging
    when the trainers finish has its samples out of the accumulator (``grad_samples`` leaves them out,
    ``/v1/progress``'s ``samples`` holds them), so books read then were a round short. A peer counts as
    settled when its progress, read before and after its status, agrees with it and shows no round."""
    keys = ("step", "samples", "averaging", "dropped_samples")
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while True:
            before = {d: (await http.get(f"{d.data}/v1/progress", timeout=10)).json() for d in peers}
            statuses = {d: await d.status_async() for d in peers}
            after = {d: (await http.get(f"{d.data}/v1/progress", timeout=10)).json() for d in peers}
            if all(not after[d]["averaging"] and [before[d][k] for k in keys] == [after[d][k] for k in keys]
                   and statuses[d]["step"] == after[d]["step"] and statuses[d]["grad_samples"] == after[d]["samples"]
                   for d in peers):
                return statuses, {d: int(after[d]["dropped_samples"]) for d in peers}
            if time.monotonic() > deadline:
                pytest.fail(f"the peers did not settle within {timeout_s:.0f}s: " + json.dumps(
                    [{k: after[d][k] for k in keys} for d in peers]))
            await asyncio.sleep(0.1)


async def test_three_trainers_and_a_sigkilled_peer_keep_the_books(spawn, tmp_path, monkeypatch) -> None:
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(KILL_HOOK)
    ctl = tmp_path / "kill.json"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SWARMD_TEST_KILL_CTL", str(ctl))
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
    # killed right after it accumulated a backward, after the swarm stepped twice: it holds samples
    ctl.write_text(json.dumps({"pid": victim.pid, "min_step": 2, "min_samples": MICRO}))
    api = others[0].api  # a stage-1 peer: it outlives the kill
    trainers = [Trainer(trainer_config(api, f"k{i}", steps=7)) for i in range(3)]
    summaries = await asyncio.gather(*(t.run() for t in trainers))
    statuses, dropped = await settled([d for d in peers if d is not victim])
    fired = Path(f"{ctl}.fired")
    assert fired.exists() and victim.proc.wait(timeout=10) == -9, (
        "the victim never held two microbatches after step 2: " + repr([s.to_json() for s in summaries]))
    for s in summaries:
        strict(s)
        assert s.microbatches_issued == s.microbatches_completed
    # the backward the victim died in lost its answer: its trainer asked the dead peer, could not, retried
    assert sum(s.claims_unanswered for s in summaries) >= 1 and sum(s.claims_counted for s in summaries) == 0
    kept = statuses[book]
    lost = kept["reservations"]["written_off"]
    books = json.dumps({"book_rounds": [(r["step"], r["samples"]) for r in rounds(kept)], "book": kept["reservations"],
                        "book_held": kept["grad_samples"], "killed": json.loads(fired.read_text()),
                        "last_held": [st["grad_samples"] for st in statuses.values() if st["stage"] == 1],
                        "last_dropped": [dropped[d] for d, st in statuses.items() if st["stage"] == 1],
                        "trainers": [(s.samples, s.leases, s.stale_redos, s.claims, s.claims_unanswered)
                                     for s in summaries]})
    # printed whole (pytest cuts a long assertion message): the book, each survivor's step, digest and recent
    # rounds, and what each trainer counted
    print("books:", books)
    print("stage-1 survivors:", json.dumps([
        {"peer": st["peer_id"][:8], "step": st["step"], "digest": (st["params_digest"] or "")[:12],
         "rounds_ok": st["averaging"]["rounds_ok"], "rounds_aborted": st["averaging"]["rounds_aborted"],
         "held": st["grad_samples"], "served": st["served"], "exactly_once": st["exactly_once"],
         "recent": [(r["step"], r["samples"], r["status"], (r.get("leader") or "")[:8], r.get("used"))
                    for r in st["averaging"]["recent"]]}
        for st in statuses.values() if st["stage"] == 1], default=str))
    print("trainers:", json.dumps([{k: s.to_json().get(k) for k in ("samples", "microbatches_completed", "duplicates",
                                                                   "stale_redos", "retries", "claims", "verify")}
                                   for s in summaries], default=str))
    # every step of the paced stage aggregated exactly the target batch, also the one the victim's death cut short
    assert rounds(kept) and all(r["samples"] == TARGET for r in rounds(kept)), books
    for status in statuses.values():
        assert all(r["samples"] >= TARGET for r in rounds(status))
    stepped = sum(r["samples"] for r in rounds(kept)) + kept["grad_samples"]
    computed = sum(s.samples for s in summaries)
    # The last stage counts by its own step, not through the book: a round of it that starts late (or is
    # retried after an abort, as on a loaded machine) takes in microbatches the book granted for the next
    # step, so one of its steps may hold more than the target (CI once saw 56 of 32) and a later one is
    # completed with fewer. Over the run its books balance: every sample the trainers completed was counted
    # there (stepped, still held, or dropped by a resync), and beyond those only the microbatches redone
    # after the victim's death, as stale or as unconfirmed by a first spot check, and the victim's samples the
    # book wrote off and granted again.
    last = [st for st in statuses.values() if st["stage"] == 1]
    counted_last = (sum(ok_rounds(last).values()) + sum(st["grad_samples"] for st in last)
                    + sum(dropped[d] for d, st in statuses.items() if st["stage"] == 1))
    redone = MICRO * sum(s.stale_redos + s.claims_unanswered + s.verify["redone"] for s in summaries)
    assert computed <= counted_last <= computed + lost + redone, (computed, counted_last, lost, redone, books)
    # each sample counted at most once; the ones not counted died with the victim, and the book wrote them off
    assert stepped <= computed <= stepped + lost, (stepped, computed, lost, books)
    # the victim died holding samples: answered ones the book wrote off, unless every backward it held died
    # unanswered with it (two accumulated at once and it was killed before either answer went out: CI saw
    # held 16, three answers lost, nothing written off and nothing missing), and those were all redone
    unanswered = MICRO * sum(s.claims_unanswered for s in summaries)
    assert lost > 0 or unanswered >= json.loads(fired.read_text())["held"], (lost, unanswered, books)
    issued = sum(s.microbatches_issued for s in summaries)
    redos = sum(s.stale_redos for s in summaries)
    assert redos <= 0.1 * issued, (redos, issued, kept["reservations"], [s.to_json() for s in summaries])


async def test_trainers_registered_at_different_daemons_get_ranks_unique_across_the_swarm() -> None:
    # each daemon used to hand out its own ranks: two trainers at two daemons were both rank 0 and drew the
    # same data. Registered at the same moment at four daemons, eight trainers get eight different ranks.
    async with swarm(SPEC, TRAINING) as daemons:
        apis = [f"http://{d.api_addr[0]}:{d.api_addr[1]}" for d in daemons]
        async with httpx.AsyncClient(timeout=30) as http:
            replies = await asyncio.gather(*(http.post(f"{api}/trainers", json={"name": f"t{i}"})
                                             for i in range(2) for api in apis))
            assert all(r.status_code == 201 for r in replies), [r.text for r in replies]
            ranks = sorted(r.json()["rank"] for r in replies)
            assert ranks == list(range(8)), ranks
            listed = [t for api in apis for t in (await http.get(f"{api}/trainers")).json()]
            assert sorted(t["rank"] for t in listed) == ranks  # /trainers shows them
            # a trainer that finished frees its rank for the swarm's next one, whichever daemon it registers at
            done = replies[0].json()
            assert (await http.delete(f"{apis[0]}/trainers/{done['trainer_id']}")).status_code == 204
            again = await http.post(f"{apis[3]}/trainers", json={"name": "late"})
            assert again.status_code == 201 and again.json()["rank"] == done["rank"]
