"""A leader's conviction made checkable: evidence encoding, its signatures, and the seconding rule."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import msgpack
import pytest
import torch

from swarmd.dht.identity import Identity
from swarmd.errors import RequestError
from swarmd.pipeline.averaging.trust.accusations import (
    MAX_CLAIMS,
    SECOND_CLAIMS,
    SPAN,
    Claim,
    Evidence,
    OwnNorms,
    RecomputedEvidence,
    StruckClaims,
    answers_of,
    contribution_message,
    norm_score,
    second,
)
from swarmd.pipeline.averaging.trust.contribution_proofs import K, Opening, proof_seed
from swarmd.pipeline.averaging.trust.hostile_contributions import FAR_FACTOR, STRIKES
from swarmd.pipeline.averaging.trust.recomputation import inputs_digest
from swarmd.pipeline.reports import MAX_REPORT_BYTES, MisbehaviourReport
from swarmd.pipeline.averaging.trust.round_checks import per_sample_norm

STAGE = 1


def claims_of(accused: Identity, leader: str, norms: dict[int, float], samples: int = 8) -> tuple[Claim, ...]:
    """``accused``'s signed claims, one per step, of contributions with these per-sample norms."""
    out = []
    for step, norm in sorted(norms.items()):
        digest = f"{step:064x}"
        sig = accused.sign(contribution_message(STAGE, step, samples, digest, accused.peer_id, leader, norm))
        out.append(Claim(step, samples, digest, norm, sig))
    return tuple(out)


def own_history(leader: str, steps: Iterable[int], norm: float = 1.0, samples: int = 8) -> OwnNorms:
    own = OwnNorms()
    for step in steps:
        own.note(step, leader, norm, samples)
    return own


def test_evidence_round_trips_and_verifies() -> None:
    accused, leader = Identity.generate(), Identity.generate()
    ev = Evidence(leader.peer_id, accused.public_key_bytes, claims_of(accused, leader.peer_id, {3: 20.0, 4: 19.5}))
    back = Evidence.decode(ev.encode())
    assert back == ev
    back.verify(STAGE, accused.peer_id)


@pytest.mark.parametrize("how", ["other_key", "norm_raised", "other_stage", "other_leader", "same_step"])
def test_evidence_a_leader_altered_does_not_verify(how: str) -> None:
    accused, leader = Identity.generate(), Identity.generate()
    claims = list(claims_of(accused, leader.peer_id, {3: 1.0, 4: 1.1}))
    key, stage, named_leader = accused.public_key_bytes, STAGE, leader.peer_id
    if how == "other_key":
        key = Identity.generate().public_key_bytes
    elif how == "norm_raised":  # an honest peer's claim made to look far: its signature no longer covers it
        claims[0] = Claim(claims[0].step, claims[0].samples, claims[0].digest, 20.0, claims[0].signature)
    elif how == "other_stage":
        stage = STAGE + 1
    elif how == "other_leader":
        named_leader = Identity.generate().peer_id
    else:
        claims[1] = claims[0]
    with pytest.raises(RequestError):
        Evidence(named_leader, key, tuple(claims)).verify(stage, accused.peer_id)


@pytest.mark.parametrize("raw", [
    None, b"", b"\x00" * 2000, msgpack.packb([1, 2]), msgpack.packb({"leader": "x", "key": b"", "claims": []}),
    msgpack.packb({"leader": "ab" * 20, "key": b"k" * 32, "claims": [[1, 0, "00" * 32, 1.0, b"s" * 64]]}),
    msgpack.packb({"leader": "ab" * 20, "key": b"k" * 32, "claims": [[1, 8, "00" * 32, float("nan"), b"s" * 64]]}),
    msgpack.packb({"leader": "ab" * 20, "key": b"k" * 32, "claims": [[1, 8, "00" * 32, 1.0, b"s" * 64]] * 7}),
    msgpack.packb({"claims": [[1, 8, "00" * 32, 1.0, b"s" * 64]], "leader": "ab" * 20, "key": b"k" * 32,
                   "extra": 1}),
])
def test_malformed_evidence_is_refused_with_a_request_error(raw: object) -> None:
    with pytest.raises(RequestError):
        Evidence.decode(raw)


def test_an_averaging_report_carries_a_full_window_of_claims_within_the_size_limit() -> None:
    accused, leader = Identity.generate(), Identity.generate()
    ev = Evidence(leader.peer_id, accused.public_key_bytes,
                  claims_of(accused, leader.peer_id, {2**40 + s: 1e30 for s in range(MAX_CLAIMS)}, samples=2**31))
    report = MisbehaviourReport.signed(leader, accused=accused.peer_id, stage=STAGE, step=2**40, kind="averaging",
                                       mb=2**64 - 1, request_digest="ab" * 32,
                                       answers=answers_of(ev, accused.peer_id, leader.peer_id), at=time.time(),
                                       evidence=ev.encode())
    body, sig = report.encode()
    assert len(body) <= MAX_REPORT_BYTES
    back = MisbehaviourReport.decode(body, sig)
    assert Evidence.decode(back.evidence) == ev
    with pytest.raises(RequestError):  # an averaging report without its evidence
        MisbehaviourReport.signed(leader, accused=accused.peer_id, stage=STAGE, step=1, kind="averaging", mb=1,
                                  request_digest="ab" * 32, answers=answers_of(ev, accused.peer_id, leader.peer_id),
                                  at=time.time())
    with pytest.raises(RequestError):  # evidence on a spot check's report
        MisbehaviourReport.signed(leader, accused=accused.peer_id, stage=STAGE, step=1, kind="forward", mb=1,
                                  request_digest="ab" * 32, answers=answers_of(ev, accused.peer_id, leader.peer_id),
                                  at=time.time(), evidence=ev.encode())


def test_a_stage_mate_seconds_far_claims_of_rounds_it_shared() -> None:
    accused, leader = Identity.generate(), Identity.generate()
    ev = Evidence(leader.peer_id, accused.public_key_bytes,
                  claims_of(accused, leader.peer_id, {s: 20.0 for s in range(10, 10 + STRIKES)}))
    why = second(ev, own_history(leader.peer_id, range(30)))
    assert why is not None and why.startswith("hostile")
    # one of the rounds it did not share (turned away late): the others still hold SECOND_CLAIMS far claims
    assert SECOND_CLAIMS == STRIKES - 1
    own = own_history(leader.peer_id, [s for s in range(30) if s != 10])
    assert second(ev, own) is not None


@pytest.mark.parametrize("how", ["honest", "too_few", "other_leader", "not_there", "too_spread", "own_larger"])
def test_a_stage_mate_does_not_second(how: str) -> None:
    accused, leader = Identity.generate(), Identity.generate()
    norms = {s: 20.0 for s in range(10, 10 + STRIKES)}
    own = own_history(leader.peer_id, range(40))
    if how == "honest":  # the accused's contributions were as large as this peer's own
        norms = dict.fromkeys(norms, 1.3)
    elif how == "too_few":
        norms = {s: 20.0 for s in range(10, 10 + SECOND_CLAIMS - 1)} | {20: 1.0, 21: 1.2}
    elif how == "other_leader":  # this peer contributed to another leader's rounds at those steps
        own = own_history(Identity.generate().peer_id, range(40))
    elif how == "not_there":  # this peer contributed to none of those rounds
        own = own_history(leader.peer_id, range(10))
    elif how == "too_spread":  # rare far claims gathered over a long run
        norms = {10 + i * SPAN // (SECOND_CLAIMS - 1): 20.0 for i in range(SECOND_CLAIMS)}
    else:
        own = own_history(leader.peer_id, range(40), norm=5.0)
    ev = Evidence(leader.peer_id, accused.public_key_bytes, claims_of(accused, leader.peer_id, norms))
    assert second(ev, own) is None


def test_honest_norm_scores_stay_far_below_the_bound_and_minus20_above() -> None:
    """Honest stage-mates' per-sample norms over different sample counts, drawn from one gradient
    distribution (a shared mean plus per-sample noise, from signal- to noise-dominated): the
    norm score of an honest claim stays below FAR_FACTOR, the -20x liar's lies above it when the two
    contributions' samples are within a factor 2 (with far more samples than the judge's own, a
    noise-dominated lie's per-sample norm shrinks like the honest ones': the leader's ``far`` score
    misses it too)."""
    gen = torch.Generator().manual_seed(29)
    worst, liar_least = 0.0, math.inf
    for signal in (0.0, 0.1, 1.0, 10.0):
        mean = torch.randn(4096, generator=gen, dtype=torch.float64) * signal / 64
        for _ in range(50):
            sizes = torch.randint(1, 33, (2,), generator=gen).tolist()
            sums = [mean * n + torch.randn(n, 4096, generator=gen, dtype=torch.float64).sum(0) for n in sizes]
            own_norm, other_norm = (per_sample_norm(s, n) for s, n in zip(sums, sizes, strict=True))
            honest = Claim(0, sizes[1], "", other_norm, b"")
            lie = Claim(0, sizes[1], "", per_sample_norm(sums[1] * -20, sizes[1]), b"")
            worst = max(worst, norm_score(honest, own_norm, sizes[0]))
            if sizes[1] <= 2 * sizes[0]:
                liar_least = min(liar_least, norm_score(lie, own_norm, sizes[0]))
    assert worst < FAR_FACTOR / 2, worst
    assert liar_least > FAR_FACTOR, liar_least


def test_struck_claims_keep_the_far_ones_of_the_window() -> None:
    accused, other = Identity.generate(), Identity.generate()
    leader = "ab" * 20
    claims = claims_of(accused, leader, {s: float(s) for s in range(8)})
    struck = StruckClaims(window=6)
    for c in claims:
        struck.note(accused.peer_id, accused.public_key_bytes, c, far=c.step % 2 == 0)
    ev = struck.take(accused.peer_id, leader)
    assert ev is not None and [c.step for c in ev.claims] == [2, 4, 6]  # steps 0 and 1 fell out of the window
    assert struck.take(accused.peer_id, leader) is None  # taken once
    struck.note(accused.peer_id, accused.public_key_bytes, claims[0], far=True)
    struck.note(accused.peer_id, other.public_key_bytes, claims[1], far=True)  # a new key: the old claims go
    ev = struck.take(accused.peer_id, leader)
    assert ev is not None and ev.key == other.public_key_bytes and [c.step for c in ev.claims] == [1]
    struck.note(accused.peer_id, accused.public_key_bytes, claims[0], far=False)
    assert struck.take(accused.peer_id, leader) is None  # nothing far: no evidence


def _recheck_of(accused: Identity, accuser: Identity, *, at: tuple[str, ...] = ("e3" * 32, "fp32"),
                lead: str = "f4" * 32) -> tuple[bytes, bytes, bytes, torch.Tensor, torch.Tensor]:
    """A conviction by recomputation of microbatch 6 of ``accused``'s signed opening, by ``accuser``: the
    report's body and signature, the opening, and the microbatch's inputs."""
    x, y = torch.randn(2, 4, 8), torch.randint(0, 50, (2, 4))
    rows = torch.randn(4, K, dtype=torch.float64)
    opening = Opening.signed(accused, stage=1, step=9, peer_id=accused.peer_id, leader=accuser.peer_id,
                             digest="cd" * 32, codec="none", mbs=[5, 6], parts=rows[:2], extra=rows[2], sent=rows[3],
                             ins=["a1" * 32, inputs_digest(6, x, y)], at=at, lead=lead)
    ev = opening.evidence
    body, sig = MisbehaviourReport.signed(accuser, accused=accused.peer_id, stage=1, step=9, kind="averaging", mb=3,
                                          request_digest="00" * 32, answers=answers_of(ev, accused.peer_id,
                                                                                        accuser.peer_id),
                                          at=time.time(), evidence=ev.encode()).encode()
    return body, sig, opening.encode(), x, y


def test_a_conviction_by_recomputation_is_checked_before_anything_is_recomputed() -> None:
    accused, accuser = Identity.generate(), Identity.generate()
    body, sig, raw, x, y = _recheck_of(accused, accuser)
    evidence = RecomputedEvidence.check(body, sig, raw, 6, x, y)
    assert evidence.report.accused == accused.peer_id and evidence.step == 9 and evidence.mb == 6
    assert (evidence.params, evidence.precision) == ("e3" * 32, "fp32")
    assert evidence.part == Opening.decode(raw).parts[1]
    assert evidence.seed() == proof_seed(1, 9, accuser.peer_id, "f4" * 32, "cd" * 32)  # the seed it signed for
    refused = {
        "inputs": (body, sig, raw, 6, x + 1, y),
        "targets": (body, sig, raw, 6, x, y.flip(0)),
        "microbatch": (body, sig, raw, 5, x, y),  # another microbatch's signed digest
        "unlisted": (body, sig, raw, 7, x, y),
        "report signature": (body, bytes(64), raw, 6, x, y),
        "opening": (body, sig, raw[:-1] + bytes([raw[-1] ^ 1]), 6, x, y),
        "another opening": (body, sig, _recheck_of(accused, accuser)[2], 6, x, y),  # not the one reported on
        "another's opening": (body, sig, _recheck_of(Identity.generate(), accuser)[2], 6, x, y),
        "no parameters": (*_recheck_of(accused, accuser, at=(), lead="")[:3], 6, x, y),
    }
    for what, args in refused.items():
        with pytest.raises(RequestError):
            RecomputedEvidence.check(*args)
            pytest.fail(what)
    # a leader that held no gradients of its own that round: its digest, so the seed's, is empty
    body0, sig0, raw0, x0, y0 = _recheck_of(accused, accuser, lead="")
    assert RecomputedEvidence.check(body0, sig0, raw0, 6, x0, y0).seed() == proof_seed(1, 9, accuser.peer_id, "",
                                                                                          "cd" * 32)
    spot = MisbehaviourReport.signed(accuser, accused=accused.peer_id, stage=1, step=9, kind="backward", mb=3,
                                     request_digest="00" * 32, at=time.time(),
                                     answers={accused.peer_id: "11" * 32, accuser.peer_id: "22" * 32}).encode()
    with pytest.raises(RequestError, match="'averaging'"):
        RecomputedEvidence.check(*spot, raw, 6, x, y)
