"""Audits of part owners in the chunked all-reduce (issue 29; ``swarmd.pipeline.averaging.allreduce.audit``):
a member that owns a part and publishes its mean sign-flipped (inside every member's box check, so everyone
applies it) is caught when a commit draws its part for an audit, convicted by the auditor, seconded by the
other stage-mate from the same signed evidence, and excluded by both; an honest swarm's audits all hold up.
In-process daemons on loopback, 2 stages x 3 peers of ``tiny``."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from swarmd.daemon import Daemon
from swarmd.train.trainer import Trainer
from tests.support.checks import SPEC, TRAINING, trainer_config
from tests.support.liars import lie_as_owner
from tests.support.swarms import fast_swarm

ALLREDUCE = dataclasses.replace(TRAINING, averaging="allreduce")
#: Steps per training chunk, and chunks at most: each commit audits the liar's part (one of three) with
#: probability 1/3, so 30 rounds miss it with probability (2/3)^30 < 1e-5.
CHUNK, CHUNKS = 6, 5


async def _train(daemons: list[Daemon], steps: int, seed: int) -> None:
    api = f"http://{daemons[0].status()['api_addr']}"
    summaries = await asyncio.gather(*(Trainer(trainer_config(api, f"t{seed}-{k}", steps=steps, fraction=0.0,
                                                              seed=seed + k)).run() for k in range(2)))
    for summary in summaries:
        assert summary.microbatches_issued == summary.microbatches_completed


async def _metric(d: Daemon, line: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"http://{d.status()['api_addr']}/metrics") as r:
        text = await r.text()
    return sum(float(row[len(line) + 1:]) for row in text.splitlines() if row.startswith(line + " "))


def _audit_every_commit(daemons: list[Daemon]) -> None:
    """(``audit.AUDIT_SHARE`` of the commits by default: the tests would need four times the rounds)"""
    for d in daemons:
        assert d.averager is not None
        d.averager.auditor.share = 1.0  # type: ignore[attr-defined]


def _audited(d: Daemon, peer_id: str) -> bool:
    """Whether ``d`` excludes ``peer_id`` by an audit (not only for a while, as a contribution its mate refused)."""
    why = d.status()["averaging"]["excluded"].get(peer_id, {}).get("reason", "")
    return str(why).startswith("hostile: audited")


def _audits(d: Daemon) -> dict[str, int]:
    return dict(d.status()["averaging"]["audits"])


async def _same_params(peers: list[Daemon], timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len({(d.executor.step, d.executor.digest) for d in peers if d.executor is not None}) != 1:
        assert loop.time() < deadline, [(d.executor.step, d.executor.digest) for d in peers if d.executor]
        await asyncio.sleep(0.1)


@pytest.mark.timeout(600)
async def test_an_owner_publishing_a_false_mean_is_audited_convicted_seconded_and_excluded() -> None:
    async with fast_swarm(SPEC, ALLREDUCE, peers_per_stage=3) as daemons:
        stage0 = sorted((d for d in daemons if d.stage == 0), key=lambda d: d.peer_id or "")
        liar, honest = stage0[-1], stage0[:-1]
        assert liar.averager is not None and liar.peer_id is not None
        lie_as_owner(liar.averager, -1.0)  # type: ignore[arg-type]
        _audit_every_commit(daemons)
        for chunk in range(CHUNKS):
            await _train(daemons, CHUNK, seed=10 * chunk)
            if all(liar.peer_id in d.status()["averaging"]["excluded"] for d in honest):
                break
        audits = [_audits(d) for d in honest]
        # an auditor convicted it, and the other honest peer seconded it from the evidence shown, or had drawn
        # the liar's part of another commit before the evidence came and convicted it itself (seen under load)
        assert sum(a.get("mismatch", 0) for a in audits) >= 1, audits
        assert all(a.get("mismatch", 0) + a.get("seconded", 0) >= 1 for a in audits), audits
        assert not any(a.get("not_seconded") or a.get("unprovable") for a in audits), audits
        auditor, counts = next((d, a) for d, a in zip(honest, audits, strict=True) if a.get("mismatch"))
        assert await _metric(auditor, 'swarmd_averaging_audits_total{outcome="mismatch"}') == counts["mismatch"]
        for d in honest:
            excluded = d.status()["averaging"]["excluded"]
            assert excluded[liar.peer_id]["reason"].startswith("hostile: audited"), excluded
            assert not set(excluded) - {liar.peer_id}, excluded  # nobody honest
        await _same_params(honest)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("hide", ["refuse", "hang", "moved"])
async def test_an_owner_that_lies_and_will_not_show_its_evidence_is_excluded_by_its_auditor_and_mates(
        hide: str) -> None:
    """The owner refuses every audit, never answers one while it goes on taking part in the rounds, or says it
    serves another stage while it takes part in this one's commits: the auditor holds it to account as if it had shown its lie, and its stage-mates, told which commit's part it
    would not show, audit it themselves and exclude it too. Honest peers convict nobody else."""
    async with fast_swarm(SPEC, ALLREDUCE, peers_per_stage=3) as daemons:
        stage0 = sorted((d for d in daemons if d.stage == 0), key=lambda d: d.peer_id or "")
        liar, honest = stage0[-1], stage0[:-1]
        assert liar.averager is not None and liar.peer_id is not None
        lie_as_owner(liar.averager, -1.0, hide=hide)  # type: ignore[arg-type]
        _audit_every_commit(daemons)
        for d in honest:
            d.averager.auditor.timeout_s = 1.0  # type: ignore[union-attr]
        for chunk in range(3 * CHUNKS):  # (a hanging owner: three timeouts, then the mate's three)
            await _train(daemons, CHUNK, seed=10 * chunk)
            if all(_audited(d, liar.peer_id) for d in honest):
                break
        audits = [_audits(d) for d in honest]
        assert all(a.get("unaccountable", 0) >= 1 for a in audits), audits
        assert not any(a.get("mismatch") or a.get("not_seconded") for a in audits), audits
        if not any(a.get("drawn", 0) > a.get("unaccountable", 0) for a in audits):
            assert any(a.get("seconded", 0) >= 1 for a in audits), audits  # (one of them was told)
        noticed = next((d, a) for d, a in zip(honest, audits, strict=True) if a.get("unaccountable"))
        assert await _metric(noticed[0], 'swarmd_averaging_audits_total{outcome="unaccountable"}') == \
            noticed[1]["unaccountable"]
        for d in honest:
            excluded = d.status()["averaging"]["excluded"]
            assert excluded[liar.peer_id]["reason"].startswith("hostile: audited: unaccountable"), excluded
            assert not set(excluded) - {liar.peer_id}, excluded  # nobody honest
        await _same_params(honest)


@pytest.mark.timeout(600)
async def test_an_honest_swarm_audits_every_commit_and_convicts_nobody() -> None:
    async with fast_swarm(SPEC, ALLREDUCE, peers_per_stage=3) as daemons:
        _audit_every_commit(daemons)
        await _train(daemons, 8, seed=0)
        audits = [_audits(d) for d in daemons if d.averager is not None]
        # a commit per step and stage, each drawing an auditor; one audit at a time per peer (a draw while one is
        # under way is skipped), its pieces one a commit: all but the last audit of each peer are done
        assert sum(a.get("ok", 0) for a in audits) >= 4, audits
        assert all(a.get("drawn", 0) - a.get("ok", 0) <= 1 for a in audits), audits
        assert not any(a.get(k) for a in audits
                       for k in ("mismatch", "unprovable", "unanswered", "seconded", "unaccountable")), audits
        for d in daemons:
            assert not d.status()["averaging"]["excluded"], d.status()["averaging"]["excluded"]


@pytest.mark.timeout(600)
async def test_an_owner_flipping_its_part_is_suspected_and_excluded_without_waiting_for_a_draw() -> None:
    """No commit draws an audit (share 0): each honest member sees the flipped part's mean point against its own
    slice (``audit.SUSPECT_BELOW``), audits that part itself before applying the commit, convicts the owner from
    its evidence and does not apply the lie (it keeps its gradients for the next round, without the liar): in the
    first round the liar owns a part in, not after the draw's ~``n / AUDIT_SHARE`` rounds."""
    async with fast_swarm(SPEC, ALLREDUCE, peers_per_stage=3) as daemons:
        stage0 = sorted((d for d in daemons if d.stage == 0), key=lambda d: d.peer_id or "")
        liar, honest = stage0[-1], stage0[:-1]
        assert liar.averager is not None and liar.peer_id is not None
        lie_as_owner(liar.averager, -1.0)  # type: ignore[arg-type]
        for d in daemons:
            d.averager.auditor.share = 0.0  # type: ignore[union-attr]
        await _train(daemons, CHUNK, seed=0)
        audits = [_audits(d) for d in honest]
        assert all(a.get("suspected", 0) >= 1 and a.get("mismatch", 0) >= 1 for a in audits), audits
        assert not any(a.get("drawn") or a.get("not_seconded") or a.get("unprovable") for a in audits), audits
        assert await _metric(honest[0], 'swarmd_averaging_audits_total{outcome="suspected"}') == \
            audits[0]["suspected"]
        for d in honest:  # the commit that held the lie was not applied here
            refused = [r for r in d.averager.history if "convicted by an audit" in r.get("reason", "")]  # type: ignore[union-attr]
            assert refused and refused[0]["status"] == "missed", list(d.averager.history)  # type: ignore[union-attr]
        for d in honest:
            excluded = d.status()["averaging"]["excluded"]
            assert excluded[liar.peer_id]["reason"].startswith("hostile: audited"), excluded
            assert not set(excluded) - {liar.peer_id}, excluded
        await _same_params(honest)


@pytest.mark.timeout(600)
async def test_honest_owners_suspected_by_mistake_show_their_evidence_and_are_cleared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every member suspects every part of every commit (its check patched to see each mean point against its
    slice): each audit fetches an honest owner's evidence within the rounds it keeps it (``KEEP_ROUNDS``), holds
    up, and nobody is excluded; the stage trains on, its peers identical."""
    from swarmd.pipeline.averaging.allreduce import member

    monkeypatch.setattr(member, "against_own", lambda mean, own: -1.0)
    async with fast_swarm(SPEC, ALLREDUCE, peers_per_stage=3) as daemons:
        for d in daemons:
            d.averager.auditor.share = 0.0  # type: ignore[union-attr]
        await _train(daemons, 8, seed=0)
        audits = [_audits(d) for d in daemons if d.averager is not None]
        assert sum(a.get("suspected", 0) for a in audits) >= 6, audits
        assert sum(a.get("ok", 0) for a in audits) >= sum(a.get("suspected", 0) for a in audits) - len(audits), audits
        assert not any(a.get(k) for a in audits
                       for k in ("mismatch", "unprovable", "unanswered", "seconded", "unaccountable")), audits
        for d in daemons:
            assert not d.status()["averaging"]["excluded"], d.status()["averaging"]["excluded"]
        for s in (0, 1):
            await _same_params([d for d in daemons if d.stage == s])
