"""Shared fixtures: real daemons on 127.0.0.1 with port 0, torn down in ``finally``."""

from __future__ import annotations

import os

# One OpenMP thread per process, for the test workers and every process they start (before torch is
# imported): the xdist workers, their in-process daemons and the daemons they spawn share two cores,
# and oversubscribed OpenMP threads spin. Measured in the full suite under -n 2: a unit test that
# takes 0.06 s alone took 14 s (tests/unit/test_optimizer.py, test_model.py, test_codecs.py: 64 s -> 5 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import pytest_timeout

from swarmd import local_swarm
from swarmd.config import ApiConfig, Config, NetConfig, PipelineConfig, RebalanceConfig
from swarmd.daemon import Daemon
from swarmd.pipeline.spec import PRESETS, ModelSpec
from swarmd.task_dump import format_tasks
from tests.support.netlab_fixture import netlab  # noqa: F401  (the network lab: separate hosts as namespaces)

TINY: ModelSpec = PRESETS["tiny"]

_dump_threads = pytest_timeout.dump_stacks


def _dump_threads_and_tasks(terminal: Any) -> None:
    """pytest-timeout's dump of every thread's stack, then every asyncio task's await chain: an async test
    that times out sits in its loop's ``select`` (the SIGALRM handler runs in that thread, with the loop
    running), and only the tasks say what it waits on."""
    _dump_threads(terminal)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not an async test
        return
    terminal.write(format_tasks(asyncio.all_tasks(loop), why="test timeout"))


pytest_timeout.dump_stacks = _dump_threads_and_tasks


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


# Heaviest first: pytest-xdist's ``--dist loadfile`` hands out files in collection order (``scripts/test`` turns
# off its reordering by test count, which put the many tiny unit tests first and the single-test files of a minute
# last, so one worker ran them alone at the end); the end-to-end folders go first and the unit tests fill the gaps.
_HEAVY_FIRST = {"system": 0, "adversarial": 1, "integration": 2, "unit": 3}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _HEAVY_FIRST.get(Path(str(item.path)).parent.name, 4))  # stable within a folder


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
