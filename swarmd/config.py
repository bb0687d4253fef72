"""One frozen configuration tree for a daemon, built by the CLI (or by tests) and never mutated.

Like uvicorn's ``Config``: the command line maps onto these dataclasses, the daemon reads
them, and nothing reads the environment at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarmd.net.limits import DEFAULT_LIMITS, WireLimits
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.swarm_key import SwarmKey

DEFAULT_API_PORT = 8080
DEFAULT_BOOTSTRAP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class NetConfig:
    """The aiohttp data plane: where it listens and how long it waits."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; the bound port is logged and shown in /status
    # --announce: the host (and port) others dial; None learns it (swarmd.net.addresses)
    announce_host: str | None = None
    announce_port: int | None = None
    # relaying for peers nobody can dial (swarmd.net.relay): how many at most (0: none), bytes/s over all
    relay_max_peers: int = 8
    relay_budget_bytes_s: float = 50 * 2**20
    limits: WireLimits = DEFAULT_LIMITS
    drain_timeout_s: float = 30.0  # how long shutdown waits for in-flight requests
    read_timeout_s: float = 60.0  # a request body must arrive within this


@dataclass(frozen=True)
class ApiConfig:
    """The FastAPI control plane."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_API_PORT
    token: str | None = None  # required for mutating endpoints when set (and by the CLI off loopback)
    request_timeout_s: float = 10.0  # a request (headers and body) must arrive within this, else closed


@dataclass(frozen=True)
class DHTConfig:
    """Kademlia membership: where the UDP node listens, whom it joins, how often it announces."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; shown in /status as dht_addr
    join: tuple[tuple[str, int], ...] = ()  # bootstrap peers; empty: found a new swarm
    announce_period_s: float = 10.0  # records are refreshed this often and expire after 3 periods
    # give up joining (and finding the swarm's record) after this: a --join address nobody answers at
    # fails within seconds, while a peer started at the same moment as this one still has time to open
    # its port (swarmd.dht.node retries with backoff until then)
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S
    state_dir: Path | None = None  # where the peer's key lives; None: a fresh key for this run only
    max_per_source: int = 8  # new records one source group may place under one DHT key (swarmd.dht.sources)
    source_grouping: str = "auto"  # what one source group is: auto | prefix | address | endpoint

    @property
    def record_ttl_s(self) -> float:
        return 3.0 * self.announce_period_s


@dataclass(frozen=True)
class RebalanceConfig:
    """The live rebalancing task: which policy, how often (``swarmd.pipeline.placement.rebalance``)."""

    policy: str = "adaptive"  # every peer of a swarm should run the same one
    period_s: float = 300.0  # a decision every period, and on membership changes (adaptive)
    cooldown_s: float = 30.0  # after moving, a peer takes no other decision for this long


@dataclass(frozen=True)
class PipelineConfig:
    """Which stage of which model this peer serves, and on what hardware."""

    spec: ModelSpec | None = None  # None: read the swarm's spec from the DHT (joiners)
    stage: int | None = None  # None: --stage auto, the stage that needs this peer most
    training: TrainingSpec | None = None  # a founder's settings (None: defaults); joiners take the swarm's
    device: str = "cpu"  # already resolved: "cpu", "cuda" or "cuda:N"
    precision: str = "fp32"  # fp32, bf16 or fp16: autocast of the stage's compute (swarmd.pipeline.stage.precision)
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    max_batch_tokens: int = 1 << 16  # B*T above this is refused with 413 (keeps one request from OOMing a peer)
    # forwards kept for their backwards (swarmd.pipeline.stage.activation_cache): a kept forward's backward
    # skips the recompute and may omit its inputs; 0 entries or bytes turn it off (every backward resends)
    activation_cache_entries: int = 64
    activation_cache_bytes: int = 256 * 2**20
    activation_cache_ttl_s: float = 60.0


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of the served stage under the state directory (``swarmd.checkpoint``)."""

    every: int = 50  # steps between checkpoints (and one on graceful shutdown); 0: never write one
    keep: int = 3  # the newest this many per stage are kept, older ones deleted


@dataclass(frozen=True)
class Config:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    swarm: str = "default"
    net: NetConfig = field(default_factory=NetConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # needs dht.state_dir
    swarm_key: SwarmKey | None = None  # a private swarm's pre-shared key (--swarm-key): DHT and data plane
