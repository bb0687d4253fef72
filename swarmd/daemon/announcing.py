"""What this peer tells the swarm about itself, and what it reads back about every stage.

SWARM peers find each other through the DHT (paper, section 3.2): each announces which stage it
serves, its state and load every announce period, in a signed record that expires when it stops
announcing (``swarmd.dht.records``). The announcer builds that record from the daemon's state,
publishes it (and its copy of the swarm record) every period, withdraws it on a graceful stop (a
``stopped`` record, so every view drops the peer at once), keeps the stage's list of stage-mates
for the averaging rounds, and sums up every stage's health from what it reads
(``swarmd.pipeline.placement.coverage``): a stage without a peer, or with one, is a warning with what to
do.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from swarmd import __version__
from swarmd.dht.records import MAX_HELD, PeerRecord
from swarmd.errors import SwarmdError
from swarmd.net.addresses import format_addr
from swarmd.peer_state import PeerState
from swarmd.pipeline.placement.coverage import StageHealth, stage_health

if TYPE_CHECKING:
    from swarmd.daemon.host import Host
    from swarmd.daemon.joining import Joining
    from swarmd.daemon.relaying import Relaying
    from swarmd.daemon.stage_state import StageState

__all__ = ["ANNOUNCE_TASK", "Announcer", "random_jitter"]

log = logging.getLogger(__name__)

ANNOUNCE_TASK = "announce"


def random_jitter() -> float:
    """A factor in [0.9, 1.1]: periodic loops of many peers do not fall into step."""
    return random.uniform(0.9, 1.1)


class Announcer:
    """Publishes this peer's record and reads the swarm's stages back."""

    def __init__(self, host: Host, *, joining: Joining, stage_state: StageState, relaying: Relaying) -> None:
        self.host = host
        self.joining = joining
        self.stage_state = stage_state
        self.relaying = relaying
        self.announcements = 0  # successful record publications, for /status and tests
        self.coverage: list[StageHealth] = []  # every stage's health, refreshed every announce period
        self._coverage_said: dict[int, str] = {}  # the health last logged per stage
        self._mates_cache: tuple[float, dict[str, str], int] | None = None  # (when read, mates, stage)
        self._mates_reads = 0  # reads of the stage's listing in flight

    def record(self, state: PeerState | None = None) -> PeerRecord:
        """This peer's record now (``state``: another than the daemon's, e.g. ``stopped``)."""
        host = self.host
        assert host.identity is not None and host.stage is not None  # a stage is chosen before announcing
        ex = host.executor
        now = time.time()
        stage = host.stage
        state = state or host.state
        if state == PeerState.STARTING:
            state = PeerState.JOINING  # a stage chosen, nothing built yet: a claim (swarmd.pipeline.placement.claims)
        throughput = ex.throughput if ex else 0.0
        target = host.migrator.target
        if host.state == PeerState.MIGRATING and target is not None:
            stage = target  # a mover is capacity on its way to its new stage, not on its old one
        if throughput == 0.0 and host.migrator.last_throughput:
            throughput = host.migrator.last_throughput  # freshly moved or joined: an estimate until measured
        checkpoints = self.stage_state.checkpoints
        return PeerRecord(
            peer_id=host.identity.peer_id,
            stage=stage,
            state=state.value,
            data_addr=host.data_addr or "",
            api_addr=format_addr(host.api_addr) or "",
            throughput=throughput,
            queue=ex.queue if ex else 0,
            step=ex.step if ex else 0,
            params_digest=ex.digest if ex else None,
            version=__version__,
            timestamp=now,
            expiry=now + host.config.dht.record_ttl_s,
            reachable=host.reachability.status,
            checkpoint=checkpoints.newest_step(stage) if checkpoints is not None else None,
            claimed_at=self.joining.claimed_at if host.state == PeerState.STARTING else None,
            held=self.stage_state.held(MAX_HELD),
        )

    async def announce(self) -> None:
        """Publish this peer's record (state, stage, load, addresses) to the DHT now."""
        host = self.host
        assert host.membership is not None  # joined the DHT
        accepted = await host.membership.announce(self.record())
        self.announcements += 1
        log.debug("announced %s on stage %s to %d DHT node(s)", host.state, host.stage, accepted)

    async def announce_quietly(self) -> None:
        """Announce now; a DHT that refuses is a warning (the announce loop tries again)."""
        try:
            await self.announce()
        except SwarmdError as exc:
            log.warning("could not announce this peer's stage: %s", exc)

    async def run(self) -> None:
        """Every announce period: refresh this peer's record, its copy of the swarm record and the stages'
        health, and ask for its reachability again while nobody has said."""
        host = self.host
        assert host.membership is not None and host.spec is not None  # started once serving
        period = host.config.dht.announce_period_s
        while True:
            await asyncio.sleep(period * random_jitter())
            try:
                await self.joining.relearn_address()
                await self.announce()
                await host.membership.publish_swarm(host.spec, host.training.to_dict())
                await self.refresh_coverage()
                self.relaying.check_later()
            except SwarmdError as exc:
                log.warning("could not refresh this peer's DHT records: %s", exc)

    async def withdraw(self) -> None:
        """Replace this peer's record with a ``stopped`` one, so every view drops it now rather than
        when the record expires (a crash still leaves it to expire)."""
        host = self.host
        if host.membership is None or host.identity is None or host.stage is None:
            return
        try:
            await asyncio.wait_for(host.membership.announce(self.record(state=PeerState.STOPPED)), 3.0)
        except (SwarmdError, asyncio.TimeoutError) as exc:
            log.warning("could not withdraw this peer's record (it expires within %.0fs): %s",
                        host.config.dht.record_ttl_s, exc or "timed out")

    async def refresh_coverage(self) -> None:
        """Sum up every stage's health from the swarm's records (``swarmd.pipeline.placement.coverage``); a stage that
        turns empty, thin or lost is a warning with what to do, one that recovers a line saying so."""
        host = self.host
        assert host.membership is not None and host.spec is not None
        records = await host.membership.all_peers(host.spec.n_stages)
        checkpoints = self.stage_state.checkpoints
        held = checkpoints.held if checkpoints is not None else None
        healths = stage_health(host.spec.n_stages, records, now=time.time(), held_here=held)
        before = {h.stage: h.health for h in self.coverage}
        for h in healths:
            # said once a health held for two refreshes in a row: records of peers starting at the same moment
            # take an announce period to appear, and a founder restarted first is not a lost stage
            said = self._coverage_said.get(h.stage, "ok")
            if h.health == said or before.get(h.stage) != h.health:
                continue
            self._coverage_said[h.stage] = h.health
            if h.health == "ok":
                log.info("stage %d is covered again (%d peers serve it)", h.stage, h.serving)
            elif h.health != "starting":
                log.warning("stage %d is %s: %s", h.stage, h.health, h.hint)
        self.coverage = healths

    async def stage_mates(self, max_age_s: float = 1.0, *, fresh: bool = False) -> dict[str, str]:
        """Serving peers of this stage (peer_id -> data_addr), this one included, cached briefly
        (``fresh``: read now). The cache's age counts from when a read answered, and a cached answer
        older than ``max_age_s`` is still taken while another read is under way: on a long link a DHT
        lookup takes longer than the cache lasts, and a lone peer keeps one going in the background
        (``swarmd.pipeline.averaging.round``), which the averaging loop must not wait on again."""
        host = self.host
        assert host.dht is not None and host.stage is not None  # only called while averaging
        stage = host.stage
        cached = self._mates_cache
        if not fresh and cached is not None and cached[2] == stage and (
                time.monotonic() - cached[0] <= max_age_s or self._mates_reads):
            return dict(cached[1])
        self._mates_reads += 1
        try:
            records = await host.dht.get_stage_peers(host.config.swarm, stage)
        finally:
            self._mates_reads -= 1
        # this peer, and the stage-mates the others can dial (an unreachable one cannot take part)
        mates = {pid: r.data_addr for pid, r in records.items()
                 if r.state == "serving" and (r.usable or pid == host.peer_id)}
        self._mates_cache = (time.monotonic(), mates, stage)
        return dict(mates)

    def forget_stage_mates(self) -> None:
        self._mates_cache = None
