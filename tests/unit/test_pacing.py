"""Asynchronous pacing's decisions (swarmd.train.pacing): whose lease book, when a book peer lags, how
much a trainer without a book may start, when a new step's microbatches must wait, and how far each stage
is waited for."""

from __future__ import annotations

import dataclasses

import pytest

from swarmd.pipeline.routing import RoutedPeer
from swarmd.train.pacing import BookLag, book_peer, pace_budget, reachable_steps, rounds_pending
from swarmd.train.swarm_client import PeerProgress
from tests.support.routing import peer


def ids(p: RoutedPeer | None) -> str | None:
    return None if p is None else p.peer_id


def test_the_book_is_the_smallest_proven_then_alive_then_any_usable_peer() -> None:
    fresh = [peer("a"), peer("b"), peer("c")]
    assert ids(book_peer(fresh)) == "a"  # nobody proven yet: the smallest id, like every other trainer
    assert ids(book_peer([peer("a"), peer("b", alive=True), peer("c", alive=True)])) == "b"
    assert ids(book_peer([peer("a", alive=True), peer("b"), peer("c", proven=True)])) == "c"  # a small fake id waits
    assert ids(book_peer([])) is None


def test_a_banned_or_lagging_or_excluded_peer_keeps_no_book_unless_it_answered_the_last_poll() -> None:
    peers = [peer("a", proven=True, banned_for_s=5.0), peer("b", proven=True)]
    assert ids(book_peer(peers)) == "b"
    # banned for a failed compute call, but it answered the progress poll: its book is still the stage's
    assert ids(book_peer(peers, answered={"a"})) == "a"
    assert ids(book_peer(peers, answered={"a"}, behind={"a"})) == "b"  # behind the front step: it refuses
    assert ids(book_peer([peer("a", proven=True, excluded=True), peer("b")], answered={"a"})) == "b"
    assert ids(book_peer([peer("a", excluded=True)])) is None


def test_a_book_peer_behind_the_front_is_waited_for_a_grace_then_passed_over() -> None:
    lag = BookLag(grace_s=2.0)
    assert lag.update({"a"}, now=10.0) == frozenset()
    assert lag.update({"a", "b"}, now=11.5) == frozenset()
    assert lag.update({"a", "b"}, now=12.5) == {"a"}  # behind since 10.0
    assert lag.update({"b"}, now=13.0) == frozenset()  # a caught up; b only 1.5 s behind
    assert lag.update({"a", "b"}, now=13.6) == {"b"}  # a is behind again: its grace starts anew


def progress(*stages: list[tuple[int | None, int, bool]]) -> list[list[PeerProgress]]:
    """Per stage, each peer's (step, samples held, averaging)."""
    return [[PeerProgress(f"p{k}{i}", step, samples, averaging) for i, (step, samples, averaging) in enumerate(peers)]
            for k, peers in enumerate(stages)]


def test_without_a_book_a_trainer_starts_what_the_stages_still_lack() -> None:
    # stages before the last step once they hold the target: what the fullest holds at its front, and
    # what is in flight, count against it; the last stage's samples do not (its backward is not step-checked)
    polled = progress([(3, 8, False), (3, 4, False), (2, 16, False)], [(3, 2, False)], [(3, 30, False)])
    assert pace_budget(polled, target=16, in_flight_samples=4, delay_updates=False) == 16 - 12 - 4
    assert pace_budget(polled, target=16, in_flight_samples=0, delay_updates=True) is None  # nothing to pace
    assert pace_budget(polled[:1], target=16, in_flight_samples=0, delay_updates=False) is None  # one stage
    silent = progress([(None, 0, False)], [(None, 0, False)])
    assert pace_budget(silent, target=16, in_flight_samples=8, delay_updates=False) == 8


@pytest.mark.parametrize(("later", "pending"), [
    ([(4, 16, False)], True),  # holds the full batch of step 4, round not started: the new step's must wait
    ([(4, 16, True)], False),  # its round is under way: the samples are taken out
    ([(4, 8, False), (4, 8, False)], True),  # held together by two peers
    ([(4, 8, False), (4, 4, False)], False),  # short of the target: nothing to slip into
    ([(5, 16, False)], False),  # stepped already
    ([(None, 16, False)], False),  # silent: nothing known
])
def test_a_new_steps_microbatches_wait_while_a_later_stage_holds_the_step_before(
        later: list[tuple[int | None, int, bool]], pending: bool) -> None:
    assert rounds_pending(progress([(5, 0, False)], later), step=5, target=16) is pending


@pytest.mark.parametrize(("first", "later", "reach"), [
    # the later stage got its samples first (every backward reaches it before the first stage): it steps too
    ([(5, 12, False)], [(5, 16, False)], 6),
    ([(5, 16, False)], [(6, 0, False)], 6),  # stepped already
    ([(5, 16, True)], [(5, 16, True)], 6),  # both in their rounds
    # a batch behind (a convicted peer's samples were dropped): the work leased already takes it one step, not two
    ([(5, 12, False)], [(4, 12, False)], 5),
    # the first stage's samples are out for its round (it says 0): all of step 5 may still come, so wait as before
    ([(5, 0, True)], [(4, 16, True)], 6),
    # the first stage holds the whole step: nothing more comes, and a later stage short of a batch stays
    ([(5, 16, False)], [(5, 8, False)], 5),
    ([(5, 16, False)], [(4, 8, False), (4, 4, False)], 4),
    ([(5, 16, False)], [(5, 8, False), (5, 8, False)], 6),  # held together by two peers: it steps
    ([(5, 16, False)], [(5, 4, True)], 6),  # in its round: it steps once more
    ([(5, 16, False)], [(None, 0, False)], 6),  # silent: nothing known to wait less for
    ([(4, 16, False)], [(3, 0, False)], 6),  # the first stage is not at the book's step: the book's next step
])
def test_a_long_poll_waits_for_each_later_stage_only_as_far_as_the_leased_work_takes_it(
        first: list[tuple[int | None, int, bool]], later: list[tuple[int | None, int, bool]], reach: int) -> None:
    assert reachable_steps(progress(first, later), step=5, target=16) == [6, reach]


def test_a_peer_most_of_its_stage_excludes_holds_nothing_the_stage_steps_on() -> None:
    # the liar's 8 samples do not count: its mates left it out of their rounds (and the trainers, out of their routes)
    polled = progress([(5, 16, False)], [(5, 4, False), (5, 4, False), (5, 8, False)])
    polled[1][:2] = [dataclasses.replace(answer, excluded=("p12",)) for answer in polled[1][:2]]
    assert reachable_steps(polled, step=5, target=16) == [6, 5]
    assert reachable_steps(progress([(5, 16, False)], [(5, 4, False), (5, 4, False), (5, 8, False)]),
                           step=5, target=16) == [6, 6]
