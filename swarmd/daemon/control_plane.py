"""What `curl localhost:8080/...` reaches: the daemon's control plane, and the training summary it shows.

The control plane is a FastAPI app (``swarmd.api.app``) served by uvicorn on the socket the daemon
bound at start-up, as one task of the daemon's :class:`~swarmd.tasks.TaskSet`: if it ever stops
while the daemon runs, the task fails loudly rather than leaving a daemon nobody can ask. The
training summary is what this daemon's trainers reported (``POST /trainers/{id}/report``),
published under the swarm's training key in the DHT and merged with every other daemon's record,
so ``/training`` and the dashboard show the whole swarm's curve.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from swarmd.api.models import TrainerReport
from swarmd.api.server import EmbeddedUvicorn, embedded_server
from swarmd.dht.identity import Identity
from swarmd.dht.node import DHTNode
from swarmd.dht.records import sign_record
from swarmd.errors import SwarmdError
from swarmd.tasks import TaskSet
from swarmd.training_summary import TrainingLog, training_key

__all__ = ["API_TASK", "ControlPlane", "TrainingSummary"]

log = logging.getLogger(__name__)

API_TASK = "control-plane"


class ControlPlane:
    """uvicorn serving the control plane's app on an already bound socket, as a task of ``tasks``."""

    def __init__(self, tasks: TaskSet, *, request_timeout_s: float) -> None:
        self.tasks = tasks
        self.request_timeout_s = request_timeout_s
        self.server: EmbeddedUvicorn | None = None
        self._socket: socket.socket | None = None

    async def start(self, app: Any, sock: socket.socket, *, stopping: Callable[[], bool]) -> None:
        """Serve ``app`` on ``sock`` until :meth:`stop`; ``stopping``: whether the daemon is stopping
        (else the server's end is an error)."""
        self._socket = sock  # asyncio serves on this very socket; closed after uvicorn stops
        server = self.server = embedded_server(app, request_timeout_s=self.request_timeout_s)

        async def serve() -> None:
            await server.serve(sockets=[sock])
            if not stopping():
                raise RuntimeError("the control plane stopped while the daemon was running")

        task = self.tasks.spawn(API_TASK, serve)
        while not server.started:
            if task.done():
                raise RuntimeError("the control plane exited during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            task = self.tasks.get(API_TASK)
            if task is not None:
                done, _ = await asyncio.wait({task}, timeout=10)
                if not done:
                    log.warning("control plane did not stop within 10s; cancelled")
        if self._socket is not None:
            self._socket.close()


class TrainingSummary:
    """This daemon's trainers' reports, published to the DHT and merged with the swarm's."""

    def __init__(self, log_: TrainingLog, *, swarm: str, ttl_s: float, dht: Callable[[], DHTNode | None],
                 identity: Callable[[], Identity | None]) -> None:
        self.log = log_
        self.swarm = swarm
        self.ttl_s = ttl_s
        self._dht = dht
        self._identity = identity

    def on_report(self, trainer_id: str, report: TrainerReport) -> None:
        self.log.report(trainer_id, steps=[(p.step, p.loss, p.val_loss) for p in report.steps],
                        samples=report.samples, samples_per_s=report.samples_per_s)

    async def publish(self) -> None:
        """Publish what this daemon's trainers reported (if any is live), then merge every daemon's
        record into the swarm's curve."""
        dht, identity = self._dht(), self._identity()
        if dht is None or identity is None:  # not joined yet: nothing to publish to
            return
        key = training_key(self.swarm)
        record = self.log.record(identity.peer_id, self.ttl_s)
        if record is not None:
            await dht.store(key, sign_record(identity, record))
        self.log.merge(await dht.get(key))

    async def run(self, period_s: float, jitter: Callable[[], float],
                  also: Callable[[], Awaitable[None]]) -> None:
        """Publish every ``period_s`` (times ``jitter()``), and ``also`` (the trainers' ranks)."""
        while True:
            await asyncio.sleep(period_s * jitter())
            try:
                await self.publish()
                await also()
            except SwarmdError as exc:
                log.warning("could not publish or read the swarm's training summary: %s", exc)
