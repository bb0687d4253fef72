"""swarmd.task_dump: what a stalled trainer waits on, on SIGUSR1."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading

import pytest

from swarmd.task_dump import await_chain, dump_on_signal, format_tasks


async def _innermost(event: asyncio.Event) -> None:
    await event.wait()


async def _outer(event: asyncio.Event) -> None:
    await _innermost(event)


def test_the_chain_goes_down_to_the_innermost_coroutine() -> None:
    async def main() -> str:
        event = asyncio.Event()
        task = asyncio.create_task(_outer(event), name="waiter")
        await asyncio.sleep(0)
        text = format_tasks({task})
        event.set()
        await task
        return text

    text = asyncio.run(main())
    assert "task 'waiter' (pending):" in text
    lines = text.splitlines()
    outer = next(i for i, line in enumerate(lines) if line.endswith("in _outer"))
    inner = next(i for i, line in enumerate(lines) if line.endswith("in _innermost"))
    waits = next(i for i, line in enumerate(lines) if line.endswith("in wait"))  # asyncio.Event.wait
    assert outer < inner < waits
    assert "await event.wait()" in text  # the source line
    assert "waiting on <Future pending" in text


def test_a_finished_coroutine_has_no_chain() -> None:
    async def nothing() -> None:
        return None

    coro = nothing()
    with pytest.raises(StopIteration):
        coro.send(None)
    assert await_chain(coro) == []


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_sigusr1_writes_every_task_and_the_loop_goes_on() -> None:
    out = io.StringIO()

    async def main() -> bool:
        event = asyncio.Event()
        with dump_on_signal(out) as on:
            task = asyncio.create_task(_outer(event), name="stuck-microbatch")
            await asyncio.sleep(0)
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):  # the handler runs on the loop, soon
                if out.getvalue():
                    break
                await asyncio.sleep(0.01)
            event.set()
            await task
        return on

    assert asyncio.run(main())
    text = out.getvalue()
    assert "(SIGUSR1)" in text
    assert "task 'stuck-microbatch' (pending):" in text and "in _innermost" in text
    # the handler went with the block: the default action of SIGUSR1 is back
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)


def test_off_the_main_thread_it_is_off_and_harmless() -> None:
    result: list[bool] = []

    async def main() -> None:
        with dump_on_signal() as on:
            result.append(on)

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    thread.join()
    assert result == [False]
