"""How long a round waits for a contributor (issue #18, item 2): ``swarmd.pipeline.averaging.patience``."""

from __future__ import annotations

import pytest

from swarmd.pipeline.averaging.patience import Dissent, RoundPatience


def test_the_round_timeout_holds_until_enough_honest_rounds_were_seen() -> None:
    p = RoundPatience(factor=4.0, floor_s=2.0, min_samples=3)
    assert p.wait_s(30.0) == 30.0
    p.observe({"a": 0.1, "b": 0.2})
    assert p.wait_s(30.0, {"a", "b", "fake"}) == 30.0  # two samples: not enough yet
    p.observe({"a": 0.3})
    assert p.samples == 3
    assert p.wait_s(30.0, {"fake"}) == 2.0  # 4 x median 0.2 = 0.8, floored
    assert p.wait_s(1.0, {"fake"}) == 1.0  # never past the round timeout


def test_the_stage_median_resists_a_minority_of_late_peers_but_a_slow_honest_peer_keeps_its_own_patience() -> None:
    p = RoundPatience(factor=4.0, floor_s=0.5, min_samples=3)
    for _ in range(10):
        p.observe({"fast1": 0.2, "fast2": 0.25, "slow": 5.0})
    assert p.wait_s(60.0, {"fast1", "fast2", "fake"}) == pytest.approx(1.0)  # 4 x the median (0.25)
    assert p.wait_s(60.0, {"fast1", "slow", "fake"}) == pytest.approx(20.0)  # the slow one is waited for
    assert p.wait_s(10.0, {"slow"}) == 10.0


def test_silent_contributors_are_the_expected_ones_that_never_came_but_never_the_leader() -> None:
    assert RoundPatience.silent({"lead", "a", "fake"}, {"lead", "a"}, leader="lead") == {"fake"}
    assert RoundPatience.silent({"lead", "a"}, {"lead", "a", "late"}, leader="lead") == set()
    assert RoundPatience.silent({"lead"}, set(), leader="lead") == set()


def test_per_peer_memory_is_bounded() -> None:
    p = RoundPatience(per_peer=2, max_peers=3, min_samples=1, floor_s=0.1)
    for i in range(10):
        p.observe({f"p{i}": 9.0})
    p.observe({"p9": 0.1})
    assert p.wait_s(100.0, {"p0"}) == pytest.approx(4 * 9.0)  # the stage's median (9 s): p0 itself is forgotten
    assert len(p._own) == 3  # noqa: SLF001


@pytest.mark.parametrize("kwargs", [{"factor": 0.5}, {"floor_s": 0.0}, {"window": 0}, {"min_samples": 0},
                                    {"min_samples": 100, "window": 10}, {"per_peer": 0}, {"max_peers": 0}])
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RoundPatience(**kwargs)  # type: ignore[arg-type]


def test_a_mate_naming_another_leader_is_waited_for_the_grace_then_left_out_until_it_agrees() -> None:
    d = Dissent()
    # a view that lags (a peer joined) agrees within the grace: never left out
    assert d.disregarded({"lag": "x", "fake": "fake"}, "lead", now=0.0, grace_s=3.0) == frozenset()
    assert d.disregarded({"lag": "lead", "fake": "fake"}, "lead", now=1.0, grace_s=3.0) == frozenset()
    assert d.disregarded({"lag": "lead", "fake": "fake"}, "lead", now=2.9, grace_s=3.0) == frozenset()
    # one that keeps naming another for the grace is left out, counted once, at this and later steps
    assert d.disregarded({"lag": "lead", "fake": "fake"}, "lead", now=3.0, grace_s=3.0) == {"fake"}
    assert d.disregarded({"fake": "fake"}, "lead", now=3.1, grace_s=3.0) == {"fake"}
    assert d.left_out == 1 and d.current == {"fake"}
    # unseen for a while (another step), it is still left out when it comes back naming another
    assert d.disregarded({}, "lead", now=10.0, grace_s=3.0) == frozenset()
    assert d.disregarded({"fake": None}, "lead", now=11.0, grace_s=3.0) == {"fake"}
    # once it names this peer's leader, it counts again; naming another later costs a fresh grace
    assert d.disregarded({"fake": "lead"}, "lead", now=12.0, grace_s=3.0) == frozenset()
    assert d.current == frozenset()
    assert d.disregarded({"fake": "other"}, "lead", now=13.0, grace_s=3.0) == frozenset()
    assert d.disregarded({"fake": "other"}, "lead", now=16.0, grace_s=3.0) == {"fake"}
    assert d.left_out == 2


def test_dissent_forgets_the_mates_no_longer_listed() -> None:
    d = Dissent()
    assert d.disregarded({"fake": "fake"}, "lead", now=0.0, grace_s=1.0) == frozenset()
    assert d.disregarded({"fake": "fake"}, "lead", now=2.0, grace_s=1.0) == {"fake"} and d.current == {"fake"}
    assert d.disregarded({}, "lead", now=3.0, grace_s=1.0, mates={"honest"}) == frozenset()
    assert d.current == frozenset()  # gone from the listing: neither shown nor remembered
    assert d.disregarded({"fake": "fake"}, "lead", now=4.0, grace_s=1.0, mates={"fake"}) == frozenset()  # anew


def test_dissent_memory_is_bounded() -> None:
    d = Dissent(max_peers=3)
    for i in range(10):
        d.disregarded({f"p{i}": "other"}, "lead", now=float(i), grace_s=0.0)
    assert len(d._since) == 3 and d.current <= {"p7", "p8", "p9"}
