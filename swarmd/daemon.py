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
   ``swarmd.pipeline.claims``) and announce it as ``joining`` at once;
4. build the stage off the loop, start the data plane and the control plane;
5. announce ``joining`` with its addresses; take the stage's newest state wherever it is
   (``swarmd.pipeline.resume``: a live stage-mate, this peer's own checkpoint, another peer's
   checkpoint offered through the swarm), fresh parameters only while nothing has trained, and
   wait, saying so loudly, while a trained stage's state is nowhere;
6. announce ``serving``; set ``ready``; re-announce every announce period, take part in the
   stage's averaging rounds (``swarmd.pipeline.averaging``) and run the rebalancing loop
   (``swarmd.pipeline.migration``).

What the daemon does *not* do itself, each in the file named after it: moving between stages
(``pipeline/migration.py``), choosing a donor and checking a downloaded state
(``net/state_sync.py``), the state-directory lock (``state_dir.py``), supervising background
tasks (``tasks.py``) and the control plane's schema (``api/models.py``). The stage it serves is
one :class:`~swarmd.pipeline.runtime.StageRuntime` (executor + averager) held in
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
import ipaddress
import logging
import random
import socket
import time
from typing import IO, Any, cast

import aiohttp

from swarmd import __version__
from swarmd.api.app import create_app
from swarmd.api.metrics import DaemonMetrics
from swarmd.api.models import ModelInfo, PrecisionInfo, StageHealthInfo, Status, TrainerReport
from swarmd.api.server import EmbeddedUvicorn, embedded_server
from swarmd.api.trainer_ranks import RankBook
from swarmd.api.trainers import TrainerRegistry
from swarmd.checkpoint import Checkpointer, CheckpointInfo, find_checkpoints, mismatch
from swarmd.config import Config
from swarmd.dht.identity import Identity
from swarmd.dht.membership import Membership
from swarmd.dht.node import DHTNode
from swarmd.dht.records import MAX_HELD, PeerRecord, sign_record
from swarmd.dht.sources import Grouping
from swarmd.errors import ConfigError, StageStateLost, SwarmdError
from swarmd.net import codecs, reachability
from swarmd.net.addresses import (
    Announced,
    choose_host,
    default_route_source,
    family_of,
    format_addr,
    is_relayed,
    is_wildcard,
    loopback_mismatch,
    route_source,
)
from swarmd.net.checkpoint_offers import CheckpointOffers, checkpoint_path
from swarmd.net.client import client_session
from swarmd.net.handover import GradientsRequest, hand_over, handover_order
from swarmd.net.ports import Listeners, bind_listeners
from swarmd.net.proof import ProofService, Prover
from swarmd.net.relay import RelayClient, RelayServer
from swarmd.net.server import DataPlane
from swarmd.net.state_sync import adopt_state, choose_donors, proven_donors
from swarmd.peer_state import PeerState
from swarmd.pipeline.averaging import StageAverager
from swarmd.pipeline.claims import CLAIM_WAIT_S, Claim, claims_of, settled_loads, take_turns
from swarmd.pipeline.coverage import StageHealth, stage_health
from swarmd.pipeline.executor import StageExecutor
from swarmd.pipeline.migration import Migrator
from swarmd.pipeline.reports import MisbehaviourReport, ReportLedger
from swarmd.pipeline.resume import Offer, Plan, Source, plan
from swarmd.pipeline.runtime import StageRuntime
from swarmd.pipeline.spec import PRESETS, ModelSpec, TrainingSpec
from swarmd.state_dir import lock_state_dir
from swarmd.tasks import TaskSet
from swarmd.training_summary import TrainingLog, training_key

log = logging.getLogger(__name__)

ANNOUNCE_TASK, AVERAGER_TASK, REBALANCE_TASK, API_TASK = "announce", "averager", "rebalance", "control-plane"
RELAY_TASK = "relay"
CHECKPOINT_TASK = "checkpoint"
TRAINING_TASK = "training-summary"
REACHABILITY_TASK = "reachability"
SWARM_RECORD_WAIT_S = 30.0  # how long a joiner whose DHT answered waits for the swarm's record (a founder starting)


class Daemon:
    """A swarmd peer serving one stage. Use ``async with Daemon(cfg) as d`` or ``await d.run()``."""

    def __init__(self, config: Config, *, listeners: Listeners | None = None) -> None:
        self.config = config
        self.state = PeerState.STARTING
        self.ready = asyncio.Event()
        self.exit_code = 0  # non-zero once a background task crashed and stopped the daemon
        self.identity: Identity | None = None
        self.dht: DHTNode | None = None
        self.membership: Membership | None = None
        self.spec: ModelSpec | None = None  # known once the swarm is resolved
        self.training: TrainingSpec = config.pipeline.training or TrainingSpec()
        self.runtime: StageRuntime | None = None  # the stage this peer serves; swapped whole by a migration
        self.founder = not config.dht.join
        self.data_plane: DataPlane | None = None
        self.api_addr: tuple[str, int] | None = None
        self.announcements = 0  # successful record publications, for /status and tests
        self.synced_from: str | None = None  # the stage-mate whose state this peer adopted last
        self.last_sync_s: float | None = None  # how long the last state download took
        self.announced: Announced | None = None  # the host others dial (swarmd.net.addresses)
        self.reachability = reachability.Reachability()  # whether they can (swarmd.net.reachability)
        self._probes = reachability.ProbeService(lambda: self.peer_id, lambda: self._session)
        self.prover = Prover(lambda: self._session)  # which peers proved themselves (swarmd.net.proof)
        # trainers' signed reports of wrong answers; two independent ones exclude a peer (issue 17)
        self.reports = ReportLedger(on_exclude=self._on_report_exclusion)
        self._proofs = ProofService(lambda: self.identity, lambda: self.data_addr, lambda: self.runtime)
        net = config.net
        self.relay_server = RelayServer(lambda: self.identity, addr=lambda: self.data_addr,
                                        enabled=self._relays_for_others, max_peers=net.relay_max_peers,
                                        budget_bytes_s=net.relay_budget_bytes_s)
        self.relay_client: RelayClient | None = None  # while this peer, unreachable, is relayed
        self.relayed_addr: str | None = None  # what it announces then: <peer id>@<relay address>
        self.migrator = Migrator(self)
        self.tasks = TaskSet(on_fatal=self._on_fatal)
        self._init_observability()
        self.checkpoints = self._checkpointer()  # None without a --state-dir (swarmd.checkpoint)
        self.handover: dict[str, Any] = {"handed_out": 0, "dropped": 0, "to": None}  # on graceful leave
        self._stage: int | None = None  # chosen before the runtime is built
        self._claimed_at: float | None = None  # when --stage auto claimed it (swarmd.pipeline.claims)
        self.state_source: str | None = None  # where the served stage's state came from (swarmd.pipeline.resume)
        self.coverage: list[StageHealth] = []  # every stage's health, refreshed every announce period
        self._coverage_said: dict[int, str] = {}  # the health last logged per stage
        self.offers = CheckpointOffers(self._offered_checkpoint)  # GET /v1/checkpoint/{stage}
        self._session: aiohttp.ClientSession | None = None
        self._mates_cache: tuple[float, dict[str, str], int] | None = None  # (when, mates, stage)
        self._sync_lock = asyncio.Lock()
        self._api_server: EmbeddedUvicorn | None = None
        self._api_socket: socket.socket | None = None
        self._listeners = listeners  # every port, bound first (by the CLI, or _bind_first), then handed on
        self._state_lock: IO[str] | None = None
        self._stop = asyncio.Event()
        self._stopping = False
        self._started_at = time.monotonic()
        self._shutdown_done = False

    # ---- what the daemon serves ----------------------------------------------------------------

    @property
    def peer_id(self) -> str | None:
        return self.identity.peer_id if self.identity else None

    @property
    def stage(self) -> int | None:
        return self.runtime.stage if self.runtime is not None else self._stage

    @property
    def executor(self) -> StageExecutor | None:
        return self.runtime.executor if self.runtime is not None else None

    @property
    def averager(self) -> StageAverager | None:
        return self.runtime.averager if self.runtime is not None else None

    @property
    def migration(self) -> dict[str, Any] | None:
        """The last move between stages (see ``swarmd.pipeline.migration``)."""
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

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        listeners = self._bind_first()  # before anything starts, so a failure has nothing to shut down
        try:
            self._check_static_address()
            await self._join_dht()
            await self._learn_address()
            self.spec, self.training = await self._resolve_swarm()
            await self._scan_checkpoints()
            self._stage = await self._resolve_stage(self.spec)
            await asyncio.to_thread(codecs.warm_up)
            self.runtime = await self.build_runtime(self._stage)
            self._session = client_session(cfg.swarm_key)  # signs requests to stage-mates in a private swarm
            self.data_plane = DataPlane(lambda: self.runtime, limits=cfg.net.limits,
                                        read_timeout_s=cfg.net.read_timeout_s, swarm_key=cfg.swarm_key,
                                        relay=self.relay_server, peer_id=lambda: self.peer_id, reports=self.reports)
            self._probes.install(self.data_plane.app)
            self._proofs.install(self.data_plane.app)
            self.offers.install(self.data_plane.app)
            self.data_plane.app.middlewares.insert(0, self.metrics.data_plane_middleware())  # outermost: sees all
            self.relay_server.install(self.data_plane.app)
            data_addr = await self.data_plane.start(sock=listeners.data)
            log.info("data plane listening on http://%s, announced as %s (%s)", format_addr(data_addr),
                     self.data_addr, self.announced.how if self.announced else "bound")
            await self._start_api()
            log.info("control plane listening on http://%s (docs at /docs)", format_addr(self.api_addr))
            self.state = PeerState.JOINING
            await self.announce()
            await self.obtain_state(self.runtime, wait=True)
            await self._note_newest_checkpoint()
            await self.check_reachability()
            if self.reachability.status == "no":
                self._start_relaying()
            self.state = PeerState.SERVING
            await self.announce()
            await self.refresh_coverage()
            self.tasks.spawn(ANNOUNCE_TASK, self._announce_loop, restart=True)
            self.tasks.spawn(TRAINING_TASK, self._training_summary_loop, restart=True)
            self.start_averaging()
            self.tasks.spawn(REBALANCE_TASK, self.migrator.rebalance_loop, restart=True)
            self._start_checkpointing()
        except BaseException:
            await self.shutdown()
            raise
        self.ready.set()
        log.info("serving stage %d/%d of model %s (%s) in swarm %r as peer %s",
                 self._stage, self.spec.n_stages, self.spec.name, self.spec.digest[:12], cfg.swarm, self.peer_id)

    async def build_runtime(self, stage: int) -> StageRuntime:
        """A fresh runtime for ``stage``: its parameters built (off the loop) at step 0."""
        assert self.spec is not None  # resolved before any stage is built
        pipe = self.config.pipeline
        executor = await asyncio.to_thread(StageExecutor, self.spec, stage, pipe.device, training=self.training,
                                           max_batch_tokens=pipe.max_batch_tokens, threads=pipe.threads,
                                           precision=pipe.precision)
        return StageRuntime(executor)

    def spawn(self, name: str, factory: Any, *, restart: bool = False) -> asyncio.Task[None]:
        return self.tasks.spawn(name, factory, restart=restart)

    def start_averaging(self) -> None:
        """Take part in the current stage's averaging rounds."""
        runtime = self.runtime
        if self._stopping or runtime is None or runtime.averager is not None:
            return
        assert self.identity is not None and self._session is not None  # set in start() before serving
        averager = StageAverager(
            runtime.executor,
            peer_id=self.identity.peer_id,
            stage_peers=self._stage_mates,
            session=self._session,
            on_behind=self._resync,
            identity=self.identity,
            prover=self.prover,
            exclude=self._ledger_excluded,
            on_round=self.metrics.observe_round,  # swarmd_averaging_round_duration_seconds
        )
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
        return {pid: "excluded" for pid in self._excluded_peers()}

    def _untrusted_status(self) -> dict[str, Any]:
        """``/status`` -> untrusted: peers left out of the views, and what the DHT storage refused, by source."""
        out: dict[str, Any] = self.membership.untrusted() if self.membership is not None else {}
        if self.dht is not None:
            out["dht"] = self.dht.flood_stats()
        return out

    def _excluded_peers(self) -> set[str]:
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
        if not self._stop.is_set():
            log.info("stop requested: draining in-flight requests")
        self._stop.set()

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
            await self._stop.wait()
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
                await self._leave_durably()
            await self.data_plane.close()
        if self.runtime is not None:
            await self.runtime.close()
        if self._session is not None:
            await self._session.close()
        await self._withdraw()
        await self._stop_api()
        await self.tasks.close()
        if self.dht is not None:
            await self.dht.stop()
        if self._state_lock is not None:
            self._state_lock.close()
        if self._listeners is not None:  # those not handed on yet, when start-up failed half-way
            self._listeners.close()
        self.state = PeerState.STOPPED
        log.info("stopped")

    async def _withdraw(self) -> None:
        """Replace this peer's record with a ``stopped`` one, so every view drops it now rather than
        when the record expires (a crash still leaves it to expire)."""
        if self.membership is None or self.identity is None or self.stage is None:
            return
        try:
            await asyncio.wait_for(self.membership.announce(self._peer_record(state=PeerState.STOPPED)), 3.0)
        except (SwarmdError, asyncio.TimeoutError) as exc:
            log.warning("could not withdraw this peer's record (it expires within %.0fs): %s",
                        self.config.dht.record_ttl_s, exc or "timed out")

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

    async def _resolve_swarm(self) -> tuple[ModelSpec, TrainingSpec]:
        """A founder publishes its model; a joiner takes the swarm's and checks ``--model``."""
        assert self.membership is not None  # _join_dht ran
        asked = self.config.pipeline.spec
        if self.founder:
            spec, self.training = await self._founding_settings(asked)
            await self.membership.publish_swarm(spec, self.training.to_dict())
            return spec, self.training
        # the DHT answered, so a founder is there; one started at the same moment publishes its model once it
        # has read its own checkpoints: wait for it longer than for an answer (one line says so)
        info = await self.membership.wait_for_swarm(max(SWARM_RECORD_WAIT_S, self.config.dht.bootstrap_timeout_s),
                                                    say_after_s=self.config.dht.bootstrap_timeout_s)
        if asked is not None and asked.digest != info.spec.digest:
            raise ConfigError(
                f"--model {asked.name} ({asked.digest[:12]}) is not the model of swarm {self.config.swarm!r}, "
                f"which trains {info.spec.name} ({info.spec.digest[:12]}); omit --model to serve the swarm's model"
            )
        if self.config.pipeline.training is not None:
            log.warning("training settings come from the swarm; the ones given on this joiner are ignored")
        log.info("swarm %r trains model %s (%s), published by %d peer(s)",
                 self.config.swarm, info.spec.name, info.spec.digest[:12], info.publishers)
        return info.spec, TrainingSpec.from_dict(info.training)

    async def _resolve_stage(self, spec: ModelSpec) -> int:
        """``--stage N``, or for ``--stage auto`` the stage this newcomer's claim gets in turn
        (``swarmd.pipeline.claims``); either is announced as ``joining`` at once, so newcomers that
        start a moment later count this peer where it will serve."""
        asked = self.config.pipeline.stage
        if asked is not None:
            if asked >= spec.n_stages:
                raise ConfigError(
                    f"--stage {asked} is out of range: model {spec.name} has stages 0..{spec.n_stages - 1}"
                )
            self._stage = asked
            await self._announce_quietly()
            return asked
        assert self.membership is not None  # _join_dht ran
        self._claimed_at = time.time()
        self._stage = self._turn(await self.membership.all_peers(spec.n_stages), spec)
        await self._announce_quietly()
        await asyncio.sleep(CLAIM_WAIT_S * random.uniform(1.0, 1.5))  # for claims sent at the same moment
        members = await self.membership.all_peers(spec.n_stages)
        stage = self._turn(members, spec)
        if stage != self._stage:
            self._stage = stage
            await self._announce_quietly()
        log.info("--stage auto chose stage %d (%s)", stage, self._stage_summary(members, spec))
        return stage

    def _turn(self, members: list[PeerRecord], spec: ModelSpec) -> int:
        """This newcomer's stage when every claim in ``members`` takes its turn (pure, ``take_turns``)."""
        assert self._claimed_at is not None and self.peer_id is not None
        others = [r for r in members if r.peer_id != self.peer_id]
        holds = frozenset(self.checkpoints.held) if self.checkpoints is not None else frozenset()
        mine = Claim(self.peer_id, self._claimed_at, holds)
        turns = take_turns(spec.n_stages, settled_loads(others), [*claims_of(others), mine],
                           policy=self.config.rebalance.policy, now=time.time())
        return turns[self.peer_id]

    def _stage_summary(self, members: list[PeerRecord], spec: ModelSpec) -> str:
        parts = []
        for stage in range(spec.n_stages):
            here = [r for r in members if r.stage == stage and r.peer_id != self.peer_id]
            serving = sum(r.state == "serving" for r in here)
            parts.append(f"stage {stage}: {serving} serving, {len(here) - serving} starting, "
                         f"{sum(r.throughput for r in here):.0f} samples/s")
        return ", ".join(parts)

    async def _announce_quietly(self) -> None:
        """Announce now; a DHT that refuses is a warning (the announce loop tries again)."""
        try:
            await self.announce()
        except SwarmdError as exc:
            log.warning("could not announce this peer's stage: %s", exc)

    def _check_static_address(self) -> None:
        """Before anything is bound: a loopback --announce or --host into a swarm beyond loopback."""
        net = self.config.net
        host = net.announce_host or (None if is_wildcard(net.host) else net.host)
        problem = loopback_mismatch(host, self.config.dht.join) if host else None
        if problem is not None:
            raise ConfigError(problem)

    async def _learn_address(self) -> None:
        """Choose the host to announce (``swarmd.net.addresses``); refuse a loopback one that
        would go into a swarm beyond this machine."""
        assert self.dht is not None  # _join_dht ran
        net, dht = self.config.net, self.config.dht
        observed: list[str] = []
        route: str | None = None
        if net.announce_host is None and is_wildcard(net.host):
            join = [addr for addr in dht.join if not is_wildcard(addr[0]) and _is_ip(addr[0])]
            if dht.join:
                seen = await self.dht.observe_self(extra=join, timeout=1.0)
                observed = [ip for _, ip in seen]
                route = route_source(dht.join[0][0])
            if route is None:
                route = default_route_source(family_of(net.host))
        self.announced = choose_host(bound=net.host, flag=net.announce_host, observed=observed, route=route)
        log.info("others reach this peer at %s (%s); join others with --join %s",
                 self.announced.host, self.announced.how, self.dht_addr)
        problem = loopback_mismatch(self.announced.host, dht.join)
        if problem is not None:
            raise ConfigError(problem)
        if self.announced.how == "loopback" and is_wildcard(net.host):
            log.warning("bound to %s, but no route and no DHT contact tells which address others reach this peer "
                        "at: announcing %s; give --announce HOST for a swarm beyond this machine",
                        net.host, self.announced.host)

    async def _relearn_address(self) -> None:
        """A founder bound to a wildcard announced the route's address; once two or more DHT
        contacts agree on what they see, announce that instead."""
        announced = self.announced
        if self.dht is None or announced is None or announced.how not in ("route", "loopback"):
            return
        seen = await self.dht.observe_self(timeout=1.0)
        better = choose_host(bound=self.config.net.host, observed=[ip for _, ip in seen], route=announced.host)
        if better.how == "observed" and better.host != announced.host:
            log.info("DHT contacts see this peer at %s: announcing it instead of %s", better.host, announced.host)
            self.announced = better
            self.reachability = reachability.Reachability()  # a new address: check it again
        elif better.how == "observed":
            self.announced = better

    async def check_reachability(self) -> None:
        """Ask other members to dial the announced data address (``swarmd.net.reachability``)."""
        assert self.membership is not None and self.spec is not None and self._session is not None
        addr, peer_id = self.data_addr, self.peer_id
        if addr is None or peer_id is None:
            return
        try:
            members = await self.membership.all_peers(self.spec.n_stages)
        except SwarmdError as exc:
            log.warning("cannot check this peer's reachability: %s", exc)
            return
        proven = self.prover.proven({r.peer_id: r.data_addr for r in members})
        if proven:  # members that answered a signed challenge: a fake prober costs a timeout, or lies (issue 18)
            members = [r for r in members if r.peer_id in proven]
        result = await reachability.check(self._session, peer_id=peer_id, addr=addr, members=members,
                                          probers=reachability.PROBERS if proven else reachability.UNPROVEN_PROBERS)
        changed = result.status != self.reachability.status
        self.reachability = result
        if result.status == "no" and self.relayed_addr is None:
            log.error("no member of the swarm could dial this peer's data plane at %s (%s): it will serve through "
                      "a relay if one accepts. Open TCP port %s in the firewall, forward it through the NAT, or give "
                      "--announce HOST:PORT", addr, "; ".join(f"{pid[:12]}: {why}" for pid, why in result.by.items()),
                      addr.rsplit(":", 1)[-1])
        elif changed and result.status == "yes":
            log.info("reachable at %s (checked by %d member(s))", addr, sum(v == "reached" for v in result.by.values()))

    # ---- relays (swarmd.net.relay) -------------------------------------------------------------

    def _relays_for_others(self) -> bool:
        """A peer relays when others can dial it directly (and --relay-max-peers is not 0)."""
        return (self.config.net.relay_max_peers > 0 and self.relayed_addr is None
                and self.reachability.status != "no" and self.state in (PeerState.SERVING, PeerState.MIGRATING))

    def _start_relaying(self) -> None:
        """Nobody could dial this peer: serve through a relay (a task that keeps one attached)."""
        assert self.identity is not None and self._session is not None  # started
        if self.tasks.running(RELAY_TASK):
            return
        self.relay_client = RelayClient(self.identity, self._session, local_base=self._local_base,
                                        candidates=self._relay_candidates, on_change=self._on_relay_change,
                                        retry_s=self.config.dht.announce_period_s)
        self.tasks.spawn(RELAY_TASK, self.relay_client.run, restart=True)

    def _local_base(self) -> str:
        """This peer's own data plane, as it dials it itself (relayed requests are served there)."""
        assert self.data_plane is not None and self.data_plane.address is not None
        host, port = self.data_plane.address
        if is_wildcard(host):
            host = "::1" if ":" in host else "127.0.0.1"
        return f"http://{format_addr((host, port))}"

    async def _relay_candidates(self) -> list[PeerRecord]:
        """Members that may relay: serving, dialled directly by others, not relayed themselves."""
        assert self.membership is not None and self.spec is not None
        try:
            members = await self.membership.all_peers(self.spec.n_stages)
        except SwarmdError as exc:
            log.warning("cannot list possible relays: %s", exc)
            return []
        return [r for r in members
                if r.usable and r.reachable == "yes" and not is_relayed(r.data_addr) and r.peer_id != self.peer_id]

    async def _on_relay_change(self, relayed: str | None) -> None:
        """Announce the relayed address at once (or stop announcing one), then check it."""
        self.relayed_addr = relayed
        self._mates_cache = None
        if relayed is None:
            self.reachability = reachability.Reachability(status="no", addr=self.data_addr)
        else:
            await self.check_reachability()  # through the relay, by the same probers
        try:
            await self.announce()
        except SwarmdError as exc:
            log.warning("could not announce the relayed address: %s", exc)

    # ---- state sync ----------------------------------------------------------------------------

    async def _resync(self, step: int) -> None:
        """The averager found this peer behind its stage: adopt a stage-mate's state at ``step``."""
        await self.sync_state(min_step=step, required=False)

    async def sync_state(self, *, min_step: int, required: bool, runtime: StageRuntime | None = None) -> bool:
        """Adopt the state of a live stage-mate at step >= ``min_step`` (``swarmd.net.state_sync``)
        into ``runtime`` (default: the one served now).

        Once a swarm has stepped nobody may serve fresh parameters, so a joiner downloads
        whenever its stage has a serving peer; a peer that fell behind resyncs the same way.
        """
        assert self.dht is not None and self._session is not None and self.spec is not None
        async with self._sync_lock:
            runtime = runtime or self.runtime
            assert runtime is not None  # built before any sync
            if runtime.executor.step >= min_step > 0:
                return True  # another sync got there first
            records = await self.dht.get_stage_peers(self.config.swarm, runtime.stage)
            # every usable stage-mate, whatever step its record says (records lag an announce period behind a
            # stage that steps fast); only those that prove, now, to hold their identity, serve at their address
            # and be at min_step or later (their proofs' step is fresh) are donors (issue #18)
            donors = await proven_donors(self.prover, choose_donors(records, self_id=self.peer_id, min_step=0),
                                         stage=runtime.stage, min_step=min_step, exclude=self._excluded_peers())
            if not donors:
                if required:
                    raise SwarmdError(f"no serving peer of stage {runtime.stage} to download its state from")
                return False
            result = await adopt_state(self._session, runtime.executor, donors, model_digest=self.spec.digest,
                                       on_received=self._state_received)
            self.state_downloads["downloads_ok" if result is not None else "downloads_failed"] += 1
            if result is None:
                if required:
                    raise SwarmdError(f"could not download the state of stage {runtime.stage} "
                                      f"from any of {len(donors)} peers")
                return False
            self.synced_from = result.donor.peer_id
            self.last_sync_s = result.seconds
            self.state_downloads["last_download_s"] = round(result.seconds, 3)
            if runtime.executor.throughput == 0.0 and not self.migrator.last_throughput:
                # until it measures its own: what its donor serves (a joiner announcing 0 would make its
                # stage look empty, and the rebalancer would send a second peer to fill the gap)
                self.migrator.last_throughput = result.donor.throughput
            return True

    # ---- where a stage's state comes from (swarmd.pipeline.resume) --------------------------------

    async def plan_state(self, stage: int, *, min_step: int = 0) -> Plan:
        """Every source of ``stage``'s state the swarm shows now, newest first (``swarmd.pipeline.resume``)."""
        assert self.membership is not None and self.spec is not None
        members = [r for r in await self.membership.all_peers(self.spec.n_stages) if r.peer_id != self.peer_id]
        excluded = self._excluded_peers()
        live = [(r.peer_id, r.step) for r in members if r.stage == stage and r.usable and r.peer_id not in excluded]
        offered = [(r.peer_id, step) for r in members
                   if (step := r.held_step(stage)) is not None and r.data_addr and r.reachable != "no"
                   and r.peer_id not in excluded]
        held = self.checkpoints.held if self.checkpoints is not None else {}
        trained = (any(step > 0 for step in held.values())
                   or any(r.step > 0 or any(step > 0 for _, step in r.held) for r in members))
        return plan(live=live, own=held.get(stage), offered=offered, swarm_trained=trained, min_step=min_step)

    async def obtain_state(self, runtime: StageRuntime, *, wait: bool) -> Source:
        """Put the newest state of ``runtime``'s stage that exists into it: a live stage-mate's, this
        peer's own checkpoint, or another peer's offered one; fresh parameters only while nothing in the
        swarm has trained. A stage whose state is nowhere raises :class:`StageStateLost`, or with
        ``wait`` is reported loudly every announce period until a peer that holds it appears."""
        stage = runtime.stage
        warned = False
        while True:
            state_plan = await self.plan_state(stage)
            source = await self._adopt_any(runtime, state_plan)
            if source is None and state_plan.fallback is Source.FRESH:
                source = Source.FRESH
            if source is not None:
                self.state_source = source.value
                if warned:
                    log.warning("stage %d's state is back: adopted it (%s) at step %d", stage, source.value,
                                runtime.executor.step)
                return source
            message = self._lost_message(stage, state_plan)
            if not wait:
                raise StageStateLost(message)
            if not warned:
                log.error("%s", message)
                warned = True
            self.state_source = Source.LOST.value
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.dht.announce_period_s)
            except asyncio.TimeoutError:
                await self._announce_quietly()  # stay listed as joining, so nobody else is sent to this stage
                continue
            raise SwarmdError(f"stopped while waiting for a peer that holds the state of stage {stage}")

    def _lost_message(self, stage: int, state_plan: Plan) -> str:
        tried = "; every source failed" if state_plan.candidates else ""
        return (f"stage {stage}'s state is lost for now: the swarm has trained, but no live peer serves stage {stage} "
                f"and no peer offers a checkpoint of it{tried}. Serving it from step 0 would undo its training, so "
                f"this peer waits; restart a peer that served stage {stage} with its --state-dir, or start a new "
                f"swarm (another --swarm name) to train from scratch")

    async def _adopt_any(self, runtime: StageRuntime, state_plan: Plan) -> Source | None:
        """Try the plan's candidates in order; the source of the first state adopted, None if none was."""
        tried_live = False
        for offer in state_plan.candidates:
            if offer.source is Source.LIVE:
                if tried_live:
                    continue
                tried_live = True
                if await self.sync_state(min_step=offer.step, required=False, runtime=runtime):
                    return Source.LIVE
            elif offer.source is Source.OWN:
                if await self._load_own(runtime):
                    return Source.OWN
            elif await self._fetch_offered(runtime, offer):
                return Source.OFFERED
        return None

    async def _load_own(self, runtime: StageRuntime) -> bool:
        """Resume ``runtime`` from this peer's newest valid checkpoint of its stage."""
        if self.checkpoints is None:
            return False
        loaded = await self.checkpoints.load_newest(runtime.stage)
        if loaded is None:
            return False
        info, tensors = loaded
        try:
            await runtime.executor.load_state(info.state_meta, tensors)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("checkpoint %s does not fit stage %d (%s); not used", info.path, runtime.stage, exc)
            return False
        self.checkpoints.newest = self.checkpoints.resumed_from = info
        log.info("resumed stage %d from checkpoint %s at step %d (params %s)", runtime.stage,
                 info.path.with_suffix(""), info.step, info.params_digest[:12])
        return True

    async def _fetch_offered(self, runtime: StageRuntime, offer: Offer) -> bool:
        """Download the checkpoint of ``runtime``'s stage that peer ``offer.peer_id`` offers, and adopt it."""
        assert self.dht is not None and self._session is not None and self.spec is not None
        assert self.membership is not None
        members = {r.peer_id: r for r in await self.membership.all_peers(self.spec.n_stages)}
        donor = members.get(offer.peer_id or "")
        if donor is None or not donor.data_addr:
            return False
        result = await adopt_state(self._session, runtime.executor, [donor], model_digest=self.spec.digest,
                                   on_received=self._state_received, path=checkpoint_path(runtime.stage))
        self.state_downloads["downloads_ok" if result is not None else "downloads_failed"] += 1
        if result is None:
            return False
        self.synced_from = donor.peer_id
        log.info("stage %d resumed from the checkpoint of step %d that peer %s holds", runtime.stage,
                 runtime.executor.step, donor.peer_id[:12])
        return True

    async def _offered_checkpoint(self, stage: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``GET /v1/checkpoint/{stage}``: this peer's newest valid checkpoint of ``stage``, or None."""
        if self.checkpoints is None or self.spec is None or not 0 <= stage < self.spec.n_stages:
            return None
        loaded = await self.checkpoints.load_newest(stage)
        return None if loaded is None else (loaded[0].state_meta, loaded[1])

    async def _scan_checkpoints(self) -> None:
        """Which checkpoints of this swarm, model and training settings this peer holds (offered to the swarm)."""
        if self.checkpoints is None or self.spec is None:
            return
        spec, training, swarm = self.spec, self.training, self.config.swarm
        held = await self.checkpoints.scan(
            lambda info: mismatch(info, swarm=swarm, model_digest=spec.digest, training_digest=training.digest))
        if held:
            log.info("holds checkpoints of %s", ", ".join(f"stage {s} (step {n})" for s, n in sorted(held.items())))

    async def _note_newest_checkpoint(self) -> None:
        """``/status`` -> checkpoint.newest: this peer's newest checkpoint of the stage it serves, even when
        it took a stage-mate's newer state rather than resume from it."""
        checkpoints, runtime = self.checkpoints, self.runtime
        if checkpoints is None or runtime is None:
            return
        if checkpoints.newest is None or checkpoints.newest.stage != runtime.stage:
            mine = await asyncio.to_thread(checkpoints.mine, runtime.stage)
            checkpoints.newest = mine[0] if mine else None

    # ---- durability: checkpoints, resume, the hand-over on leave (swarmd.checkpoint) -----------

    def _checkpointer(self) -> Checkpointer | None:
        state_dir = self.config.dht.state_dir
        if state_dir is None:
            return None
        ck = self.config.checkpoint
        return Checkpointer(state_dir, swarm=self.config.swarm, every=ck.every, keep=ck.keep)

    async def _own_checkpoints(self) -> list[CheckpointInfo]:
        """This peer's checkpoints of this swarm, newest first (sidecars only; tensors are checked on use)."""
        if self.checkpoints is None:
            return []
        found = await asyncio.to_thread(find_checkpoints, self.checkpoints.directory)
        return [c for c in found if c.swarm == self.config.swarm]

    async def _founding_settings(self, asked: ModelSpec | None) -> tuple[ModelSpec, TrainingSpec]:
        """A founder restarted on a state dir that holds checkpoints of its swarm re-founds it with their
        model and training settings; ``--model`` and the training flags, when given, win."""
        found = await self._own_checkpoints()
        if not found:
            return asked or PRESETS["tiny"], self.training
        newest = found[0]
        spec = asked
        if spec is None:
            try:
                spec = ModelSpec.from_dict(newest.model)
            except ConfigError as exc:
                log.warning("checkpoint %s holds an unreadable model spec (%s); founding with the tiny model",
                            newest.path, exc)
                return PRESETS["tiny"], self.training
        training = self.training
        if self.config.pipeline.training is None:
            try:
                training = TrainingSpec.from_dict(newest.training)
            except ConfigError as exc:
                log.warning("checkpoint %s holds unreadable training settings (%s); using the defaults",
                            newest.path, exc)
        if spec.digest == newest.model_digest:
            log.info("re-founding swarm %r with the model (%s) and training settings of checkpoint %s (step %d)",
                     self.config.swarm, spec.digest[:12], newest.path.with_suffix(""), newest.step)
        return spec, training

    def _served(self) -> tuple[StageExecutor, TrainingSpec] | None:
        """What the checkpoint task writes: the stage served now (None while moving or stopping)."""
        runtime = self.runtime
        if runtime is None or self.state != PeerState.SERVING:
            return None
        return runtime.executor, self.training

    def _start_checkpointing(self) -> None:
        checkpoints = self.checkpoints
        if checkpoints is not None and checkpoints.enabled:
            self.tasks.spawn(CHECKPOINT_TASK, lambda: checkpoints.run(self._served), restart=True)

    async def _leave_durably(self) -> None:
        """A graceful stop, once in-flight requests are done: hand the accumulated gradients to a live
        stage-mate (``swarmd.net.handover``), then write a last checkpoint."""
        runtime = self.runtime
        if runtime is None:
            return
        await self._hand_over_gradients(runtime)
        if self.checkpoints is not None:
            try:
                await self.checkpoints.save(runtime.executor, self.training)
            except RuntimeError as exc:  # the executor is already closed
                log.warning("no checkpoint on shutdown: %s", exc)

    async def _hand_over_gradients(self, runtime: StageRuntime) -> None:
        ex = runtime.executor
        if ex.grad_samples == 0 or self.identity is None or self._session is None or self.spec is None:
            return
        contribution = await ex.take_contribution()
        if contribution.grads is None or contribution.samples == 0:
            return
        try:
            mates = await self._stage_mates(max_age_s=0.0)
        except SwarmdError as exc:
            log.warning("cannot list stage-mates for the hand-over: %s", exc)
            mates = {}
        # proven stage-mates first, few others (issue #18: a listing may hold fakes at tarpits)
        averager = runtime.averager
        prover = averager.prover if averager is not None else None
        candidates = handover_order(mates, proven=set(prover.proven(mates)) if prover is not None else None,
                                    excluded=averager.excluded() if averager is not None else (),
                                    self_id=self.identity.peer_id)
        request = GradientsRequest(stage=runtime.stage, model=self.spec.digest, step=contribution.step,
                                   samples=contribution.samples, peer_id=self.identity.peer_id,
                                   grads=contribution.grads)
        result = await hand_over(self._session, candidates, request)
        if result.accepted_by is not None:
            self.handover["handed_out"] += result.samples
            self.handover["to"] = result.accepted_by
            log.info("handed the gradients of %d samples (step %d) to stage-mate %s", result.samples,
                     contribution.step, result.accepted_by[:12])
        else:
            self.handover["dropped"] += result.samples
            log.warning("no stage-mate took the gradients of %d samples (step %d): dropped (%s)", result.samples,
                        contribution.step, "; ".join(result.refusals) or "no serving stage-mate")

    # ---- announcements -------------------------------------------------------------------------

    def _peer_record(self, state: PeerState | None = None) -> PeerRecord:
        assert self.identity is not None and self.stage is not None  # a stage is chosen before announcing
        ex = self.executor
        now = time.time()
        stage = self.stage
        state = state or self.state
        if state == PeerState.STARTING:
            state = PeerState.JOINING  # a stage chosen, nothing built yet: a claim (swarmd.pipeline.claims)
        throughput = ex.throughput if ex else 0.0
        target = self.migrator.target
        if self.state == PeerState.MIGRATING and target is not None:
            stage = target  # a mover is capacity on its way to its new stage, not on its old one
        if throughput == 0.0 and self.migrator.last_throughput:
            throughput = self.migrator.last_throughput  # freshly moved or joined: an estimate until measured
        return PeerRecord(
            peer_id=self.identity.peer_id,
            stage=stage,
            state=state.value,
            data_addr=self.data_addr or "",
            api_addr=format_addr(self.api_addr) or "",
            throughput=throughput,
            queue=ex.queue if ex else 0,
            step=ex.step if ex else 0,
            params_digest=ex.digest if ex else None,
            version=__version__,
            timestamp=now,
            expiry=now + self.config.dht.record_ttl_s,
            reachable=self.reachability.status,
            checkpoint=self.checkpoints.newest_step(stage) if self.checkpoints is not None else None,
            claimed_at=self._claimed_at if self.state == PeerState.STARTING else None,
            held=self._held(),
        )

    def _held(self) -> tuple[tuple[int, int], ...]:
        """The checkpoints this peer offers to the swarm: the newest of each stage (the most recent stages
        first when it holds more than a record carries)."""
        if self.checkpoints is None:
            return ()
        newest = sorted(self.checkpoints.held.items(), key=lambda kv: -kv[1])[:MAX_HELD]
        return tuple(sorted(newest))

    async def announce(self) -> None:
        """Publish this peer's record (state, stage, load, addresses) to the DHT now."""
        assert self.membership is not None  # _join_dht ran
        accepted = await self.membership.announce(self._peer_record())
        self.announcements += 1
        log.debug("announced %s on stage %s to %d DHT node(s)", self.state, self.stage, accepted)

    async def _announce_loop(self) -> None:
        """Refresh this peer's record (and its copy of the swarm record) every announce period."""
        assert self.membership is not None and self.spec is not None  # started once serving
        period = self.config.dht.announce_period_s
        while True:
            await asyncio.sleep(period * random_jitter())
            try:
                await self._relearn_address()
                await self.announce()
                await self.membership.publish_swarm(self.spec, self.training.to_dict())
                await self.refresh_coverage()
                if self.reachability.status == "unknown" and not self.tasks.running(REACHABILITY_TASK):
                    # e.g. a founder alone at first: ask once others are here. Not in this loop: probers that
                    # never answer (fake records at a tarpit, issue 18) would hold up the announcements
                    # until this peer's own record expired
                    self.tasks.spawn(REACHABILITY_TASK, self._recheck_reachability, restart=True)
            except SwarmdError as exc:
                log.warning("could not refresh this peer's DHT records: %s", exc)

    async def refresh_coverage(self) -> None:
        """Sum up every stage's health from the swarm's records (``swarmd.pipeline.coverage``); a stage that
        turns empty, thin or lost is a warning with what to do, one that recovers a line saying so."""
        assert self.membership is not None and self.spec is not None
        records = await self.membership.all_peers(self.spec.n_stages)
        held = self.checkpoints.held if self.checkpoints is not None else None
        healths = stage_health(self.spec.n_stages, records, now=time.time(), held_here=held)
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

    async def _recheck_reachability(self) -> None:
        try:
            await self.check_reachability()
        except SwarmdError as exc:
            log.warning("could not check this peer's reachability: %s", exc)
            return
        if self.reachability.status == "no":
            self._start_relaying()

    async def _stage_mates(self, max_age_s: float = 1.0, *, fresh: bool = False) -> dict[str, str]:
        """Serving peers of this stage (peer_id -> data_addr), this one included, cached briefly
        (``fresh``: read now)."""
        assert self.dht is not None and self.stage is not None  # only called while averaging
        now = time.monotonic()
        stage = self.stage
        cached = self._mates_cache
        if fresh or cached is None or now - cached[0] > max_age_s or cached[2] != stage:
            records = await self.dht.get_stage_peers(self.config.swarm, stage)
            # this peer, and the stage-mates the others can dial (an unreachable one cannot take part)
            mates = {pid: r.data_addr for pid, r in records.items()
                     if r.state == "serving" and (r.usable or pid == self.peer_id)}
            self._mates_cache = cached = (now, mates, stage)
        return dict(cached[1])

    # ---- seeing the swarm: metrics and the training summary -----------------------------------

    def _init_observability(self) -> None:
        """The per-daemon Prometheus registry (``swarmd.api.metrics``), the trainer registry and the
        training log its heartbeats feed (``swarmd.training_summary``)."""
        self.training_log = TrainingLog(live_s=self.config.dht.record_ttl_s)
        self.trainers = TrainerRegistry(on_report=self._on_trainer_report)
        # trainers' data-shard ranks, unique across the swarm (swarmd.api.trainer_ranks)
        self.ranks = RankBook(self.trainers, dht=lambda: self.dht, identity=lambda: self.identity,
                              swarm=self.config.swarm, ttl_s=self.config.dht.record_ttl_s)
        self.metrics = DaemonMetrics(self)
        # state downloads from stage-mates (swarmd.net.state_sync): /status -> state_transfer
        self.state_downloads: dict[str, Any] = {"downloaded_bytes": 0, "downloads_ok": 0, "downloads_failed": 0,
                                                "last_download_s": None}

    def _state_received(self, n: int) -> None:
        self.state_downloads["downloaded_bytes"] += n

    def _on_trainer_report(self, trainer_id: str, report: TrainerReport) -> None:
        self.training_log.report(trainer_id, steps=[(p.step, p.loss, p.val_loss) for p in report.steps],
                                 samples=report.samples, samples_per_s=report.samples_per_s)

    def dht_stats(self) -> dict[str, Any] | None:
        return self.dht.stats() if self.dht is not None else None

    async def publish_training_summary(self) -> None:
        """Publish what this daemon's trainers reported (if any is live), then merge every daemon's
        record into the swarm's curve."""
        assert self.dht is not None and self.identity is not None  # started once serving
        key = training_key(self.config.swarm)
        record = self.training_log.record(self.identity.peer_id, self.config.dht.record_ttl_s)
        if record is not None:
            await self.dht.store(key, sign_record(self.identity, record))
        self.training_log.merge(await self.dht.get(key))

    async def _training_summary_loop(self) -> None:
        period = self.config.dht.announce_period_s
        while True:
            await asyncio.sleep(period * random_jitter())
            try:
                await self.publish_training_summary()
                await self.ranks.publish()
            except SwarmdError as exc:
                log.warning("could not publish or read the swarm's training summary: %s", exc)

    # ---- the control plane ---------------------------------------------------------------------

    async def _start_api(self) -> None:
        assert self._listeners is not None  # bound first, in start()
        sock = self._listeners.api
        self._api_socket = sock  # asyncio serves on this very socket; closed after uvicorn stops
        self.api_addr = sock.getsockname()[:2]
        app = create_app(self, self.trainers, api_token=self.config.api.token, metrics=self.metrics,
                         training=self.training_log, ranks=self.ranks)
        server = self._api_server = embedded_server(app, request_timeout_s=self.config.api.request_timeout_s)

        async def serve() -> None:
            await server.serve(sockets=[sock])
            if not self._stopping:
                raise RuntimeError("the control plane stopped while the daemon was running")

        task = self.tasks.spawn(API_TASK, serve)
        while not server.started:
            if task.done():
                raise RuntimeError("the control plane exited during start-up")
            await asyncio.sleep(0.01)

    async def _stop_api(self) -> None:
        if self._api_server is not None:
            self._api_server.should_exit = True
            task = self.tasks.get(API_TASK)
            if task is not None:
                done, _ = await asyncio.wait({task}, timeout=10)
                if not done:
                    log.warning("control plane did not stop within 10s; cancelled")
        if self._api_socket is not None:
            self._api_socket.close()

    def welcome(self) -> dict[str, Any]:
        """What a registering trainer needs: the swarm, its model and training settings."""
        assert self.spec is not None  # registration needs a serving peer
        ex = self.executor
        return {
            "swarm": self.config.swarm,
            "model": {"name": self.spec.name, "digest": self.spec.digest, "spec": self.spec.to_dict()},
            "training": self.training.to_dict(),
            "step": ex.step if ex else 0,
        }

    async def swarm_view(self) -> dict[str, Any]:
        """The swarm as the DHT shows it now: model, every stage's live peers, DHT health."""
        assert self.membership is not None and self.spec is not None and self.dht is not None
        stages = await self.membership.stage_peers(self.spec.n_stages)
        now = time.time()
        held = self.checkpoints.held if self.checkpoints is not None else None
        healths = stage_health(self.spec.n_stages, [r for rs in stages for r in rs.values()], now=now, held_here=held)
        return {
            "swarm": self.config.swarm,
            "model": {"name": self.spec.name, "digest": self.spec.digest, "spec": self.spec.to_dict()},
            "training": self.training.to_dict(),
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
                    "dropped": [d.to_dict() for d in self.membership.dropped if d.stage == stage][:32],
                }
                for stage, records in enumerate(stages)
            ],
            "dht": self.dht.stats(),
        }

    def _auth_status(self) -> dict[str, Any]:
        """Whether this swarm is private, and what was refused for lacking its key (by reason)."""
        key = self.config.swarm_key
        dht_auth = self.dht.auth_refused() if self.dht is not None else None
        dp = self.data_plane
        return {
            "private": key is not None,
            "key_id": key.key_id if key is not None else None,
            "refused": {
                "dht": dht_auth or {},
                "data_plane": dp.auth.counts() if dp is not None and dp.auth is not None else {},
            },
        }

    def _addresses(self) -> dict[str, Any]:
        """Bound and announced addresses, and how the announced host was chosen."""
        dp = self.data_plane
        return {
            "data_bound": format_addr(dp.address) if dp is not None else None,
            "data_announced": self.data_addr,
            "dht_bound": format_addr(self.dht.address) if self.dht is not None and self.dht.running else None,
            "dht_announced": self.dht_addr,
            "how": self.announced.how if self.announced is not None else None,
            "observed": list(self.announced.observed) if self.announced is not None else [],
        }

    def status(self) -> dict[str, Any]:
        """``GET /status``, built from the control plane's own :class:`~swarmd.api.models.Status`."""
        ex = self.executor
        dp = self.data_plane
        spec = self.spec
        averager = self.averager
        return Status(
            peer_id=self.peer_id,
            stage=self.stage,
            n_stages=spec.n_stages if spec else None,
            state=self.state.value,
            swarm=self.config.swarm,
            model=ModelInfo(name=spec.name, digest=spec.digest) if spec else None,
            step=ex.step if ex else 0,
            queue=ex.queue if ex else 0,
            in_flight=dp.in_flight if dp else 0,
            throughput=ex.throughput if ex else 0.0,
            grad_samples=ex.grad_samples if ex else 0,
            stale_dropped=ex.stale_dropped if ex else 0,
            stale_applied=ex.stale_applied if ex else 0,
            activation_cache=ex.cache_stats() if ex else None,
            worker_cpu_s=ex.worker_cpu_s if ex else 0.0,
            exactly_once=ex.exactly_once() if ex else {},
            reservations=ex.reservations.status() if ex else None,
            params_digest=ex.digest if ex else None,
            averaging={
                "rounds_ok": averager.rounds_ok,
                "rounds_aborted": averager.rounds_aborted,
                "last_round": averager.last_round,
                "recent": list(averager.history)[-32:],
                **averager.checks_status(),  # proofs, refused rounds and contributions, exclusions
            } if averager else None,
            synced_from=self.synced_from,
            migration=self.migration,
            migrations=dict(self.migrator.results),
            state_transfer={**self.state_downloads, "served_bytes": dp.state_served["bytes"] if dp else 0,
                            "served_streams": dp.state_served["streams"] if dp else 0},
            precision=PrecisionInfo(mode=ex.precision, loss_scale=ex.loss_scale.scale if ex.loss_scale else None,
                                    overflows=ex.loss_scale.overflows if ex.loss_scale else None) if ex else None,
            served=dict(dp.served) if dp else {},
            auth=self._auth_status(),
            data_addr=self.data_addr,
            api_addr=format_addr(self.api_addr),
            dht_addr=self.dht_addr,
            addresses=self._addresses(),
            reachability=self.reachability.to_dict(),
            relay={"client": self.relay_client.status.to_dict() if self.relay_client is not None else None,
                   "server": self.relay_server.stats()},
            founder=self.founder,
            announcements=self.announcements,
            task_crashes=self.tasks.crashes(),
            checkpoint=self.checkpoints.status() if self.checkpoints is not None else None,
            gradient_handover={**self.handover, "handed_in": ex.handed_in_samples if ex else 0},
            untrusted=self._untrusted_status(),
            reports=self.reports.status(),
            stages=[StageHealthInfo.model_validate(h.to_dict()) for h in self.coverage],
            state_source=self.state_source,
            device=self.config.pipeline.device,
            version=__version__,
            uptime_s=round(time.monotonic() - self._started_at, 3),
        ).model_dump(mode="json")


def random_jitter() -> float:
    """A factor in [0.9, 1.1]: periodic loops of many peers do not fall into step."""
    return random.uniform(0.9, 1.1)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
