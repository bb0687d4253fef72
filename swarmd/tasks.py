"""Supervised background tasks: one owner, no silent deaths.

A daemon's long-running loops (announcing, averaging, rebalancing, a migration in progress, the
control plane) all live in one :class:`TaskSet`. Every task is awaited on shutdown, and a task
that ends with an exception is never discarded (``gather(return_exceptions=True)`` would): its
traceback is logged, then the task is either restarted after a short backoff
(``restart=True``: a loop whose next iteration can recover, e.g. rebalancing) or the set's
``on_fatal`` callback is told, so the daemon drains and exits non-zero (a loop it cannot do
without, e.g. the control plane).

Cancelling a task through :meth:`TaskSet.cancel` or :meth:`TaskSet.close` is not a crash. A task
that has not ended ``CANCEL_GRACE_S`` after its cancellation (it caught the cancellation, or waits on
something a cancellation does not reach) is a bug: it is logged as an error with the chain of
coroutines it is suspended in (``swarmd.task_dump``) and left behind, so that a daemon's shutdown
(SIGTERM) still completes instead of hanging on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from swarmd.task_dump import format_tasks

log = logging.getLogger(__name__)

#: Backoff between restarts of a crashing loop: doubles from the first to the last value.
RESTART_BACKOFF_S = (0.5, 30.0)

#: How long :meth:`TaskSet.cancel` waits for a cancelled task to end before it logs it and moves on.
CANCEL_GRACE_S = 15.0


@dataclass
class _Supervised:
    name: str
    factory: Callable[[], Awaitable[None]]
    restart: bool
    task: asyncio.Task[None] | None = None
    crashes: int = 0


class TaskSet:
    """Owns named background tasks; see the module docstring for what a crash does."""

    def __init__(self, on_fatal: Callable[[str, BaseException], None]) -> None:
        self._on_fatal = on_fatal
        self._tasks: dict[str, _Supervised] = {}
        self._closed = False

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]], *, restart: bool = False) -> asyncio.Task[None]:
        """Start ``factory()`` as task ``name`` (one task per name at a time)."""
        if self._closed:
            raise RuntimeError(f"cannot start {name!r}: the task set is closed")
        current = self._tasks.get(name)
        if current is not None and current.task is not None and not current.task.done():
            raise RuntimeError(f"a task named {name!r} is already running")
        entry = _Supervised(name, factory, restart)
        self._tasks[name] = entry
        entry.task = asyncio.create_task(self._supervise(entry), name=f"swarmd-{name}")
        return entry.task

    def get(self, name: str) -> asyncio.Task[None] | None:
        entry = self._tasks.get(name)
        return entry.task if entry is not None else None

    def running(self, name: str) -> bool:
        entry = self._tasks.get(name)
        return entry is not None and entry.task is not None and not entry.task.done()

    def crashes(self) -> dict[str, int]:
        """How often each task has crashed (for ``/status``)."""
        return {name: e.crashes for name, e in self._tasks.items() if e.crashes}

    async def _supervise(self, entry: _Supervised) -> None:
        delay = RESTART_BACKOFF_S[0]
        while True:
            try:
                await entry.factory()
                return  # finished on its own
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                entry.crashes += 1
                if not entry.restart:
                    log.critical("background task %r crashed; stopping the daemon", entry.name, exc_info=exc)
                    self._on_fatal(entry.name, exc)
                    return
                log.error("background task %r crashed (%d so far); restarting it in %.1fs",
                          entry.name, entry.crashes, delay, exc_info=exc)
            await asyncio.sleep(delay)
            delay = min(RESTART_BACKOFF_S[1], delay * 2)

    async def cancel(self, name: str) -> None:
        """Cancel task ``name`` (if running) and wait until it has ended (at most ``CANCEL_GRACE_S``)."""
        entry = self._tasks.pop(name, None)
        if entry is None or entry.task is None:
            return
        if entry.task is asyncio.current_task():
            return  # a task ending itself: it returns on its own
        entry.task.cancel()
        await wait_cancelled({entry.task}, f"background task {name!r}")

    async def close(self) -> None:
        """Cancel every task, newest first, and wait for each to end."""
        self._closed = True
        for name in reversed(list(self._tasks)):
            await self.cancel(name)


async def wait_cancelled(tasks: set[asyncio.Task[Any]], what: str, grace_s: float | None = None) -> None:
    """Wait for cancelled ``tasks`` to end, at most ``grace_s`` (``CANCEL_GRACE_S``): those still running
    then are logged as an error with what they wait on, and left behind (a shutdown must not hang)."""
    if not tasks:
        return
    grace_s = CANCEL_GRACE_S if grace_s is None else grace_s
    done, pending = await asyncio.wait(tasks, timeout=grace_s)
    for task in done:  # retrieved, as gather(return_exceptions=True) would: a cancelled task's error is no news
        if not task.cancelled():
            task.exception()
    if pending:
        log.error("%s did not end within %gs of its cancellation; left behind, waiting in:\n%s", what,
                  grace_s, format_tasks(pending, why="not ended after cancel"))


T = TypeVar("T")


async def all_or_nothing(*aws: Awaitable[T]) -> list[T]:
    """Run ``aws`` at once and return their results in order; the first to fail cancels the others,
    which are awaited before its error goes on (``asyncio.gather`` would leave them running)."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                task.result()  # raises it
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Whether ``event`` is set within ``timeout`` seconds (a non-positive timeout: whether it is set now).

    Use it instead of ``asyncio.wait_for(event.wait(), timeout)``: before Python 3.12, ``wait_for`` swallows
    a cancellation that arrives in the same turn of the loop as the event, so a loop around it went on
    waiting its whole timeout after being cancelled. Measured: the all-reduce coordinator cancelled a wait for
    its own samples the moment a mate's report woke it, and sat out the rest of a one-second hold every few
    steps (``tests/integration/test_tasks.py``)."""
    if event.is_set():
        return True
    if timeout <= 0:
        return False
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()  # (a no-op once it is done)
    return bool(done)
