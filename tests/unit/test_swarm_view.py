"""The trainer's view of the swarm (swarmd.train.swarm_view): the /swarm listing, typed for the routers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from swarmd.api.models import SwarmView
from swarmd.peer_state import PeerState
from swarmd.pipeline.routing import PeerView, StageRouter
from swarmd.train import swarm_view
from swarmd.train.swarm_client import PeerProgress, TrainerError
from swarmd.train.swarm_view import Exclusions, exclusions_of, front_step, peer_views, poll_targets
from swarmd.train.timing import Timing
from tests.support.routing import peer


def body(*stages: list[dict[str, Any]]) -> SwarmView:
    """A ``GET /swarm`` body listing ``stages`` (each a list of peers: ``peer_id``, ``state``, ...)."""

    def peer(p: dict[str, Any]) -> dict[str, Any]:
        return {"data_addr": f"{p['peer_id']}:1", "api_addr": "x:2", "throughput": 1.0, "queue": 0, "step": 0,
                "params_digest": None, "version": "0", "age_s": 0.1, "state": "serving", **p}

    return SwarmView.model_validate({
        "swarm": "s", "model": {"name": "m", "digest": "d", "spec": {}}, "training": {}, "dht": {},
        "stages": [{"stage": k, "throughput": 1.0, "peers": [peer(p) for p in peers]} for k, peers in enumerate(stages)],
    })


def test_the_listing_becomes_typed_peers_and_unknown_values_do_not_break_it() -> None:
    views = peer_views(body(
        [{"peer_id": "a", "throughput": 3.5}, {"peer_id": "b", "state": "draining", "reachable": "yes"}],
        [{"peer_id": "c", "reachable": "no"}, {"peer_id": "d", "state": "hibernating"},  # a newer peer's state
         {"peer_id": "e", "reachable": "sometimes"}],
    ))
    assert views == {
        0: [PeerView("a", 0, "a:1", PeerState.SERVING, "unknown", 3.5),
            PeerView("b", 0, "b:1", PeerState.DRAINING, "yes", 1.0)],
        1: [PeerView("c", 1, "c:1", PeerState.SERVING, "no", 1.0), PeerView("e", 1, "e:1", PeerState.SERVING, "unknown", 1.0)],
    }
    assert [p.usable for p in views[0] + views[1]] == [True, False, False, True]
    router = StageRouter(1)
    router.update_peers(views[1])
    assert [p.peer_id for p in router.snapshot()] == ["e"]  # the unreachable one is listed, never routed to


def answer(peer_id: str, step: int | None, *excluded: str, digest: str = "d") -> PeerProgress:
    return PeerProgress(peer_id, step, excluded=excluded, params_digest=digest)


def test_the_swarm_is_at_its_slowest_stages_most_advanced_peer_not_a_liars_step() -> None:
    assert front_step([[answer("a", 3), answer("b", 5)], [answer("c", 4)]]) == 4
    assert front_step([[answer("a", 3)], [answer("c", None)]]) == 0  # a stage nobody answered for: unknown
    assert front_step([]) == 0
    # a refused leader stepped alone on its own lie: most of its stage excludes it, or it is a fork
    lied = [[answer("L", 6, digest="x"), answer("a", 5, "L"), answer("b", 5, "L")], [answer("c", 9)]]
    assert front_step(lied) == 5
    forked = [[answer("L", 5, digest="x"), answer("a", 5), answer("b", 5), answer("c", 4)]]
    assert front_step(forked) == 5  # the honest peers are at 5 too


def test_exclusions_by_the_swarm_by_the_stage_and_forks() -> None:
    polled = [
        [answer("a", 1, "x", "s"), answer("b", 1, "x", "s"), answer("s", 1)],
        [answer("x", 1), answer("d", 1, "x"), answer("f", 1, digest="other"), answer("e", 1, "q")],
    ]
    stage0, stage1 = exclusions_of(polled)
    # s: two of its stage's three; x: three of the seven answering peers, no swarm-wide majority
    assert stage0 == Exclusions(swarm_wide=frozenset(), by_stage=frozenset({"s", "x"}), forked=frozenset())
    assert stage1.by_stage == frozenset() and stage1.forked == {"f"} and stage1.all == {"f"}
    assert stage1.reasons(frozenset({"f"})) == "another params digest than most of its stage: a fork"
    everyone = [[answer("a", 1, "x"), answer("b", 1, "x")], [answer("x", 1), answer("c", 1, "x")]]
    assert all(e.swarm_wide == {"x"} for e in exclusions_of(everyone))
    assert exclusions_of([[answer("a", None, "x"), answer("b", None, "x")]])[0].all == frozenset()  # silent: no word


def test_a_poll_asks_the_peers_not_excluded_and_not_banned_unless_they_answered_before() -> None:
    peers = [peer("a", proven=True, banned_for_s=1.0), peer("b", banned_for_s=30.0), peer("c"),
             peer("d", proven=True, excluded=True), replace(peer("e"), alive=True)]
    assert [p.peer_id for p in poll_targets(peers)] == ["a", "c", "e"]


async def test_a_run_counts_its_steps_from_a_swarm_step_every_stage_answered_for() -> None:
    """A resumed swarm at step 50 whose last stage's peer is still starting is not at step 0: the run waits
    for an answer from every stage (else every step's loss is booked at 50+ and the run looks at 0+)."""
    polls = [[[answer("a", 50)], [answer("c", None)]], [[answer("a", 50)], []], [[answer("a", 50)], [answer("c", 50)]]]

    class Resuming(swarm_view.SwarmView):
        async def poll(self, wait_step: int | None = None) -> list[list[PeerProgress]]:
            return polls.pop(0)

    view = Resuming(None, request_timeout_s=1.0, window=1, timing=Timing(no_peer_poll_s=0.001))  # type: ignore[arg-type]
    assert await view.swarm_step() == 50 and not polls
    polls[:] = [[[answer("a", 50)], []]] * 1000
    silent = Resuming(None, request_timeout_s=1.0, window=1,  # type: ignore[arg-type]
                      timing=Timing(no_peer_poll_s=0.001), stage_wait_timeout_s=0.01)
    with pytest.raises(TrainerError, match="stage 1 has had no peer that answers for 0s; giving up"):
        await silent.swarm_step()


async def test_what_the_listing_announces_is_read_from_one_record_of_it() -> None:
    """``announced`` (the window's input: serving peers' own throughputs) and ``unreachable`` read the
    same record of the last ``/swarm``, and a new listing replaces all of it."""
    listings = [
        body([{"peer_id": "a", "throughput": 3.5}, {"peer_id": "b", "state": "draining", "throughput": 9.0}],
             [{"peer_id": "c", "reachable": "no", "throughput": 2.0}]),
        body([{"peer_id": "a", "throughput": 4.0}], []),
    ]

    class Listing:
        async def stage_map(self, *, force: bool = False) -> SwarmView:
            return listings.pop(0)

    view = swarm_view.SwarmView(Listing(), request_timeout_s=1.0, window=1, timing=Timing())  # type: ignore[arg-type]
    view.adopt(2)
    await view.refresh()
    assert view.announced(0) == [3.5] and view.announced(1) == [2.0] and view.announced(7) == []
    assert view.unreachable(0) == [] and view.unreachable(1) == ["c:1"]
    await view.refresh()
    assert view.announced(0) == [4.0] and view.announced(1) == [] and view.unreachable(1) == []


async def test_a_poll_says_which_listed_peers_some_peer_holds_one_report_against() -> None:
    """``suspected`` (the spot checks check those peers more: ``CheckLedger.watch``) is what this poll's
    answers named, of the peers listed: a name nobody lists is dropped, and a later poll replaces it."""
    answers = [[[PeerProgress("a", 3, suspected=("b", "nobody"))], [PeerProgress("c", 3)]],
               [[PeerProgress("a", 3)], [PeerProgress("c", 3)]]]

    class Swarm:
        async def stage_map(self, *, force: bool = False) -> SwarmView:
            return body([{"peer_id": "a"}, {"peer_id": "b"}], [{"peer_id": "c"}])

        def stage_map_due(self) -> bool:
            return False

        async def progress(self, stages: Any, **kw: Any) -> list[list[PeerProgress]]:
            return answers.pop(0)

    view = swarm_view.SwarmView(Swarm(), request_timeout_s=1.0, window=1, timing=Timing())  # type: ignore[arg-type]
    view.adopt(2)
    await view.refresh()
    assert view.suspected == frozenset()
    await view.poll()
    assert view.suspected == {"b"}
    await view.poll()
    assert view.suspected == frozenset()


async def test_a_poll_does_not_wait_for_the_stage_map_a_slow_daemon_is_still_reading() -> None:
    """``/swarm`` is a DHT lookup behind the daemon's control plane: seconds when a peer just died. A poll
    that awaited it stalled the trainer's loop for that long (its sample leases expired unrenewed). Now the
    poll asks the peers the routers list and the read goes on in the background, one at a time; its map is
    adopted when it comes, ``aclose`` cancels it, and a read that fails with a bug is raised by the next poll."""
    gate = asyncio.Event()
    reads: list[str] = []

    class SlowDaemon:
        due = True

        def stage_map_due(self) -> bool:
            return self.due

        async def stage_map(self, *, force: bool = False) -> SwarmView:
            reads.append("read")
            await gate.wait()
            self.due = False
            return body([{"peer_id": "a"}, {"peer_id": "b"}], [{"peer_id": "c"}])

        async def progress(self, stages: Any, **kw: Any) -> list[list[PeerProgress]]:
            return [[PeerProgress(pid, 1) for pid, _ in peers] for peers in stages]

    daemon = SlowDaemon()
    view = swarm_view.SwarmView(daemon, request_timeout_s=1.0, window=1, timing=Timing())  # type: ignore[arg-type]
    view.adopt(2)
    first = await asyncio.wait_for(view.poll(), 1.0)  # the read hangs; the poll does not
    second = await asyncio.wait_for(view.poll(), 1.0)
    assert first == second == [[], []] and reads == ["read"]  # one read under way, not one per poll
    gate.set()
    for _ in range(10):
        await asyncio.sleep(0)
    polled = await view.poll()
    assert [[p.peer_id for p in stage] for stage in polled] == [["a", "b"], ["c"]] and reads == ["read"]

    gate.clear()
    daemon.due = True
    await view.poll()
    await asyncio.sleep(0)  # the second read starts, and hangs
    await view.aclose()  # the read still out is cancelled and awaited
    assert reads == ["read", "read"] and view._refreshing is None

    class Broken(SlowDaemon):
        async def stage_map(self, *, force: bool = False) -> SwarmView:
            raise KeyError("a bug in reading the map")

    broken = swarm_view.SwarmView(Broken(), request_timeout_s=1.0, window=1, timing=Timing())  # type: ignore[arg-type]
    broken.adopt(2)
    await broken.poll()
    for _ in range(10):
        await asyncio.sleep(0)
    with pytest.raises(KeyError, match="a bug in reading the map"):
        await broken.poll()
