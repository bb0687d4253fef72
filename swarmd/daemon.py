"""One long-running daemon per machine: it owns every task and shuts down in a fixed order.

Start-up, in this order (readiness is an explicit event, set last, so nothing acts on a
half-started peer; hivemind #634 announced before its DHT was up):

1. load (or create) the peer's key from ``--state-dir`` and start the DHT node: found a new
   DHT, or join one through ``--join`` with bounded retries;
2. learn the model: a founder publishes its spec as the swarm record; a joiner reads the swarm
   record (and refuses an explicit ``--model`` that disagrees);
3. pick the stage (``--stage auto``: the one with the lowest total throughput);
4. build the stage off the loop, start the data plane and the control plane;
5. announce ``joining``; download the stage's state (parameters, optimizer state, step) from
   a live stage-mate when there is one, trying the next on failure, and check its digest;
6. announce ``serving``; set ``ready``; re-announce every announce period and take part in
   the stage's averaging rounds (``swarmd.pipeline.averaging``).

Shutdown (SIGTERM/SIGINT via the CLI, or ``request_stop``), in this order:

1. state ``draining``, announced in the DHT; the data plane closes its listening socket and
   answers new requests on open connections with 503, so clients go elsewhere at once;
2. in-flight requests finish, bounded by ``net.drain_timeout_s``;
3. the data plane closes, then the stage's worker thread finishes its queue and stops;
4. the control plane stops, so ``/status`` shows ``draining`` until the very end; the DHT
   node stops last.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import IO, Any

import aiohttp

from swarmd import __version__
from swarmd.api.app import create_app
from swarmd.api.server import EmbeddedUvicorn, bind_socket, embedded_server
from swarmd.config import Config
from swarmd.dht.identity import Identity
from swarmd.dht.membership import Membership
from swarmd.dht.node import DHTNode
from swarmd.dht.records import PeerRecord
from swarmd.errors import ConfigError, SwarmdError
from swarmd.net import codecs
from swarmd.net.client import client_session
from swarmd.net.server import DataPlane
from swarmd.net.state_transfer import download_state
from swarmd.pipeline.averaging import StageAverager
from swarmd.pipeline.executor import StageExecutor
from swarmd.pipeline.optimizer import TrainingSpec
from swarmd.pipeline.rebalance import PeerLoad, StageLoad, SwarmSnapshot, choose_stage, get_policy
from swarmd.pipeline.spec import PRESETS, ModelSpec

log = logging.getLogger(__name__)


class MigrationRefused(SwarmdError):
    """A move between stages that cannot happen now (HTTP 409, or 422 for a stage that does not exist)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.http_status = status


def lock_state_dir(state_dir: Path) -> IO[str]:
    """Hold an exclusive lock on ``state_dir`` for the daemon's life: two daemons sharing one
    key would announce the same peer id and overwrite each other's records."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle = open(state_dir / "lock", "a+")
    except OSError as exc:
        raise ConfigError(f"cannot use --state-dir {state_dir}: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ConfigError(
            f"another swarmd is running with --state-dir {state_dir}; give each daemon its own --state-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def format_addr(addr: tuple[str, int] | None) -> str | None:
    if addr is None:
        return None
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Daemon:
    """A swarmd peer serving one stage. Use ``async with Daemon(cfg) as d`` or ``await d.run()``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = "starting"
        self.ready = asyncio.Event()
        self.identity: Identity | None = None
        self.dht: DHTNode | None = None
        self.membership: Membership | None = None
        self.spec: ModelSpec | None = None  # known once the swarm is resolved
        self.training: TrainingSpec = config.pipeline.training or TrainingSpec()
        self.stage: int | None = None  # known once a stage is chosen
        self.founder = not config.dht.join
        self.executor: StageExecutor | None = None
        self.data_plane: DataPlane | None = None
        self.api_addr: tuple[str, int] | None = None
        self.announcements = 0  # successful record publications, for /status and tests
        self.averager: StageAverager | None = None
        self.synced_from: str | None = None  # the stage-mate whose state this peer adopted last
        self._session: aiohttp.ClientSession | None = None
        self._averager_task: asyncio.Task[None] | None = None
        self._mates_cache: tuple[float, dict[str, str]] | None = None
        self._sync_lock = asyncio.Lock()
        self.migration: dict[str, Any] | None = None  # the last move between stages, for /status
        self._migration_task: asyncio.Task[None] | None = None
        self._rebalance_task: asyncio.Task[None] | None = None
        self._last_sync_s: float | None = None  # how long the last state download took
        self._moved_at = -math.inf  # monotonic time of this peer's last move
        self._last_throughput = 0.0  # measured on the stage this peer left, announced until re-measured
        self._api_server: EmbeddedUvicorn | None = None
        self._api_task: asyncio.Task[None] | None = None
        self._api_socket: socket.socket | None = None
        self._announce_task: asyncio.Task[None] | None = None
        self._state_lock: IO[str] | None = None
        self._stop = asyncio.Event()
        self._started_at = time.monotonic()
        self._shutdown_done = False

    @property
    def peer_id(self) -> str | None:
        return self.identity.peer_id if self.identity else None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        try:
            await self._join_dht()
            self.spec, self.training = await self._resolve_swarm()
            self.stage = await self._resolve_stage(self.spec)
            await asyncio.to_thread(codecs.warm_up)
            pipe = cfg.pipeline
            self.executor = await asyncio.to_thread(
                StageExecutor,
                self.spec,
                self.stage,
                pipe.device,
                training=self.training,
                max_batch_tokens=pipe.max_batch_tokens,
                threads=pipe.threads,
            )
            self._session = client_session(cfg.swarm_key)  # signs requests to stage-mates in a private swarm
            self.data_plane = DataPlane(self.executor, limits=cfg.net.limits, read_timeout_s=cfg.net.read_timeout_s,
                                        swarm_key=cfg.swarm_key)
            data_addr = await self.data_plane.start(cfg.net.host, cfg.net.port)
            log.info("data plane listening on http://%s", format_addr(data_addr))
            await self._start_api()
            log.info("control plane listening on http://%s (docs at /docs)", format_addr(self.api_addr))
            self.state = "joining"
            await self._announce()
            await self._sync_state(min_step=0, required=False)
            self.state = "serving"
            await self._announce()
        except BaseException:
            await self.shutdown()
            raise
        self._announce_task = asyncio.create_task(self._announce_loop(), name="swarmd-announce")
        self._start_averager()
        self._rebalance_task = asyncio.create_task(self._rebalance_loop(), name="swarmd-rebalance")
        self.ready.set()
        log.info(
            "serving stage %d/%d of model %s (%s) in swarm %r as peer %s",
            self.stage,
            self.spec.n_stages,
            self.spec.name,
            self.spec.digest[:12],
            cfg.swarm,
            self.peer_id,
        )

    def _start_averager(self) -> None:
        assert self.executor is not None and self.identity is not None and self.data_plane is not None
        self.averager = StageAverager(
            self.executor,
            peer_id=self.identity.peer_id,
            stage_peers=self._stage_mates,
            session=self._session,
            on_behind=lambda step: self._sync_state(min_step=step, required=False),
        )
        self.data_plane.averager = self.averager
        self._averager_task = asyncio.create_task(self.averager.run(), name="swarmd-averager")

    async def _stop_averager(self) -> None:
        if self._averager_task is not None:
            self._averager_task.cancel()
            await asyncio.gather(self._averager_task, return_exceptions=True)
            self._averager_task = None
        if self.averager is not None:
            await self.averager.close()
        if self.data_plane is not None:
            self.data_plane.averager = None

    # ---- migration -------------------------------------------------------------------------

    async def stage_peer_count(self, stage: int) -> int:
        """Serving peers of ``stage`` other than this one, as the DHT shows them now."""
        assert self.membership is not None and self.spec is not None
        stages = await self.membership.stage_peers(self.spec.n_stages)
        return sum(1 for pid, r in stages[stage].items() if pid != self.peer_id and r.state == "serving")

    async def request_migration(self, stage: int, *, force: bool = False, reason: str = "by hand") -> dict[str, Any]:
        """Check a move to ``stage`` and start it in the background; MigrationRefused says why not."""
        assert self.spec is not None
        if self.state != "serving" or self._migration_task is not None:
            raise MigrationRefused(f"this peer is {self.state}; it can move only while serving")
        if not 0 <= stage < self.spec.n_stages:
            raise MigrationRefused(f"stage {stage} does not exist: model {self.spec.name} has stages "
                                   f"0..{self.spec.n_stages - 1}", status=422)
        if stage == self.stage:
            raise MigrationRefused(f"this peer already serves stage {stage}")
        if not force and await self.stage_peer_count(self.stage) == 0:
            raise MigrationRefused(f"this peer is the last one serving stage {self.stage}; moving would empty it "
                                   "(send force: true to move anyway)")
        src = self.stage
        self.migration = {"from": src, "to": stage, "phase": "starting", "reason": reason,
                          "started_at": time.time(), "error": None}
        self._migration_task = asyncio.create_task(self._migrate(stage), name="swarmd-migrate")
        return dict(self.migration)

    async def _migrate(self, dst: int) -> None:
        """Leave this stage for ``dst``: announce, drain, swap the stage, download its state."""
        assert self.data_plane is not None and self.executor is not None and self.spec is not None
        migration = self.migration
        assert migration is not None
        old = self.executor
        try:
            self.state = "migrating"
            migration["phase"] = "draining"
            await self._announce()
            await self._stop_averager()
            await self.data_plane.pause(self.config.net.drain_timeout_s)
            migration["phase"] = "building"
            pipe = self.config.pipeline
            new = await asyncio.to_thread(StageExecutor, self.spec, dst, pipe.device, training=self.training,
                                          max_batch_tokens=pipe.max_batch_tokens, threads=pipe.threads)
            migration["dropped_samples"] = old.grad_samples  # accumulated for the old stage: lost with it
            self._last_throughput = old.throughput
            self.executor, self.stage = new, dst
            self.data_plane.executor = new
            self._mates_cache = None
            await old.close()
            migration["phase"] = "downloading"
            await self._announce()
            await self._sync_state(min_step=0, required=False)
            self.state = "serving"
            migration["phase"] = "done"
            await self._announce()
            self._moved_at = time.monotonic()
            log.info("moved from stage %d to stage %d (%s) at step %d",
                     migration["from"], dst, migration["reason"], new.step)
        except asyncio.CancelledError:
            migration["phase"] = "cancelled"
            raise
        except Exception as exc:  # the move failed: say so and keep serving whatever stage we hold
            migration["phase"], migration["error"] = "failed", str(exc)
            log.exception("moving to stage %d failed", dst)
            self.state = "serving"
        finally:
            self.data_plane.resume()
            if self.state == "serving" and self._averager_task is None:
                self._start_averager()
            self._migration_task = None

    async def _rebalance_loop(self) -> None:
        """Run the rebalancing policy every period and when the swarm's membership changes.

        Every peer runs the same pure policy on (nearly) the same DHT snapshot and moves only
        when a returned move names it, so two peers never race for one move.
        """
        assert self.membership is not None and self.spec is not None
        cfg = self.config.rebalance
        policy = get_policy(cfg.policy)
        check_every = min(self.config.dht.announce_period_s, cfg.period_s)
        last_period = time.monotonic()
        known: set[str] | None = None
        while True:
            await asyncio.sleep(check_every * random.uniform(0.9, 1.1))
            if self.state != "serving" or self._migration_task is not None:
                continue
            try:
                stages = await self.membership.stage_peers(self.spec.n_stages)
            except SwarmdError as exc:
                log.warning("rebalancing could not read the swarm: %s", exc)
                continue
            records = [r for records in stages for r in records.values()]
            ids = {r.peer_id for r in records if r.state != "draining"}
            event = None
            if known is not None and ids != known:
                event = "leave" if known - ids else "join"
            known = ids
            now = time.monotonic()
            if now - last_period >= cfg.period_s:
                event, last_period = "period", now
            if event is None or now - self._moved_at < cfg.cooldown_s:
                continue
            snapshot = SwarmSnapshot(
                n_stages=self.spec.n_stages,
                peers=tuple(PeerLoad(r.peer_id, r.stage, r.state, r.throughput, r.queue) for r in records),
                now=time.time(),
            )
            download_s = self._last_sync_s if self._last_sync_s is not None else 60.0
            moves = [m for m in policy.decide(snapshot, event=event, download_s=download_s) if m.peer_id == self.peer_id]
            if moves:
                move = moves[0]
                try:
                    await self.request_migration(move.dst, reason=f"rebalance: {policy.name} on {event}")
                except SwarmdError as exc:
                    log.info("rebalancing wanted this peer on stage %d but: %s", move.dst, exc)

    async def _join_dht(self) -> None:
        dht = self.config.dht
        if dht.state_dir is not None:
            self._state_lock = lock_state_dir(dht.state_dir)
            self.identity = await asyncio.to_thread(Identity.load_or_create, dht.state_dir)
        else:
            self.identity = Identity.generate()
        key = self.config.swarm_key
        self.dht = DHTNode(self.identity, host=dht.host, port=dht.port, rpc_timeout=1.0, swarm_key=key)
        if key is not None:
            log.info("private swarm: DHT datagrams and data-plane requests are authenticated with the swarm key "
                     "from %s (key id %s)", key.source or "the config", key.key_id)
        await self.dht.start(dht.join, deadline_s=dht.bootstrap_timeout_s)
        verb = "joined the swarm's DHT" if dht.join else "founded a new DHT"
        log.info("%s; DHT node on udp://%s (join others with --join %s)",
                 verb, format_addr(self.dht.address), format_addr(self.dht.address))
        self.membership = Membership(self.dht, self.identity, self.config.swarm, ttl_s=dht.record_ttl_s)

    async def _resolve_swarm(self) -> tuple[ModelSpec, TrainingSpec]:
        """A founder publishes its model; a joiner takes the swarm's and checks ``--model``."""
        assert self.membership is not None
        asked = self.config.pipeline.spec
        if self.founder:
            spec = asked or PRESETS["tiny"]
            await self.membership.publish_swarm(spec, self.training.to_dict())
            return spec, self.training
        info = await self.membership.wait_for_swarm(self.config.dht.bootstrap_timeout_s)
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
        asked = self.config.pipeline.stage
        if asked is not None:
            if asked >= spec.n_stages:
                raise ConfigError(
                    f"--stage {asked} is out of range: model {spec.name} has stages 0..{spec.n_stages - 1}"
                )
            return asked
        assert self.membership is not None
        stages = await self.membership.stage_peers(spec.n_stages)
        loads = []
        for stage, records in enumerate(stages):
            live = [r for pid, r in records.items() if pid != self.peer_id and r.state != "draining"]
            loads.append(StageLoad(stage, len(live), sum(r.throughput for r in live)))
        stage = choose_stage(loads)
        log.info("--stage auto chose stage %d (%s)", stage,
                 ", ".join(f"stage {x.stage}: {x.peers} peers, {x.throughput:.0f} samples/s" for x in loads))
        return stage

    # ---- announcements ---------------------------------------------------------------------

    def _peer_record(self) -> PeerRecord:
        assert self.identity is not None and self.stage is not None
        ex = self.executor
        step = ex.step if ex else 0
        digest = ex.digest if ex else None
        now = time.time()
        stage = self.stage
        throughput = ex.throughput if ex else 0.0
        if self.state == "migrating" and self.migration is not None:
            stage = self.migration["to"]  # a mover is capacity on its way to ``to``, not on its old stage
        if throughput == 0.0 and self._last_throughput:
            throughput = self._last_throughput  # freshly moved: what it served before, until it measures anew
        return PeerRecord(
            peer_id=self.identity.peer_id,
            stage=stage,
            state=self.state,
            data_addr=self.data_addr or "",
            api_addr=format_addr(self.api_addr) or "",
            throughput=throughput,
            queue=ex.queue if ex else 0,
            step=step,
            params_digest=digest,
            version=__version__,
            timestamp=now,
            expiry=now + self.config.dht.record_ttl_s,
        )

    async def _announce(self) -> None:
        assert self.membership is not None
        accepted = await self.membership.announce(self._peer_record())
        self.announcements += 1
        log.debug("announced %s on stage %s to %d DHT node(s)", self.state, self.stage, accepted)

    async def _announce_loop(self) -> None:
        """Refresh this peer's record (and its copy of the swarm record) every announce period."""
        assert self.membership is not None and self.spec is not None
        period = self.config.dht.announce_period_s
        while True:
            await asyncio.sleep(period * random.uniform(0.9, 1.1))  # jitter: peers don't sync up
            try:
                await self._announce()
                await self.membership.publish_swarm(self.spec, self.training.to_dict())
            except SwarmdError as exc:
                log.warning("could not refresh this peer's DHT records: %s", exc)

    async def _stage_mates(self, max_age_s: float = 1.0) -> dict[str, str]:
        """Serving peers of this stage (peer_id -> data_addr), this one included, cached briefly."""
        assert self.dht is not None and self.stage is not None
        now = time.monotonic()
        if self._mates_cache is None or now - self._mates_cache[0] > max_age_s:
            records = await self.dht.get_stage_peers(self.config.swarm, self.stage)
            mates = {pid: r.data_addr for pid, r in records.items() if r.state == "serving"}
            self._mates_cache = (now, mates)
        return dict(self._mates_cache[1])

    async def _sync_state(self, *, min_step: int, required: bool) -> bool:
        """Adopt the state of a live stage-mate at step >= ``min_step``; the next one on failure.

        Once a swarm has stepped nobody may serve fresh parameters, so a joiner downloads
        whenever its stage has a serving peer; a peer that fell behind resyncs the same way.
        """
        assert self.dht is not None and self.executor is not None and self._session is not None
        async with self._sync_lock:
            if self.executor.step >= min_step > 0:
                return True  # another sync got there first
            records = await self.dht.get_stage_peers(self.config.swarm, self.stage)
            donors = [r for pid, r in records.items() if pid != self.peer_id and r.state == "serving"
                      and r.step >= min_step]
            if not donors:
                if required:
                    raise SwarmdError(f"no serving peer of stage {self.stage} to download its state from")
                return False
            # spread joiners over donors (hivemind #169): newest step first, random among equals
            random.shuffle(donors)
            donors.sort(key=lambda r: -r.step)
            spec = self.spec
            assert spec is not None
            for donor in donors:
                url = f"http://{donor.data_addr}/v1/state"

                def expected(meta: dict[str, Any]) -> None:
                    if meta.get("stage") != self.stage or meta.get("model") != spec.digest:
                        raise SwarmdError(f"{url} serves another stage or model")

                started = time.monotonic()
                try:
                    snapshot = await download_state(self._session, url, expected=expected)
                    await self.executor.load_state(snapshot.meta, snapshot.tensors)
                    digest = await self.executor.params_digest()
                except SwarmdError as exc:
                    log.warning("state download from %s failed: %s; trying the next stage-mate", donor.peer_id[:12], exc)
                    continue
                if digest != snapshot.meta.get("params_digest"):
                    log.warning("state from %s does not match its digest; trying the next stage-mate", donor.peer_id[:12])
                    continue
                self.synced_from = donor.peer_id
                self._last_sync_s = time.monotonic() - started
                log.info("adopted the state of stage %d at step %d from %s in %.2fs (params %s)",
                         self.stage, self.executor.step, donor.peer_id[:12], time.monotonic() - started, digest[:12])
                return True
            if required:
                raise SwarmdError(f"could not download the state of stage {self.stage} from any of {len(donors)} peers")
            log.error("could not download the state of stage %d from any of %d peers", self.stage, len(donors))
            return False

    def welcome(self) -> dict[str, Any]:
        """What a registering trainer needs: the swarm, its model and training settings."""
        assert self.spec is not None
        return {
            "swarm": self.config.swarm,
            "model": {"name": self.spec.name, "digest": self.spec.digest, "spec": self.spec.to_dict()},
            "training": self.training.to_dict(),
            "step": self.executor.step if self.executor else 0,
        }

    async def swarm_view(self) -> dict[str, Any]:
        """The swarm as the DHT shows it now: model, every stage's live peers, DHT health."""
        assert self.membership is not None and self.spec is not None and self.dht is not None
        stages = await self.membership.stage_peers(self.spec.n_stages)
        now = time.time()
        return {
            "swarm": self.config.swarm,
            "model": {"name": self.spec.name, "digest": self.spec.digest, "spec": self.spec.to_dict()},
            "training": self.training.to_dict(),
            "stages": [
                {
                    "stage": stage,
                    "throughput": sum(r.throughput for r in records.values()),
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
                            "age_s": round(max(0.0, now - r.timestamp), 3),
                        }
                        for r in sorted(records.values(), key=lambda r: r.peer_id)
                    ],
                }
                for stage, records in enumerate(stages)
            ],
            "dht": self.dht.stats(),
        }

    async def _start_api(self) -> None:
        sock = bind_socket(self.config.api.host, self.config.api.port)
        self._api_socket = sock  # asyncio serves on this very socket; closed after uvicorn stops
        self.api_addr = sock.getsockname()[:2]
        app = create_app(self, api_token=self.config.api.token)
        self._api_server = embedded_server(app, request_timeout_s=self.config.api.request_timeout_s)
        self._api_task = asyncio.create_task(self._api_server.serve(sockets=[sock]), name="swarmd-api")
        while not self._api_server.started:
            if self._api_task.done():
                self._api_task.result()  # re-raise why it failed
                raise RuntimeError("the control plane exited during start-up")
            await asyncio.sleep(0.01)

    def request_stop(self) -> None:
        """Ask the daemon to drain and stop (safe to call from a signal handler, repeatedly)."""
        if not self._stop.is_set():
            log.info("stop requested: draining in-flight requests")
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until ``request_stop``, then shut down in order."""
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        if self._shutdown_done:
            return
        self._shutdown_done = True
        was_serving = self.state in ("serving", "migrating")
        self.state = "draining"
        self.ready.clear()
        for task in (self._announce_task, self._rebalance_task, self._migration_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._stop_averager()
        if was_serving:
            try:  # tell trainers and peers at once rather than letting the record expire
                await asyncio.wait_for(self._announce(), 3.0)
            except (SwarmdError, asyncio.TimeoutError) as exc:
                log.warning("could not announce draining: %s", exc or "timed out")
        if self.data_plane is not None:
            await self.data_plane.drain(self.config.net.drain_timeout_s)
            await self.data_plane.close()
        if self.executor is not None:
            await self.executor.close()
        if self._session is not None:
            await self._session.close()
        if self._api_server is not None and self._api_task is not None:
            self._api_server.should_exit = True
            try:
                await asyncio.wait_for(self._api_task, 10)
            except asyncio.TimeoutError:
                log.warning("control plane did not stop within 10s; cancelled")
        if self._api_socket is not None:
            self._api_socket.close()
        if self.dht is not None:
            await self.dht.stop()
        if self._state_lock is not None:
            self._state_lock.close()
        self.state = "stopped"
        log.info("stopped")

    async def __aenter__(self) -> Daemon:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ---- views -----------------------------------------------------------------------------

    @property
    def data_addr(self) -> str | None:
        return format_addr(self.data_plane.address) if self.data_plane else None

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

    def status(self) -> dict[str, Any]:
        ex = self.executor
        dp = self.data_plane
        spec = self.spec
        return {
            "peer_id": self.peer_id,
            "stage": self.stage,
            "n_stages": spec.n_stages if spec else None,
            "state": self.state,
            "swarm": self.config.swarm,
            "model": {"name": spec.name, "digest": spec.digest} if spec else None,
            "step": ex.step if ex else 0,
            "queue": ex.queue if ex else 0,
            "in_flight": dp.in_flight if dp else 0,
            "throughput": ex.throughput if ex else 0.0,
            "grad_samples": ex.grad_samples if ex else 0,
            "stale_dropped": ex.stale_dropped if ex else 0,
            "stale_applied": ex.stale_applied if ex else 0,
            "activation_cache": ex.cache_stats() if ex else None,
            "worker_cpu_s": ex.worker_cpu_s if ex else 0.0,
            "params_digest": ex.digest if ex else None,
            "averaging": {
                "rounds_ok": self.averager.rounds_ok,
                "rounds_aborted": self.averager.rounds_aborted,
                "last_round": self.averager.last_round,
                "recent": list(self.averager.history)[-32:],
            } if self.averager else None,
            "synced_from": self.synced_from,
            "migration": dict(self.migration) if self.migration else None,
            "served": dict(dp.served) if dp else {},
            "auth": self._auth_status(),
            "data_addr": self.data_addr,
            "api_addr": format_addr(self.api_addr),
            "dht_addr": format_addr(self.dht.address) if self.dht and self.dht.running else None,
            "founder": self.founder,
            "announcements": self.announcements,
            "device": self.config.pipeline.device,
            "version": __version__,
            "uptime_s": round(time.monotonic() - self._started_at, 3),
        }
