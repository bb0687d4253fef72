"""What the daemon's parts may use of the daemon: one typed surface, so no part imports another.

``Daemon`` (``swarmd.daemon.lifecycle``) owns every object and task and wires its parts
together; each part (joining, the stage's state, announcements, reachability and relays, the
views) holds the daemon as a :class:`Host` and reaches the others through it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import aiohttp

    from swarmd.api.metrics import DaemonMetrics
    from swarmd.api.trainer_ranks import RankBook
    from swarmd.api.trainers import TrainerRegistry
    from swarmd.checkpoint import Checkpointer
    from swarmd.config import Config
    from swarmd.dht.identity import Identity
    from swarmd.dht.membership import Membership
    from swarmd.dht.node import DHTNode
    from swarmd.net.addresses import Announced
    from swarmd.net.proof import Prover
    from swarmd.net.reachability import Reachability
    from swarmd.net.relay import RelayClient, RelayServer
    from swarmd.net.server import DataPlane
    from swarmd.peer_state import PeerState
    from swarmd.pipeline.averaging.averager import StageAverager
    from swarmd.pipeline.placement.migration import Migrator
    from swarmd.pipeline.reports import ReportLedger
    from swarmd.pipeline.spec import ModelSpec, TrainingSpec
    from swarmd.pipeline.stage.executor import StageExecutor
    from swarmd.pipeline.stage.runtime import StageRuntime
    from swarmd.tasks import TaskSet
    from swarmd.training_summary import TrainingLog

__all__ = ["Host"]


class Host(Protocol):
    """The daemon as its parts see it."""

    config: Config
    state: PeerState
    founder: bool
    identity: Identity | None
    dht: DHTNode | None
    membership: Membership | None
    spec: ModelSpec | None
    training: TrainingSpec
    runtime: StageRuntime | None
    session: aiohttp.ClientSession | None
    data_plane: DataPlane | None
    api_addr: tuple[str, int] | None
    announced: Announced | None
    reachability: Reachability
    relay_client: RelayClient | None
    relay_server: RelayServer
    relayed_addr: str | None
    prover: Prover
    reports: ReportLedger
    migrator: Migrator
    tasks: TaskSet
    metrics: DaemonMetrics
    trainers: TrainerRegistry
    training_log: TrainingLog
    ranks: RankBook
    stop_requested: asyncio.Event
    started_at: float

    @property
    def peer_id(self) -> str | None: ...

    @property
    def stage(self) -> int | None: ...

    @property
    def executor(self) -> StageExecutor | None: ...

    @property
    def averager(self) -> StageAverager | None: ...

    @property
    def data_addr(self) -> str | None: ...

    @property
    def dht_addr(self) -> str | None: ...

    @property
    def migration(self) -> dict[str, Any] | None: ...

    @property
    def checkpoints(self) -> Checkpointer | None: ...

    def excluded_peers(self) -> set[str]: ...

    async def announce(self) -> None: ...

    async def announce_quietly(self) -> None: ...

    async def stage_mates(self, max_age_s: float = 1.0, *, fresh: bool = False) -> dict[str, str]: ...

    def forget_stage_mates(self) -> None: ...
