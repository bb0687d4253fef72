"""swarmd.pipeline.placement.claims: newcomers that start at once take their stages in turn (pure)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.dht.records import PeerRecord
from swarmd.pipeline.placement.claims import Claim, claims_of, is_claim, settled_loads, take_turns
from swarmd.pipeline.placement.rebalance import POLICIES, PeerLoad

NOW = 1_000_000.0


def record(pid: str, stage: int, state: str = "serving", *, addr: str = "127.0.0.1:1", claimed_at: float | None = None,
           held: tuple[tuple[int, int], ...] = (), throughput: float = 0.0) -> PeerRecord:
    return PeerRecord(peer_id=pid * 40 if len(pid) == 1 else pid, stage=stage, state=state, data_addr=addr, api_addr="",
                      throughput=throughput, queue=0, step=0, params_digest=None, version="t", timestamp=NOW,
                      expiry=NOW + 30, claimed_at=claimed_at, held=held)


def test_three_peers_started_at_once_cover_both_stages() -> None:
    # the README's three commands: the founder names stage 0, two joiners claim at the same moment
    founder = record("a", 0, "joining", addr="")  # announced as soon as its stage was chosen
    b = record("b", 0, "joining", addr="", claimed_at=NOW)
    c = record("c", 0, "joining", addr="", claimed_at=NOW + 0.001)
    records = [founder, b, c]
    turns = take_turns(2, settled_loads(records), claims_of(records))
    assert turns == {b.peer_id: 1, c.peer_id: 0}
    # the founder not listed yet when they read: they still spread over the stages
    turns = take_turns(2, settled_loads([b, c]), claims_of([b, c]))
    assert sorted(turns.values()) == [0, 1]


def test_a_claimant_that_started_its_data_plane_is_settled_and_counts_as_any_peer() -> None:
    settled = record("b", 1, "joining", addr="127.0.0.1:5", claimed_at=NOW)
    claim = record("c", 0, "joining", addr="", claimed_at=NOW + 1)
    assert not is_claim(settled) and is_claim(claim)
    assert [p.peer_id for p in settled_loads([settled, claim])] == [settled.peer_id]
    assert take_turns(2, settled_loads([settled, claim]), claims_of([settled, claim])) == {claim.peer_id: 0}


def test_a_claimant_prefers_a_stage_it_holds_among_those_that_need_it_as_much() -> None:
    b = record("b", 0, "joining", addr="", claimed_at=NOW, held=((1, 350),))
    c = record("c", 0, "joining", addr="", claimed_at=NOW + 1, held=((0, 350), (1, 300)))
    turns = take_turns(2, [], claims_of([b, c]))
    assert turns == {b.peer_id: 1, c.peer_id: 0}
    # a preference never beats need: a stage with a serving peer is not taken over an empty one
    serving = record("f", 1)
    turns = take_turns(2, settled_loads([serving]), claims_of([b]))
    assert turns == {b.peer_id: 0}


def test_a_swarm_restarted_together_comes_back_from_its_own_disks() -> None:
    # the README's three peers restarted with the same commands: the founder names stage 0 again, the
    # joiner that held stage 0 claims first; by need alone it would take empty stage 1 and leave stage 1's
    # holder on stage 0, with stage 1's state on a disk nobody reads
    founder = record("a", 0, "joining", addr="", held=((0, 50),))
    b = record("b", 0, "joining", addr="", claimed_at=NOW, held=((0, 50),))
    c = record("c", 0, "joining", addr="", claimed_at=NOW + 0.5, held=((1, 50),))
    records = [founder, b, c]
    assert take_turns(2, settled_loads(records), claims_of(records)) == {b.peer_id: 0, c.peer_id: 1}
    # two holders of one uncovered stage: the first in turn takes it, the other goes where it is needed
    d = record("d", 0, "joining", addr="", claimed_at=NOW + 1, held=((1, 40),))
    turns = take_turns(3, settled_loads([founder]), claims_of([c, d]))
    assert turns == {c.peer_id: 1, d.peer_id: 2}


def test_stopped_and_unreachable_peers_are_no_capacity() -> None:
    gone = record("d", 0, "stopped")
    unreachable = replace(record("e", 0), reachable="no")
    assert settled_loads([gone, unreachable, record("f", 1)]) == [PeerLoad("f" * 40, 1, "serving", 0.0)]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[int, list[PeerLoad], list[Claim]]:
    n = draw(st.integers(1, 4))
    settled = [PeerLoad(f"s{i}", draw(st.integers(0, n - 1)), draw(st.sampled_from(["serving", "joining"])),
                        draw(st.sampled_from([0.0, 1.0, 3.0]))) for i in range(draw(st.integers(0, 6)))]
    claims = [Claim(f"c{i}", draw(st.sampled_from([NOW, NOW + 1, NOW + 2])),
                    frozenset(draw(st.sets(st.integers(0, n - 1), max_size=2))))
              for i in range(draw(st.integers(0, 8)))]
    return n, settled, claims


@settings(max_examples=200, deadline=None)
@given(fleets(), st.randoms(use_true_random=False), st.sampled_from(sorted(POLICIES)))
def test_every_reader_agrees_whatever_order_it_read_the_records_in(fleet: tuple[int, list[PeerLoad], list[Claim]],
                                                                   rnd: random.Random, policy: str) -> None:
    n, settled, claims = fleet
    turns = take_turns(n, settled, claims, policy=policy)
    shuffled_settled, shuffled_claims = list(settled), list(claims)
    rnd.shuffle(shuffled_settled)
    rnd.shuffle(shuffled_claims)
    assert take_turns(n, shuffled_settled, shuffled_claims, policy=policy) == turns
    assert set(turns) == {c.peer_id for c in claims}
    # enough newcomers cover every stage (each turn goes to an uncovered stage while there is one)
    covered = {p.stage for p in settled} | set(turns.values())
    if len(claims) >= n - len({p.stage for p in settled}):
        assert covered == set(range(n))


def test_newcomers_spread_evenly_over_empty_stages() -> None:
    claims = [Claim(f"c{i}", NOW + i) for i in range(8)]
    turns = take_turns(4, [], claims)
    counts = [sum(1 for s in turns.values() if s == k) for k in range(4)]
    assert counts == [2, 2, 2, 2]
    assert [turns[f"c{i}"] for i in range(4)] == [0, 1, 2, 3]
    assert list(itertools.islice(turns.values(), 4, 8)) == [0, 1, 2, 3]
