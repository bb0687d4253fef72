"""A daemon's background loops never die silently (issue #10): real in-process daemons."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from swarmd import tasks
from swarmd.daemon import Daemon
from tests.conftest import daemon_config


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "RESTART_BACKOFF_S", (0.05, 0.1))


async def test_a_crashing_rebalance_loop_is_logged_restarted_and_shown_in_status(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    d = Daemon(daemon_config())
    calls = 0
    recovered = asyncio.Event()

    async def broken_loop() -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise ZeroDivisionError("a bug in the policy")
        recovered.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(d.migrator, "rebalance_loop", broken_loop)
    with caplog.at_level(logging.ERROR):
        await d.start()
        try:
            await asyncio.wait_for(recovered.wait(), 10)
            async with httpx.AsyncClient(base_url=f"http://{d.status()['api_addr']}") as api:
                status = (await api.get("/status")).json()
            assert status["task_crashes"] == {"rebalance": 2}
            assert status["state"] == "serving"
        finally:
            await d.shutdown()
    assert d.exit_code == 0
    crashes = [r for r in caplog.records if "'rebalance' crashed" in r.getMessage()]
    assert len(crashes) == 2 and all(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in crashes)


async def test_the_control_plane_dying_stops_the_daemon_with_a_non_zero_exit_code(
        caplog: pytest.LogCaptureFixture) -> None:
    d = Daemon(daemon_config())
    await d.start()
    runner = asyncio.create_task(d.run_started())
    try:
        assert d._api_server is not None
        with caplog.at_level(logging.CRITICAL):
            d._api_server.should_exit = True  # uvicorn returns from serve() as if something stopped it
            await asyncio.wait_for(runner, 30)
    finally:
        await d.shutdown()
    assert d.exit_code == 1
    assert d.state == "stopped"
    assert any("control-plane" in r.getMessage() and r.exc_info for r in caplog.records)
