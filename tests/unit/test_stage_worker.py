"""The stage's worker thread: a round's hooks run before queued microbatches, each lane in order."""

from __future__ import annotations

import threading

import pytest

from swarmd.pipeline.stage.worker import StageWorker


def test_urgent_jobs_overtake_queued_compute_and_each_lane_keeps_its_order() -> None:
    ran: list[str] = []
    gate = threading.Event()
    worker = StageWorker("test-stage", initializer=lambda: ran.append("init"))
    try:
        blocker = worker.submit(gate.wait)  # running: what is submitted now queues behind it
        compute = [worker.submit(lambda i=i: ran.append(f"compute{i}")) for i in range(3)]
        urgent = [worker.submit(lambda i=i: ran.append(f"urgent{i}"), urgent=True) for i in range(2)]
        gate.set()
        for f in [blocker, *compute, *urgent]:
            f.result(timeout=10)
        assert ran == ["init", "urgent0", "urgent1", "compute0", "compute1", "compute2"]
    finally:
        gate.set()
        worker.shutdown()


def test_a_job_that_raises_hands_its_exception_over_and_the_worker_goes_on() -> None:
    worker = StageWorker("test-stage")
    try:
        failed = worker.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(timeout=10)
        assert worker.submit(lambda: 42).result(timeout=10) == 42
    finally:
        worker.shutdown()


def test_shutdown_runs_what_is_queued_then_refuses_new_jobs() -> None:
    gate = threading.Event()
    worker = StageWorker("test-stage")
    blocker = worker.submit(gate.wait)
    queued = worker.submit(lambda: "done")
    gate.set()
    worker.shutdown(wait=True)
    assert blocker.done() and queued.result(timeout=0) == "done"
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)
    worker.shutdown()  # twice is harmless
