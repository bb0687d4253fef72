"""The daemon as the control plane shows it: ``/status``, ``/swarm`` and a trainer's welcome.

Built from the control plane's own schema (``swarmd.api.models``), so the OpenAPI document at
``/docs``, ``/metrics`` (read from ``/status`` at scrape time) and what the daemon reports are one
definition. ``/swarm`` is the DHT's view, every stage with its health and each peer's own
report and its age (``swarmd.pipeline.placement.coverage``): a number is never shown without how old it is.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from swarmd import __version__
from swarmd.api import models as m
from swarmd.api.models import ModelInfo, PrecisionInfo, StageHealthInfo, Status
from swarmd.net.addresses import format_addr
from swarmd.pipeline.placement.coverage import StageHealth, stage_health

if TYPE_CHECKING:
    from swarmd.daemon.host import Host
    from swarmd.daemon.stage_state import StageState
    from swarmd.dht.records import PeerRecord

__all__ = ["status", "swarm_view", "welcome"]


def welcome(host: Host) -> dict[str, Any]:
    """What a registering trainer needs: the swarm, its model and training settings."""
    assert host.spec is not None  # registration needs a serving peer
    ex = host.executor
    return {
        "swarm": host.config.swarm,
        "model": {"name": host.spec.name, "digest": host.spec.digest, "spec": host.spec.to_dict()},
        "training": host.training.to_dict(),
        "step": ex.step if ex else 0,
    }


async def swarm_view(host: Host, own: PeerRecord | None = None) -> dict[str, Any]:
    """``GET /swarm``: the swarm as the DHT shows it now: model, every stage's health and live peers.

    ``own`` is this peer's record as it would announce it now: its row shows its live step and load
    rather than its last announcement's, so a page never shows this peer at two steps."""
    assert host.membership is not None and host.spec is not None and host.dht is not None
    spec, membership = host.spec, host.membership
    stages = await membership.stage_peers(spec.n_stages)
    if own is not None and 0 <= own.stage < len(stages) and own.peer_id in stages[own.stage]:
        stages[own.stage][own.peer_id] = own
    now = time.time()
    held = host.checkpoints.held if host.checkpoints is not None else None
    healths = stage_health(spec.n_stages, [r for rs in stages for r in rs.values()], now=now, held_here=held)
    return {
        "swarm": host.config.swarm,
        "model": {"name": spec.name, "digest": spec.digest, "spec": spec.to_dict()},
        "training": host.training.to_dict(),
        "stages": [
            {
                "stage": stage,
                "throughput": sum(r.throughput for r in records.values()),
                "health": healths[stage].to_dict(),
                "peers": [
                    {
                        "peer_id": r.peer_id,
                        "state": r.state,
                        "data_addr": r.data_addr,
                        "api_addr": r.api_addr,
                        "throughput": r.throughput,
                        "queue": r.queue,
                        "step": r.step,
                        "params_digest": r.params_digest,
                        "version": r.version,
                        "reachable": r.reachable,
                        "age_s": round(max(0.0, now - r.timestamp), 3),
                    }
                    for r in sorted(records.values(), key=lambda r: r.peer_id)
                ],
                "dropped": [d.to_dict() for d in membership.dropped if d.stage == stage][:32],
            }
            for stage, records in enumerate(stages)
        ],
        "dht": host.dht.stats(),
    }


def status(host: Host, stage_state: StageState, *, announcements: int,
           coverage: list[StageHealth]) -> dict[str, Any]:
    """``GET /status``, built from the control plane's own :class:`~swarmd.api.models.Status`."""
    ex = host.executor
    dp = host.data_plane
    spec = host.spec
    averager = host.averager
    return Status(
        peer_id=host.peer_id,
        stage=host.stage,
        n_stages=spec.n_stages if spec else None,
        state=host.state.value,
        swarm=host.config.swarm,
        model=ModelInfo(name=spec.name, digest=spec.digest) if spec else None,
        step=ex.step if ex else 0,
        queue=ex.queue if ex else 0,
        in_flight=dp.in_flight if dp else 0,
        throughput=ex.throughput if ex else 0.0,
        grad_samples=ex.grad_samples if ex else 0,
        stale_dropped=ex.stale_dropped if ex else 0,
        stale_applied=ex.stale_applied if ex else 0,
        activation_cache=_typed(m.ActivationCacheInfo, ex.cache_stats() if ex else None),
        worker_cpu_s=ex.worker_cpu_s if ex else 0.0,
        exactly_once=m.ExactlyOnceInfo.model_validate(ex.exactly_once() if ex else {}),
        reservations=_typed(m.ReservationsInfo, ex.reservations.status() if ex else None),
        params_digest=ex.digest if ex else None,
        averaging=_typed(m.AveragingInfo, {
            "rounds_ok": averager.rounds_ok,
            "rounds_aborted": averager.rounds_aborted,
            "last_round": averager.last_round,
            "recent": list(averager.history)[-32:],
            **averager.checks_status(),  # proofs, refused rounds and contributions, exclusions
        } if averager else None),
        synced_from=stage_state.synced_from,
        migration=_typed(m.MigrationInfo, host.migration),
        migrations=dict(host.migrator.results),
        state_transfer=m.StateTransferInfo(**stage_state.downloads,
                                           served_bytes=dp.state_served["bytes"] if dp else 0,
                                           served_streams=dp.state_served["streams"] if dp else 0),
        precision=PrecisionInfo(mode=ex.precision, loss_scale=ex.loss_scale.scale if ex.loss_scale else None,
                                overflows=ex.loss_scale.overflows if ex.loss_scale else None) if ex else None,
        served=m.ServedInfo.model_validate(dict(dp.served) if dp else {}),
        auth=_typed(m.AuthInfo, _auth(host)),
        data_addr=host.data_addr,
        api_addr=format_addr(host.api_addr),
        dht_addr=host.dht_addr,
        addresses=_addresses(host),
        reachability=m.ReachabilityInfo.model_validate(host.reachability.to_dict()),
        relay=m.RelayInfo.model_validate({
            "client": host.relay_client.status.to_dict() if host.relay_client is not None else None,
            "server": host.relay_server.stats(),
        }),
        founder=host.founder,
        announcements=announcements,
        task_crashes=host.tasks.crashes(),
        checkpoint=_typed(m.CheckpointStatus,
                          stage_state.checkpoints.status() if stage_state.checkpoints is not None else None),
        gradient_handover=m.GradientHandoverInfo(**stage_state.handover, handed_in=ex.handed_in_samples if ex else 0),
        untrusted=_untrusted(host),
        reports=m.ReportsInfo.model_validate(host.reports.status()),
        stages=[StageHealthInfo.model_validate(h.to_dict()) for h in coverage],
        state_source=stage_state.source,
        device=host.config.pipeline.device,
        version=__version__,
        uptime_s=round(time.monotonic() - host.started_at, 3),
    ).model_dump(mode="json", by_alias=True)


_P = TypeVar("_P", bound=BaseModel)


def _typed(model: type[_P], value: Mapping[str, Any] | None) -> _P | None:
    """``value`` as ``model`` (None stays None): a part of ``/status``, checked against its schema."""
    return None if value is None else model.model_validate(value)


def _auth(host: Host) -> dict[str, Any]:
    """Whether this swarm is private, and what was refused for lacking its key (by reason)."""
    key = host.config.swarm_key
    dht_auth = host.dht.auth_refused() if host.dht is not None else None
    dp = host.data_plane
    return {
        "private": key is not None,
        "key_id": key.key_id if key is not None else None,
        "refused": {
            "dht": dht_auth or {},
            "data_plane": dp.auth.counts() if dp is not None and dp.auth is not None else {},
        },
    }


def _addresses(host: Host) -> m.AddressesInfo:
    """Bound and announced addresses, and how the announced host was chosen."""
    dp = host.data_plane
    return m.AddressesInfo(
        data_bound=format_addr(dp.address) if dp is not None else None,
        data_announced=host.data_addr,
        dht_bound=format_addr(host.dht.address) if host.dht is not None and host.dht.running else None,
        dht_announced=host.dht_addr,
        how=host.announced.how if host.announced is not None else None,
        observed=list(host.announced.observed) if host.announced is not None else [],
    )


def _untrusted(host: Host) -> m.UntrustedInfo:
    """Peers left out of the views, and what the DHT storage refused, by source."""
    out: dict[str, Any] = host.membership.untrusted() if host.membership is not None else {}
    if host.dht is not None:
        out["dht"] = host.dht.flood_stats()
    return m.UntrustedInfo.model_validate(out)
