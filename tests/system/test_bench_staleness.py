"""scripts/bench_staleness.py at its smallest: the runs start alike and only the staleness rule tells them apart.

Every mode rebuilds the model from the same seed and draws the same microbatches, so with no stale
microbatch ``stale``, ``predicted`` and ``recomputed`` must be ``sync`` to the bit, and with some they must not be
(the one-update-old parameters are really used); the delayed modes are ``sync`` before ``--delay-after``. How much staleness costs goes in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_staleness.py"


def _bench(tmp_path: Path, *extra: str) -> dict[str, Any]:
    argv = [sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "3", "--val-every", "1",
            "--val-batches", "1", "--corpus-bytes", str(2**20), "--json", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {r["mode"]: r for r in report["runs"]}


def test_no_stale_microbatch_is_sync_and_some_are_not(tmp_path: Path) -> None:
    exact = _bench(tmp_path, "--stale-fraction", "0", "--modes", "sync", "stale", "predicted", "recomputed")
    assert exact["sync"]["vs_sync"] == 0.0
    for mode in ("stale", "predicted", "recomputed"):
        assert exact[mode]["val_curve"] == exact["sync"]["val_curve"], mode

    stale = _bench(tmp_path, "--stale-fraction", "0.5")
    sync = stale["sync"]["val_curve"]
    assert [p[:2] for p in sync] == [[1, 32], [2, 64], [3, 96]]
    # step 1 has no older parameters to use: alike; from step 2 on the stale gradients show
    assert stale["stale"]["val_curve"][0] == sync[0] and stale["stale"]["val_curve"][2] != sync[2]
    assert stale["predicted"]["val_curve"][2] not in (sync[2], stale["stale"]["val_curve"][2])
    assert stale["recomputed"]["val_curve"][2] not in (sync[2], stale["stale"]["val_curve"][2])
    assert stale["delayed"]["val_curve"][0] != sync[0]  # its first update is the zero one
    # prediction needs a non-zero update behind it (the first is the zero one, the second at the
    # warmup's smallest rate): alike at first, then computed at other parameters
    both = _bench(tmp_path, "--steps", "6", "--modes", "delayed", "delayed-predicted")
    delayed, predicted = both["delayed"]["val_curve"], both["delayed-predicted"]["val_curve"]
    assert predicted[:2] == delayed[:2] and predicted[5] != delayed[5]

    late = _bench(tmp_path, "--modes", "sync", "delayed", "--delay-after", "3")
    assert late["delayed"]["val_curve"] == late["sync"]["val_curve"]  # every update of the run taken at once


def test_bad_arguments_are_one_sentence(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--stale-fraction", "2"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "--stale-fraction" in done.stderr
