"""A daemon's membership in its swarm: what it publishes about itself and reads about others.

SWARM peers find each other through a DHT rather than a central server (paper, section 3.2):
each peer periodically announces which stage it serves and how fast it is, and trainers and
peers read those announcements to wire pipelines and pick stages. This module is that layer,
on top of :class:`~swarmd.dht.node.DHTNode`:

- the *swarm record* (model spec and training settings) lives under the swarm's key. Every
  serving peer republishes its own signed copy, so the swarm outlives its founder; a joiner
  takes the spec most peers publish (ties: the oldest), and a mismatch is the joiner's error.
- *peer records* live under their stage's bucket keys; a reader merges all stages and keeps one
  record per peer (the newest), so a peer that just moved stage is listed once, where it is now;
  a peer that stopped gracefully published a ``stopped`` record last, and is not listed at all.
- *untrusted peers* (issue 18): a signed record proves only that someone minted a key, so the
  daemon's views leave out the peers it holds evidence against (``evidence``: peer id -> reason,
  e.g. a signed data-plane challenge that failed again and again: a fake at a tarpit or a
  refusing port), and says so: :meth:`Membership.untrusted` for ``/status`` and ``/metrics``, and
  one log line a minute naming the reasons (a flood of 500 fakes is one line, not 500).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from swarmd.dht.identity import Identity
from swarmd.dht.keys import swarm_key
from swarmd.dht.node import DHTNode
from swarmd.dht.records import PeerRecord, SwarmRecord, sign_record
from swarmd.dht.sources import RateLimiter
from swarmd.errors import BootstrapError, ConfigError
from swarmd.pipeline.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmInfo:
    """What a swarm's records agree on: its model and training settings."""

    spec: ModelSpec
    training: dict[str, Any]
    publishers: int  # how many peers currently publish this spec


def pick_swarm(records: Mapping[str, Any], swarm: str) -> SwarmInfo | None:
    """The spec most publishers agree on (ties: the oldest publication), or None if there is none.

    Records that name another swarm or carry a spec this build cannot read are ignored: one bad
    or outdated peer cannot block a joiner.
    """
    groups: dict[str, list[SwarmRecord]] = {}
    specs: dict[str, ModelSpec] = {}
    for record in records.values():
        if not isinstance(record, SwarmRecord) or record.swarm != swarm:
            continue
        try:
            spec = ModelSpec.from_dict(record.spec)
        except ConfigError as exc:
            log.warning("ignoring the swarm record of %s: %s", record.founder[:12], exc)
            continue
        specs[spec.digest] = spec
        groups.setdefault(spec.digest, []).append(record)
    if not groups:
        return None
    digest = max(groups, key=lambda d: (len(groups[d]), -min(r.timestamp for r in groups[d])))
    if len(groups) > 1:
        log.warning("peers of swarm %r publish %d different models; following the majority (%s)",
                    swarm, len(groups), digest[:12])
    oldest = min(groups[digest], key=lambda r: r.timestamp)
    return SwarmInfo(spec=specs[digest], training=dict(oldest.training), publishers=len(groups[digest]))


def latest_per_peer(stages: list[dict[str, PeerRecord]]) -> list[dict[str, PeerRecord]]:
    """Keep each peer only in the stage of its newest record (a mover's old record lingers)."""
    newest: dict[str, PeerRecord] = {}
    for records in stages:
        for peer_id, record in records.items():
            held = newest.get(peer_id)
            if held is None or held.timestamp < record.timestamp:
                newest[peer_id] = record
    out: list[dict[str, PeerRecord]] = [{} for _ in stages]
    for peer_id, record in newest.items():
        out[record.stage][peer_id] = record
    return out


@dataclass(frozen=True, slots=True)
class Dropped:
    """A peer record left out of a view, and why."""

    peer_id: str
    stage: int
    data_addr: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "stage": self.stage, "data_addr": self.data_addr, "reason": self.reason}


def drop_untrusted(
    stages: list[dict[str, PeerRecord]], evidence: Mapping[str, str], *, self_id: str | None = None
) -> tuple[list[dict[str, PeerRecord]], list[Dropped]]:
    """``stages`` without the peers ``evidence`` names (peer id -> reason), and those left out.
    This peer's own record is never left out (the evidence is about others)."""
    kept: list[dict[str, PeerRecord]] = []
    dropped: list[Dropped] = []
    for records in stages:
        keep = {}
        for pid, record in records.items():
            reason = evidence.get(pid) if pid != self_id else None
            if reason is None:
                keep[pid] = record
            else:
                dropped.append(Dropped(pid, record.stage, record.data_addr, reason))
        kept.append(keep)
    return kept, dropped


MAX_REMEMBERED_DROPS = 4096  # distinct peers counted in ``dropped_peers_total`` (then the oldest are forgotten)
SHOWN_DROPS = 16  # examples of dropped peers in /status


class Membership:
    """Publishes this peer's records and reads the swarm's, through one DHT node."""

    def __init__(
        self,
        node: DHTNode,
        identity: Identity,
        swarm: str,
        *,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        evidence: Callable[[], Mapping[str, str]] | None = None,
        log_period_s: float = 60.0,
    ) -> None:
        """``evidence``: the peers this daemon holds evidence against now (peer id -> reason word,
        e.g. ``never_answered``, ``failed_proof``, ``excluded``); they are left out of every view."""
        self.node = node
        self.identity = identity
        self.swarm = swarm
        self.ttl_s = ttl_s
        self._clock = clock
        self.evidence = evidence
        self.dropped: list[Dropped] = []  # left out of the newest view
        self._ever: OrderedDict[tuple[str, str], None] = OrderedDict()  # (peer id, reason) ever left out
        self.dropped_total: Counter[str] = Counter()  # distinct peers left out, by reason
        self._log_limit = RateLimiter(log_period_s)

    async def publish_swarm(self, spec: ModelSpec, training: Mapping[str, Any]) -> int:
        now = self._clock()
        record = SwarmRecord(
            swarm=self.swarm,
            spec=spec.to_dict(),
            training=dict(training),
            founder=self.identity.peer_id,
            timestamp=now,
            expiry=now + self.ttl_s,
        )
        return await self.node.store(swarm_key(self.swarm), sign_record(self.identity, record))

    async def read_swarm(self) -> SwarmInfo | None:
        return pick_swarm(await self.node.get(swarm_key(self.swarm)), self.swarm)

    async def wait_for_swarm(self, timeout_s: float, poll_s: float = 0.5, *,
                             say_after_s: float | None = None) -> SwarmInfo:
        """The swarm's record, retrying while a just-started founder has not published it yet (saying so once,
        after ``say_after_s``)."""
        start = time.monotonic()
        deadline = start + timeout_s
        say_at = None if say_after_s is None else start + say_after_s
        while True:
            info = await self.read_swarm()
            if info is not None:
                return info
            if say_at is not None and time.monotonic() >= say_at:
                say_at = None
                log.info("joined the DHT, but swarm %r has published no model yet: waiting up to %.0fs more for its "
                         "founder (still starting?)", self.swarm, deadline - time.monotonic())
            if time.monotonic() >= deadline:
                raise BootstrapError(
                    f"joined the DHT but found no swarm named {self.swarm!r} within {timeout_s:.0f}s; "
                    "check --swarm, or omit --join to found a new swarm"
                )
            await asyncio.sleep(poll_s)

    async def announce(self, record: PeerRecord) -> int:
        return await self.node.store_peer(self.swarm, sign_record(self.identity, record))

    async def stage_peers(self, n_stages: int) -> list[dict[str, PeerRecord]]:
        """Live peer records of every stage, read in parallel, one record per peer, without the
        peers this daemon holds evidence against (:attr:`dropped`, with the reasons)."""
        found = await asyncio.gather(*(self.node.get_stage_peers(self.swarm, s, withdrawn=True)
                                       for s in range(n_stages)))
        stages = latest_per_peer(list(found))  # a withdrawal hides the peer's older records of other stages
        stages = [{pid: r for pid, r in records.items() if r.listed} for records in stages]
        if self.evidence is None:
            return stages
        kept, self.dropped = drop_untrusted(stages, self.evidence(), self_id=self.identity.peer_id)
        self._note(self.dropped)
        return kept

    def _note(self, dropped: list[Dropped]) -> None:
        """Count the peers newly left out, and say so in the log once a period (all reasons in one line)."""
        new = 0
        for d in dropped:
            key = (d.peer_id, d.reason)
            if key in self._ever:
                continue
            new += 1
            self._ever[key] = None
            self.dropped_total[d.reason] += 1
            while len(self._ever) > MAX_REMEMBERED_DROPS:
                self._ever.popitem(last=False)
        if dropped and new and self._log_limit.allow("view"):
            reasons = ", ".join(f"{n} {why}" for why, n in sorted(Counter(d.reason for d in dropped).items()))
            example = dropped[0]
            log.warning("left %d peer(s) out of this daemon's view of swarm %r (%s), e.g. %s at %s: records that "
                        "did not hold up (fake or unreachable peers; see /status -> untrusted)", len(dropped),
                        self.swarm, reasons, example.peer_id[:12], example.data_addr)

    def untrusted(self) -> dict[str, Any]:
        """For ``/status``: the peers left out of the newest view by reason, examples, totals."""
        return {
            "dropped": dict(sorted(Counter(d.reason for d in self.dropped).items())),
            "peers": [d.to_dict() for d in self.dropped[:SHOWN_DROPS]],
            "dropped_peers_total": dict(sorted(self.dropped_total.items())),
        }

    async def all_peers(self, n_stages: int) -> list[PeerRecord]:
        """Every live peer record of the swarm, whatever its stage (:meth:`stage_peers`, flattened)."""
        return [r for records in await self.stage_peers(n_stages) for r in records.values()]
