"""Trainers' ranks, unique across the swarm: which shard of the data each trainer draws from.

A trainer draws its training windows from the shard of its rank (``swarmd.train.data``), so
that trainers of one swarm draw different data. A daemon used to hand out ranks among its own
trainers only: two trainers registered at two daemons were both rank 0 and, with the default
seed, drew the same windows, so every sample was trained twice an epoch. So every daemon
publishes the ranks its trainers hold (a signed :class:`~swarmd.dht.records.RanksRecord` under
the swarm's ranks key, refreshed every announce period and expiring with its trainers) and
gives a new trainer the smallest rank no trainer of the swarm holds. Two daemons that claim the
same rank at the same moment see each other's claim a moment later: the earlier claim (by
``(claimed_at, daemon id)``, :func:`lost`) keeps it, the other moves on to the next free rank
before its trainer is told. A daemon that dies takes its claims with it when its record expires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from swarmd.dht.keys import KEY_PREFIX
from swarmd.dht.records import MAX_RANKS, RanksRecord, sign_record
from swarmd.errors import SwarmdError

if TYPE_CHECKING:
    from swarmd.api.trainers import Registration, TrainerRegistry
    from swarmd.dht.identity import Identity
    from swarmd.dht.node import DHTNode

__all__ = ["RankBook", "free_rank", "lost", "ranks_key"]

log = logging.getLogger(__name__)

SETTLE_S = 0.3  # how long a claim is left to land before it is checked against others' (a DHT round trip)
ATTEMPTS = 5


def ranks_key(swarm: str) -> str:
    """The DHT key under which every daemon of ``swarm`` publishes its trainers' ranks."""
    return f"{KEY_PREFIX}/{swarm}/ranks"


def free_rank(taken: Collection[int]) -> int:
    """The smallest rank not in ``taken``."""
    return next(i for i in range(len(taken) + 1) if i not in taken)


def lost(mine: Mapping[int, float], me: str, others: Iterable[RanksRecord]) -> set[int]:
    """The ranks of ``mine`` (rank -> claimed_at) that another daemon claimed first (ties: the smaller
    daemon id): they are that daemon's, and this one's trainers must move."""
    out = set()
    for record in others:
        if record.peer_id == me:
            continue
        for rank, claimed_at in record.ranks:
            if rank in mine and (claimed_at, record.peer_id) < (mine[rank], me):
                out.add(rank)
    return out


class RankBook:
    """Publishes this daemon's trainers' ranks and hands out new ones, unique across the swarm."""

    def __init__(self, registry: TrainerRegistry, *, dht: Callable[[], DHTNode | None],
                 identity: Callable[[], Identity | None], swarm: str, ttl_s: float, settle_s: float = SETTLE_S) -> None:
        self.registry = registry
        self._dht = dht
        self._identity = identity
        self.key = ranks_key(swarm)
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.reassigned = 0  # claims that lost to another daemon's and moved
        self._published = False

    async def others(self) -> list[RanksRecord]:
        """Every other daemon's live ranks record."""
        dht, identity = self._dht(), self._identity()
        if dht is None or identity is None:
            return []
        found = await dht.get(self.key)
        return [r for r in found.values() if isinstance(r, RanksRecord) and r.peer_id != identity.peer_id]

    async def publish(self) -> None:
        """Store this daemon's ranks (an empty record once, when its last trainer went)."""
        dht, identity = self._dht(), self._identity()
        if dht is None or identity is None:
            return
        held = self.registry.ranks()
        if not held and not self._published:
            return
        now = time.time()
        ranks = tuple(sorted(held.items()))[:MAX_RANKS]
        await dht.store(self.key, sign_record(identity, RanksRecord(identity.peer_id, ranks, now, now + self.ttl_s)))
        self._published = bool(held)

    async def assign(self, registration: Registration) -> int:
        """Give ``registration`` the smallest rank no trainer of the swarm holds, and claim it."""
        identity = self._identity()
        if identity is None:
            return registration.rank
        try:
            for _ in range(ATTEMPTS):
                others = await self.others()
                taken = {rank for record in others for rank, _ in record.ranks}
                # this daemon's other trainers' ranks as they are now: no await between reading and setting, so
                # registrations here at the same moment never take one rank
                taken |= set(self.registry.ranks(exclude=registration.trainer_id))
                self.registry.set_rank(registration.trainer_id, free_rank(taken), time.time())
                await self.publish()
                await asyncio.sleep(self.settle_s)
                mine = {registration.rank: registration.rank_claimed_at}
                if not lost(mine, identity.peer_id, await self.others()):
                    return registration.rank
                self.reassigned += 1
                log.info("rank %d was claimed first by another daemon's trainer: choosing again", registration.rank)
        except SwarmdError as exc:
            log.warning("could not check trainer ranks across the swarm (%s): rank %d is unique among this "
                        "daemon's trainers only", exc, registration.rank)
        return registration.rank
