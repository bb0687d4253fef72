"""Newcomers that start at once: stage claims, taken in turn.

A newcomer with ``--stage auto`` joins the stage that needs it most (SWARM, section 3.3: a
pipeline runs at the speed of its slowest stage; ``swarmd.pipeline.placement.rebalance.choose_stage_for``).
Alone, that is enough. But peers started at the same moment (the README's three commands, a
fleet booted together) all read the same empty swarm before any of them is listed, and all pick
stage 0; the rebalancer could fix that only once they serve, after every one of them downloaded
a stage it should not have.

So a newcomer *claims* before it builds anything: it announces a ``joining`` record with the time
it claimed (``PeerRecord.claimed_at``) and no data address yet, waits a moment for the other
claims to land in the DHT, reads the swarm again and takes its turn. The claimants are put in
order by ``(claimed_at, peer_id)``, and each one's stage is the policy's choice over the *settled*
peers (everyone who is not a claimant) plus the claimants before it, at the stages *their* turns
gave them. Every newcomer computes the whole sequence itself from the same records (pure:
:func:`take_turns`), so they agree without talking and never wait for each other to re-announce.
A stopped swarm restarted together should come back from its own disks, so state goes first: a
stage no settled peer serves goes to the first claimant (in that order) that holds a checkpoint of
it, before anyone chooses by need; and a claimant that holds checkpoints prefers, among stages that
need it equally, one it holds. (By need alone, a claimant holding stage 0 would take an empty stage
1 that a later claimant holds, leaving that one on stage 0 and stage 1's state on a disk nobody reads.)

A peer is a claimant while its record is ``joining``, carries ``claimed_at`` and has no data
address: once it has started its data plane its stage is settled, and it counts as any peer
does. A claimant that dies while claiming is a ghost for one record lifetime at most; the
rebalancer's coverage rule fills whatever gap that leaves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmd.pipeline.placement.rebalance import DEFAULT_POLICY, PeerLoad, SwarmSnapshot, choose_stage_for

if TYPE_CHECKING:
    from swarmd.dht.records import PeerRecord

__all__ = ["CLAIM_WAIT_S", "Claim", "claims_of", "is_claim", "settled_loads", "take_turns"]

#: How long a claimant waits after announcing its claim before it reads the others' (seconds; a
#: DHT store is one round trip to the replicas, so this covers claims sent at the same moment).
CLAIM_WAIT_S = 1.0


@dataclass(frozen=True)
class Claim:
    """A newcomer still choosing its stage."""

    peer_id: str
    claimed_at: float
    holds: frozenset[int] = frozenset()  # stages it holds checkpoints of: preferred among equals


def is_claim(record: PeerRecord) -> bool:
    return record.state == "joining" and record.claimed_at is not None and not record.data_addr


def claims_of(records: Iterable[PeerRecord]) -> list[Claim]:
    """The claimants among ``records``."""
    return [Claim(r.peer_id, r.claimed_at, frozenset(s for s, _ in r.held))
            for r in records if is_claim(r) and r.claimed_at is not None]


def settled_loads(records: Iterable[PeerRecord]) -> list[PeerLoad]:
    """Every listed peer that is not a claimant, as the rebalancing policies see peers (a peer nobody
    can dial is no capacity)."""
    return [PeerLoad(r.peer_id, r.stage, r.state, r.throughput, r.queue)
            for r in records if not is_claim(r) and r.listed and r.reachable != "no"]


def take_turns(n_stages: int, settled: Sequence[PeerLoad], claims: Iterable[Claim], *,
               policy: str = DEFAULT_POLICY, now: float = 0.0) -> dict[str, int]:
    """Each claimant's stage (peer id -> stage): first, in ``(claimed_at, peer_id)`` order, each claimant
    that holds a checkpoint of a stage nobody covers yet takes it; then the others, in the same order,
    each choosing over the settled peers and the claimants before it (pure; the same records give
    every reader the same answer)."""
    peers = list(settled)
    taken = {p.peer_id for p in peers}
    out: dict[str, int] = {}
    in_turn = sorted(claims, key=lambda c: (c.claimed_at, c.peer_id))
    covered = {p.stage for p in peers}
    for claim in in_turn:  # state first: an uncovered stage goes to the first claimant that holds it
        if claim.peer_id in taken:
            continue
        mine = sorted(s for s in claim.holds if 0 <= s < n_stages and s not in covered)
        if mine:
            out[claim.peer_id] = mine[0]
            covered.add(mine[0])
            peers.append(PeerLoad(claim.peer_id, mine[0], "joining", 0.0))
            taken.add(claim.peer_id)
    for claim in in_turn:  # then need
        if claim.peer_id in taken:
            continue
        snapshot = SwarmSnapshot(n_stages, tuple(peers), now)
        stage = choose_stage_for(snapshot, 0.0, policy, prefer=claim.holds)
        out[claim.peer_id] = stage
        peers.append(PeerLoad(claim.peer_id, stage, "joining", 0.0))
        taken.add(claim.peer_id)
    return out
