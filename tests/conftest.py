"""Shared fixtures: real daemons on 127.0.0.1 with port 0, torn down in ``finally``."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from swarmd import local_swarm
from swarmd.config import ApiConfig, Config, NetConfig, PipelineConfig, RebalanceConfig
from swarmd.daemon import Daemon
from swarmd.pipeline.spec import PRESETS, ModelSpec
from tests.support.netlab_fixture import netlab  # noqa: F401  (the network lab: separate hosts as namespaces)

TINY: ModelSpec = PRESETS["tiny"]


def daemon_config(stage: int = 0, spec: ModelSpec = TINY, **net: Any) -> Config:
    return Config(
        swarm="test",
        net=replace(NetConfig(host="127.0.0.1", port=0, drain_timeout_s=10.0), **net),
        api=ApiConfig(host="127.0.0.1", port=0),
        rebalance=RebalanceConfig(policy="none"),
        pipeline=PipelineConfig(spec=spec, stage=stage, device="cpu"),
    )


@contextlib.asynccontextmanager
async def running_daemon(stage: int = 0, spec: ModelSpec = TINY, **net: Any) -> AsyncIterator[Daemon]:
    daemon = Daemon(daemon_config(stage, spec, **net))
    try:
        await daemon.start()
        yield daemon
    finally:
        await daemon.shutdown()


def swarmd_command() -> list[str]:
    """The installed console script when there is one, else ``python -m swarmd`` (same entry point)."""
    script = Path(sys.executable).with_name("swarmd")
    if script.exists():
        return [str(script)]
    found = shutil.which("swarmd")
    return [found] if found else [sys.executable, "-m", "swarmd"]


class DaemonProcess(local_swarm.DaemonProcess):
    """The local-swarm harness with the suite's defaults: the installed entry point, one OpenMP thread.

    The environment is read when a process starts, so a test's ``monkeypatch.setenv`` (a
    ``sitecustomize`` on ``PYTHONPATH``) before construction reaches the child.
    """

    def __init__(self, args: list[str], tmp_path: Path) -> None:
        super().__init__(args, tmp_path, name=f"daemon-{time.monotonic_ns()}", command=swarmd_command(),
                         env={"OMP_NUM_THREADS": "1"})

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return super().wait_ready(timeout_s)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and the exit code (SIGKILL, so a negative code, if it does not exit in time)."""
        return self.stop(timeout_s)

    def close(self) -> None:
        self.kill()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    procs: list[DaemonProcess] = []

    def _spawn(*args: str) -> DaemonProcess:
        p = DaemonProcess(list(args), tmp_path)
        procs.append(p)
        return p

    try:
        yield _spawn
    finally:
        for p in procs:
            p.close()
