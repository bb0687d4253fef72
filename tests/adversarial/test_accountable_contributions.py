"""The sign-flip liar of issue #29's table, caught by opening contributions (item 3): a last-stage peer
whose contribution is its true gradient times -1 (same norm, so no norm rule sees it) in a real
2-stage x 3-peer swarm of in-process daemons on loopback. Its signed opening (its microbatches'
sketches, and its contribution's, under a projection fixed after it sent it:
``swarmd.pipeline.averaging.trust.contribution_proofs``) contradicts itself; the leader convicts it, its honest
stage-mate checks the opening itself and seconds, and both exclude it (``/status``, ``/metrics``).
An honest swarm opens every contribution and convicts nobody.

The checks of an opening that both averaging modes make (consistency, the microbatches listed, the bound
on the extra term, striking a contribution whose sender owes an opening) are tested in both, as
``test_averaging_robust`` does (the single leader's, ``averaging="leader"``, and the all-reduce
coordinator's, ``"allreduce"``), and so is recomputing a sampled microbatch (the leader's from inputs shipped
with each contribution, the coordinator's from a drawn microbatch's inputs it asks the member for after its
opening: ``swarmd.pipeline.averaging.allreduce.recompute``); shipping them is the leader's only."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import aiohttp
import pytest
import torch

from swarmd.daemon import Daemon
from swarmd.dht.identity import Identity
from swarmd.net.messages import RecheckRequest
from swarmd.pipeline.averaging.allreduce.messages import ArAck, ArInputs, ArInputsQuery
from swarmd.net.wire import CONTENT_TYPE
from swarmd.pipeline.averaging.trust.accusations import answers_of
from swarmd.pipeline.averaging.trust.contribution_proofs import Opening
from swarmd.pipeline.averaging.trust.recomputation import extra_bound
from swarmd.pipeline.reports import MisbehaviourReport
from swarmd.train.trainer import Trainer
from tests.support.averaging import AVERAGING_MODES
from tests.support.checks import SPEC, TRAINING, trainer_config
from tests.support.liars import lie_about_a_microbatch, poison_contributions, withhold_inputs, withhold_openings
from tests.support.swarms import fast_swarm

STEPS = 12
MODES = AVERAGING_MODES


async def _train(daemons: list[Daemon], steps: int = STEPS) -> None:
    """Two asynchronous trainers for ``steps`` steps (no spot checks)."""
    api = f"http://{daemons[0].status()['api_addr']}"
    summaries = await asyncio.gather(*(Trainer(trainer_config(api, f"t{k}", steps=steps, fraction=0.0, seed=k)).run()
                                       for k in range(2)))
    for summary in summaries:
        assert summary.steps >= steps


def _recompute_every_contribution(daemons: list[Daemon]) -> None:
    """Leaders recompute one microbatch of every contribution (``recompute_share`` 1; the default recomputes a
    quarter of the samples, at random): the most checks an honest swarm must pass, and a liar caught within
    the run whenever its lie is drawn (one microbatch in ``m`` per round)."""
    for d in daemons:
        if d.averager is not None:
            d.averager.recompute_share = 1.0


def _convictions(daemons: list[Daemon]) -> dict[str, list[int]]:
    """Peer id -> the steps of the rounds whose leader convicted it (from the rounds' records)."""
    out: dict[str, list[int]] = {}
    for d in daemons:
        for rnd in d.averager.history if d.averager is not None else ():
            for pid in rnd.get("convicted", {}):
                out.setdefault(pid, []).append(rnd["step"])
    return out


def _last_stage_by_id(daemons: list[Daemon]) -> list[Daemon]:
    """Stage 1's peers (the last stage: the one that opens its contributions) by peer id: the tests make
    the last one the liar, as the largest id never leads while an honest mate serves, and the first leads."""
    return sorted((d for d in daemons if d.stage == 1), key=lambda d: d.peer_id or "")


def _only_the_liar_excluded_as_hostile(daemons: list[Daemon], liar: Daemon) -> None:
    """Nobody honest excluded for hostile contributions, anywhere."""
    for d in daemons:
        if d.averager is not None and d is not liar:
            hostile = {p for p, e in d.averager.checks_status()["excluded"].items()
                       if e["reason"].startswith("hostile")}
            assert hostile <= {liar.peer_id}, (d.peer_id, hostile)


async def _metric(daemon: Daemon, line: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"http://{daemon.status()['api_addr']}/metrics") as r:
        text = await r.text()
    rows = [row for row in text.splitlines() if row.startswith(line + " ")]
    assert rows, line
    return float(rows[0].split()[-1])


async def _until(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("averaging", MODES)
@pytest.mark.parametrize(("grad_codec", "delayed"), [("auto", False), ("8bit", True), ("5level", False)])
async def test_an_honest_swarm_opens_its_contributions_and_convicts_nobody(grad_codec: str, delayed: bool,
                                                                           averaging: str) -> None:
    """``auto`` is exact on loopback; ``8bit`` quantises what the leader receives and feeds the residual
    back into the next contribution (a part no microbatch explains), and with delayed updates (the second
    case) the stage keeps accumulating while a contribution is out and the update sets those sums aside:
    still consistent, within tolerance. ``5level``, the loosest codec, leaves the largest residual in the part
    no microbatch explains (0.38-0.60 measured): still under its bound there (``recomputation.extra_bound``:
    0.9), and the recomputed parts exact (the parts are not quantised; only the contribution is)."""
    training = dataclasses.replace(TRAINING, grad_codec=grad_codec, delay_updates=delayed, averaging=averaging)
    async with fast_swarm(SPEC, training, peers_per_stage=3) as daemons:
        _recompute_every_contribution(daemons)
        await _train(daemons)
        assert not _convictions(daemons)
        stage1 = [d for d in daemons if d.stage == 1]
        openings = [d.status()["averaging"]["openings"] for d in stage1]
        checked = sum(o.get("ok", 0) for o in openings)
        assert checked >= 3, openings  # openings did travel and were checked, each consistent
        assert not any(o.get(k) for o in openings for k in ("bad", "inconsistent")), openings
        assert sum(o.get("sent", 0) for o in openings) >= checked
        for d in stage1:
            assert not d.status()["averaging"]["excluded"], d.status()["averaging"]["excluded"]
            assert not d.status()["averaging"]["accusations"], d.status()["averaging"]["accusations"]  # no rechecks
        stage0 = [d for d in daemons if d.stage == 0]
        assert not any(d.status()["averaging"]["openings"] for d in stage0)  # the last stage only
        # leaders recomputed a sampled microbatch of contributions and found each opened part right (not under
        # delayed updates: a microbatch may have run at the step before, so nothing is shipped nor recomputed)
        recomputed = sum(o.get("recomputed", 0) for o in openings)
        assert not any(o.get(k) for o in openings
                       for k in ("mismatch", "inputs_refused", "misstated", "sent_mismatch", "sent_owner_wrong")), openings
        if averaging == "allreduce":  # the part each member sent its coordinator, checked against its opening
            assert sum(o.get("sent_own_checked", 0) for o in openings) >= 3, openings  # (sent_parts)
        if delayed:
            assert recomputed == 0, openings
        else:
            assert recomputed >= 3, openings
            gaps = [d.averager.opening_costs["max_recompute_gap"] for d in stage1 if d.averager is not None]
            assert max(gaps) < 1e-3, gaps  # far inside RECOMPUTE_TOLERANCE: the same float32 computation
        if not delayed:
            shares = [d.averager.opening_costs["max_extra_share"] for d in stage1 if d.averager is not None]
            assert max(shares) < extra_bound(grad_codec), shares  # the codec residual, under its bound


@pytest.mark.timeout(600)
@pytest.mark.parametrize("averaging", MODES)
async def test_a_sign_flipped_contribution_is_convicted_seconded_and_excluded(averaging: str) -> None:
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging=averaging), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, (leader, mate) = stage1[-1], stage1[:-1]
        assert liar.averager is not None and liar.peer_id is not None
        poison_contributions(liar.averager, "flipped")
        await _train(daemons)
        convictions = _convictions(daemons)
        assert set(convictions) == {liar.peer_id}, convictions  # the liar, and nobody honest
        assert min(convictions[liar.peer_id]) <= 10  # within 10 steps
        lead = leader.status()["averaging"]
        assert lead["openings"].get("inconsistent") == 1, lead["openings"]
        assert lead["hostile_convictions"] == {liar.peer_id: 1}
        assert lead["excluded"][liar.peer_id]["reason"].startswith("hostile: unaccountable"), lead["excluded"]
        assert lead["accusations"].get("sent") == 1, lead["accusations"]
        # the stage-mate checked the liar's own signed opening and seconded: two of three exclude it
        await _until(lambda: mate.status()["averaging"]["accusations"].get("seconded") == 1)
        seconding = mate.status()["averaging"]
        assert seconding["excluded"][liar.peer_id]["reason"].startswith("hostile: unaccountable"), seconding
        assert await _metric(leader, 'swarmd_averaging_openings_total{outcome="inconsistent"}') == 1
        assert await _metric(leader, "swarmd_averaging_hostile_convictions_total") == 1
        assert await _metric(mate, 'swarmd_averaging_accusations_total{outcome="seconded"}') == 1
        _only_the_liar_excluded_as_hostile(daemons, liar)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["every part", "others' parts"])
async def test_a_member_that_opens_its_true_contribution_but_sent_a_flipped_one_is_convicted(where: str) -> None:
    """(The all-reduce: ``allreduce.sent_parts``.) Its opening is consistent (its true microbatches, and the sketch
    of its true contribution as the one sent), which no owner could check whole. Its opening's per-part sketches
    are checked: the part its coordinator owns by the coordinator itself (``every part``: convicted at its first
    opening), and a drawn part owned by another by asking that owner for its sketch of the slice, then for the
    member's signed slice when they disagree (``others' parts``: it flips only the slices it sends the third
    member, the one drawable part). The coordinator posts the member's signed opening and signed slice to the
    stage-mates, and the other honest one sketches the slice itself and seconds (``POST /v1/recheck``), so two of
    three exclude it. Nobody honest is convicted, and no owner is found wrong."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging="allreduce"), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, coordinator, mate = stage1[-1], stage1[0], stage1[1]
        assert liar.averager is not None and coordinator.averager is not None and liar.peer_id is not None
        poison_contributions(liar.averager, "flipped", open_true=True, others_only=where == "others' parts")
        await _train(daemons)
        convictions = _convictions(daemons)
        assert set(convictions) == {liar.peer_id}, convictions  # the liar, and nobody honest
        assert min(convictions[liar.peer_id]) <= 10  # within 10 steps
        openings = coordinator.status()["averaging"]["openings"]
        assert not openings.get("inconsistent"), openings  # its openings were consistent throughout
        if where == "every part":
            assert openings.get("misstated") == 1, openings
            expected = "hostile: unaccountable contribution: its opening sketches part 0 as"
        else:
            assert openings.get("sent_mismatch") == 1 and not openings.get("misstated"), openings
            expected = "hostile: unaccountable contribution: its opening sketches part"
        reason = coordinator.status()["averaging"]["excluded"][liar.peer_id]["reason"]
        assert reason.startswith(expected) and "(signed)" in reason, reason
        assert not any(d.status()["averaging"]["openings"].get("sent_owner_wrong") for d in stage1)
        assert coordinator.status()["averaging"]["accusations"].get("sent") == 1
        # the stage-mate checked the liar's signed sketch against its signed slice itself, and seconded
        await _until(lambda: mate.status()["averaging"]["accusations"].get("seconded") == 1)
        reason = mate.status()["averaging"]["excluded"][liar.peer_id]["reason"]
        assert reason.startswith("hostile: unaccountable contribution: its opening sketches part"), reason
        assert mate.status()["averaging"]["accusations"].get("rechecked") == 1
        assert mate.reports.status().get("accepted") == 1, mate.reports.status()
        _only_the_liar_excluded_as_hostile(daemons, liar)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("averaging", MODES)
async def test_a_peer_that_never_opens_is_left_out_of_every_mean_after_its_first(averaging: str) -> None:
    """It cannot be convicted (an honest peer whose answer was lost has nothing to open either), but every
    contribution that comes without the opening it owes is struck: counted for its samples, out of the mean.
    Its contributions here are its true gradients (no score strikes them), so every strike is the rule's. In
    the all-reduce the coordinator strikes it in the round's plan, every owner leaves its slices out, and the
    signed commit names it (``allreduce.openings``)."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging=averaging), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, leader = stage1[-1], stage1[0]
        assert liar.averager is not None and leader.averager is not None
        withhold_openings(liar.averager)
        await _train(daemons)
        lead = leader.status()["averaging"]
        assert not lead["openings"].get("inconsistent") and lead["openings"].get("missing", 0) >= 3, lead["openings"]
        pid = liar.peer_id
        used = [r for r in leader.averager.history if r.get("used", {}).get(pid, 0) > 0]  # its gradients, used here
        # each contribution after one this leader used owes an opening, and is left out of the mean (unless it
        # holds every sample of the round: a mean of nothing is no step)
        owing = [r for r in used[1:] if sum(r["used"].values()) > r["used"][pid]]
        assert len(owing) >= 3, [(r["step"], r["used"], r.get("struck")) for r in leader.averager.history]
        assert all(pid in r.get("struck", ()) for r in owing), [
            (r["step"], r["status"], r["used"], r.get("struck")) for r in leader.averager.history]
        assert not any(e["reason"].startswith("hostile") for e in lead["excluded"].values()), lead["excluded"]


def _hostile_to(daemon: Daemon, peer_id: str) -> bool:
    """Whether ``daemon``'s averager excludes ``peer_id`` for hostile contributions."""
    entry = daemon.averager.checks_status()["excluded"].get(peer_id) if daemon.averager is not None else None
    return entry is not None and entry["reason"].startswith("hostile")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("averaging", MODES)
async def test_a_liar_about_one_microbatch_is_caught_by_recomputing_it_and_excluded(averaging: str) -> None:
    """Its contributions hold one microbatch's gradient flipped and its openings say so consistently (their
    parts sum to the contribution: the sum check passes); a leader that draws that microbatch recomputes it
    from the inputs shipped with the contribution and convicts (an all-reduce coordinator: from the inputs it
    asks the member for once its opening came, checked against the digests it committed). It posts the liar's signed opening and that
    microbatch's inputs (``POST /v1/recheck``) to the other honest stage-mate, which recomputes it on its own
    copy of that step's parameters and seconds: both honest peers exclude it, their progress answers name it,
    so the trainers stop routing to it (before, they kept sending it microbatches whose samples no round
    counted, and the stage slowed to their retries: 26-28 s a step in scripts/bench_recompute.py), and the
    stage keeps stepping without it."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging=averaging), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, honest = stage1[-1], stage1[:-1]
        assert liar.averager is not None and liar.peer_id is not None
        lied = lie_about_a_microbatch(liar.averager)
        _recompute_every_contribution(daemons)
        training = asyncio.ensure_future(_train(daemons, steps=60))  # cancelled below, once the checks are done
        try:
            await _until(lambda: training.done() or all(_hostile_to(d, liar.peer_id or "") for d in honest), 120)
            assert not training.done(), "the trainers stopped before both honest stage-mates excluded the liar"
            excluded_at = max(d.executor.step for d in honest)
            # the trainers poll the stage every refresh_s (0.5 s): two steps on, they route around it
            await _until(lambda: training.done() or min(d.executor.step for d in honest) >= excluded_at + 2, 120)
            served = liar.executor.backward_ema.count
            await _until(lambda: training.done() or min(d.executor.step for d in honest) >= excluded_at + 6, 120)
            assert not training.done(), "the trainers stopped before the stage stepped on without the liar"
            assert liar.executor.backward_ema.count == served, "the trainers still route microbatches to the liar"
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        assert lied, "the liar never contributed a microbatch"
        convictions = _convictions(daemons)
        assert set(convictions) == {liar.peer_id}, convictions  # the liar, and nobody honest
        assert min(convictions[liar.peer_id]) <= 10  # within 10 steps
        openings = [d.status()["averaging"]["openings"] for d in honest]
        assert sum(o.get("mismatch", 0) for o in openings) >= 1, openings
        assert not any(o.get("inconsistent") for o in openings), openings  # its sums were consistent throughout
        convicting = [d for d, o in zip(honest, openings, strict=True) if o.get("mismatch")]
        seconding = [d for d in honest if d not in convicting]
        assert len(convicting) == 1 and len(seconding) == 1, openings  # one convicts, and the other seconds
        (leader,), (mate,) = convicting, seconding
        reason = leader.status()["averaging"]["excluded"][liar.peer_id]["reason"]
        assert reason.startswith("hostile: unaccountable contribution: the signed part"), reason
        assert leader.status()["averaging"]["accusations"].get("sent") == 1, leader.status()["averaging"]
        assert await _metric(leader, 'swarmd_averaging_openings_total{outcome="mismatch"}') >= 1
        # the stage-mate redid the recomputation itself and seconded (it did not take the leader's word)
        accusations = mate.status()["averaging"]["accusations"]
        assert accusations.get("rechecked") == 1 and accusations.get("seconded") == 1, accusations
        reason = mate.status()["averaging"]["excluded"][liar.peer_id]["reason"]
        assert reason.startswith("hostile: unaccountable contribution: the signed part"), reason
        assert await _metric(mate, 'swarmd_averaging_accusations_total{outcome="seconded"}') == 1
        assert await _metric(mate, 'swarmd_averaging_rechecks_total{outcome="rechecked"}') == 1
        # the mate's ledger counted the leader's report once it held (the leader, excluding the liar already,
        # takes no part in the mate's seconding copy)
        assert mate.reports.status().get("accepted") == 1, mate.reports.status()
        assert leader.status()["averaging"]["accusations"].get("accepted_by_mates") == 1
        _only_the_liar_excluded_as_hostile(daemons, liar)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("averaging", MODES)
@pytest.mark.parametrize("where", ["extra", "unlisted"])
async def test_a_lie_hidden_in_the_extra_term_is_refused(where: str, averaging: str) -> None:
    """Its contribution is flipped and its opening says so consistently through the part no microbatch
    explains (every microbatch part true, so no recomputation sees it either). Every sample of the
    contribution is a shipped microbatch's, so that part can only be a codec's residual, bounded (item 2;
    to half the sketch in a swarm averaging uncompressed, where a flip hidden there is 2/3 of it): the leader
    refuses the opening and excludes the liar from its rounds; nobody is convicted. ``unlisted``: a true
    contribution whose opening moves one microbatch into that part (out of the recomputation's reach): its
    opening does not list every microbatch whose inputs came, and is refused the same way. In the all-reduce
    the coordinator refuses both: no inputs travel there, so it checks the microbatches the contribution
    named, and how many of its samples none of them explains is the member's word (``allreduce.openings``)."""
    training = dataclasses.replace(TRAINING, grad_codec="none", averaging=averaging)
    async with fast_swarm(SPEC, training, peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, honest = stage1[-1], stage1[:-1]
        assert liar.averager is not None and liar.peer_id is not None
        lied = lie_about_a_microbatch(liar.averager, where=where)
        _recompute_every_contribution(daemons)
        training = asyncio.ensure_future(_train(daemons))
        try:
            await _until(lambda: training.done() or any(
                d.status()["averaging"]["openings"].get("bad") for d in honest), timeout_s=60)
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        assert lied
        refusing = [d for d in honest if d.status()["averaging"]["openings"].get("bad")]
        assert refusing, [d.status()["averaging"]["openings"] for d in honest]
        for d in refusing:
            reason = d.status()["averaging"]["excluded"][liar.peer_id]["reason"]
            expected = {"extra": "what no microbatch of its explains",
                        "unlisted": "its microbatches are not those " + (
                            "whose inputs came" if averaging == "leader" else "its contribution named")}[where]
            assert reason.startswith(f"bad_opening: bad opening: {expected}"), reason
        assert not any(d.status()["averaging"]["openings"].get(k) for d in honest for k in ("inconsistent", "mismatch"))
        assert not _convictions(daemons)


@pytest.mark.timeout(600)
async def test_a_peer_that_ships_no_inputs_is_left_out_of_every_mean() -> None:
    # (the single leader's: in the all-reduce, see the next test)
    """It would dodge the recomputation; each contribution naming microbatches without their inputs is struck
    (counted for its samples, out of the mean), as an unopened one is, and nobody is convicted."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging="leader"), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, leader = stage1[-1], stage1[0]
        assert liar.averager is not None and leader.averager is not None
        withhold_inputs(liar.averager)
        await _train(daemons)
        pid = liar.peer_id
        used = [r for r in leader.averager.history if r.get("used", {}).get(pid, 0) > 0]
        # every round that used its samples and held others' too struck its contribution from the mean
        others = [r for r in used if sum(r["used"].values()) > r["used"][pid]]
        assert len(others) >= 3, [(r["step"], r["used"], r.get("struck")) for r in leader.averager.history]
        assert all(pid in r.get("struck", ()) for r in others), [
            (r["step"], r["status"], r["used"], r.get("struck")) for r in leader.averager.history]
        assert not _convictions(daemons)


@pytest.mark.timeout(600)
async def test_a_member_that_commits_no_inputs_is_left_out_of_the_next_means() -> None:
    """The all-reduce's counterpart of the test above: a member that names microbatches without committing
    their inputs' digests with part 0 would dodge the recomputation (``allreduce.recompute``). Its coordinator
    cannot strike that contribution (the plan, which names the struck, came before it), so its opening is
    ``uncommitted`` and its next contribution is struck from the mean (its samples counted): so it moves no mean
    after its first. Nobody is convicted or excluded (an honest member that lost some inputs does this once)."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging="allreduce"), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, coordinator = stage1[-1], stage1[0]
        assert liar.averager is not None and coordinator.averager is not None
        withhold_inputs(liar.averager)
        await _train(daemons)
        pid = liar.peer_id
        openings = coordinator.status()["averaging"]["openings"]
        assert openings.get("uncommitted", 0) >= 3 and openings.get("struck_uncommitted", 0) >= 3, openings
        assert not openings.get("bad"), openings
        rounds = [r for r in coordinator.averager.history if r.get("leader") == coordinator.peer_id
                  and r.get("used", {}).get(pid, 0) > 0 and sum(r["used"].values()) > r["used"][pid]]
        struck = [r for r in rounds if pid in r.get("struck", ())]
        assert len(struck) >= 3, [(r["step"], r["used"], r.get("struck")) for r in rounds]
        assert isinstance(liar.averager.inputs_kept.answer(ArInputsQuery(1, "any", 1)), ArAck)  # it kept none
        assert not _convictions(daemons)
        assert pid not in coordinator.status()["averaging"]["excluded"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["refuses", "other inputs"])
async def test_a_member_that_will_not_show_a_drawn_microbatch_is_convicted(how: str) -> None:
    """Its opening came (consistent, signing the inputs it committed); then its coordinator draws one of its
    microbatches and asks for its inputs (``allreduce.recompute``). A member that refuses, or answers inputs
    that are not those it committed, is convicted as unaccountable by that coordinator: an honest member keeps
    the inputs of the rounds it opened. Nobody honest is convicted."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging="allreduce"), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        liar, coordinator = stage1[-1], stage1[0]
        assert liar.averager is not None and coordinator.averager is not None
        kept = liar.averager.inputs_kept
        answer = kept.answer

        def hiding(q: ArInputsQuery) -> Any:
            if how == "refuses":
                return ArAck(False, "not telling")
            got = answer(q)
            return dataclasses.replace(got, inputs=got.inputs + 1.0) if isinstance(got, ArInputs) else got

        kept.answer = hiding  # type: ignore[method-assign]
        _recompute_every_contribution(daemons)
        training = asyncio.ensure_future(_train(daemons, steps=60))
        try:
            await _until(lambda: training.done() or _hostile_to(coordinator, liar.peer_id or ""), 120)
            assert not training.done(), "the trainers stopped before the coordinator convicted the member"
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        reason = coordinator.status()["averaging"]["excluded"][liar.peer_id]["reason"]
        expected = "it refused (not telling)" if how == "refuses" else "it answered inputs that are not those it"
        assert reason.startswith("hostile: unaccountable contribution: asked for the inputs of its microbatch"), reason
        assert expected in reason, reason
        assert coordinator.status()["averaging"]["openings"].get("inputs_refused", 0) >= 1
        assert set(_convictions(daemons)) <= {liar.peer_id}, _convictions(daemons)
        _only_the_liar_excluded_as_hostile(daemons, liar)


async def _post_recheck(daemon: Daemon, request: RecheckRequest) -> tuple[int, str]:
    """``POST /v1/recheck`` to ``daemon`` as any stranger could: the status and the body."""
    async with aiohttp.ClientSession() as session, session.post(
            f"http://{daemon.status()['data_addr']}/v1/recheck", data=request.encode(),
            headers={"Content-Type": CONTENT_TYPE}) as r:
        return r.status, (await r.read()).decode("utf-8", "replace")


def _forged(stranger: Identity, raw: bytes, mb: int, x: torch.Tensor, y: torch.Tensor,
            shown: bytes | None = None) -> RecheckRequest:
    """A stranger's conviction by recomputation of the peer whose signed opening ``raw`` is (showing ``shown``
    as that opening, when given)."""
    ev = Opening.decode(raw).evidence
    body, sig = MisbehaviourReport.signed(stranger, accused=ev.peer_id, stage=ev.stage, step=ev.step,
                                          kind="averaging", mb=1, request_digest="00" * 32, at=time.time(),
                                          answers=answers_of(ev, ev.peer_id, stranger.peer_id),
                                          evidence=ev.encode()).encode()
    return RecheckRequest(body, sig, raw if shown is None else shown, mb, x, y)


@pytest.mark.timeout(600)
async def test_forged_convictions_by_recomputation_convict_nobody() -> None:
    # (the single leader's only: convictions by recomputation, which the all-reduce does not make)
    """In an honest swarm, a stranger shows a stage-mate an honest peer's signed opening and the inputs of the
    microbatch a leader recomputed, as a conviction (``POST /v1/recheck``). Tampered with (the inputs, a byte
    of the opening, a report resting on another peer's opening) it is a 422 before anything is computed.
    Intact, it is counted as one report and not recomputed (only the leader the peer opened to can have drawn
    it). Shown by that leader (a hostile leader framing an honest peer), the stage-mate recomputes that
    microbatch on its copy of that step's parameters, finds the part true and does not second: counted
    against the accuser (``not_seconded``). Shown for a step whose parameters it no longer holds, it cannot
    check it and does not second either. Nobody is convicted, nobody excluded, and lone reports exclude
    nobody from any ledger."""
    async with fast_swarm(SPEC, dataclasses.replace(TRAINING, averaging="leader"), peers_per_stage=3) as daemons:
        stage1 = _last_stage_by_id(daemons)
        leader = stage1[0]
        assert leader.averager is not None
        _recompute_every_contribution(daemons)
        stranger = Identity.generate()
        shown: list[tuple[str, bytes, int, torch.Tensor, torch.Tensor]] = []
        statuses: list[tuple[int, str]] = []
        check_opening = leader.averager._check_opening

        async def spy(peer_id: str, raw: bytes | None, step: int) -> Any:
            awaited = leader.averager._awaited.get(peer_id) if leader.averager is not None else None
            refusal = await check_opening(peer_id, raw, step)
            if (refusal is None and raw is not None and awaited is not None and awaited.sampled is not None
                    and awaited.sampled_inputs is not None and len(shown) < 2
                    and all(Opening.decode(r).evidence.step != awaited.step for _, r, *_ in shown)):
                shown.append((peer_id, raw, awaited.sampled, *awaited.sampled_inputs))
                if len(shown) == 1:  # at once, while the stage-mate still holds that step's parameters
                    mate = next(d for d in stage1 if d not in (leader,) and d.peer_id != peer_id)
                    x, y = awaited.sampled_inputs
                    tampered = x.clone()
                    tampered.view(-1)[0] += 1.0
                    statuses.append(await _post_recheck(mate, _forged(stranger, raw, awaited.sampled, tampered, y)))
                    flipped = bytearray(raw)
                    flipped[len(flipped) // 2] ^= 0x01
                    statuses.append(await _post_recheck(mate, _forged(stranger, raw, awaited.sampled, x, y,
                                                                       bytes(flipped))))
                    statuses.append(await _post_recheck(mate, _forged(stranger, raw, awaited.sampled, x, y)))
                    # the same, from the leader it was opened to (a hostile leader framing an honest peer)
                    assert leader.averager is not None and leader.averager.identity is not None
                    statuses.append(await _post_recheck(mate, _forged(leader.averager.identity, raw, awaited.sampled,
                                                                      x, y)))
            return refusal

        leader.averager._check_opening = spy  # type: ignore[method-assign]
        await _train(daemons)
        assert len(shown) == 2, "the leader recomputed fewer than two openings of distinct steps"
        accused = shown[0][0]
        mate = next(d for d in stage1 if d is not leader and d.peer_id != accused)
        assert [s for s, _ in statuses] == [422, 422, 200, 200], statuses
        assert "not those the accused signed" in statuses[0][1], statuses[0]
        await _until(lambda: mate.status()["averaging"]["accusations"].get("rechecked") == 1)
        # a report resting on another peer's signed opening: refused
        peer_id, raw, mb, x, y = shown[1]
        other = _forged(stranger, raw, mb, x, y)
        report = MisbehaviourReport.decode(other.body, other.signature)
        body, sig = MisbehaviourReport.signed(stranger, accused=leader.peer_id or "", stage=1, step=report.step,
                                              kind="averaging", mb=1, request_digest="00" * 32, at=time.time(),
                                              answers={leader.peer_id or "": "11" * 32, stranger.peer_id: "22" * 32},
                                              evidence=report.evidence).encode()
        status, text = await _post_recheck(mate, RecheckRequest(body, sig, raw, mb, x, y))
        assert status == 422 and "accused" in text, text
        # an old step: the stage-mate no longer holds its parameters (the training is over, many steps on)
        target = next(d for d in stage1 if d is not leader and d.peer_id != peer_id)
        assert leader.averager.identity is not None
        assert (await _post_recheck(target, _forged(leader.averager.identity, raw, mb, x, y)))[0] == 200
        await _until(lambda: target.status()["averaging"]["accusations"].get("unchecked") == 1)
        for d in stage1:
            accusations = d.status()["averaging"]["accusations"]
            assert not accusations.get("seconded") and not accusations.get("seconded_sent"), accusations
        # the stranger's intact one was not even recomputed (only the leader the accused opened to could have
        # drawn it); the leader's was, and found true; the old one could not be checked: neither seconded, both
        # counted against the leader
        assert mate.status()["averaging"]["accusations"].get("rechecked") == 1, mate.status()["averaging"]
        assert sum(d.status()["averaging"]["accusations"].get("not_seconded", 0) for d in stage1) == 2
        assert not _convictions(daemons)
        for d in daemons:
            assert d.averager is not None and not any(
                e["reason"].startswith("hostile") for e in d.averager.checks_status()["excluded"].values())
            assert d.reports.excluded() == frozenset() and not d.reports.status()["accepted"]  # none held
