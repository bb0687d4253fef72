"""The stage's worker thread: every torch job of a stage runs on it, a round's own jobs first.

A stage's parameters, gradient sums and activation cache belong to one thread
(``swarmd.pipeline.stage.executor``), so forwards, backwards and the averaging round's hooks never
race. With a first-in-first-out queue the round's hooks (take the gradients out, apply the
mean, put them back) waited behind every microbatch queued before them: with delayed parameter
updates and a trainer keeping many microbatches in flight, a stage 100 ms from its stage-mates
took 5-20 s per round on `bench_wan`'s wan100 (2 x 2 ``small``, window 16), most of it the
leader's and contributors' hooks queued behind their own backwards, while the stage's other
peers waited for them.

So this worker has two lanes: *urgent* jobs (a round's hooks, a state snapshot for a joining
peer) run before any queued *compute* job, in the order they came; compute jobs keep their own
order. A job already running is never interrupted. Moving a hook ahead of queued backwards is
what would have happened had those backwards arrived a moment later: without delayed updates
they are refused ``Busy`` while the gradients are out (and retried), with them they join the
next update (the step rule of ``swarmd.pipeline.stage.step_protocol`` judges each one when it runs).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["StageWorker"]

T = TypeVar("T")

_URGENT, _COMPUTE, _STOP = 0, 1, 2


class StageWorker:
    """One thread running submitted jobs, urgent ones before queued compute ones."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], Any] | None, Future[Any] | None]] = (
            queue.PriorityQueue())
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._stopped = False
        self._initializer = initializer
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T], *, urgent: bool = False) -> Future[T]:
        """Queue ``fn``; its future holds the result or the exception it raised."""
        future: Future[T] = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the stage worker is shut down")
            self._queue.put((_URGENT if urgent else _COMPUTE, next(self._seq), fn, future))
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the thread (``wait``: until it has stopped)."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put((_STOP, next(self._seq), None, None))
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _loop(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            _, _, fn, future = self._queue.get()
            if fn is None or future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine, as a thread pool would
                future.set_exception(exc)
            else:
                future.set_result(result)
