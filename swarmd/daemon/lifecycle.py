"""One long-running daemon per machine: it owns every task and shuts down in a fixed order.

Start-up, in this order (readiness is an explicit event, set last, so nothing acts on a
half-started peer; hivemind #634 announced before its DHT was up):

1. bind every port (``swarmd.net.ports``: a taken one fails at once, naming its flag; the CLI
   binds them even before importing torch); load (or create) the peer's key from ``--state-dir``
   and start the DHT node: found a new DHT, or join one through ``--join`` with bounded retries;
2. learn the model: a founder publishes its spec as the swarm record; a joiner reads the swarm
   record (and refuses an explicit ``--model`` that disagrees);
3. pick the stage (``--stage auto``: where the rebalancing policy needs a peer most, claimed in
   the DHT and taken in turn with the newcomers that start at the same moment,
   ``swarmd.pipeline.placement.claims``) and announce it as ``joining`` at once;
4. build the stage off the loop, start the data plane and the control plane;
5. announce ``joining`` with its addresses; take the stage's newest state wherever it is
   (``swarmd.pipeline.placement.resume``: a live stage-mate, this peer's own checkpoint, another peer's
   checkpoint offered through the swarm), fresh parameters only while nothing has trained, and
   wait, saying so loudly, while a trained stage's state is nowhere;
6. announce ``serving``; set ``ready``; re-announce every announce period, take part in the
   stage's averaging rounds (``swarmd.pipeline.averaging.averager``) and run the rebalancing loop
   (``swarmd.pipeline.placement.migration``).

``Daemon`` keeps the lifecycle and the wiring; its parts live beside it, each in the file named
after its job, and see the daemon as a :class:`~swarmd.daemon.host.Host`: choosing the address,
model and stage (``joining.py``), the served stage's state in and out (``stage_state.py``), what
it announces and reads back (``announcing.py``), reachability and relays (``relaying.py``), and
``/status`` and ``/swarm`` (``views.py``). Elsewhere: moving between stages
(``pipeline/placement/migration.py``), choosing a donor and checking a downloaded state
(``pipeline/placement/state_sync.py``), the state-directory lock (``state_dir.py``), supervising background
tasks (``tasks.py``) and the control plane's schema (``api/models.py``). The stage it serves is
one :class:`~swarmd.pipeline.stage.runtime.StageRuntime` (executor + averager) held in
``Daemon.runtime``, which a migration replaces in one assignment.

Every background loop is a task of one :class:`~swarmd.tasks.TaskSet`. A loop that crashes is
logged with its traceback: the announce, averaging and rebalance loops are restarted (with
backoff); the control plane's crash, or a move that cannot be undone, stops the daemon, which
then exits non-zero (``exit_code``).

Shutdown (SIGTERM/SIGINT via the CLI, or ``request_stop``), in this order:

1. state ``draining``, announced in the DHT; the data plane closes its listening socket and
   answers new requests on open connections with 503, so clients go elsewhere at once;
2. in-flight requests finish, bounded by ``net.drain_timeout_s``;
3. the data plane closes, then the stage's worker thread finishes its queue and stops;
4. the peer withdraws its record (a ``stopped`` record replaces it, so every view drops it at
   once); the control plane stops, so ``/status`` shows ``draining`` until the very end; the
   DHT node stops last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import IO, Any, cast

import aiohttp

from swarmd.api.app import create_app
from swarmd.api.metrics import DaemonMetrics
from swarmd.api.server import EmbeddedUvicorn
from swarmd.api.trainer_ranks import RankBook
from swarmd.api.trainers import TrainerRegistry
from swarmd.checkpoint import Checkpointer
from swarmd.config import Config
from swarmd.daemon import views
from swarmd.daemon.announcing import ANNOUNCE_TASK, Announcer, random_jitter
from swarmd.daemon.control_plane import ControlPlane, TrainingSummary
from swarmd.daemon.joining import Joining
from swarmd.daemon.relaying import RELAY_TASK, Relaying
from swarmd.daemon.stage_state import CHECKPOINT_TASK, StageState
from swarmd.dht.identity import Identity
from swarmd.dht.membership import Membership
from swarmd.dht.node import DHTNode
from swarmd.dht.sources import Grouping
from swarmd.errors import SwarmdError
from swarmd.net import codecs, reachability
from swarmd.net.addresses import Announced, format_addr, is_wildcard
from swarmd.net.client import DataPlaneClient, client_session
from swarmd.net.ports import Listeners, bind_listeners
from swarmd.net.proof import ProofService, Prover
from swarmd.net.relay import RelayClient, RelayServer
from swarmd.net.server import DataPlane
from swarmd.peer_state import PeerState
from swarmd.pipeline.averaging.allreduce.averager import AllReduceAverager
from swarmd.pipeline.averaging.allreduce.evidence_store import KeptEvidence
from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.placement.migration import Migrator
from swarmd.pipeline.placement.resume import Plan, Source
from swarmd.pipeline.reports import MisbehaviourReport, ReportLedger
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.stage.runtime import StageRuntime
from swarmd.state_dir import lock_state_dir
from swarmd.tasks import TaskSet
from swarmd.training_summary import TrainingLog

__all__ = ["Daemon"]

log = logging.getLogger(__name__)

AVERAGER_TASK, REBALANCE_TASK = "averager", "rebalance"
TRAINING_TASK = "training-summary"


class Daemon:
    """A swarmd peer serving one stage. Use ``async with Daemon(cfg) as d`` or ``await d.run()``."""

    def __init__(self, config: Config, *, listeners: Listeners | None = None) -> None:
        self.config = config
        self.state = PeerState.STARTING
        self.ready = asyncio.Event()
        self.stop_requested = asyncio.Event()
        self.exit_code = 0  # non-zero once a background task crashed and stopped the daemon
        self.started_at = time.monotonic()
        self.identity: Identity | None = None
        self.dht: DHTNode | None = None
        self.membership: Membership | None = None
        self.spec: ModelSpec | None = None  # known once the swarm is resolved
        self.training: TrainingSpec = config.pipeline.training or TrainingSpec()
        self.runtime: StageRuntime | None = None  # the stage this peer serves; swapped whole by a migration
        self.founder = not config.dht.join
        self.session: aiohttp.ClientSession | None = None  # signs requests to stage-mates in a private swarm
        self.data_plane: DataPlane | None = None
        self.api_addr: tuple[str, int] | None = None
        self.announced: Announced | None = None  # the host others dial (swarmd.net.addresses)
        self.reachability = reachability.Reachability()  # whether they can (swarmd.net.reachability)
        self.prover = Prover(lambda: self.session)  # which peers proved themselves (swarmd.net.proof)
        # trainers' signed reports of wrong answers; two independent ones exclude a peer (issue 17)
        self.reports = ReportLedger(on_exclude=self._on_report_exclusion)
        self.migrator = Migrator(self)
        self.tasks = TaskSet(on_fatal=self._on_fatal)
        # the parts (swarmd.daemon.host: each sees this daemon as its Host)
        self.stage_state = StageState(self)
        self.joining = Joining(self, self.stage_state)
        self.relaying = Relaying(self)
        self.announcer = Announcer(self, joining=self.joining, stage_state=self.stage_state, relaying=self.relaying)
        net = config.net
        self.relay_server = RelayServer(lambda: self.identity, addr=lambda: self.data_addr,
                                        enabled=self.relaying.for_others, max_peers=net.relay_max_peers,
                                        budget_bytes_s=net.relay_budget_bytes_s)
        self.relay_client: RelayClient | None = None  # while this peer, unreachable, is relayed
        self.relayed_addr: str | None = None  # what it announces then: <peer id>@<relay address>
        self._probes = reachability.ProbeService(lambda: self.peer_id, lambda: self.session)
        self._proofs = ProofService(lambda: self.identity, lambda: self.data_addr, lambda: self.executor)
        # seeing the swarm: the Prometheus registry, trainers' registrations and ranks, their training log
        self.training_log = TrainingLog(live_s=config.dht.record_ttl_s)
        self.summary = TrainingSummary(self.training_log, swarm=config.swarm, ttl_s=config.dht.record_ttl_s,
                                       dht=lambda: self.dht, identity=lambda: self.identity)
        self.trainers = TrainerRegistry(on_report=self.summary.on_report)
        self.ranks = RankBook(self.trainers, dht=lambda: self.dht, identity=lambda: self.identity,
                              swarm=config.swarm, ttl_s=config.dht.record_ttl_s)  # swarmd.api.trainer_ranks
        self.metrics = DaemonMetrics(self)
        self.control_plane = ControlPlane(self.tasks, request_timeout_s=config.api.request_timeout_s)
        self._listeners = listeners  # every port, bound first (by the CLI, or _bind_first), then handed on
        self._state_lock: IO[str] | None = None
        state_dir = config.dht.state_dir
        self._kept_evidence = KeptEvidence(state_dir / "audits" if state_dir is not None else None)
        self._stopping = False
        self._shutdown_done = False

    # ---- what the daemon serves ----------------------------------------------------------------

    @property
    def peer_id(self) -> str | None:
        return self.identity.peer_id if self.identity else None

    @property
    def stage(self) -> int | None:
        return self.runtime.stage if self.runtime is not None else self.joining.stage

    @property
    def executor(self) -> StageExecutor | None:
        return self.runtime.executor if self.runtime is not None else None

    @property
    def averager(self) -> StageAverager | None:
        return self.runtime.averager if self.runtime is not None else None

    @property
    def checkpoints(self) -> Checkpointer | None:
        return self.stage_state.checkpoints

    @property
    def migration(self) -> dict[str, Any] | None:
        """The last move between stages (see ``swarmd.pipeline.placement.migration``)."""
        status = self.migrator.status
        return status.to_dict() if status is not None else None

    @property
    def data_addr(self) -> str | None:
        """The data-plane address this peer announces: what trainers and stage-mates dial."""
        if self.data_plane is None or self.data_plane.address is None:
            return None
        if self.relayed_addr is not None:
            return self.relayed_addr
        bound = self.data_plane.address
        if self.announced is None:
            return format_addr(bound)
        return self.announced.addr(self.config.net.announce_port or bound[1])

    @property
    def dht_addr(self) -> str | None:
        """The DHT contact address to give others (``--join``): announced host, bound port."""
        if self.dht is None or not self.dht.running:
            return None
        host, port = self.dht.address
        if is_wildcard(host) and self.announced is not None:
            host = self.announced.host
        return format_addr((host, port))

    # what other components and the tests ask of the daemon, answered by its parts
    @property
    def synced_from(self) -> str | None:
        return self.stage_state.synced_from

    @property
    def last_sync_s(self) -> float | None:
        return self.stage_state.last_sync_s

    @property
    def announcements(self) -> int:
        return self.announcer.announcements

    async def announce(self) -> None:
        await self.announcer.announce()

    async def announce_quietly(self) -> None:
        await self.announcer.announce_quietly()

    async def stage_mates(self, max_age_s: float = 1.0, *, fresh: bool = False) -> dict[str, str]:
        return await self.announcer.stage_mates(max_age_s, fresh=fresh)

    def forget_stage_mates(self) -> None:
        self.announcer.forget_stage_mates()

    async def sync_state(self, *, min_step: int, required: bool, runtime: StageRuntime | None = None) -> bool:
        return await self.stage_state.sync(min_step=min_step, required=required, runtime=runtime)

    async def plan_state(self, stage: int, *, min_step: int = 0, confirm: bool = False) -> Plan:
        return await self.stage_state.plan(stage, min_step=min_step, confirm=confirm)

    async def obtain_state(self, runtime: StageRuntime, *, wait: bool) -> Source:
        return await self.stage_state.obtain(runtime, wait=wait)

    async def check_reachability(self) -> None:
        await self.relaying.check()

    def status(self) -> dict[str, Any]:
        """``GET /status`` (``swarmd.daemon.views``)."""
        return views.status(self, self.stage_state, announcements=self.announcer.announcements,
                            coverage=self.announcer.coverage)

    async def swarm_view(self) -> dict[str, Any]:
        """``GET /swarm`` (``swarmd.daemon.views``)."""
        return await views.swarm_view(self, own=self.announcer.record())

    def welcome(self) -> dict[str, Any]:
        """What a registering trainer needs (``swarmd.daemon.views``)."""
        return views.welcome(self)

    def dht_stats(self) -> dict[str, Any] | None:
        return self.dht.stats() if self.dht is not None else None

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        listeners = self._bind_first()  # before anything starts, so a failure has nothing to shut down
        try:
            self.joining.check_static_address()
            await self._join_dht()
            await self.joining.learn_address()
            self.spec, self.training = await self.joining.resolve_swarm()
            await self.stage_state.scan()
            stage = await self.joining.resolve_stage(self.spec)
            await asyncio.to_thread(codecs.warm_up)
            self.runtime = await self.build_runtime(stage)
            self.session = client_session(cfg.swarm_key)  # signs requests to stage-mates in a private swarm
            self.data_plane = DataPlane(lambda: self.runtime, limits=cfg.net.limits,
                                        read_timeout_s=cfg.net.read_timeout_s, swarm_key=cfg.swarm_key,
                                        relay=self.relay_server, peer_id=lambda: self.peer_id, reports=self.reports,
                                        hops=DataPlaneClient(session=self.session, limits=cfg.net.limits))
            for service in (self._probes, self._proofs, self.stage_state.offers):
                service.install(self.data_plane.app)
            self.data_plane.app.middlewares.insert(0, self.metrics.data_plane_middleware())  # outermost: sees all
            self.relay_server.install(self.data_plane.app)
            data_addr = await self.data_plane.start(sock=listeners.data)
            log.info("data plane listening on http://%s, announced as %s (%s)", format_addr(data_addr),
                     self.data_addr, self.announced.how if self.announced else "bound")
            await self._start_api()
            log.info("control plane listening on http://%s (docs at /docs)", format_addr(self.api_addr))
            self.state = PeerState.JOINING
            await self.announce()
            await self.stage_state.obtain(self.runtime, wait=True)
            await self.stage_state.note_newest()
            await self.relaying.check()
            if self.reachability.status == "no":
                self.relaying.start()
            self.state = PeerState.SERVING
            await self.announce()
            await self.announcer.refresh_coverage()
            self.tasks.spawn(ANNOUNCE_TASK, self.announcer.run, restart=True)
            self.tasks.spawn(TRAINING_TASK, lambda: self.summary.run(self.config.dht.announce_period_s, random_jitter,
                                                                     self.ranks.publish), restart=True)
            self.start_averaging()
            self.tasks.spawn(REBALANCE_TASK, self.migrator.rebalance_loop, restart=True)
            self.stage_state.start_checkpointing()
        except BaseException:
            await self.shutdown()
            raise
        self.ready.set()
        log.info("serving stage %d/%d of model %s (%s) in swarm %r as peer %s",
                 stage, self.spec.n_stages, self.spec.name, self.spec.digest[:12], cfg.swarm, self.peer_id)

    async def build_runtime(self, stage: int) -> StageRuntime:
        """A fresh runtime for ``stage``: its parameters built (off the loop) at step 0."""
        assert self.spec is not None  # resolved before any stage is built
        pipe = self.config.pipeline
        executor = await asyncio.to_thread(StageExecutor, self.spec, stage, pipe.device, training=self.training,
                                           max_batch_tokens=pipe.max_batch_tokens, threads=pipe.threads,
                                           precision=pipe.precision,
                                           activation_cache_entries=pipe.activation_cache_entries,
                                           activation_cache_bytes=pipe.activation_cache_bytes,
                                           activation_cache_ttl_s=pipe.activation_cache_ttl_s)
        return StageRuntime(executor)

    def spawn(self, name: str, factory: Any, *, restart: bool = False) -> asyncio.Task[None]:
        return self.tasks.spawn(name, factory, restart=restart)

    def start_averaging(self) -> None:
        """Take part in the current stage's averaging rounds."""
        runtime = self.runtime
        if self._stopping or runtime is None or runtime.averager is not None:
            return
        assert self.identity is not None and self.session is not None  # set in start() before serving
        # the training spec picks the round: one leader, or the chunked all-reduce (issue 28)
        kind = AllReduceAverager if runtime.executor.training.averaging == "allreduce" else StageAverager
        averager = kind(
            runtime.executor,
            peer_id=self.identity.peer_id,
            stage_peers=self.stage_mates,
            session=self.session,
            on_behind=self.stage_state.resync,
            identity=self.identity,
            prover=self.prover,
            exclude=self._ledger_excluded,
            on_round=self.metrics.observe_round,  # swarmd_averaging_round_duration_seconds
        )
        if isinstance(averager, AllReduceAverager):
            # the evidence of drawn parts it reduced outlives a move to another stage and, on disk, a restart: an
            # owner that cannot show it is held to account as one that lied (``allreduce.evidence_store``)
            averager.auditor.kept = self._kept_evidence
        runtime.averager = averager
        self.tasks.spawn(AVERAGER_TASK, averager.run, restart=True)

    def _ledger_excluded(self) -> set[str]:
        """Peers the trainers' reports exclude now (``swarmd.pipeline.reports``)."""
        return set(self.reports.excluded())

    def _on_report_exclusion(self, peer_id: str, seconds: float, report: MisbehaviourReport) -> None:
        log.warning("peer %s excluded for %.0fs: reported by %d independent checks, the last by trainer %s "
                    "(stage %d step %d %s mb %d, request %s, answers %s)", peer_id, seconds,
                    self.reports.reporters_needed, report.reporter_id[:12], report.stage, report.step, report.kind,
                    report.mb, report.request_digest[:16],
                    ", ".join(f"{p[:12]}={d[:12]}" for p, d in report.answers))

    def _untrusted_evidence(self) -> dict[str, str]:
        """Peers this daemon's views leave out (swarmd.dht.membership, issue 18), with the reason: caught by
        the stage's round checks or excluded by reports."""
        return {pid: "excluded" for pid in self.excluded_peers()}

    def excluded_peers(self) -> set[str]:
        """Peers this stage does not trust now (nor takes state from): caught by its round checks lately, or
        excluded by reports."""
        averager = self.averager
        return averager.distrusted() if averager is not None else self._ledger_excluded()

    async def stop_averaging(self) -> None:
        await self.tasks.cancel(AVERAGER_TASK)
        runtime = self.runtime
        if runtime is not None and runtime.averager is not None:
            averager, runtime.averager = runtime.averager, None
            await averager.close()

    async def pause_serving(self) -> None:
        assert self.data_plane is not None  # started before any move
        await self.data_plane.pause(self.config.net.drain_timeout_s)

    def resume_serving(self) -> None:
        if self.data_plane is not None:
            self.data_plane.resume()

    async def request_migration(self, stage: int, *, force: bool = False, reason: str = "by hand") -> dict[str, Any]:
        """Check a move to ``stage`` and start it (``POST /migrate``); MigrationRefused says why not."""
        return await self.migrator.request(stage, force=force, reason=reason)

    def request_stop(self) -> None:
        """Ask the daemon to drain and stop (safe to call from a signal handler, repeatedly)."""
        if not self.stop_requested.is_set():
            log.info("stop requested: draining in-flight requests")
        self.stop_requested.set()

    def _on_fatal(self, name: str, exc: BaseException) -> None:
        self.exit_code = 1
        log.critical("stopping: the %s task failed (%s: %s)", name, type(exc).__name__, exc)
        self.request_stop()

    async def run(self) -> None:
        """Start, serve until ``request_stop``, then shut down in order."""
        await self.start()
        await self.run_started()

    async def run_started(self) -> None:
        """Serve a started daemon until ``request_stop`` (or a fatal task crash), then shut down."""
        try:
            await self.stop_requested.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        if self._shutdown_done:
            return
        self._shutdown_done = True
        self._stopping = True
        was_serving = self.state in (PeerState.SERVING, PeerState.MIGRATING)
        self.state = PeerState.DRAINING
        self.ready.clear()
        for name in (REBALANCE_TASK, Migrator.TASK, ANNOUNCE_TASK, RELAY_TASK, CHECKPOINT_TASK):
            await self.tasks.cancel(name)
        await self.relay_server.close()  # the peers relayed through this one find another relay
        await self.stop_averaging()
        if was_serving:
            try:  # tell trainers and peers at once rather than letting the record expire
                await asyncio.wait_for(self.announce(), 3.0)
            except (SwarmdError, asyncio.TimeoutError) as exc:
                log.warning("could not announce draining: %s", exc or "timed out")
        if self.data_plane is not None:
            await self.data_plane.drain(self.config.net.drain_timeout_s)
            if was_serving:
                await self.stage_state.leave()
            await self.data_plane.close()
            if self.data_plane.hops is not None:
                await self.data_plane.hops.close()  # its codec threads; the session is the daemon's
        if self.runtime is not None:
            await self.runtime.close()
        if self.session is not None:
            await self.session.close()
        await self.announcer.withdraw()
        await self.control_plane.stop()
        await self.tasks.close()
        if self.dht is not None:
            await self.dht.stop()
        if self._state_lock is not None:
            self._state_lock.close()
        if self._listeners is not None:  # those not handed on yet, when start-up failed half-way
            self._listeners.close()
        self.state = PeerState.STOPPED
        log.info("stopped")

    async def __aenter__(self) -> Daemon:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ---- joining -------------------------------------------------------------------------------

    def _bind_first(self) -> Listeners:
        """Every port bound before anything starts (unless the CLI bound them already, before it
        imported torch): a taken port or a host that is not this machine's fails in one sentence."""
        if self._listeners is None:
            cfg = self.config
            self._listeners = bind_listeners((cfg.net.host, cfg.net.port), (cfg.api.host, cfg.api.port),
                                             (cfg.dht.host, cfg.dht.port))
        return self._listeners

    async def _join_dht(self) -> None:
        assert self._listeners is not None  # bound first, in start()
        dht = self.config.dht
        if dht.state_dir is not None:
            self._state_lock = lock_state_dir(dht.state_dir)
            self.identity = await asyncio.to_thread(Identity.load_or_create, dht.state_dir)
        else:
            self.identity = Identity.generate()
        key = self.config.swarm_key
        self.dht = DHTNode(self.identity, host=dht.host, port=dht.port, rpc_timeout=1.0, swarm_key=key,
                           max_per_source=dht.max_per_source,
                           source_grouping=cast("Grouping", dht.source_grouping))  # checked by source_group()
        if key is not None:
            log.info("private swarm: DHT datagrams and data-plane requests are authenticated with the swarm key "
                     "from %s (key id %s)", key.source or "the config", key.key_id)
        await self.dht.start(dht.join, deadline_s=dht.bootstrap_timeout_s, sock=self._listeners.dht)
        log.info("%s; DHT node on udp://%s", "joined the swarm's DHT" if dht.join else "founded a new DHT",
                 format_addr(self.dht.address))
        self.membership = Membership(self.dht, self.identity, self.config.swarm, ttl_s=dht.record_ttl_s,
                                     evidence=self._untrusted_evidence)

    # ---- seeing the swarm: the training summary; the control plane (swarmd.daemon.control_plane) --

    async def publish_training_summary(self) -> None:
        await self.summary.publish()

    @property
    def _api_server(self) -> EmbeddedUvicorn | None:
        return self.control_plane.server

    async def _start_api(self) -> None:
        assert self._listeners is not None  # bound first, in start()
        sock = self._listeners.api
        self.api_addr = sock.getsockname()[:2]
        app = create_app(self, self.trainers, api_token=self.config.api.token, metrics=self.metrics,
                         training=self.training_log, ranks=self.ranks)
        await self.control_plane.start(app, sock, stopping=lambda: self._stopping)
