"""scripts/bench_p2p.py on loopback with its smallest settings: the report's shape, and the bytes p2p saves.

Real daemons through the CLI and the real trainer, without and with ``--p2p``: the trainer's bytes per
microbatch are exact (the same frames every time), so what p2p saves at 2 stages is asserted (every
activation and gradient: with the backward chain the trainer sends and receives meta and token ids only);
how fast each mode is goes in docs/BENCHMARKS.md, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_p2p.py"


# the suite's 10-minute budget (28 s in CI): the harness runs with -m slow; what it measures is tested in the default
# run by tests/integration/test_p2p.py (the trainer's bytes, per stage count, with and without p2p)
@pytest.mark.slow
@pytest.mark.timeout(600)  # two daemons and four trainer runs: minutes on a busy 2-core machine
def test_p2p_takes_the_tensors_off_the_trainers_bytes_and_the_report_says_so(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--stages", "2", "--rounds", "1", "--steps", "1", "--warmup", "2",
            "--batch-size", "16", "--microbatch-size", "8", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert len(report["load_average_before"]) == len(report["load_average_after"]) == 3
    [result] = report["results"]
    assert result["stages"] == 2 and [run["p2p"] for run in result["runs"]] == [False, True]
    for run in result["runs"]:
        assert run["microbatches"] == 2 and run["samples_per_s"] > 0 and run["issued_equals_completed"]
    off, on = result["runs"]
    # warm-up: the first calls go through the trainer (peers on probation); then every microbatch's chain
    assert off["p2p_hops"] == 0 and on["p2p_hops"] > 0 and on["p2p_fallbacks"] == 0 and on["p2p_backwards"] > 0
    # without p2p: an activation out and back and a gradient back and out; with it (the backward chain): neither,
    # only the token ids, the targets and the chain's meta (under 2 KB against 0.5 MB)
    assert on["trainer_bytes_per_microbatch"] < 2048 and result["ratio_trainer_bytes_per_microbatch"] < 0.01
    assert result["ratio_samples_per_s"] == pytest.approx(on["samples_per_s"] / off["samples_per_s"])
