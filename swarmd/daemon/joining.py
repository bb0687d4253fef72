"""Joining a swarm: which address to announce, which model to serve, which stage to take.

Steps 1-3 of a daemon's start-up (``swarmd.daemon``), after its DHT node is up:

- the address others dial (``swarmd.net.addresses``): the ``--announce`` flag, a specific
  ``--host``, what two or more DHT contacts see (as STUN does), or the route to the bootstrap
  peer; never a loopback address into a swarm beyond this machine;
- the model: a founder publishes its spec as the swarm record (a founder restarted on a state dir
  with checkpoints re-founds the swarm with their model and training settings); a joiner reads
  the swarm record and refuses an explicit ``--model`` that disagrees;
- the stage: ``--stage N``, or for ``--stage auto`` the stage its claim gets in turn
  (``swarmd.pipeline.placement.claims``: newcomers started at the same moment spread over the stages),
  announced as ``joining`` at once so that newcomers a moment later count it where it will serve.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import time
from typing import TYPE_CHECKING

from swarmd.errors import ConfigError
from swarmd.net import reachability
from swarmd.net.addresses import (
    choose_host,
    default_route_source,
    family_of,
    is_wildcard,
    loopback_mismatch,
    route_source,
)
from swarmd.pipeline.placement.claims import CLAIM_WAIT_S, Claim, claims_of, settled_loads, take_turns
from swarmd.pipeline.spec import PRESETS, ModelSpec, TrainingSpec

if TYPE_CHECKING:
    from swarmd.daemon.host import Host
    from swarmd.daemon.stage_state import StageState
    from swarmd.dht.records import PeerRecord

__all__ = ["SWARM_RECORD_WAIT_S", "Joining"]

log = logging.getLogger(__name__)

SWARM_RECORD_WAIT_S = 30.0  # how long a joiner whose DHT answered waits for the swarm's record (a founder starting)


class Joining:
    """Chooses the daemon's announced address, model and stage."""

    def __init__(self, host: Host, stage_state: StageState) -> None:
        self.host = host
        self.stage_state = stage_state
        self.stage: int | None = None  # chosen before the runtime is built
        self.claimed_at: float | None = None  # when --stage auto claimed it (swarmd.pipeline.placement.claims)

    # ---- the address others dial ----------------------------------------------------------------

    def check_static_address(self) -> None:
        """Before anything is bound: a loopback --announce or --host into a swarm beyond loopback."""
        net = self.host.config.net
        host = net.announce_host or (None if is_wildcard(net.host) else net.host)
        problem = loopback_mismatch(host, self.host.config.dht.join) if host else None
        if problem is not None:
            raise ConfigError(problem)

    async def learn_address(self) -> None:
        """Choose the host to announce (``swarmd.net.addresses``); refuse a loopback one that
        would go into a swarm beyond this machine."""
        host = self.host
        assert host.dht is not None  # joined the DHT
        net, dht = host.config.net, host.config.dht
        observed: list[str] = []
        route: str | None = None
        if net.announce_host is None and is_wildcard(net.host):
            join = [addr for addr in dht.join if not is_wildcard(addr[0]) and _is_ip(addr[0])]
            if dht.join:
                seen = await host.dht.observe_self(extra=join, timeout=1.0)
                observed = [ip for _, ip in seen]
                route = route_source(dht.join[0][0])
            if route is None:
                route = default_route_source(family_of(net.host))
        host.announced = choose_host(bound=net.host, flag=net.announce_host, observed=observed, route=route)
        log.info("others reach this peer at %s (%s); join others with --join %s",
                 host.announced.host, host.announced.how, host.dht_addr)
        problem = loopback_mismatch(host.announced.host, dht.join)
        if problem is not None:
            raise ConfigError(problem)
        if host.announced.how == "loopback" and is_wildcard(net.host):
            log.warning("bound to %s, but no route and no DHT contact tells which address others reach this peer "
                        "at: announcing %s; give --announce HOST for a swarm beyond this machine",
                        net.host, host.announced.host)

    async def relearn_address(self) -> None:
        """A founder bound to a wildcard announced the route's address; once two or more DHT
        contacts agree on what they see, announce that instead."""
        host = self.host
        announced = host.announced
        if host.dht is None or announced is None or announced.how not in ("route", "loopback"):
            return
        seen = await host.dht.observe_self(timeout=1.0)
        better = choose_host(bound=host.config.net.host, observed=[ip for _, ip in seen], route=announced.host)
        if better.how == "observed" and better.host != announced.host:
            log.info("DHT contacts see this peer at %s: announcing it instead of %s", better.host, announced.host)
            host.announced = better
            host.reachability = reachability.Reachability()  # a new address: check it again
        elif better.how == "observed":
            host.announced = better

    # ---- the model -------------------------------------------------------------------------------

    async def resolve_swarm(self) -> tuple[ModelSpec, TrainingSpec]:
        """A founder publishes its model; a joiner takes the swarm's and checks ``--model``."""
        host = self.host
        assert host.membership is not None  # joined the DHT
        cfg = host.config
        asked = cfg.pipeline.spec
        if host.founder:
            spec, training = await self._founding_settings(asked)
            await host.membership.publish_swarm(spec, training.to_dict())
            return spec, training
        # the DHT answered, so a founder is there; one started at the same moment publishes its model once it
        # has read its own checkpoints: wait for it longer than for an answer (one line says so)
        info = await host.membership.wait_for_swarm(max(SWARM_RECORD_WAIT_S, cfg.dht.bootstrap_timeout_s),
                                                    say_after_s=cfg.dht.bootstrap_timeout_s)
        if asked is not None and asked.digest != info.spec.digest:
            raise ConfigError(
                f"--model {asked.name} ({asked.digest[:12]}) is not the model of swarm {cfg.swarm!r}, "
                f"which trains {info.spec.name} ({info.spec.digest[:12]}); omit --model to serve the swarm's model"
            )
        if cfg.pipeline.training is not None:
            log.warning("training settings come from the swarm; the ones given on this joiner are ignored")
        log.info("swarm %r trains model %s (%s), published by %d peer(s)",
                 cfg.swarm, info.spec.name, info.spec.digest[:12], info.publishers)
        return info.spec, TrainingSpec.from_dict(info.training)

    async def _founding_settings(self, asked: ModelSpec | None) -> tuple[ModelSpec, TrainingSpec]:
        """A founder restarted on a state dir that holds checkpoints of its swarm re-founds it with their
        model and training settings; ``--model`` and the training flags, when given, win."""
        host = self.host
        found = await self.stage_state.own_checkpoints()
        if not found:
            return asked or PRESETS["tiny"], host.training
        newest = found[0]
        spec = asked
        if spec is None:
            try:
                spec = ModelSpec.from_dict(newest.model)
            except ConfigError as exc:
                log.warning("checkpoint %s holds an unreadable model spec (%s); founding with the tiny model",
                            newest.path, exc)
                return PRESETS["tiny"], host.training
        training = host.training
        if host.config.pipeline.training is None:
            try:
                training = TrainingSpec.from_dict(newest.training)
            except ConfigError as exc:
                log.warning("checkpoint %s holds unreadable training settings (%s); using the defaults",
                            newest.path, exc)
        if spec.digest == newest.model_digest:
            log.info("re-founding swarm %r with the model (%s) and training settings of checkpoint %s (step %d)",
                     host.config.swarm, spec.digest[:12], newest.path.with_suffix(""), newest.step)
        return spec, training

    # ---- the stage -------------------------------------------------------------------------------

    async def resolve_stage(self, spec: ModelSpec) -> int:
        """``--stage N``, or for ``--stage auto`` the stage this newcomer's claim gets in turn; either is
        announced as ``joining`` at once."""
        host = self.host
        asked = host.config.pipeline.stage
        if asked is not None:
            if asked >= spec.n_stages:
                raise ConfigError(
                    f"--stage {asked} is out of range: model {spec.name} has stages 0..{spec.n_stages - 1}"
                )
            self.stage = asked
            await host.announce_quietly()
            return asked
        assert host.membership is not None  # joined the DHT
        self.claimed_at = time.time()
        self.stage = self._turn(await host.membership.all_peers(spec.n_stages), spec)
        await host.announce_quietly()
        await asyncio.sleep(CLAIM_WAIT_S * random.uniform(1.0, 1.5))  # for claims sent at the same moment
        members = await host.membership.all_peers(spec.n_stages)
        stage = self._turn(members, spec)
        if stage != self.stage:
            self.stage = stage
            await host.announce_quietly()
        log.info("--stage auto chose stage %d (%s)", stage, self._summary(members, spec))
        return stage

    def _turn(self, members: list[PeerRecord], spec: ModelSpec) -> int:
        """This newcomer's stage when every claim in ``members`` takes its turn (pure, ``take_turns``)."""
        host = self.host
        assert self.claimed_at is not None and host.peer_id is not None
        others = [r for r in members if r.peer_id != host.peer_id]
        checkpoints = self.stage_state.checkpoints
        holds = frozenset(checkpoints.held) if checkpoints is not None else frozenset()
        mine = Claim(host.peer_id, self.claimed_at, holds)
        turns = take_turns(spec.n_stages, settled_loads(others), [*claims_of(others), mine],
                           policy=host.config.rebalance.policy, now=time.time())
        return turns[host.peer_id]

    def _summary(self, members: list[PeerRecord], spec: ModelSpec) -> str:
        parts = []
        for stage in range(spec.n_stages):
            here = [r for r in members if r.stage == stage and r.peer_id != self.host.peer_id]
            serving = sum(r.state == "serving" for r in here)
            parts.append(f"stage {stage}: {serving} serving, {len(here) - serving} starting, "
                         f"{sum(r.throughput for r in here):.0f} samples/s")
        return ", ".join(parts)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
