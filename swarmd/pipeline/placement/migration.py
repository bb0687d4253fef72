"""Migration: a live peer moves to another stage, by hand or because the rebalancer says so.

The SWARM paper's rebalancing (section 3.3, Algorithm 2) moves peers from the stage with the
most capacity to the one with the least. ``swarmd.pipeline.placement.rebalance`` decides *who* moves (pure
functions over a DHT snapshot); this module carries a move out and runs the loop that asks.

A move, one phase after the other (``MigrationPhase``, shown in ``/status`` as ``migration``):

1. ``starting``: checked (serving, not moving already, a stage that exists and is not this one,
   not the last peer of this stage unless forced) and started in the background;
2. ``draining``: state ``migrating`` is announced *on the destination stage* (a mover is
   capacity on its way there, not on the stage it leaves); the peer leaves its stage's rounds
   and the data plane pauses (new requests 503, in-flight ones finish);
3. ``building``: the destination stage's runtime is built off the loop;
4. ``downloading``: the destination's newest state is put into it, wherever it is
   (``swarmd.pipeline.placement.resume``: a live stage-mate, this peer's own checkpoint of it, another
   peer's offered checkpoint); only then is it swapped in with one assignment
   (``Daemon.runtime``), and the gradients accumulated for the old stage are dropped with the
   old one (counted in ``dropped_samples``); ``serving`` is announced and the peer takes part in
   rounds;
5. ``done``, or ``failed`` (the peer keeps serving the stage it had: a move never leaves it with
   fresh parameters) or ``cancelled`` (shutdown).

A move to a stage whose state is nowhere (a trained swarm, no live peer, no checkpoint offered)
is refused before it starts: serving it would restart that stage from step 0. The holders its
records name are challenged first (``swarmd.net.proof``): a record outlives a dead peer by up to
its lifetime, and only those that answer now count.

Every peer runs the same pure policy on (nearly) the same snapshot and moves only when a move
names it, so two peers never race for one move; a peer that moved waits ``cooldown_s`` before
it takes any other decision.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from swarmd.dht.sources import RateLimiter
from swarmd.errors import MigrationRefused, SwarmdError
from swarmd.peer_state import PeerState
from swarmd.pipeline.placement.rebalance import PeerLoad, SwarmSnapshot, empty_stages, get_policy
from swarmd.pipeline.placement.resume import Plan, Source

if TYPE_CHECKING:
    from swarmd.config import Config
    from swarmd.dht.membership import Membership
    from swarmd.pipeline.spec import ModelSpec
    from swarmd.pipeline.stage.runtime import StageRuntime

log = logging.getLogger(__name__)


class MigrationPhase(str, Enum):
    STARTING = "starting"
    DRAINING = "draining"
    BUILDING = "building"
    DOWNLOADING = "downloading"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


@dataclass
class MigrationStatus:
    """The last move between stages (``/status`` → ``migration``)."""

    src: int
    to: int
    reason: str
    phase: MigrationPhase = MigrationPhase.STARTING
    started_at: float = field(default_factory=time.time)
    error: str | None = None
    dropped_samples: int | None = None  # accumulated for the old stage when it was dropped
    duration_s: float | None = None  # from the start to done, failed or cancelled

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["from"] = d.pop("src")
        d["phase"] = self.phase.value
        return d


class MigrationHost(Protocol):
    """What a move needs from the daemon (``swarmd.daemon.Daemon`` implements it)."""

    config: Config
    state: PeerState
    runtime: StageRuntime | None
    spec: ModelSpec | None
    membership: Membership | None

    @property
    def peer_id(self) -> str | None: ...

    @property
    def stage(self) -> int | None: ...

    async def announce(self) -> None: ...

    def start_averaging(self) -> None: ...

    async def stop_averaging(self) -> None: ...

    async def pause_serving(self) -> None: ...

    def resume_serving(self) -> None: ...

    async def build_runtime(self, stage: int) -> StageRuntime: ...

    async def plan_state(self, stage: int, *, min_step: int = 0, confirm: bool = False) -> Plan: ...

    async def obtain_state(self, runtime: StageRuntime, *, wait: bool) -> Source: ...

    def spawn(self, name: str, factory: Any, *, restart: bool = False) -> asyncio.Task[None]: ...

    @property
    def last_sync_s(self) -> float | None: ...


class Migrator:
    """Moves its host between stages (one move at a time) and runs the rebalancing loop."""

    TASK = "migration"

    def __init__(self, host: MigrationHost) -> None:
        self.host = host
        self.status: MigrationStatus | None = None  # the last move, for /status
        self.moving = False
        self.moved_at = -math.inf  # monotonic time of the last finished move
        self.last_throughput = 0.0  # measured on the stage the host left, announced until re-measured
        # moves by how they ended (done, failed, cancelled) and requests refused: ``swarmd_migrations_total``
        self.results: Counter[str] = Counter()
        self._refusals = RateLimiter(60.0)  # one log line a minute per reason a wanted move could not happen

    @property
    def target(self) -> int | None:
        """The stage a move in progress goes to (the host announces it there)."""
        return self.status.to if self.moving and self.status is not None else None

    async def stage_peer_count(self, stage: int) -> int:
        """Serving peers of ``stage`` other than the host, as the DHT shows them now."""
        host = self.host
        assert host.membership is not None and host.spec is not None  # only called once serving
        stages = await host.membership.stage_peers(host.spec.n_stages)
        return sum(1 for pid, r in stages[stage].items() if pid != host.peer_id and r.usable)

    async def request(self, stage: int, *, force: bool = False, reason: str = "by hand") -> dict[str, Any]:
        """Check a move to ``stage`` and start it in the background; MigrationRefused says why not."""
        try:
            return await self._request(stage, force=force, reason=reason)
        except MigrationRefused:
            self.results["refused"] += 1
            raise

    async def _request(self, stage: int, *, force: bool, reason: str) -> dict[str, Any]:
        host = self.host
        if host.state != PeerState.SERVING or self.moving or host.spec is None or host.stage is None:
            raise MigrationRefused(f"this peer is {host.state}; it can move only while serving")
        spec, src = host.spec, host.stage
        if not 0 <= stage < spec.n_stages:
            raise MigrationRefused(f"stage {stage} does not exist: model {spec.name} has stages "
                                   f"0..{spec.n_stages - 1}", status=422)
        if stage == src:
            raise MigrationRefused(f"this peer already serves stage {stage}")
        if not force and await self.stage_peer_count(src) == 0:
            raise MigrationRefused(f"this peer is the last one serving stage {src}; moving would empty it "
                                   "(send force: true to move anyway)")
        if not (await host.plan_state(stage, confirm=True)).available:  # holders that answer now, not records
            raise MigrationRefused(f"stage {stage}'s state is nowhere: the swarm has trained, and no live peer serves "
                                   f"stage {stage} and no peer offers a checkpoint of it; serving it would restart it "
                                   "from step 0. Restart a peer that served it with its --state-dir")
        if self.moving or host.state != PeerState.SERVING:  # changed while the DHT was read
            raise MigrationRefused(f"this peer is {host.state}; it can move only while serving")
        self.status = MigrationStatus(src=src, to=stage, reason=reason)
        self.moving = True
        host.spawn(self.TASK, lambda: self._move(stage))
        return self.status.to_dict()

    async def _move(self, dst: int) -> None:
        host = self.host
        status = self.status
        assert status is not None and host.runtime is not None  # set by request()
        old = host.runtime
        try:
            host.state = PeerState.MIGRATING
            status.phase = MigrationPhase.DRAINING
            await host.announce()
            await host.stop_averaging()
            await host.pause_serving()
            status.phase = MigrationPhase.BUILDING
            new = await host.build_runtime(dst)
            status.phase = MigrationPhase.DOWNLOADING
            try:  # the destination's newest state, wherever it is; the old stage is kept until it is in
                source = await host.obtain_state(new, wait=False)
            except BaseException:
                await new.close()
                raise
            status.dropped_samples = old.executor.grad_samples  # accumulated for the old stage: lost with it
            self.last_throughput = old.executor.throughput
            host.runtime = new  # the one assignment that moves this peer (the data plane asks for it)
            await old.close()
            log.info("stage %d's state came from %s (step %d)", dst, source.value, new.executor.step)
            host.state = PeerState.SERVING
            self.moving = False
            await host.announce()
            self.moved_at = time.monotonic()
            # done only now, with no await before `finally` counts it: /status never says "done" while
            # swarmd_migrations_total does not count it yet
            status.phase = MigrationPhase.DONE
            log.info("moved from stage %d to stage %d (%s) at step %d", status.src, dst, status.reason,
                     new.executor.step)
        except asyncio.CancelledError:
            status.phase = MigrationPhase.CANCELLED
            raise
        except Exception as exc:  # the move failed: say so (with the traceback) and keep serving what we hold
            status.phase, status.error = MigrationPhase.FAILED, str(exc)
            log.exception("moving to stage %d failed", dst)
            host.state = PeerState.SERVING
        finally:
            self.moving = False
            self.results[status.phase.value] += 1  # done, failed or cancelled
            status.duration_s = round(time.time() - status.started_at, 3)
            host.resume_serving()
            if host.state == PeerState.SERVING:
                host.start_averaging()

    async def rebalance_loop(self) -> None:
        """Run the rebalancing policy every period and when the swarm's membership changes."""
        host = self.host
        assert host.membership is not None and host.spec is not None  # started once serving
        cfg = host.config.rebalance
        policy = get_policy(cfg.policy)
        check_every = min(host.config.dht.announce_period_s, cfg.period_s)
        last_period = time.monotonic()
        known: set[str] | None = None
        while True:
            await asyncio.sleep(check_every * random.uniform(0.9, 1.1))
            if host.state != PeerState.SERVING or self.moving:
                continue
            try:
                members = await host.membership.all_peers(host.spec.n_stages)
            except SwarmdError as exc:
                log.warning("rebalancing could not read the swarm: %s", exc)
                continue
            # a peer nobody can dial serves nobody: it is no capacity, and no stage relies on it
            records = [r for r in members if r.reachable != "no"]
            ids = {r.peer_id for r in records if r.state != "draining"}
            event = None
            if known is not None and ids != known:
                event = "leave" if known - ids else "join"
            known = ids
            now = time.monotonic()
            if now - last_period >= cfg.period_s:
                event, last_period = "period", now
            snapshot = SwarmSnapshot(
                n_stages=host.spec.n_stages,
                peers=tuple(PeerLoad(r.peer_id, r.stage, r.state, r.throughput, r.queue) for r in records),
                now=time.time(),
            )
            uncovered = empty_stages(snapshot)
            if uncovered:  # a stage without a peer stops the pipeline: decide now, cool-down or not
                event = event or "leave"
            elif event is None or now - self.moved_at < cfg.cooldown_s:
                continue
            download_s = host.last_sync_s if host.last_sync_s is not None else 60.0
            moves = [m for m in policy.decide(snapshot, event=event, download_s=download_s)
                     if m.peer_id == host.peer_id]
            if moves:
                why = f"cover empty stage {moves[0].dst}" if moves[0].dst in uncovered else event
                try:
                    await self.request(moves[0].dst, reason=f"rebalance: {policy.name} on {why}")
                except SwarmdError as exc:
                    if self._refusals.allow(str(exc)):
                        log.info("rebalancing wanted this peer on stage %d but: %s", moves[0].dst, exc)
