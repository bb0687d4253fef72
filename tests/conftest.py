"""Shared fixtures: real daemons on 127.0.0.1 with port 0, torn down in ``finally``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from swarmd.config import ApiConfig, Config, NetConfig, PipelineConfig, RebalanceConfig
from swarmd.daemon import Daemon
from swarmd.pipeline.spec import PRESETS, ModelSpec

TINY: ModelSpec = PRESETS["tiny"]


def daemon_config(stage: int = 0, spec: ModelSpec = TINY, **net: object) -> Config:
    return Config(
        swarm="test",
        net=replace(NetConfig(host="127.0.0.1", port=0, drain_timeout_s=10.0), **net),
        api=ApiConfig(host="127.0.0.1", port=0),
        rebalance=RebalanceConfig(policy="none"),
        pipeline=PipelineConfig(spec=spec, stage=stage, device="cpu"),
    )


@contextlib.asynccontextmanager
async def running_daemon(stage: int = 0, spec: ModelSpec = TINY, **net: object) -> AsyncIterator[Daemon]:
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


class DaemonProcess:
    """A ``swarmd`` subprocess started through the real CLI; ports read back from --ready-file."""

    def __init__(self, args: list[str], tmp_path: Path) -> None:
        self.ready_file = tmp_path / f"ready-{time.monotonic_ns()}.json"
        self.log_path = self.ready_file.with_suffix(".log")
        self.state_dir = self.ready_file.with_suffix(".state")
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [*swarmd_command(), "--api-port", "0", "--port", "0", "--dht-port", "0", "--threads", "1",
             "--state-dir", str(self.state_dir), "--ready-file", str(self.ready_file), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.info: dict = {}

    def wait_ready(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if self.proc.poll() is not None:
                raise AssertionError(f"swarmd exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"swarmd not ready within {timeout}s:\n{self.log()}")

    @property
    def api(self) -> str:
        return f"http://{self.info['api_addr']}"

    @property
    def data(self) -> str:
        return f"http://{self.info['data_addr']}"

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
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
