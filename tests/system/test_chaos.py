"""The chaos harness as a test: peers SIGKILLed and replaced while training, nothing lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def run_chaos(duration: int, kill_every: int, timeout: int, averaging: str = "allreduce") -> dict:
    # its own process group: the harness's daemons are its children, and a run past its time must not leave them
    # training on (they would slow every test after this one)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--duration", str(duration), "--kill-every", str(kill_every),
                             "--averaging", averaging, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the chaos run took over {timeout} s; the end of its log:\n{stderr[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived the harness
        except ProcessLookupError:
            pass
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["averaging"] == averaging
    assert proc.returncode == (0 if result["ok"] else 1)
    return result


def check(result: dict) -> None:
    assert result["kills"] >= 1 and result["steps"] > 0
    assert result["lost_microbatches"] == 0 and result["microbatches_issued"] == result["microbatches_completed"]
    assert min(result["min_samples_per_step"].values()) >= result["target_batch_size"]
    assert result["max_stall_s"] <= result["stall_bound_s"]
    assert abs(result["final_loss"] - result["reference_final_loss"]) <= 0.1 * result["reference_final_loss"]
    assert result["ok"], result["checks"]


@pytest.mark.timeout(300)
# the default mode's run in every suite; the leader's as a slow one (the suite is past its 10 minutes on 2 cores)
@pytest.mark.parametrize("averaging", ["allreduce", pytest.param("leader", marks=pytest.mark.slow)])
def test_short_chaos_run_loses_nothing(averaging: str) -> None:
    check(run_chaos(duration=8, kill_every=3, timeout=280, averaging=averaging))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_long_chaos_run_loses_nothing() -> None:
    check(run_chaos(duration=300, kill_every=10, timeout=1100))
