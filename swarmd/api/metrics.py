"""``GET /metrics``: one Prometheus registry per daemon, in the text format of ``prometheus-client``.

Two kinds of metric, so that nothing is counted twice and nothing drifts from ``/status``:

- most families are *read at scrape time* from the daemon's own ``/status`` document (the
  :class:`~swarmd.api.models.Status` model: throughput, queue, step, averaging rounds, served
  requests, auth refusals, activation cache, checkpoint, relay ...), its DHT counters and its
  training log, by :class:`StatusCollector`: the daemon keeps counting where it always did, and
  a scrape turns those counters into families;
- request counts, bytes and latency histograms, which no counter held before, are observed as
  requests pass: :meth:`DaemonMetrics.data_plane_middleware` on the aiohttp data plane and
  :meth:`DaemonMetrics.observe_api` on the control plane. Their endpoint label is the route's
  template (``/v1/forward``, ``/trainers/{trainer_id}/heartbeat``), never the raw path, so a
  scanner cannot grow the registry; the data plane's byte counters also carry the ``codec`` the
  request named (one of ``swarmd.net.codecs.CODECS``, checked before it is used; ``none`` for
  requests without tensors or refused before their frame was read). The duration of each
  averaging round (SWARM section 3.2: stage-mates average, then step together) is observed when
  the round is recorded (:meth:`DaemonMetrics.observe_round`, the averager's ``on_round``).

Names follow Prometheus conventions: ``swarmd_`` prefix, base units (``_seconds``, ``_bytes``),
counters end in ``_total``. Registries are per daemon (never the global default), so several
daemons in one process (the tests) keep their own numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from swarmd.api.models import (
    AUDIT_OUTCOMES,
    ActivationCacheInfo,
    AuthInfo,
    AuthRefusals,
    AveragingInfo,
    CheckpointStatus,
    MigrationInfo,
    PrecisionInfo,
    ProofsInfo,
    RelayInfo,
    ReportsInfo,
    StageHealthInfo,
    StateTransferInfo,
    Status,
    UntrustedInfo,
)
from swarmd.api.trainers import TrainerRegistry
from swarmd.net.server import CODEC_KEY
from swarmd.training_summary import TrainingLog

__all__ = ["CONTENT_TYPE", "DaemonMetrics", "MetricsSource", "StatusCollector"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Request latency buckets: a loopback forward takes milliseconds, a WAN state download minutes.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
#: Averaging round buckets: a loopback round of a tiny model takes milliseconds; the averaging
#: timeout (default 30 s) bounds a round that waits for a silent stage-mate.
ROUND_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: How a recorded round ended (``swarmd.pipeline.averaging.averager``): the label's only values.
ROUND_RESULTS = ("ok", "aborted", "refused")
#: How a move between stages ended, or that it was refused (``swarmd.pipeline.placement.migration``).
MIGRATION_RESULTS = ("done", "failed", "cancelled", "refused")
STATES = ("starting", "joining", "serving", "migrating", "draining", "stopped")


class MetricsSource(Protocol):
    """What the collector reads from a daemon at scrape time."""

    def status(self) -> dict[str, Any]: ...

    def dht_stats(self) -> dict[str, Any] | None: ...

    @property
    def training_log(self) -> TrainingLog: ...

    @property
    def trainers(self) -> TrainerRegistry: ...


class _Changed:
    """When a value last changed, as seen by scrapes (the age of the step, of the params digest)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._value: object = None
        self._since = clock()

    def age(self, value: object) -> float:
        if value != self._value:
            self._value, self._since = value, self._clock()
        return self._clock() - self._since


def _gauge(name: str, doc: str, value: float | None, labels: Mapping[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    if value is not None:
        family.add_metric(list((labels or {}).values()), float(value))
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


def _by(name: str, doc: str, label: str, values: Mapping[str, Any], *, counter: bool = True) -> Metric:
    family: Metric = (CounterMetricFamily(name, doc, labels=[label]) if counter
                      else GaugeMetricFamily(name, doc, labels=[label]))
    for key, value in sorted(values.items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            family.add_metric([str(key)], float(value))  # type: ignore[attr-defined]
    return family


class StatusCollector(Collector):
    """Families read from the daemon's ``/status``, DHT counters and training log at each scrape."""

    def __init__(self, source: MetricsSource, clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._step_changed = _Changed(clock)
        self._digest_changed = _Changed(clock)

    @staticmethod
    def _coverage(stages: list[StageHealthInfo]) -> Iterator[Metric]:
        """Every stage's health (``swarmd.pipeline.placement.coverage``): alert on
        ``swarmd_stage_health{health!="ok"}``."""
        health = GaugeMetricFamily("swarmd_stage_health", "1 for each stage's health as the swarm's records show it: "
                                   "ok, thin (one peer), starting, empty (no peer), lost (no peer, no state)",
                                   labels=["stage", "health"])
        peers = GaugeMetricFamily("swarmd_stage_peers", "peers of each stage, serving or on their way (pending)",
                                  labels=["stage", "state"])
        for st in stages:
            stage = str(st.stage)
            health.add_metric([stage, st.health], 1.0)
            peers.add_metric([stage, "serving"], float(st.serving))
            peers.add_metric([stage, "pending"], float(st.pending))
        yield health
        yield peers

    def collect(self) -> Iterator[Metric]:
        st = Status.model_validate(self._source.status())  # read by field below (swarmd.api.models)
        info = InfoMetricFamily("swarmd_peer", "who this peer is")
        model = st.model
        info.add_metric([], {"peer_id": st.peer_id or "", "swarm": st.swarm, "version": st.version,
                             "device": st.device, "model": model.name if model else "",
                             "model_digest": model.digest if model else ""})
        yield info
        state = GaugeMetricFamily("swarmd_state", "1 for the state this peer is in", labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if st.state == name else 0.0)
        yield state
        yield _gauge("swarmd_stage", "the pipeline stage this peer serves", st.stage)
        yield _gauge("swarmd_stages", "stages of the model", st.n_stages)
        yield _gauge("swarmd_throughput_samples_per_second", "forward+backward samples/s (EMA)", st.throughput)
        yield _gauge("swarmd_queue_jobs", "compute jobs waiting or running on the stage's worker", st.queue)
        yield _gauge("swarmd_in_flight_requests", "data-plane requests being served", st.in_flight)
        yield _gauge("swarmd_step", "optimizer steps applied to this stage's parameters", st.step)
        yield _gauge("swarmd_step_age_seconds", "seconds since the step last changed (as seen by scrapes)",
                     self._step_changed.age((st.stage, st.step)))
        yield _gauge("swarmd_params_digest_age_seconds", "seconds since the params digest last changed "
                     "(as seen by scrapes)", self._digest_changed.age(st.params_digest))
        yield _gauge("swarmd_grad_samples", "samples accumulated since the last step", st.grad_samples)
        yield _counter("swarmd_stale_backwards_dropped", "backwards refused: forward at an older step",
                       st.stale_dropped)
        yield _counter("swarmd_stale_backwards_applied", "backwards one step old, applied to the next update",
                       st.stale_applied)
        yield _counter("swarmd_worker_cpu_seconds", "CPU seconds of the stage's worker thread", st.worker_cpu_s)
        yield _by("swarmd_served_requests", "data-plane requests answered, by kind", "kind", st.served.model_dump())
        yield _counter("swarmd_announcements", "peer records published to the DHT", st.announcements)
        yield _by("swarmd_task_crashes", "background task crashes, by task", "task", st.task_crashes)
        yield _gauge("swarmd_uptime_seconds", "seconds since the daemon started", st.uptime_s)
        yield from self._averaging(st.averaging)
        yield from self._checks(st.averaging or AveragingInfo())
        yield from self._reports(st.reports)
        yield from self._cache(st.activation_cache or ActivationCacheInfo())
        yield from self._auth(st.auth)
        yield from self._migration(st.migration)
        yield _by("swarmd_migrations", "moves between stages, by how they ended (refused: a request or a "
                  "rebalancing decision that was checked and refused)", "result",
                  {r: st.migrations.get(r, 0) for r in MIGRATION_RESULTS})
        yield from self._state_transfer(st.state_transfer)
        yield from self._precision(st.precision)
        yield from self._checkpoint(st.checkpoint)
        yield from self._relay(st.relay)
        handover = st.gradient_handover
        yield _by("swarmd_gradient_handover_samples", "gradients handed over on graceful leave, in samples",
                  "direction", {"handed_out": handover.handed_out, "dropped": handover.dropped,
                                "handed_in": handover.handed_in})
        reach = st.reachability.status
        yield _gauge("swarmd_reachable", "1 when other members could dial this peer's data plane, 0 when not, "
                     "absent while unknown", {"yes": 1.0, "no": 0.0}.get(reach))
        yield from self._dht(self._source.dht_stats())
        yield from self._untrusted(st.untrusted)
        yield from self._coverage(st.stages)
        yield from self._training(self._source.training_log)
        trainers = self._source.trainers
        yield _counter("swarmd_trainer_retries", "requests the trainers registered here retried on another peer, "
                       "as their heartbeats report", trainers.retries_total)
        yield _counter("swarmd_trainer_bans", "peers the trainers registered here banned after a failure, as their "
                       "heartbeats report", trainers.bans_total)
        spot = trainers.spot_checks_total
        for key, name, doc in (("checks", "swarmd_trainer_spot_checks", "calls the trainers registered here re-sent "
                                "to a second peer to check its answer (issue 17), as their heartbeats report"),
                               ("mismatches", "swarmd_trainer_spot_check_mismatches", "spot checks whose two "
                                "answers disagreed"),
                               ("arbitrations", "swarmd_trainer_spot_check_arbitrations", "third opinions the "
                                "trainers asked for after a mismatch"),
                               ("liars", "swarmd_trainer_liars_caught", "peers the trainers caught lying (banned and "
                                "reported)"),
                               ("reports_sent", "swarmd_trainer_reports_sent", "signed misbehaviour reports the "
                                "trainers sent that peers accepted")):
            yield _counter(name, doc, spot.get(key, 0))

    @staticmethod
    def _state_transfer(transfer: StateTransferInfo) -> Iterator[Metric]:
        """A stage's state (parameters, optimizer state, step) downloaded from and served to stage-mates."""
        family = CounterMetricFamily("swarmd_state_transfer_bytes", "stage state streamed between stage-mates, by "
                                     "direction (downloaded: read from donors, failed attempts included; served: "
                                     "streamed to joiners by GET /v1/state)", labels=["direction"])
        family.add_metric(["downloaded"], float(transfer.downloaded_bytes))
        family.add_metric(["served"], float(transfer.served_bytes))
        yield family
        downloads = CounterMetricFamily("swarmd_state_downloads", "state downloads this peer adopted or gave up on "
                                        "(every donor failed), by result", labels=["result"])
        downloads.add_metric(["ok"], float(transfer.downloads_ok))
        downloads.add_metric(["failed"], float(transfer.downloads_failed))
        yield downloads
        yield _counter("swarmd_state_served_streams", "state snapshots streamed to stage-mates",
                       transfer.served_streams)
        yield _gauge("swarmd_state_last_download_seconds", "how long the last adopted state download took",
                     transfer.last_download_s)

    @staticmethod
    def _precision(precision: PrecisionInfo | None) -> Iterator[Metric]:
        """``--precision`` and, for fp16, the stage's loss scale (``swarmd.pipeline.stage.precision``)."""
        info = InfoMetricFamily("swarmd_precision", "the precision this peer computes its stage in")
        if precision is not None:
            info.add_metric([], {"precision": precision.mode})
        yield info
        yield _gauge("swarmd_loss_scale", "the stage's dynamic loss scale (fp16 only)",
                     precision.loss_scale if precision else None)
        yield _counter("swarmd_loss_scale_overflows", "backwards recomputed at half the loss scale after an overflow "
                       "(fp16 only)", (precision.overflows if precision else None) or 0)

    @staticmethod
    def _untrusted(untrusted: UntrustedInfo) -> Iterator[Metric]:
        """Fake, unreachable or misbehaving peers (issue 18): left out of views; refused by the DHT storage."""
        yield _by("swarmd_untrusted_peers", "peers left out of this daemon's newest view of the swarm, by reason",
                  "reason", untrusted.dropped, counter=False)
        yield _by("swarmd_untrusted_peers_seen", "distinct peers ever left out of this daemon's views, by reason",
                  "reason", untrusted.dropped_peers_total)
        yield _counter("swarmd_dht_evicted_records", "DHT records of over-represented sources evicted to make room "
                       "for a newcomer from a smaller source group (fair share)",
                       untrusted.dht.evicted if untrusted.dht is not None else 0)

    @staticmethod
    def _averaging(averaging: AveragingInfo | None) -> Iterator[Metric]:
        rounds = CounterMetricFamily("swarmd_averaging_rounds", "averaging rounds this peer took part in, by result",
                                     labels=["result"])
        if averaging is not None:
            rounds.add_metric(["ok"], float(averaging.rounds_ok))
            rounds.add_metric(["aborted"], float(averaging.rounds_aborted))
        yield rounds

    @staticmethod
    def _checks(averaging: AveragingInfo) -> Iterator[Metric]:
        """The round checks and proofs (issues #17, #18): what this peer refused in its stage's rounds."""
        yield _counter("swarmd_averaging_rounds_refused", "rounds whose leader's answer this peer refused (the round "
                       "checks)", averaging.rounds_refused)
        yield _by("swarmd_averaging_contributions_refused", "stage-mates' contributions this peer refused as "
                  "leader, by reason", "reason", averaging.contributions_refused)
        yield _counter("swarmd_averaging_refused_samples", "samples in refused contributions and answers",
                       averaging.refused_samples)
        yield _counter("swarmd_averaging_contributions_clipped", "contributions whose influence the robust mean "
                       "(CenteredClip) cut in rounds this peer led", averaging.contributions_clipped)
        yield _counter("swarmd_averaging_contributions_struck", "contributions left out of the mean (their samples "
                       "counted) as far from or against the leader's own gradient, in rounds this peer led",
                       averaging.contributions_struck)
        yield _counter("swarmd_averaging_own_slices_struck", "(all-reduce) parts this peer owned whose mean left its "
                       "own slice out, far from or against the part's median", averaging.own_slices_struck)
        yield _counter("swarmd_averaging_hostile_convictions", "stage-mates this peer, leading, convicted of hostile "
                       "contributions (then excluded; summed over peers)", sum(averaging.hostile_convictions.values()))
        yield _by("swarmd_averaging_accusations", "convictions of hostile contributions shown to the stage-mates "
                  "as signed evidence (sent), stage-mates' accusations this peer seconded or not, and those it "
                  "seconded shown on to the others (seconded_sent) (issue 29)", "outcome",
                  {k: averaging.accusations.get(k, 0) for k in ("sent", "seconded", "not_seconded", "seconded_sent")})
        yield _counter("swarmd_averaging_accusations_accepted", "stage-mates whose ledgers counted an accusation "
                       "this peer showed them (summed over accusations)",
                       averaging.accusations.get("accepted_by_mates", 0))
        yield _by("swarmd_averaging_rechecks", "stage-mates' convictions by recomputation (POST /v1/recheck) this "
                  "peer took up: recomputed here (rechecked; then seconded or not), or could not be (unchecked: no "
                  "parameters of that step left, inputs that do not fit)", "outcome",
                  {k: averaging.accusations.get(k, 0) for k in ("rechecked", "unchecked")})
        yield _counter("swarmd_averaging_rechecks_not_taken", "stage-mates that did not take up a conviction by "
                       "recomputation this peer showed them (refused, busy or unreachable at every try)",
                       averaging.accusations.get("recheck_not_taken", 0))
        yield _by("swarmd_averaging_openings", "opened contributions (issue 29, item 3): sent by this peer, and "
                  "checked as leader: ok, missing, bad (refused), inconsistent (convicted); a sampled microbatch "
                  "recomputed, its part a mismatch (convicted), or unchecked (other parameters)", "outcome",
                  {k: averaging.openings.get(k, 0) for k in ("sent", "ok", "missing", "bad", "inconsistent",
                                                              "recomputed", "mismatch", "unchecked")})
        yield _by("swarmd_averaging_audits", "(all-reduce) audits of part owners: drawn, noticed (a stage-mate's "
                  "notice), suspected (a mean against this peer's slice), ok, mismatch (convicted), unaccountable "
                  "(it would not show its evidence: excluded), unanswered (gone), unprovable; shown to stage-mates, "
                  "seconded, not_seconded, busy, skipped",
                  "outcome", {k: averaging.audits.get(k, 0) for k in AUDIT_OUTCOMES})
        yield _counter("swarmd_averaging_leaders_refused", "leaders' answers this peer refused (each counts once "
                       "per refusal, summed over leaders)", sum(averaging.leaders_refused.values()))
        yield _counter("swarmd_averaging_leaders_stalling", "times this peer excluded a leader that aborted or turned "
                       "away every round at one step", sum(averaging.leaders_stalling.values()))
        yield _by("swarmd_averaging_control_requests", "averaging requests without gradients this peer sent (progress "
                  "polls; the all-reduce's reports, ready reports and decision queries), by kind: per round, divide by "
                  "swarmd_averaging_rounds", "kind", averaging.control_requests)
        yield _counter("swarmd_averaging_silent_contributors", "expected contributors that never came to a round "
                       "this peer led (then excluded)", averaging.silent_contributors)
        yield _counter("swarmd_averaging_dissenting_mates", "stage-mates this peer stopped waiting for to agree on "
                       "the round's leader (named another for longer than the stage's patience)",
                       averaging.dissenting_mates)
        yield _counter("swarmd_averaging_duplicate_microbatches", "microbatch ids found in two contributions of one "
                       "round this peer led (exactly-once, issue 13)", averaging.duplicate_microbatches)
        yield _by("swarmd_averaging_excluded_peers", "stage-mates this peer leaves out of its rounds now, by why",
                  "by", {"checks": len(averaging.excluded), "reports": len(averaging.excluded_by_reports)},
                  counter=False)
        proofs = averaging.proofs or ProofsInfo()
        yield _by("swarmd_proof_peers", "stage-mates by the state of their proofs (a signed challenge at their "
                  "address)", "state", {"proven": proofs.proven, "failing": proofs.failing,
                                        "unproven": proofs.unproven}, counter=False)
        yield _counter("swarmd_proofs_ok", "stage-mates' proofs that succeeded", proofs.proofs_ok)
        yield _by("swarmd_proofs_failed", "stage-mates' proofs that failed, by reason", "reason", proofs.proofs_failed)

    @staticmethod
    def _reports(reports: ReportsInfo) -> Iterator[Metric]:
        """Trainers' signed misbehaviour reports (``POST /v1/report``, issue #17)."""
        yield _by("swarmd_reports", "trainers' misbehaviour reports, by outcome", "outcome",
                  {"received": reports.received, "accepted": reports.accepted})
        yield _by("swarmd_reports_refused", "misbehaviour reports refused, by reason", "reason", reports.refused)
        yield _counter("swarmd_report_exclusions", "peers excluded by two independent reports", reports.exclusions)
        yield _gauge("swarmd_reports_excluded_peers", "peers excluded by reports now", reports.excluded_now)
        yield _gauge("swarmd_reports_suspected_peers", "peers accused by one report and not excluded: trainers "
                     "check their answers more", len(reports.suspected))

    @staticmethod
    def _cache(cache: ActivationCacheInfo) -> Iterator[Metric]:
        # held: backwards served from the inputs the peer kept (sent without them); unheld: refused, resent (#30)
        for key, value in (("hits", cache.hits), ("misses", cache.misses), ("mismatches", cache.mismatches),
                           ("evictions", cache.evictions), ("skipped", cache.skipped), ("held", cache.held),
                           ("unheld", cache.unheld)):
            yield _counter(f"swarmd_activation_cache_{key}", f"activation cache {key}", value)
        yield _gauge("swarmd_activation_cache_entries", "forwards' graphs kept for their backward", cache.entries)
        yield _gauge("swarmd_activation_cache_bytes", "bytes held by the activation cache", cache.bytes)

    @staticmethod
    def _auth(auth: AuthInfo | None) -> Iterator[Metric]:
        family = CounterMetricFamily("swarmd_auth_refusals", "requests and datagrams refused for lacking the swarm "
                                     "key, by plane and reason", labels=["plane", "reason"])
        refused = auth.refused if auth is not None else AuthRefusals()
        for plane, counts in (("dht", refused.dht), ("data_plane", refused.data_plane)):
            for reason, count in sorted(counts.items()):
                family.add_metric([plane, reason], float(count))
        yield family

    @staticmethod
    def _migration(migration: MigrationInfo | None) -> Iterator[Metric]:
        family = GaugeMetricFamily("swarmd_migration_info", "the last move between stages (1)",
                                   labels=["from_stage", "to_stage", "phase", "reason"])
        started = None
        if migration is not None:
            family.add_metric([str(migration.from_stage), str(migration.to), str(migration.phase),
                               str(migration.reason)[:64]], 1.0)
            started = migration.started_at
        yield family
        yield _gauge("swarmd_migration_started_timestamp_seconds", "unix time the last move started", started)

    @staticmethod
    def _checkpoint(checkpoint: CheckpointStatus | None) -> Iterator[Metric]:
        newest = checkpoint.newest if checkpoint is not None else None
        yield _gauge("swarmd_checkpoint_age_seconds", "age of the newest checkpoint under --state-dir",
                     newest.age_s if newest is not None else None)
        yield _counter("swarmd_checkpoint_writes", "checkpoints written", checkpoint.writes if checkpoint else 0)
        yield _counter("swarmd_checkpoint_failures", "checkpoint writes that failed",
                       checkpoint.failures if checkpoint else 0)

    @staticmethod
    def _relay(relay: RelayInfo) -> Iterator[Metric]:
        server, client = relay.server, relay.client
        yield _counter("swarmd_relay_served_requests", "requests relayed for unreachable peers", server.requests)
        yield _counter("swarmd_relay_served_bytes", "bytes relayed for unreachable peers", server.bytes)
        yield _gauge("swarmd_relay_peers", "unreachable peers relayed through this one", len(server.peers))
        yield _gauge("swarmd_relayed", "1 while this peer is reached through a relay",
                     1.0 if client is not None and client.state == "relayed" else 0.0)
        yield _counter("swarmd_relayed_requests", "requests that reached this peer through its relay",
                       client.requests if client is not None else 0)
        yield _by("swarmd_relay_refused", "relay requests this peer refused, by reason", "reason", server.refused)

    @staticmethod
    def _dht(stats: Mapping[str, Any] | None) -> Iterator[Metric]:
        stats = stats or {}
        yield _gauge("swarmd_dht_routing_table_peers", "DHT contacts in the routing table",
                     stats.get("routing_table_size", 0))
        yield _gauge("swarmd_dht_stored_records", "records this DHT node stores", stats.get("stored_records", 0))
        yield _by("swarmd_dht_rejected_records", "DHT records refused, by reason", "reason",
                  stats.get("rejected") or {})
        yield _by("swarmd_dht_dropped_datagrams", "DHT datagrams dropped, by reason", "reason",
                  stats.get("dropped_datagrams") or {})

    @staticmethod
    def _training(training: TrainingLog) -> Iterator[Metric]:
        live = training.live_trainers()
        yield _gauge("swarmd_trainers", "trainers registered here that reported lately", len(live))
        yield _gauge("swarmd_trainer_samples_per_second", "samples/s of the trainers registered here",
                     sum(r.samples_per_s for r in live.values()))
        losses = [r.loss for r in live.values() if r.loss is not None]
        yield _gauge("swarmd_trainer_loss", "mean newest training loss of the trainers registered here",
                     sum(losses) / len(losses) if losses else None)
        swarm = training.swarm[-1] if training.swarm else None
        yield _gauge("swarmd_swarm_loss", "the swarm's training loss, merged from every daemon's DHT record",
                     swarm.loss if swarm is not None else None)
        yield _gauge("swarmd_swarm_val_loss", "the swarm's validation loss, merged from the DHT",
                     swarm.val_loss if swarm is not None else None)
        yield _gauge("swarmd_swarm_samples_per_second", "the swarm's samples/s, summed over reporting trainers",
                     swarm.samples_per_s if swarm is not None else None)


class DaemonMetrics:
    """One daemon's registry: the scrape-time collector plus the request observations."""

    def __init__(self, source: MetricsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)  # no scrape-time read at construction
        self.registry.register(StatusCollector(source))
        r = self.registry
        self.data_requests = Counter("swarmd_data_plane_requests", "data-plane requests, by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.data_seconds = Histogram("swarmd_data_plane_request_duration_seconds", "data-plane request latency",
                                      ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.data_in = Counter("swarmd_data_plane_received_bytes", "request bodies received, by endpoint and the "
                               "codec the request named", ["endpoint", "codec"], registry=r)
        self.data_out = Counter("swarmd_data_plane_sent_bytes", "reply bodies sent, by endpoint and the codec the "
                                "request named (state transfer: /v1/state)", ["endpoint", "codec"], registry=r)
        self.api_requests = Counter("swarmd_control_plane_requests", "control-plane requests, by endpoint and "
                                    "status (401: token refusals)", ["endpoint", "status"], registry=r)
        self.api_seconds = Histogram("swarmd_control_plane_request_duration_seconds", "control-plane latency",
                                     ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.round_seconds = Histogram("swarmd_averaging_round_duration_seconds", "averaging rounds this peer "
                                       "took part in, from taking its gradients to the outcome, by result",
                                       ["result"], buckets=ROUND_BUCKETS_S, registry=r)
        for result in ROUND_RESULTS:  # every result shows, at 0, before the first round
            self.round_seconds.labels(result)

    def render(self) -> bytes:
        """The exposition, in Prometheus text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def observe_api(self, endpoint: str, status: int, seconds: float) -> None:
        self.api_requests.labels(endpoint, str(status)).inc()
        self.api_seconds.labels(endpoint).observe(seconds)

    def observe_round(self, record: Mapping[str, Any]) -> None:
        """An averaging round the averager recorded (its ``last_round``): its duration by result."""
        seconds = record.get("duration_s")
        result = str(record.get("status"))
        if isinstance(seconds, (int, float)) and result in ROUND_RESULTS:
            self.round_seconds.labels(result).observe(float(seconds))

    def data_plane_middleware(self) -> Middleware:
        """An aiohttp middleware counting the data plane's requests, bytes and latency by route."""

        @web.middleware
        async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
            started = time.perf_counter()
            route = request.match_info.route.resource
            endpoint = route.canonical if route is not None else "other"
            status = 500
            response: web.StreamResponse | None = None
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            finally:
                self.data_requests.labels(endpoint, str(status)).inc()
                self.data_seconds.labels(endpoint).observe(time.perf_counter() - started)
                codec = str(request.get(CODEC_KEY, "none"))
                self.data_in.labels(endpoint, codec).inc(request.content_length or 0)
                self.data_out.labels(endpoint, codec).inc(_body_bytes(response))

        return observe


def _body_bytes(response: web.StreamResponse | None) -> int:
    """A reply's body size: a plain Response knows it; a streamed one (GET /v1/state) counts what it wrote."""
    if response is None:
        return 0
    if isinstance(response, web.Response) and response.body is not None:
        size = response.content_length
        return size if size is not None else 0
    return int(getattr(response, "body_length", 0) or 0)
