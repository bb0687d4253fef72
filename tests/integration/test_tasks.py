"""The daemon's supervised task set: a crash is never silent (issue #10)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from swarmd import tasks
from swarmd.tasks import TaskSet


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "RESTART_BACKOFF_S", (0.01, 0.02))


async def test_a_crashing_loop_is_logged_with_its_traceback_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    fatal: list[str] = []
    runs = 0
    again = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise KeyError(f"bug number {runs}")
        again.set()
        await asyncio.Event().wait()

    ts = TaskSet(on_fatal=lambda name, exc: fatal.append(name))
    with caplog.at_level(logging.ERROR, logger="swarmd.tasks"):
        ts.spawn("rebalance", flaky, restart=True)
        await asyncio.wait_for(again.wait(), 5)
    assert runs == 3 and fatal == []
    assert ts.crashes() == {"rebalance": 2}
    crashed = [r for r in caplog.records if "rebalance" in r.getMessage()]
    assert len(crashed) == 2 and all(r.exc_info and r.exc_info[0] is KeyError for r in crashed)
    assert ts.running("rebalance")
    await ts.close()
    assert not ts.running("rebalance")


async def test_a_crash_of_a_loop_that_is_not_restarted_is_fatal(caplog: pytest.LogCaptureFixture) -> None:
    fatal: list[tuple[str, BaseException]] = []

    async def broken() -> None:
        raise RuntimeError("the control plane went away")

    ts = TaskSet(on_fatal=lambda name, exc: fatal.append((name, exc)))
    with caplog.at_level(logging.CRITICAL, logger="swarmd.tasks"):
        task = ts.spawn("control-plane", broken)
        await asyncio.wait({task})
    assert [name for name, _ in fatal] == ["control-plane"]
    assert isinstance(fatal[0][1], RuntimeError)
    assert any(r.exc_info and "control-plane" in r.getMessage() for r in caplog.records)
    await ts.close()


async def test_cancel_and_close_are_not_crashes_and_wait_for_every_task() -> None:
    fatal: list[str] = []
    finished: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            finished.append(name)

    ts = TaskSet(on_fatal=lambda name, exc: fatal.append(name))
    ts.spawn("a", lambda: forever("a"))
    ts.spawn("b", lambda: forever("b"), restart=True)
    ts.spawn("c", lambda: forever("c"))
    await asyncio.sleep(0)
    await ts.cancel("a")
    assert finished == ["a"]
    await ts.close()
    assert finished == ["a", "c", "b"]  # newest first
    assert fatal == [] and ts.crashes() == {}
    with pytest.raises(RuntimeError, match="closed"):
        ts.spawn("d", lambda: forever("d"))


async def test_one_task_per_name() -> None:
    ts = TaskSet(on_fatal=lambda name, exc: None)
    ts.spawn("x", lambda: asyncio.sleep(10))
    with pytest.raises(RuntimeError, match="already running"):
        ts.spawn("x", lambda: asyncio.sleep(10))
    await ts.close()


async def test_a_task_that_ignores_its_cancellation_is_logged_with_what_it_waits_on_and_left_behind(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shutdown must not hang on one loop that swallowed its cancellation: after the grace, the set
    moves on and says which task, and where it waits."""
    monkeypatch.setattr(tasks, "CANCEL_GRACE_S", 0.2)
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                continue  # the bug: carries on waiting

    ts = TaskSet(on_fatal=lambda name, exc: None)
    task = ts.spawn("announce", stubborn)
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="swarmd.tasks"):
        await asyncio.wait_for(ts.close(), 5)
    assert not task.done()  # left behind, not waited for
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "background task 'announce' did not end within 0.2s of its cancellation" in errors[0]
    assert "in stubborn" in errors[0] and "await asyncio.Event().wait()" in errors[0]  # where it waits
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done()


async def test_wait_event_says_whether_the_event_came_in_time() -> None:
    event = asyncio.Event()
    assert await tasks.wait_event(event, 0.01) is False
    assert await tasks.wait_event(event, 0) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await tasks.wait_event(event, 5) is True
    assert await tasks.wait_event(event, 0) is True  # already set: at once


async def test_a_loop_waiting_on_an_event_ends_when_cancelled_as_the_event_comes() -> None:
    # Python 3.11's asyncio.wait_for swallows a cancellation that arrives in the turn its event is set: a loop
    # around it then waited out its whole timeout (the all-reduce coordinator sat out a 1 s hold every few steps)
    event = asyncio.Event()
    turns = 0

    async def loop() -> None:
        nonlocal turns
        while True:
            turns += 1
            if not await tasks.wait_event(event, 30):
                return
            event.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)  # (not a TimeoutError: the loop did not wait on)
    assert turns == 1


async def test_a_wait_for_progress_cancelled_as_the_samples_arrive_ends_at_once() -> None:
    from swarmd.pipeline.spec import TrainingSpec
    from swarmd.pipeline.stage.executor import StageExecutor
    from tests.support.averaging import ONE

    ex = StageExecutor(ONE, 0, training=TrainingSpec(target_batch_size=10**6), threads=1)
    try:
        task = asyncio.create_task(ex.wait_progress(8, samples=10**6))
        await asyncio.sleep(0.01)
        event = ex._progressed
        assert event is not None
        event.set()  # as _adopt does when the samples change
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
    finally:
        await ex.close()
