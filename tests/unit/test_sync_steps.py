"""A sync step's wait, decided from one progress poll (swarmd.train.sync_steps.assess): who is still
waited for, how short a stage is, whether it is stuck, and whom not to wait for any more."""

from __future__ import annotations

from swarmd.train.swarm_client import PeerProgress
from swarmd.train.sync_steps import LeftBehind, Standing, assess

TARGET = 12


def p(peer_id: str, step: int | None, samples: int = 0, *, averaging: bool = False,
      excluded: tuple[str, ...] = (), digest: str = "d") -> PeerProgress:
    return PeerProgress(peer_id, step, samples, averaging, excluded=excluded, params_digest=digest)


def test_every_peer_at_the_step_is_nothing_to_wait_for() -> None:
    standing = assess([[p("a", 1), p("b", 2)], [p("c", 1)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert standing == Standing(lagging=(), missing=0, stuck=False, refused=False)


def test_a_silent_peer_is_waited_for_and_a_short_stage_says_how_short() -> None:
    standing = assess([[p("a", 1)], [p("b", 0, 4), p("c", None)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert standing.lagging == ((1, "b", 0), (1, "c", None))
    assert standing.missing == TARGET - 4 and not standing.stuck and not standing.refused


def test_a_stage_that_holds_the_batch_without_stepping_is_stuck_and_one_averaging_is_neither() -> None:
    stuck = assess([[p("a", 0, 8), p("b", 0, 4)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert stuck.stuck and stuck.missing == 0
    busy = assess([[p("a", 0, 8, averaging=True), p("b", 0, 4)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert not busy.stuck and busy.missing == 0 and len(busy.lagging) == 2


def test_a_distrusted_peer_counts_neither_its_samples_nor_its_step() -> None:
    # its leader refused z's poisoned work: z's 4 samples are not the stage's, and it is not waited for
    polled = [[p("a", 0, 4, excluded=("z",)), p("b", 0, 4), p("z", 0, 4)]]
    standing = assess(polled, 1, TARGET, LeftBehind(30.0), now=0.0)
    assert standing.missing == TARGET - 8 and standing.refused
    assert [peer for _, peer, _ in standing.lagging] == ["a", "b"]
    # a refused leader that stepped alone on its own lie (a fork) does not make the stage look stepped
    forked = [[p("L", 1, digest="x"), p("a", 0, 4, excluded=("L",)), p("b", 0, 4, excluded=("L",))]]
    assert assess(forked, 1, TARGET, LeftBehind(30.0), now=0.0).missing == TARGET - 8


def test_a_peer_most_of_its_stage_left_behind_is_waited_for_only_a_grace() -> None:
    left = LeftBehind(grace_s=30.0)
    polled = [[p("a", 1), p("b", 1), p("z", 0)]]
    assert assess(polled, 1, TARGET, left, now=100.0).lagging == ((0, "z", 0),)
    assert assess(polled, 1, TARGET, left, now=130.0).lagging == ((0, "z", 0),)  # the grace is not over
    assert assess(polled, 1, TARGET, left, now=130.5).lagging == ()
    assert left.late(130.5) == ["z"] and left.late(120.0) == []
    # half of a stage behind is no majority past it: both waited for, however long
    even = LeftBehind(grace_s=30.0)
    half = [[p("a", 1), p("z", 0)]]
    assert assess(half, 1, TARGET, even, now=0.0).lagging == assess(half, 1, TARGET, even, now=1e6).lagging
