"""Misbehaviour reports (swarmd.pipeline.reports): strict decoding, signatures and the ledger's rules
(issue #17, item 3). POST /v1/report on real daemons: tests/adversarial/test_spot_checks.py and the fuzzer
(tests/adversarial/test_fuzz_dataplane.py::test_report_refuses_hostile_reports)."""

from __future__ import annotations

import secrets
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.dht.identity import Identity
from swarmd.errors import RequestError
from swarmd.net.messages import ProgressReply
from swarmd.pipeline.reports import MisbehaviourReport, ReportLedger

NOW = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def hexid() -> str:
    return secrets.token_hex(20)


ACCUSED, HONEST, ARBITER = sorted(hexid() for _ in range(3))


def report(identity: Identity | None = None, accused: str = ACCUSED, at: float = NOW, **kw: Any) -> MisbehaviourReport:
    fields: dict[str, Any] = dict(stage=0, step=3, kind="forward", mb=2**64 - 1, request_digest="ab" * 32,
                                  answers={accused: "01" * 32, HONEST: "02" * 32, ARBITER: "02" * 32})
    fields.update(kw)
    return MisbehaviourReport.signed(identity or Identity.generate(), accused=accused, at=at, **fields)


# ---- the report -------------------------------------------------------------------------------


def test_a_signed_report_round_trips_and_verifies() -> None:
    me = Identity.generate()
    r = report(me)
    body, sig = r.encode()
    back = MisbehaviourReport.decode(body, sig)
    assert back == r and back.reporter_id == me.peer_id
    assert [p for p, _ in back.answers] == sorted([ACCUSED, HONEST, ARBITER])


def test_a_tampered_or_forged_report_is_refused() -> None:
    body, sig = report().encode()
    fields = msgpack.unpackb(body)
    fields["accused"] = HONEST  # blame someone else under the same signature
    with pytest.raises(RequestError, match="signature"):
        MisbehaviourReport.decode(msgpack.packb(fields, use_bin_type=True), sig)
    with pytest.raises(RequestError, match="signature"):
        MisbehaviourReport.decode(body, bytes(64))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"v": 2}, "version"),
        ({"accused": "XY" * 20}, "accused"),
        ({"kind": "average"}, "kind"),
        ({"request": "00"}, "request"),
        ({"answers": [["00" * 20, "00" * 32]]}, "answers"),
        ({"reporter": b"short"}, "reporter"),
        ({"at": float("nan")}, "at"),
        ({"at": 5}, "at"),
        ({"stage": -1}, "stage"),
        ({"mb": -1}, "mb"),
        ({"step": True}, "step"),
    ],
)
def test_malformed_fields_are_refused_with_a_sentence(change: dict[str, Any], match: str) -> None:
    body, sig = report().encode()
    fields = msgpack.unpackb(body)
    fields.update(change)
    with pytest.raises(RequestError, match=match):
        MisbehaviourReport.decode(msgpack.packb(fields, use_bin_type=True), sig)


def test_answers_must_name_the_accused_and_be_canonical() -> None:
    with pytest.raises(RequestError, match="include the accused"):
        report(answers={HONEST: "02" * 32, ARBITER: "02" * 32})
    me = Identity.generate()
    with pytest.raises(RequestError, match="itself"):
        report(me, accused=me.peer_id, answers={me.peer_id: "01" * 32, HONEST: "02" * 32})


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=3000), sig=st.binary(min_size=0, max_size=70))
def test_garbage_never_raises_anything_but_request_error(body: bytes, sig: bytes) -> None:
    with pytest.raises(RequestError):
        MisbehaviourReport.decode(body, sig)


# ---- the ledger -------------------------------------------------------------------------------


def ledger(**kw: Any) -> tuple[ReportLedger, Clock, list[tuple[str, float]]]:
    clock, excluded = Clock(), []
    book = ReportLedger(clock=clock, on_exclude=lambda p, s, r: excluded.append((p, s)), **kw)
    return book, clock, excluded


def test_two_independent_reporters_exclude_and_the_ban_grows_on_repeat() -> None:
    book, clock, excluded = ledger(exclusion_base_s=600.0)
    assert book.add(report(), "10.0.0.1").accepted
    assert book.add(report(), "10.0.0.9").reason == "same_source"  # another key, the same /24: one reporter
    assert book.excluded() == frozenset()
    result = book.add(report(), "10.0.1.1")
    assert result.accepted and result.excluded and book.excluded() == {ACCUSED}
    assert excluded == [(ACCUSED, 600.0)]
    assert book.add(report(at=clock.now), "10.0.2.1").reason == "already_excluded"
    clock.now += 601
    assert book.excluded() == frozenset()
    book.add(report(at=clock.now), "10.0.3.1")
    book.add(report(at=clock.now), "10.0.4.1")
    assert excluded[-1] == (ACCUSED, 1200.0)  # the second exclusion lasts twice as long
    status = book.status()
    assert status["exclusions"] == 2 and status["excluded"] == [ACCUSED] and status["refused"]["same_source"] == 1


def test_one_reporter_twice_is_one_report_and_old_reports_expire() -> None:
    book, clock, _ = ledger(window_s=100.0)
    me = Identity.generate()
    assert book.add(report(me), "10.0.0.1").accepted
    assert book.add(report(me), "10.0.9.1").reason == "duplicate"
    assert book.add(report(at=NOW - 101), "10.0.8.1").reason == "stale"
    assert book.add(report(at=NOW + 3600), "10.0.8.1").reason == "stale"  # from the future
    clock.now += 150  # the first report has aged out of the window: one more is not enough
    assert not book.add(report(at=clock.now), "10.0.7.1").excluded
    assert book.add(report(at=clock.now), "10.0.6.1").excluded


def test_loopback_reporters_count_by_key_and_a_reporter_is_rate_limited() -> None:
    book, _, _ = ledger(max_per_reporter=2)
    assert book.add(report(), "127.0.0.1").accepted and book.add(report(), "127.0.0.1").excluded
    me = Identity.generate()
    others = [hexid() for _ in range(3)]
    results = [book.add(report(me, accused=a, answers={a: "01" * 32, HONEST: "02" * 32}), "10.1.1.1") for a in others]
    assert [r.reason for r in results] == ["counted", "counted", "rate_limited"]


def test_one_report_makes_a_peer_suspected_until_a_second_excludes_it_or_the_window_ends() -> None:
    book, clock, _ = ledger(window_s=100.0)
    others = [hexid() for _ in range(3)]
    assert book.suspected() == []
    assert book.add(report(), "10.0.0.1").reason == "counted"
    assert book.suspected() == [ACCUSED] and book.excluded() == frozenset()  # checked more, not excluded
    for a in others:
        clock.now += 1
        book.add(report(accused=a, at=clock.now, answers={a: "01" * 32, HONEST: "02" * 32}), "10.0.9.1")
    assert book.suspected() == [*reversed(others), ACCUSED]  # the most recently accused first
    assert book.suspected(limit=2) == list(reversed(others))[:2]
    assert book.status()["suspected"] == sorted([ACCUSED, *others])
    assert book.add(report(at=clock.now), "10.0.1.1").excluded
    assert ACCUSED not in book.suspected()  # excluded now: no longer merely suspected
    clock.now += 100  # the others' reports aged out of the window
    assert book.suspected() == []


def test_the_ledger_is_bounded() -> None:
    book, _, _ = ledger(max_accused=10, max_per_reporter=1000)
    for _ in range(50):
        a = hexid()
        book.add(report(accused=a, answers={a: "01" * 32, HONEST: "02" * 32}), "10.0.0.1")
    assert book.status()["accused"] <= 10


# ---- POST /v1/report on a real daemon: tests/adversarial/test_spot_checks.py (the 2x3 swarm with liars) ----------


@pytest.mark.parametrize("key", ["excluded", "suspected"])
def test_progress_reply_excluded_and_suspected_are_validated(key: str) -> None:
    base = ProgressReply(stage=0, step=0, samples=0, **{key: (ACCUSED,)}).to_json()
    assert getattr(ProgressReply.from_json(base), key) == (ACCUSED,)
    assert getattr(ProgressReply.from_json({k: v for k, v in base.items() if k != key}), key) == ()  # older peers
    for bad in ([1], ["x" * 65], ["a"] * 1025, "nope"):
        with pytest.raises(Exception, match=f"{key}|wrong type"):
            ProgressReply.from_json({**base, key: bad})
