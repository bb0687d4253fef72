"""Stochastic wiring (swarmd.pipeline.routing): weighting, interleaving, bans, membership."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.peer_state import PeerState
from swarmd.pipeline.routing import JITTER, PeerView, RoutedPeer, StageRouter
from tests.support.routing import listed


class FakeClock:
    """A clock the test moves by hand; the router never sleeps."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_router(peers: dict[str, str] | None = None, **kwargs: object) -> tuple[StageRouter, FakeClock]:
    clock = FakeClock()
    router = StageRouter(0, clock=clock, rng=random.Random(0), **kwargs)  # type: ignore[arg-type]
    router.update_peers(listed(peers if peers is not None else {"a": "addr-a", "b": "addr-b"}))
    return router, clock


def picks(router: StageRouter, n: int, exclude: tuple[str, ...] = ()) -> list[str]:
    out = []
    for _ in range(n):
        choice = router.choose(exclude)
        assert choice is not None
        out.append(choice[0])
    return out


def longest_run(seq: list[str], item: str) -> int:
    return max((len(list(g)) for k, g in itertools.groupby(seq) if k == item), default=0)


# ---- weighting -----------------------------------------------------------------------------


def test_throughput_3_to_1_splits_300_to_100_interleaved() -> None:
    router, _ = make_router()
    router.report_success("a", 30, 1.0)
    router.report_success("b", 10, 1.0)
    seq = picks(router, 400)
    counts = Counter(seq)
    assert abs(counts["a"] - 300) <= 1 and abs(counts["b"] - 100) <= 1
    # interleaved: a never gets more than 3 in a row (AABA AABA ...), b never twice in a row
    assert longest_run(seq, "a") <= 3
    assert longest_run(seq, "b") == 1
    # spread evenly: every window of 8 consecutive choices holds exactly two b
    assert all(seq[i : i + 8].count("b") == 2 for i in range(len(seq) - 8))


def test_equal_weights_round_robin_exactly() -> None:
    router, _ = make_router({"a": "1", "b": "2", "c": "3"})
    for p in "abc":
        router.report_success(p, 5, 1.0)
    seq = picks(router, 30)
    assert seq == ["a", "b", "c"] * 10


def test_unmeasured_peers_round_robin() -> None:
    router, _ = make_router({"a": "1", "b": "2", "c": "3"})
    assert picks(router, 9) == ["a", "b", "c"] * 3


def test_new_peer_is_tried_at_once_then_rotates_at_top_weight() -> None:
    router, _ = make_router()
    router.report_success("a", 30, 1.0)
    router.report_success("b", 10, 1.0)
    picks(router, 7)
    router.update_peers(listed({"a": "addr-a", "b": "addr-b", "c": "addr-c"}))
    assert router.choose() == ("c", "addr-c")  # probed by the very next choice
    # until measured, c rotates with the fastest peer's weight (30 of 70 in a round)
    counts = Counter(picks(router, 70))
    assert abs(counts["c"] - 30) <= 2
    assert router.snapshot()[2].weight == pytest.approx(30.0)


def test_explore_weight_overrides_newcomer_weight() -> None:
    router, _ = make_router(explore_weight=10.0)
    router.report_success("a", 30, 1.0)
    router.update_peers(listed({"a": "addr-a", "b": "addr-b"}))
    assert [s.weight for s in router.snapshot()] == [pytest.approx(30.0), pytest.approx(10.0)]
    counts = Counter(picks(router, 400))
    assert abs(counts["b"] - 100) <= 2


def test_several_newcomers_are_each_probed_once_in_id_order() -> None:
    router, _ = make_router({"a": "1"})
    router.report_success("a", 100, 1.0)
    router.update_peers(listed({"a": "1", "z": "4", "y": "3", "x": "2"}))
    assert picks(router, 3) == ["x", "y", "z"]


def test_weight_floor_keeps_slow_peer_in_rotation() -> None:
    router, _ = make_router(min_share=0.01)
    router.report_success("a", 1000, 1.0)
    router.report_success("b", 0, 1.0)  # measured at 0 samples/s
    counts = Counter(picks(router, 1010))
    assert counts["b"] == 10


def test_ema_is_bias_corrected_and_moves_with_alpha() -> None:
    router, _ = make_router(alpha=0.1)
    router.report_success("a", 64, 2.0)
    assert router.stats("a").throughput == pytest.approx(32.0)  # first measurement counts fully
    router.report_success("a", 64, 1.0)
    # raw = 0.9 * 3.2 + 0.1 * 64 = 9.28; corrected by 1 - 0.9**2 = 0.19
    assert router.stats("a").throughput == pytest.approx(9.28 / 0.19)
    for _ in range(200):
        router.report_success("a", 10, 1.0)
    assert router.stats("a").throughput == pytest.approx(10.0)


def test_weights_follow_measurements() -> None:
    router, _ = make_router()
    router.report_success("a", 10, 1.0)
    router.report_success("b", 10, 1.0)
    for _ in range(100):  # b slows down to a fifth
        router.report_success("b", 2, 1.0)
    counts = Counter(picks(router, 600))
    assert abs(counts["a"] - 500) <= 2 and abs(counts["b"] - 100) <= 2


# ---- bans and recovery -------------------------------------------------------------------


def test_failed_peer_is_not_chosen_until_its_ban_expires() -> None:
    router, clock = make_router()
    router.report_success("a", 1, 1.0)  # proven: a failure costs it the base ban, 1 s
    ban = router.report_failure("a")
    assert 1.0 * (1 - JITTER) <= ban <= 1.0 * (1 + JITTER)
    assert set(picks(router, 10)) == {"b"}
    clock.advance(ban - 1e-6)
    assert router.choose(exclude=("b",)) is None
    clock.advance(2e-6)
    assert router.choose(exclude=("b",)) == ("a", "addr-a")  # recovery


def test_backoff_doubles_per_consecutive_failure_up_to_cap_and_success_resets() -> None:
    router, clock = make_router(ban_base_s=1.0, ban_max_s=10.0, probation_ban_s=5.0)
    router.report_success("a", 1, 1.0)
    bans = []
    for _ in range(7):
        bans.append(router.report_failure("a"))
        clock.advance(bans[-1])
    for k, ban in enumerate(bans[:4]):
        assert 2**k * (1 - JITTER) <= ban <= 2**k * (1 + JITTER)
    assert all(9.0 <= ban <= 10.0 for ban in bans[4:])  # capped (jitter only below the cap)
    assert router.stats("a").consecutive_failures == 7
    router.report_success("a", 1, 1.0)
    assert router.stats("a").consecutive_failures == 0
    assert router.report_failure("a") <= 1.0 + JITTER


def test_ban_jitter_is_deterministic_given_rng() -> None:
    def bans(seed: int) -> list[float]:
        router = StageRouter(0, clock=FakeClock(), rng=random.Random(seed))
        router.update_peers(listed({"a": "1"}))
        clock = router._clock
        out = []
        for _ in range(5):
            out.append(router.report_failure("a"))
            clock.advance(out[-1])  # type: ignore[attr-defined]
        return out

    assert bans(1) == bans(1)
    assert bans(1) != bans(2)


def test_huge_failure_streak_does_not_overflow() -> None:
    router, clock = make_router(ban_max_s=60.0)
    for _ in range(2000):
        ban = router.report_failure("a")
        clock.advance(ban)
    assert 54.0 <= ban <= 60.0


def test_failures_of_calls_sent_before_the_ban_do_not_lengthen_it() -> None:
    # ten calls in flight to a peer whose relay died fail together: one outage, one base ban
    router, clock = make_router()
    router.report_success("a", 1, 1.0)
    bans = [router.report_failure("a") for _ in range(10)]
    assert 1.0 * (1 - JITTER) <= bans[0] <= 1.0 * (1 + JITTER)
    assert all(b <= bans[0] for b in bans[1:])
    assert router.stats("a").consecutive_failures == 1 and router.stats("a").failures == 10
    clock.advance(bans[0])
    again = router.report_failure("a")  # a call sent after the ban failed: the next step of the backoff
    assert 2.0 * (1 - JITTER) <= again <= 2.0 * (1 + JITTER)


def test_a_peer_banned_for_failures_that_moves_gets_a_new_try_and_a_sentenced_one_does_not() -> None:
    router, clock = make_router({"a": "a@relay1", "b": "2"})
    router.report_success("a", 1, 1.0)
    router.report_failure("a")
    clock.advance(1.5)
    router.report_failure("a")  # ~2 s
    router.update_peers(listed({"a": "a@relay1", "b": "2"}))  # the same address: still banned
    assert "a" not in picks(router, 5)
    router.update_peers(listed({"a": "a@relay2", "b": "2"}))  # relayed again: its failures were the old relay's
    assert router.stats("a").addr == "a@relay2"
    assert "a" in picks(router, 4)
    router.ban("b", 600.0)  # a caught liar keeps its sentence wherever it announces itself
    router.update_peers(listed({"a": "a@relay2", "b": "2-elsewhere"}))
    assert router.snapshot()[1].banned_for_s == pytest.approx(600.0)
    router.update_peers(listed({"a": "a@relay2", "b": "2-elsewhere", "fake": "f:1"}))
    ban = router.report_failure("fake", timeout=True)  # never answered: a probation ban, kept at any port
    router.update_peers(listed({"a": "a@relay2", "b": "2-elsewhere", "fake": "f:2"}))
    assert router.snapshot()[2].banned_for_s == pytest.approx(ban)


def test_success_does_not_lift_a_ban_in_force() -> None:
    router, _ = make_router()
    router.report_failure("a")
    router.report_success("a", 10, 1.0)  # a call begun before the failure finished late
    assert router.usable_count == 1
    assert set(picks(router, 5)) == {"b"}


def test_only_failures_peer_is_retried_after_ban_not_starved() -> None:
    router, clock = make_router()
    router.report_success("b", 100, 1.0)
    assert router.choose() == ("a", "addr-a")  # the probe
    ban = router.report_failure("a")
    assert "a" not in picks(router, 20)
    clock.advance(ban)
    # unmeasured again: rotates at b's weight, so it comes back within two choices
    assert "a" in picks(router, 2)


def test_all_banned_returns_none_and_next_unban_in_is_the_shortest_ban() -> None:
    router, clock = make_router(ban_base_s=4.0, ban_max_s=100.0)
    assert router.next_unban_in() is None
    clock.advance(router.report_failure("a"))
    router.report_failure("a")  # second in a row: ~8 s
    ban_b = router.report_failure("b")  # ~4 s
    assert router.choose() is None
    assert router.usable_count == 0
    assert router.next_unban_in() == pytest.approx(ban_b)
    clock.advance(1.0)
    assert router.next_unban_in() == pytest.approx(ban_b - 1.0)
    clock.advance(router.next_unban_in() or 0.0)
    assert router.choose() == ("b", "addr-b")
    assert router.usable_count == 1


def test_no_peers_at_all() -> None:
    router, _ = make_router({})
    assert router.choose() is None
    assert router.next_unban_in() is None
    assert router.usable_count == 0
    assert router.snapshot() == []


# ---- membership ----------------------------------------------------------------------------


def test_update_peers_forgets_vanished_adds_new_keeps_known_stats() -> None:
    router, clock = make_router({"a": "1", "b": "2"})
    router.report_success("a", 42, 1.0)
    ban = router.report_failure("b")
    assert 30.0 * (1 - JITTER) <= ban <= 30.0 * (1 + JITTER)  # never answered: a probation ban
    router.update_peers(listed({"a": "1-new", "b": "2", "c": "3"}))
    assert router.stats("a").throughput == pytest.approx(42.0)
    assert router.stats("a").addr == "1-new"
    assert router.snapshot()[1].banned_for_s == pytest.approx(ban)
    router.update_peers(listed({"a": "1-new", "c": "3"}))
    assert "b" not in router and len(router) == 2
    assert [s.peer_id for s in router.snapshot()] == ["a", "c"]
    assert router.choose() == ("c", "3")  # newcomer probed
    assert router.choose() == ("a", "1-new")
    # a vanished peer that comes back while its ban runs gets its record back (backoff kept) ...
    router.update_peers(listed({"a": "1-new", "b": "2", "c": "3"}))
    assert router.stats("b").failures == 1 and router.usable_count == 2
    # ... and one that comes back after its ban ended starts afresh: no stats, no ban
    router.update_peers(listed({"a": "1-new", "c": "3"}))
    clock.advance(ban + 1.0)
    router.update_peers(listed({"a": "1-new", "b": "2", "c": "3"}))
    assert router.stats("b").failures == 0 and router.usable_count == 3


def test_only_usable_peers_of_its_own_stage_are_routed_to() -> None:
    """The router takes the swarm's view typed: a peer that is not serving (joining, migrating,
    draining) or that no member could dial is listed but never called (``PeerView.usable``, the rule
    ``PeerRecord.usable`` holds for the DHT's own records); a peer of another stage is a bug."""
    assert PeerView("a", 0, "A").usable and PeerView("a", 0, "A", reachable="yes").usable
    router, _ = make_router({})
    router.update_peers([PeerView("a", 0, "A"), PeerView("b", 0, "B", PeerState.DRAINING),
                         PeerView("c", 0, "C", PeerState.JOINING), PeerView("d", 0, "D", reachable="no"),
                         PeerView("e", 0, "E", PeerState.MIGRATING, reachable="yes")])
    assert [p.peer_id for p in router.snapshot()] == ["a"]
    assert {router.choose() for _ in range(5)} == {("a", "A")}
    with pytest.raises(ValueError, match="of stage 1"):
        router.update_peers([PeerView("x", 1, "X")])


def test_reports_about_unknown_peers_are_ignored() -> None:
    router, _ = make_router()
    router.report_success("ghost", 1, 1.0)
    assert router.report_failure("ghost") == 0.0
    router.begin("ghost")
    router.release("ghost")
    assert len(router) == 2


def test_exclude_retries_on_another_peer_of_the_stage() -> None:
    router, _ = make_router({"a": "1", "b": "2", "c": "3"})
    for p in "abc":
        router.report_success(p, 10, 1.0)
    first = router.choose()
    assert first is not None
    router.report_failure(first[0])
    retry = router.choose(exclude={first[0]})
    assert retry is not None and retry[0] != first[0]
    assert router.choose(exclude=["a", "b", "c"]) is None
    assert router.next_unban_in() is not None


# ---- in-flight accounting ------------------------------------------------------------------


def test_in_flight_accounting_and_cap() -> None:
    router, _ = make_router(max_in_flight=2)
    router.report_success("a", 100, 1.0)
    router.report_success("b", 1, 1.0)
    for _ in range(2):
        router.begin("a")
    assert router.stats("a").in_flight == 2
    assert set(picks(router, 5)) == {"b"}  # a is saturated despite its weight
    router.report_success("a", 100, 1.0)
    assert router.stats("a").in_flight == 1
    assert router.choose() == ("a", "addr-a")
    router.report_failure("a")
    router.release("a")
    router.release("a")  # never below zero
    assert router.stats("a").in_flight == 0
    snap = {s.peer_id: s for s in router.snapshot()}
    assert snap["a"].in_flight == 0 and snap["a"].failures == 1


def test_snapshot_fields() -> None:
    router, clock = make_router()
    router.report_success("a", 20, 2.0)
    router.report_failure("b")
    snap = router.snapshot()
    assert [s.peer_id for s in snap] == ["a", "b"]
    a, b = snap
    assert a == RoutedPeer(
        peer_id="a",
        addr="addr-a",
        throughput=pytest.approx(10.0),
        measured=True,
        proven=True,
        alive=False,
        weight=pytest.approx(10.0),
        in_flight=0,
        banned_for_s=0.0,
        excluded=False,
        successes=1,
        failures=0,
        timeouts=0,
        consecutive_failures=0,
    )
    assert a.routable and not a.banned
    assert b.banned_for_s > 0 and b.banned and not b.routable and not b.measured and b.weight == pytest.approx(10.0)
    clock.advance(100.0)
    assert router.snapshot()[1].banned_for_s == 0.0 and not router.snapshot()[1].proven


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"ban_base_s": 0.0},
        {"ban_base_s": 10.0, "ban_max_s": 5.0},
        {"explore_weight": 0.0},
        {"min_share": -0.1},
        {"max_in_flight": 0},
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        StageRouter(0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("samples, seconds", [(-1, 1.0), (1, -1.0), (1, math.nan), (1, math.inf)])
def test_bad_measurements_are_refused(samples: int, seconds: float) -> None:
    router, _ = make_router()
    with pytest.raises(ValueError):
        router.report_success("a", samples, seconds)


# ---- properties ----------------------------------------------------------------------------

PEER_IDS = ["p0", "p1", "p2", "p3", "p4"]
operations = st.lists(
    st.one_of(
        st.tuples(st.just("choose"), st.sets(st.sampled_from(PEER_IDS), max_size=3)),
        st.tuples(st.just("success"), st.sampled_from(PEER_IDS), st.integers(0, 64), st.floats(0.0, 5.0)),
        st.tuples(st.just("failure"), st.sampled_from(PEER_IDS)),
        st.tuples(st.just("advance"), st.floats(0.0, 30.0)),
        st.tuples(st.just("view"), st.dictionaries(st.sampled_from(PEER_IDS), st.sampled_from(["x", "y"]))),
        st.tuples(st.just("begin"), st.sampled_from(PEER_IDS)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=operations, cap=st.one_of(st.none(), st.integers(1, 3)))
def test_choose_never_returns_banned_excluded_saturated_or_unknown_peers(
    ops: list[tuple[Any, ...]], cap: int | None
) -> None:
    clock = FakeClock()
    router = StageRouter(0, clock=clock, rng=random.Random(0), max_in_flight=cap)
    view: dict[str, str] = {}
    for op in ops:
        kind = op[0]
        if kind == "choose":
            exclude = op[1]
            before = {s.peer_id: s for s in router.snapshot()}
            choice = router.choose(exclude)
            live = [s for s in before.values() if s.banned_for_s == 0.0]
            probation_open = not any(s.proven for s in live) or sum(
                s.in_flight for s in before.values() if not s.proven) < router.probation_slots
            usable = [
                pid
                for pid, s in before.items()
                if s.banned_for_s == 0.0 and pid not in exclude and (cap is None or s.in_flight < cap)
                and (s.proven or (probation_open and s.in_flight == 0))
            ]
            if choice is None:
                assert not usable
                if not exclude and before and not router.waiting_on_caps():
                    assert router.next_unban_in() is not None
            else:
                assert choice[0] in usable
                assert choice == (choice[0], view[choice[0]])
        elif kind == "success":
            router.report_success(op[1], op[2], op[3])
        elif kind == "failure":
            ban = router.report_failure(op[1])
            if op[1] in view:
                assert 0.0 < ban <= router.ban_max_s
            else:
                assert ban == 0.0  # a peer outside the view is not tracked
        elif kind == "advance":
            clock.advance(op[1])
        elif kind == "view":
            view = dict(op[1])
            router.update_peers(listed(view))
            assert sorted(s.peer_id for s in router.snapshot()) == sorted(view)
        else:
            router.begin(op[1])
        assert router.usable_count == sum(1 for s in router.snapshot() if s.banned_for_s == 0.0)
        assert all(s.weight > 0.0 for s in router.snapshot())


@settings(max_examples=100, deadline=None)
@given(rates=st.lists(st.integers(1, 20), min_size=1, max_size=5), rounds=st.integers(1, 5))
def test_proportions_hold_at_every_point_not_just_per_round(rates: list[int], rounds: int) -> None:
    peers = {f"p{i}": f"addr{i}" for i in range(len(rates))}
    router, _ = make_router(peers, min_share=0.0)
    for i, rate in enumerate(rates):
        router.report_success(f"p{i}", rate, 1.0)
    total = sum(rates)
    counts = Counter[str]()
    for n in range(1, rounds * total + 1):
        choice = router.choose()
        assert choice is not None
        counts[choice[0]] += 1
        # interleaving: after any number of choices each peer is within about one pick of its
        # exact share (a burst AAAB would put B a whole share behind); smooth WRR stays
        # within 1 here, the slack covers float rounding in the EMA weights
        for i, rate in enumerate(rates):
            assert abs(counts[f"p{i}"] - n * rate / total) <= 1.5
    for i, rate in enumerate(rates):
        assert abs(counts[f"p{i}"] - rounds * rate) <= 1  # exact over whole rounds


# ---- probation, timeouts from measurements, long bans (issue #18) --------------------------


def test_unproven_peers_share_a_bounded_budget_while_a_proven_peer_is_usable() -> None:
    router, _ = make_router({"a": "A", "t1": "T1", "t2": "T2", "t3": "T3"}, probation_slots=1)
    router.report_success("a", 10, 1.0)
    first = router.choose()
    assert first is not None and first[0] == "t1"  # a newcomer is probed within the budget
    router.begin("t1")
    # the budget is taken: every other choice goes to the proven peer until t1's call ends
    assert set(picks(router, 20)) == {"a"}
    router.report_failure("t1", timeout=True)
    assert router.choose() == ("t2", "T2")  # the slot is free again: the next newcomer
    router.begin("t2")
    router.report_success("t2", 10, 1.0)  # answered: proven, off probation
    router.begin("t2")
    router.begin("t2")
    assert router.stats("t2").in_flight == 2  # a proven peer takes any number of calls
    assert router.choose() == ("t3", "T3")


def test_without_a_proven_peer_each_unproven_peer_gets_one_call() -> None:
    router, _ = make_router({"a": "A", "b": "B"})
    for peer in ("a", "b"):
        assert router.choose() == (peer, peer.upper())  # each probed once, in id order
        router.begin(peer)
    assert router.choose() is None
    assert router.waiting_on_caps()  # the caller waits for a call to end, not for an unban
    assert router.next_unban_in() is None
    router.report_success("a", 1, 0.1)
    assert router.choose() == ("a", "A")


def test_excluded_and_explicitly_banned_peers_are_never_chosen() -> None:
    router, clock = make_router({"a": "A", "b": "B", "c": "C"})
    for p in "abc":
        router.report_success(p, 10, 1.0)
    router.set_excluded({"b"})
    assert "b" not in picks(router, 30) and router.usable_count == 2
    assert router.choose_preferred("b") != ("b", "B")
    router.ban("c", 600.0)
    router.report_success("c", 10, 1.0)  # a late answer does not lift it
    assert set(picks(router, 10)) == {"a"}
    clock.advance(601.0)
    router.set_excluded(())
    assert set(picks(router, 30)) == {"a", "b", "c"}
    with pytest.raises(ValueError):
        router.ban("a", math.inf)


def test_a_fake_peer_is_banned_for_minutes_not_seconds() -> None:
    router, clock = make_router({"a": "A", "fake": "F"})
    router.report_success("a", 10, 1.0)
    bans = []
    for _ in range(7):
        bans.append(router.report_failure("fake", timeout=True))
        clock.advance(bans[-1])
    assert 27.0 <= bans[0] <= 33.0 and 54.0 <= bans[1] <= 66.0
    assert all(540.0 <= b <= 600.0 for b in bans[5:])  # ten minutes, capped
    assert router.stats("fake").timeouts == 7
    # an honest peer that answered before pays the short base ban for a hiccup
    assert router.report_failure("a") <= 1.0 + JITTER


def test_timeout_follows_the_stages_typical_latency_within_floor_and_ceiling() -> None:
    router, _ = make_router({"a": "A", "b": "B", "c": "C", "new": "N"}, timeout_factor=4.0,
                            timeout_floor_s=0.5, timeout_ceiling_s=60.0, probation_timeout_s=10.0)
    # nothing measured: the ceiling for a proven peer, the probation cap for a newcomer
    assert router.timeout_for("new", 8, "forward") == 10.0
    router.report_success("a", 8, 0.8, "forward")  # 0.1 s per sample
    router.report_success("b", 8, 1.6, "forward")  # 0.2 s per sample
    router.report_success("c", 8, 80.0, "forward")  # 10 s per sample: slow, or stretching
    assert router.typical_latency("forward") == pytest.approx(0.2)  # the median, not the mean
    # a newcomer (a tarpit, maybe) waits about one typical request: 4 x 0.2 x 8
    assert router.timeout_for("new", 8, "forward") == pytest.approx(6.4)
    assert router.timeout_for("a", 8, "forward") == pytest.approx(6.4)  # at least the stage's
    assert router.timeout_for("c", 8, "forward") == 60.0  # its own is longer: capped at the ceiling
    assert router.timeout_for("new", 1, "forward") == pytest.approx(0.8)
    router.report_success("a", 8, 0.0001, "backward")
    assert router.timeout_for("new", 8, "backward") == 0.5  # the floor
    assert router.timeout_for("a", 8, "nothing-yet") == 60.0
    assert router.timeout_for("ghost", 8, "forward") == pytest.approx(6.4)


def test_latency_estimate_is_bias_corrected_per_kind() -> None:
    router, _ = make_router(alpha=0.1)
    router.report_success("a", 10, 1.0, "forward")
    assert router.stats("a").latency["forward"].value == pytest.approx(0.1)  # not 0.01
    router.report_success("a", 10, 3.0, "forward")
    assert 0.1 < router.stats("a").latency["forward"].value < 0.3
    router.report_success("a", 0, 1.0, "backward")  # no samples: no per-sample latency
    assert "backward" not in router.stats("a").latency


def test_a_calls_own_floor_overrides_the_routers() -> None:
    router, _ = make_router({"a": "A"}, timeout_floor_s=1.0)
    router.report_success("a", 8, 0.008, "backward")
    assert router.timeout_for("a", 8, "backward") == 1.0
    assert router.timeout_for("a", 8, "backward", floor_s=6.0) == 6.0
    assert router.timeout_for("a", 8, "backward", floor_s=600.0) == router.timeout_ceiling_s


def test_a_backwards_deadline_leaves_slack_before_its_timeout() -> None:
    from swarmd.train.timing import Timing

    timing = Timing()
    floor = timing.backward_timeout_floor_s
    assert timing.backward_deadline_ms(60.0) == 45_000  # a quarter of a long timeout for the way back
    assert timing.backward_deadline_ms(floor) == int(1000 * (floor - timing.backward_slack_s))
    assert timing.backward_deadline_ms(1.0) == 0  # never negative: the peer then adds nothing, the trainer retries


@pytest.mark.parametrize(
    "kwargs",
    [
        {"probation_ban_s": 0.0},
        {"probation_ban_s": 1000.0},
        {"probation_slots": 0},
        {"timeout_factor": 0.5},
        {"timeout_floor_s": 0.0},
        {"timeout_floor_s": 100.0, "timeout_ceiling_s": 10.0},
        {"probation_timeout_s": 0.0},
    ],
)
def test_bad_probation_and_timeout_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        StageRouter(0, **kwargs)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["choose", "end_ok", "end_fail", "advance"]),
                              st.sampled_from(["p", "t0", "t1", "t2", "t3"])), max_size=60),
       slots=st.integers(1, 3))
def test_probation_budget_is_never_exceeded_while_a_proven_peer_is_usable(
    ops: list[tuple[str, str]], slots: int
) -> None:
    clock = FakeClock()
    router = StageRouter(0, clock=clock, rng=random.Random(0), probation_slots=slots)
    router.update_peers(listed({p: p for p in ["p", "t0", "t1", "t2", "t3"]}))
    router.report_success("p", 10, 1.0)
    for op, peer in ops:
        if op == "choose":
            choice = router.choose()
            if choice is not None:
                router.begin(choice[0])
        elif op == "end_ok" and router.stats(peer).in_flight:
            router.report_success(peer, 1, 0.1)
        elif op == "end_fail" and router.stats(peer).in_flight and peer != "p":  # p stays usable
            router.report_failure(peer, timeout=True)
        elif op == "advance":
            clock.advance(40.0)
        snap = router.snapshot()
        if any(s.proven and not s.banned_for_s for s in snap):
            assert sum(s.in_flight for s in snap if not s.proven) <= slots
        assert all(s.in_flight <= 1 for s in snap if not s.proven)
