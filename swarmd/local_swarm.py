"""A local swarm, one ``swarmd`` child process at a time: what the demo, benchmarks and tests start.

A :class:`DaemonProcess` runs the real CLI (``python -m swarmd``) on free ports (``--port 0
--api-port 0 --dht-port 0``) with its own ``--state-dir``, ``--ready-file`` and log file, all
named after it in one working directory. Readiness is the ready file (written atomically by the
daemon once it serves, with the ports it bound), not a sleep: :meth:`DaemonProcess.wait_ready`
polls it against a deadline and fails with the end of the child's log if the child exits first
or the deadline passes. Stopping is SIGTERM (the daemon drains and exits 0), then SIGKILL.

Only the standard library is used (``urllib.request`` for ``/status``), so ``swarmd demo`` runs
from a plain ``pip install swarmd``. Callers vary the child through the constructor: extra flags,
extra environment (a test's ``sitecustomize`` on ``PYTHONPATH``, ``OMP_NUM_THREADS``), or another
command prefix (``python -m cProfile -o FILE -m swarmd`` to profile a daemon).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

POLL_S = 0.05  # how often the ready file is looked for
LOG_TAIL_CHARS = 2000
_names = itertools.count()


def swarmd_command() -> list[str]:
    """``python -m swarmd`` with this interpreter: the same entry point as the console script."""
    return [sys.executable, "-m", "swarmd"]


class DaemonStartError(RuntimeError):
    """A child exited, or did not become ready in time; the message ends with its log's tail."""


class DaemonProcess:
    """One ``swarmd`` child process started through the real CLI; its addresses read from its ready file.

    ``args`` are swarmd flags, placed after the harness's own (so they win where both give one,
    e.g. ``--threads``); ``name`` names the ready file (``NAME.json``), log (``NAME.log``) and state
    directory (``NAME/``) in ``workdir``; ``env`` is merged over this process's environment as it is
    now; ``command`` replaces ``python -m swarmd``; ``threads`` (None: the child's default) becomes
    ``--threads``.
    """

    def __init__(
        self,
        args: Sequence[str],
        workdir: Path,
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        threads: int | None = 1,
    ) -> None:
        self.name = name or f"swarmd-{os.getpid()}-{next(_names)}"
        self.workdir = Path(workdir)
        self.ready_file = self.workdir / f"{self.name}.json"
        self.log_path = self.workdir / f"{self.name}.log"
        self.state_dir = self.workdir / self.name
        self.info: dict[str, Any] = {}
        argv = [*(command or swarmd_command()), "--port", "0", "--api-port", "0", "--dht-port", "0",
                "--state-dir", str(self.state_dir), "--ready-file", str(self.ready_file),
                *(["--threads", str(threads)] if threads is not None else []), *args]
        with open(self.log_path, "wb") as log:  # the child holds its own descriptor from here on
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def api(self) -> str:
        """The control plane's base URL (after :meth:`wait_ready`)."""
        return f"http://{self.info['api_addr']}"

    @property
    def data(self) -> str:
        """The data plane's base URL (after :meth:`wait_ready`)."""
        return f"http://{self.info['data_addr']}"

    def _ready_or_raise(self, deadline: float) -> dict[str, Any] | None:
        """The ready file's content once it exists; raises if the child is gone or time is up."""
        if self.ready_file.exists():
            self.info = json.loads(self.ready_file.read_text())
            return self.info
        code = self.proc.poll()
        if code is not None:
            raise DaemonStartError(f"swarmd {self.name} exited with {code} before serving; "
                                   f"the end of its log:\n{self.log_tail()}")
        if time.monotonic() > deadline:
            raise DaemonStartError(f"swarmd {self.name} was not serving within its deadline; "
                                   f"the end of its log:\n{self.log_tail()}")
        return None

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Block until the child serves: its ready file (peer_id, stage, data_addr, api_addr, dht_addr ...)."""
        deadline = time.monotonic() + timeout_s
        while (info := self._ready_or_raise(deadline)) is None:
            time.sleep(POLL_S)
        return info

    async def wait_ready_async(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """:meth:`wait_ready` without blocking the event loop."""
        deadline = time.monotonic() + timeout_s
        while (info := self._ready_or_raise(deadline)) is None:
            await asyncio.sleep(POLL_S)
        return info

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """``GET /status`` of the child's control plane; OSError (URLError) or ValueError if that fails."""
        with urllib.request.urlopen(f"{self.api}/status", timeout=timeout_s) as reply:
            body: dict[str, Any] = json.load(reply)
        return body

    async def status_async(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return await asyncio.to_thread(self.status, timeout_s)

    def log(self) -> str:
        """The child's whole log so far (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log()[-chars:]

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (the daemon drains), SIGKILL if it is still running after ``timeout_s``; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL (no goodbye: its DHT record must expire) unless it already exited; its exit code."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(10)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


def stop_all(daemons: Sequence[DaemonProcess], timeout_s: float = 30.0) -> list[int]:
    """SIGTERM every daemon at once, so they drain side by side rather than one after the other,
    then their exit codes in order (SIGKILL for any still running ``timeout_s`` after the signal)."""
    for d in daemons:
        if d.running():
            d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes = []
    for d in daemons:  # not d.stop(): a second SIGTERM could reach a daemon past its handlers and kill it
        try:
            codes.append(d.proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(d.kill())
    return codes


@contextmanager
def stopping(daemons: Sequence[DaemonProcess]) -> Iterator[list[int]]:
    """Stop the daemons of ``daemons`` (which the block may still be filling) when the block ends,
    side by side (:func:`stop_all`); if it raised, print each one's log tail to stderr first, so a
    failed benchmark says what its daemons saw. Yields the list their exit codes go into."""
    codes: list[int] = []
    try:
        yield codes
    except BaseException:
        for d in daemons:
            print(f"--- {d.name} log (end) ---\n{d.log_tail()}", file=sys.stderr)
        raise
    finally:
        codes.extend(stop_all(daemons))
