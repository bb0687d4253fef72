"""Averaging liars of issue #29's table in a real 2-stage x 3-peer swarm (in-process daemons on
loopback): a stage peer whose contribution is its true gradient times -20 (inside the 64x outlier
band), or sign-flipped. The leader's robust mean bounds what the contribution does to the step
(``swarmd.pipeline.averaging.trust.robust_aggregation``); its scores leave the contribution out of the mean
within a few rounds and convict the -20x one, which is then excluded and reported (direction
alone never convicts: ``swarmd.pipeline.averaging.trust.hostile_contributions``; the sign flip is convicted on its
own opening instead: ``swarmd.pipeline.averaging.trust.contribution_proofs``); the honest peers
stay bit-identical, nobody honest is convicted, and the held-out loss stays near an honest run's."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import pytest

from swarmd.daemon import Daemon
from swarmd.train.trainer import Trainer
from tests.support.averaging import AVERAGING_MODES
from tests.support.checks import SPEC, TRAINING, trainer_config
from tests.support.liars import poison_contributions
from tests.support.swarms import fast_swarm

STEPS = 12


async def _train(daemons: list[Daemon], seed: int) -> float:
    """Two asynchronous trainers for STEPS steps (no spot checks: losses are compared), then a fresh
    trainer's held-out loss."""
    api = f"http://{daemons[0].status()['api_addr']}"
    summaries = await asyncio.gather(*(Trainer(trainer_config(api, f"t{k}", steps=STEPS, fraction=0.0,
                                                              seed=seed + k)).run() for k in range(2)))
    for summary in summaries:
        assert summary.microbatches_issued == summary.microbatches_completed
    final = await Trainer(dataclasses.replace(trainer_config(api, "val", steps=1, fraction=0.0, seed=99),
                                              val_batches=16)).run()
    assert final.val_loss is not None
    return final.val_loss


async def _same_params(peers: list[Daemon], timeout_s: float = 30.0) -> None:
    """The peers reach one step with one params digest (a round may still be settling)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {(d.executor.step, d.executor.digest) for d in peers if d.executor is not None}
        if len(states) == 1:
            return
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.1)


def _convictions(daemons: list[Daemon]) -> dict[str, list[int]]:
    """Peer id -> the steps at which some leader convicted it (from the rounds' records)."""
    out: dict[str, list[int]] = {}
    for d in daemons:
        if d.averager is None:
            continue
        for rnd in d.averager.history:
            for pid in rnd.get("convicted", {}):
                out.setdefault(pid, []).append(rnd["step"])
    return out


_HONEST: dict[str, float] = {}  # averaging mode -> the honest run's held-out loss (one run per mode and worker)


async def _honest_loss(averaging: str) -> float:
    """The held-out loss of an honest swarm trained as the liars' swarms are (seed 0), in which nobody is
    convicted and the last stage's peers end identical; run once per averaging mode and shared by both
    liars' tests (it took ~10 s of each, the suite being over its time budget)."""
    if averaging not in _HONEST:
        async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging=averaging), peers_per_stage=3) as daemons:
            loss = await _train(daemons, seed=0)
            assert not _convictions(daemons)  # nobody honest is convicted
            if averaging == "allreduce":  # nor, but rarely, an honest owner's own slice left out of its part
                # (now and then an honest slice is: 0-2 in ~200 rounds of bench_verify's honest runs)
                struck = [d.status()["averaging"]["own_slices_struck"] for d in daemons if d.averager]
                assert sum(struck) <= 2, struck
            await _same_params([d for d in daemons if d.stage == 1])
        _HONEST[averaging] = loss
    return _HONEST[averaging]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("averaging", AVERAGING_MODES)
@pytest.mark.parametrize("poison", ["minus20", "flipped"])
async def test_an_averaging_liar_is_bounded_convicted_and_excluded(poison: str, averaging: str) -> None:
    """In leader rounds the leader scores whole contributions; in the chunked all-reduce each part's owner
    scores its slices and the coordinator sums the scores, convicts in its commit and checks the openings
    (``swarmd.pipeline.averaging.allreduce.averager``, "Hostile contributions"): the same outcomes."""
    training = dataclasses.replace(TRAINING, averaging=averaging)
    honest_loss = await _honest_loss(averaging)
    async with fast_swarm(SPEC, training, peers_per_stage=3) as daemons:
        stage1 = sorted((d for d in daemons if d.stage == 1), key=lambda d: d.peer_id or "")
        liar = stage1[-1]  # the largest id: it never leads while an honest stage-mate serves
        assert liar.averager is not None and liar.peer_id is not None
        poison_contributions(liar.averager, poison)
        loss = await _train(daemons, seed=0)
        convictions = _convictions(daemons)
        honest = stage1[:-1]
        await _same_params(honest)
        leader = honest[0]
        status = leader.status()["averaging"]
        struck = sorted(r["step"] for r in leader.averager.history if liar.peer_id in r.get("struck", ()))
        assert struck and struck[0] <= 10  # left out of the mean within 10 steps
        if poison == "minus20":  # far: convicted and excluded
            assert set(convictions) == {liar.peer_id}, convictions  # the liar, and nobody honest
            assert min(convictions[liar.peer_id]) <= 10  # within 10 steps
            assert status["hostile_convictions"] == {liar.peer_id: 1}
            assert liar.peer_id in status["excluded"]
            assert status["excluded"][liar.peer_id]["reason"].startswith("hostile")
        else:  # not far, so the scores never convict it: its own opening does (contribution_proofs, item 3)
            assert set(convictions) == {liar.peer_id}, convictions
            assert min(convictions[liar.peer_id]) <= 10
            assert status["openings"].get("inconsistent") == 1, status["openings"]
            assert status["excluded"][liar.peer_id]["reason"].startswith("hostile: unaccountable")
        # -20x ruined training (3.10x the honest held-out loss) before the robust mean: now near honest
        assert loss <= 1.05 * honest_loss, (loss, honest_loss)


@pytest.mark.timeout(600)
async def test_a_member_lying_only_in_the_part_it_owns_moves_nothing() -> None:
    """Issue 29: in the chunked all-reduce every member owns a part. A liar honest to the other owners and
    -20x in its own slice of the part it owns is scored by no other owner, and its part was judged by its own
    slice: its lie was that part's mean every round. On the first stage nothing else catches it (no
    openings, no convictions before the last stage: ``hostile_contributions``). Its own slice is now scored
    against the part's median (``hostile_contributions.score_owner``): left out every round, and the
    training ends as an honest run's."""
    training = dataclasses.replace(TRAINING, averaging="allreduce")
    honest_loss = await _honest_loss("allreduce")
    async with fast_swarm(SPEC, training, peers_per_stage=3) as daemons:
        stage0 = sorted((d for d in daemons if d.stage == 0), key=lambda d: d.peer_id or "")
        liar = stage0[-1]
        assert liar.averager is not None and liar.peer_id is not None
        poison_contributions(liar.averager, "minus20", own_part_only=True)
        loss = await _train(daemons, seed=0)
        await _same_params(stage0)
        assert not _convictions(daemons)
        # (its own code says so: it reduces honestly; with AdamW a -20x part is a sign flip, which 12 steps
        # do not show in the loss, so the loss alone could not tell the rule was kept)
        status = liar.status()["averaging"]
        # (a part of which fewer than three members hold samples scores nothing: 11 of 13 rounds were struck on a
        # quiet machine, 4 of 13 in a CI run, where the trainers' microbatches left a member without samples more
        # often; without the rule none is)
        assert status["rounds_ok"] >= STEPS and status["own_slices_struck"] >= 1, status
        # (an honest owner's own slice is struck now and then: SECURITY.md; seen once under a loaded machine)
        assert sum(d.status()["averaging"]["own_slices_struck"] for d in stage0[:-1]) <= 2
        assert loss <= 1.05 * honest_loss, (loss, honest_loss)


async def _served(daemon: Daemon) -> float:
    """The forwards and backwards ``daemon``'s data plane answered 200 (a trainer's calls; the last
    stage's are fused backwards), from its ``/metrics``."""
    async with aiohttp.ClientSession() as session, session.get(f"http://{daemon.status()['api_addr']}/metrics") as r:
        text = await r.text()
    lines = [f'swarmd_data_plane_requests_total{{endpoint="/v1/{kind}",status="200"}} '
             for kind in ("forward", "backward")]
    return sum(float(row[len(line):]) for row in text.splitlines() for line in lines if row.startswith(line))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("averaging", AVERAGING_MODES)
async def test_a_convicted_averaging_liar_is_seconded_and_the_trainers_stop_routing_to_it(averaging: str) -> None:
    """Issue #29, item 4: the leader's conviction of a -20x liar reaches its stage-mates as signed
    evidence (``swarmd.pipeline.averaging.trust.accusations``); the honest stage-mate checks it against its own
    contributions, seconds it, and excludes the liar too, so two of the stage's three peers name it
    and a trainer routes nothing more to it. Nobody honest is accused. In the all-reduce the conviction
    comes in the coordinator's commit, and the stage-mate seconds it from the liar's slices of its own
    part (``allreduce.owner.PartStrikes``); the coordinator's report still reaches its ledger."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging=averaging), peers_per_stage=3) as daemons:
        stage1 = sorted((d for d in daemons if d.stage == 1), key=lambda d: d.peer_id or "")
        liar, honest = stage1[-1], stage1[:-1]
        assert liar.averager is not None and liar.peer_id is not None
        poison_contributions(liar.averager, "minus20")
        await _train(daemons, seed=0)
        leader, mate = honest
        lead, seconding = leader.status()["averaging"], mate.status()["averaging"]
        assert lead["hostile_convictions"] == {liar.peer_id: 1}
        assert lead["accusations"].get("sent") == 1, lead["accusations"]
        assert seconding["accusations"].get("seconded") == 1, seconding["accusations"]
        assert seconding["excluded"][liar.peer_id]["reason"].startswith("hostile"), seconding["excluded"]
        assert mate.reports.status()["accepted"] >= 1  # the leader's report, counted in the stage-mate's ledger
        for d in daemons:  # nobody honest excluded for hostile contributions, anywhere
            if d.averager is not None and d is not liar:
                hostile = {p for p, e in d.averager.checks_status()["excluded"].items()
                           if e["reason"].startswith("hostile")}
                assert hostile <= {liar.peer_id}, (d.peer_id, hostile)
        before = [await _served(d) for d in stage1]
        api = f"http://{daemons[0].status()['api_addr']}"
        after_run = await Trainer(trainer_config(api, "after", steps=3, fraction=0.0, seed=7)).run()
        assert after_run.steps >= 3
        after = [await _served(d) for d in stage1]
        assert after[-1] == before[-1], (before, after)  # not one call to the convicted liar
        assert sum(after[:-1]) > sum(before[:-1])  # while its honest stage-mates served the run
