"""What a running trainer (or a daemon's stuck task) waits on: asyncio tasks' await chains.

A trainer that stops making progress without an error (every microbatch waiting on something that
never comes) says nothing in its log. ``kill -USR1 <pid>`` makes it print, for each of its asyncio
tasks, the chain of coroutines it is suspended in (outermost first, each with its source line) and
the future it waits on, then carry on. :func:`format_tasks` is the text; :func:`dump_on_signal` the
handler's lifetime (a no-op where signals cannot be handled: not the main thread, no ``SIGUSR1``).

Python's own ``Task.print_stack`` shows only a suspended task's outermost frame; this walks the
``await`` chain down to the innermost coroutine.
"""

from __future__ import annotations

import asyncio
import contextlib
import linecache
import signal
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any, TextIO

__all__ = ["await_chain", "dump_on_signal", "format_tasks"]

_MAX_DEPTH = 64
_installed: dict[asyncio.AbstractEventLoop, int] = {}  # loop -> trainers of it that asked for the handler


def _frame_of(obj: Any) -> FrameType | None:
    """The frame of a coroutine, generator or async generator (None: finished, or not one)."""
    for attr in ("cr_frame", "gi_frame", "ag_frame"):
        frame = getattr(obj, attr, None)
        if frame is not None:
            return frame
    return None


def _awaited(obj: Any) -> Any:
    """What a suspended coroutine, generator or async generator awaits (None: nothing known)."""
    for attr in ("cr_await", "gi_yieldfrom", "ag_await"):
        inner = getattr(obj, attr, None)
        if inner is not None:
            return inner
    return None


def await_chain(coro: Any) -> list[str]:
    """The frames ``coro`` is suspended in, outermost first: ``File "f", line n, in name`` and the
    source line, as a traceback shows them."""
    lines: list[str] = []
    obj = coro
    for _ in range(_MAX_DEPTH):
        frame = _frame_of(obj)
        if frame is None:
            break
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        source = linecache.getline(code.co_filename, frame.f_lineno).strip()
        if source:
            lines.append(f"    {source}")
        obj = _awaited(obj)
        if obj is None:
            break
    return lines


def format_tasks(tasks: set[asyncio.Task[Any]] | None = None, *, why: str = "") -> str:
    """Every task of the running loop (or ``tasks``): its name, state, await chain and the future it
    waits on."""
    tasks = asyncio.all_tasks() if tasks is None else tasks
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = [f"swarmd: {len(tasks)} asyncio task(s) at {stamp}{f' ({why})' if why else ''}"]
    for task in sorted(tasks, key=lambda t: t.get_name()):
        state = "done" if task.done() else "pending"
        out.append(f"task {task.get_name()!r} ({state}):")
        out.extend(await_chain(task.get_coro()))
        waiter = getattr(task, "_fut_waiter", None)  # the future it is suspended on (both Task implementations)
        if waiter is not None:
            out.append(f"  waiting on {waiter!r}")
    return "\n".join(out) + "\n"


def _dump(file: TextIO | None) -> None:
    stream = sys.stderr if file is None else file
    stream.write(format_tasks(why="SIGUSR1"))
    stream.flush()


@contextlib.contextmanager
def dump_on_signal(file: TextIO | None = None) -> Iterator[bool]:
    """While inside: ``SIGUSR1`` writes :func:`format_tasks` of the running loop to ``file`` (stderr).
    Yields whether the handler is on (not off the main thread, nor without ``SIGUSR1``). Several
    trainers of one loop share the handler, which goes when the last one leaves."""
    loop = asyncio.get_running_loop()
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None:
        yield False
        return
    if loop not in _installed:
        try:
            loop.add_signal_handler(sig, _dump, file)
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread, or no signals here
            yield False
            return
        _installed[loop] = 0
    _installed[loop] += 1
    try:
        yield True
    finally:
        _installed[loop] -= 1
        if not _installed[loop]:
            del _installed[loop]
            loop.remove_signal_handler(sig)
