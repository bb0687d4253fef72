"""The stage as the all-reduce's quorum counts it (swarmd.pipeline.averaging.allreduce.membership): pure, times given."""

from __future__ import annotations

import itertools

import pytest

from swarmd.pipeline.averaging.allreduce.plan import quorum
from swarmd.pipeline.averaging.allreduce.membership import StageMembership

STAGE = {"a": "h:1", "b": "h:2", "c": "h:3", "d": "h:4"}


def answered_all(m: StageMembership, now: float) -> None:
    for pid in STAGE:
        m.answered(pid, now, away=False)


def test_an_expired_record_of_a_live_peer_keeps_counting_and_a_gone_one_stops() -> None:
    m = StageMembership(remember_s=30.0, mute_after_s=10.0)
    m.observe(STAGE, 0.0)
    answered_all(m, 1.0)
    m.observe({"a": "h:1", "b": "h:2"}, 5.0)  # c and d missed their refreshes (a loaded machine)
    assert m.counted(5.0) == set(STAGE)  # the listing shrank, the count did not
    assert set(m.to_probe(5.0, 2.0, 8)) == {"c", "d"}  # ... and they are probed
    m.answered("c", 6.0, away=False)  # it serves this stage still
    m.failed("d", 6.0, gone=True)  # nothing listens at its address: it died
    assert m.counted(6.0) == {"a", "b", "c"} and set(m.to_probe(7.0, 2.0, 8)) == set()
    m.failed("c", 9.0, gone=False)  # a timeout (loaded) is no proof of death
    assert "c" in m.counted(9.0)
    m.observe({"a": "h:1", "b": "h:2"}, 30.0)  # c was last listed at 0
    assert "c" in m.counted(30.0)
    m.observe({"a": "h:1", "b": "h:2"}, 31.0)  # not listed for longer than remember_s: forgotten
    assert m.counted(31.0) == {"a", "b"}
    m.observe(STAGE, 38.0)  # d came back (a restart): it counts from its listing, until mute_after_s
    assert "d" in m.counted(38.0) and "d" not in m.counted(48.0)


def test_records_that_never_answer_stop_counting_and_cannot_hold_a_lone_peer() -> None:
    m = StageMembership(mute_after_s=10.0)
    flood = {f"fake{i}": f"f:{i}" for i in range(20)}
    m.observe({"a": "h:1", **flood}, 0.0)
    m.answered("a", 0.5)
    assert len(m.counted(1.0)) == 21 and quorum({"a"}, m.counted(1.0)) is not None  # a newcomer may be honest
    m.observe({"a": "h:1", **flood}, 10.0)
    assert m.counted(10.0) == {"a"} and m.mute(10.0) == set(flood)
    assert quorum({"a"}, m.counted(10.0)) is None
    m.answered("fake3", 11.0)  # one answers after all: it counts (as any peer that answered once)
    assert m.counted(11.0) == {"a", "fake3"}
    m.observe({"a": "h:1", **flood, "fake3": "f:moved"}, 12.0)  # at a new address it must answer anew
    assert m.counted(12.0) == {"a", "fake3"} and "fake3" not in m.counted(22.0)


def test_a_record_that_failed_two_challenges_and_never_answered_stops_counting_at_once() -> None:
    m = StageMembership(mute_after_s=10.0, mute_after_failures=2)
    m.observe({"a": "h:1", "pit": "f:1", "slow": "h:2"}, 0.0)
    m.answered("a", 0.0, away=False)
    m.challenged("pit", 1)
    m.failed("slow", 1.0, gone=False)
    assert m.counted(2.0) == {"a", "pit", "slow"}  # one failure: it may be a loaded newcomer
    m.challenged("pit", 2)
    m.answered("slow", 2.5)  # its proof came through: it counts, and its failures are forgotten
    m.failed("slow", 3.0, gone=False)
    assert m.counted(3.0) == {"a", "slow"} and m.mute(3.0) == {"pit"}
    m.challenged("slow", 5)  # (an answered peer stays answered)
    assert "slow" in m.counted(4.0)


def test_a_peer_that_says_it_is_away_counts_again_once_that_is_old() -> None:
    m = StageMembership(away_memory_s=10.0)
    m.observe(STAGE, 0.0)
    answered_all(m, 0.0)
    m.answered("d", 1.0, away=True)
    m.answered("d", 1.5)  # its proof (proofs say nothing of "away")
    assert m.counted(2.0) == {"a", "b", "c"} and m.to_probe(3.0, 2.0, 8) == {"d": "h:4"}
    assert m.to_probe(3.0, 2.5, 8) == {}  # probed within every_s
    assert "d" in m.counted(11.5)  # its answer is old: it may be back
    m.answered("d", 11.6)  # a proof says nothing of "away"
    assert m.to_probe(11.7, 2.0, 8) == {"d": "h:4"}
    m.answered("d", 12.0, away=False)  # back in the stage's rounds
    assert "d" in m.counted(12.0) and m.to_probe(20.0, 2.0, 8) == {}


def test_bounded_and_checked() -> None:
    m = StageMembership(max_peers=3)
    m.observe(STAGE, 0.0)
    assert len(m.counted(0.0)) <= 4 and len(m._seen) == 3
    assert StageMembership().to_probe(0.0, 1.0, 8) == {}
    with pytest.raises(ValueError):
        StageMembership(remember_s=-1.0)
    m.answered("nobody", 1.0)  # unknown peers are ignored
    m.failed("nobody", 1.0, gone=True)


def test_counting_never_breaks_the_quorum_when_both_coordinators_count_both_rounds() -> None:
    """The quorum's claim with a counted (not listed) denominator: on every view where both
    coordinators count every member of both rounds, two disjoint rounds do not both have a quorum
    unless each coordinator excludes a member of the other's (as ``test_allreduce`` checks for listings)."""
    peers = ["a", "b", "c", "d", "e"]
    subsets = [frozenset(c) for k in range(len(peers) + 1) for c in itertools.combinations(peers, k)]
    for x, y in itertools.product(subsets[1:], repeat=2):
        if x & y:
            continue
        for extra_x, extra_y in itertools.product((frozenset(), frozenset({"zz"})), repeat=2):
            counted_x, counted_y = x | y | extra_x, x | y | extra_y  # each counts both rounds, and maybe more
            if quorum(x, counted_x) is None and quorum(y, counted_y) is None:
                raise AssertionError((x, y, counted_x, counted_y))
