"""One long-running daemon per machine: it owns every task and shuts down in a fixed order.

Start-up: build the stage (off the loop), start the data plane, start the control plane, then
set ``ready`` and enter state ``serving``. Readiness is an explicit event so nothing (a test, a
DHT announcement later) acts on a half-started peer.

Shutdown (SIGTERM/SIGINT via the CLI, or ``request_stop``), in this order:

1. state ``draining``: the data plane closes its listening socket and answers new requests on
   open connections with 503, so clients go elsewhere at once;
2. in-flight requests finish, bounded by ``net.drain_timeout_s``;
3. the data plane closes, then the stage's worker thread finishes its queue and stops;
4. the control plane stops last, so ``/status`` shows ``draining`` until the very end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from swarmd import __version__
from swarmd.api.app import create_app
from swarmd.config import Config
from swarmd.net import codecs
from swarmd.net.server import DataPlane
from swarmd.pipeline.executor import StageExecutor

log = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn on our loop: the daemon, not uvicorn, owns signal handling."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (0: a free port), IPv4 or IPv6 as host says."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def format_addr(addr: tuple[str, int] | None) -> str | None:
    if addr is None:
        return None
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Daemon:
    """A swarmd peer serving one stage. Use ``async with Daemon(cfg) as d`` or ``await d.run()``."""

    def __init__(self, config: Config, *, peer_id: str | None = None) -> None:
        self.config = config
        self.peer_id = peer_id or secrets.token_hex(8)
        self.state = "starting"
        self.ready = asyncio.Event()
        self.executor: StageExecutor | None = None
        self.data_plane: DataPlane | None = None
        self.api_addr: tuple[str, int] | None = None
        self._api_server: _EmbeddedUvicorn | None = None
        self._api_task: asyncio.Task[None] | None = None
        self._api_socket: socket.socket | None = None
        self._stop = asyncio.Event()
        self._started_at = time.monotonic()
        self._shutdown_done = False

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        pipe = cfg.pipeline
        try:
            await asyncio.to_thread(codecs.warm_up)
            self.executor = await asyncio.to_thread(
                StageExecutor,
                pipe.spec,
                pipe.stage,
                pipe.device,
                max_batch_tokens=pipe.max_batch_tokens,
                threads=pipe.threads,
            )
            self.data_plane = DataPlane(self.executor, limits=cfg.net.limits, read_timeout_s=cfg.net.read_timeout_s)
            data_addr = await self.data_plane.start(cfg.net.host, cfg.net.port)
            log.info("data plane listening on http://%s", format_addr(data_addr))
            await self._start_api()
            log.info("control plane listening on http://%s (docs at /docs)", format_addr(self.api_addr))
        except BaseException:
            await self.shutdown()
            raise
        self.state = "serving"
        self.ready.set()
        log.info(
            "serving stage %d/%d of model %s (%s) in swarm %r as peer %s",
            pipe.stage,
            pipe.spec.n_stages,
            pipe.spec.name,
            pipe.spec.digest[:12],
            cfg.swarm,
            self.peer_id,
        )

    async def _start_api(self) -> None:
        sock = bind_socket(self.config.api.host, self.config.api.port)
        self.api_addr = sock.getsockname()[:2]
        config = uvicorn.Config(
            create_app(self),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._api_server = _EmbeddedUvicorn(config)
        self._api_task = asyncio.create_task(self._api_server.serve(sockets=[sock]), name="swarmd-api")
        self._api_socket = sock  # asyncio serves on this very socket; closed after uvicorn stops
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
        self.state = "draining"
        self.ready.clear()
        if self.data_plane is not None:
            await self.data_plane.drain(self.config.net.drain_timeout_s)
            await self.data_plane.close()
        if self.executor is not None:
            await self.executor.close()
        if self._api_server is not None and self._api_task is not None:
            self._api_server.should_exit = True
            try:
                await asyncio.wait_for(self._api_task, 10)
            except asyncio.TimeoutError:
                log.warning("control plane did not stop within 10s; cancelled")
        if self._api_socket is not None:
            self._api_socket.close()
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

    def status(self) -> dict[str, Any]:
        cfg = self.config
        ex = self.executor
        dp = self.data_plane
        return {
            "peer_id": self.peer_id,
            "stage": cfg.pipeline.stage,
            "n_stages": cfg.pipeline.spec.n_stages,
            "state": self.state,
            "swarm": cfg.swarm,
            "model": {"name": cfg.pipeline.spec.name, "digest": cfg.pipeline.spec.digest},
            "step": ex.step if ex else 0,
            "queue": ex.queue if ex else 0,
            "in_flight": dp.in_flight if dp else 0,
            "throughput": ex.throughput if ex else 0.0,
            "grad_samples": ex.grad_samples if ex else 0,
            "served": dict(dp.served) if dp else {},
            "data_addr": self.data_addr,
            "api_addr": format_addr(self.api_addr),
            "device": cfg.pipeline.device,
            "version": __version__,
            "uptime_s": round(time.monotonic() - self._started_at, 3),
        }
