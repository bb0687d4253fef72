"""One frozen configuration tree for a daemon, built by the CLI (or by tests) and never mutated.

Like uvicorn's ``Config``: the command line maps onto these dataclasses, the daemon reads
them, and nothing reads the environment at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.net.wire import DEFAULT_LIMITS, WireLimits
from swarmd.pipeline.spec import ModelSpec

DEFAULT_API_PORT = 8080


@dataclass(frozen=True)
class NetConfig:
    """The aiohttp data plane: where it listens and how long it waits."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; the bound port is logged and shown in /status
    limits: WireLimits = DEFAULT_LIMITS
    drain_timeout_s: float = 30.0  # how long shutdown waits for in-flight requests
    read_timeout_s: float = 60.0  # a request body must arrive within this


@dataclass(frozen=True)
class ApiConfig:
    """The FastAPI control plane."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_API_PORT


@dataclass(frozen=True)
class PipelineConfig:
    """Which stage of which model this peer serves, and on what hardware."""

    spec: ModelSpec
    stage: int = 0
    device: str = "cpu"  # already resolved: "cpu", "cuda" or "cuda:N"
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    max_batch_tokens: int = 1 << 16  # B*T above this is refused with 413 (keeps one request from OOMing a peer)


@dataclass(frozen=True)
class Config:
    pipeline: PipelineConfig
    swarm: str = "default"
    net: NetConfig = field(default_factory=NetConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
