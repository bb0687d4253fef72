"""scripts/bench_gpipe.py on loopback with its smallest settings: the report's shape, and the same math.

swarmd (real daemons through the CLI), torch.distributed.pipelining's GPipe and 1F1B and the hand-written
GPipe train the same model from the same weights on the same samples and microbatches, so their per-step
losses must agree to float rounding. How fast each is goes in docs/BENCHMARKS.md, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpipe.py"
VARIANTS = ("swarmd", "swarmd_p2p", "pipelining_gpipe", "pipelining_1f1b", "gpipe_prepost")
SWARMD = ("swarmd", "swarmd_p2p")
LOSS_RTOL = 1e-4  # the same computation, summed in other orders: rounding is ~1e-7


# the suite's 10-minute budget (34-41 s in CI with nine processes, before swarmd_p2p's three): the harness runs with -m slow, before a benchmark
@pytest.mark.slow
@pytest.mark.timeout(600)  # nine processes start one after another: minutes on a busy 2-core machine
def test_every_variant_reports_a_rate_and_the_same_losses(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--scenarios", "loopback", "--model", "tiny", "--stages", "2",
            "--steps", "1", "--warmup", "1", "--batch-size", "16", "--microbatch-size", "8", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert report["settings"]["stages"] == 2 and report["microbatch_sizes"] == [8, 8]
    assert len(report["load_average_at_end"]) == 3
    [loopback] = report["scenarios"]
    assert loopback["scenario"] == "loopback" and loopback["rtt_ms"] == 0.0
    assert set(loopback["variants"]) == set(VARIANTS)
    for name, variant in loopback["variants"].items():
        assert "error" not in variant, (name, variant.get("error"))
        assert variant["samples"] == 16 and variant["window_s"] > 0 and variant["samples_per_s"] > 0
        assert len(variant["step_losses"]) == 2, name  # warm-up step and timed step
        assert loopback["vs_loopback"][name] == pytest.approx(1.0)
    assert set(loopback["ratios"]) == {f"{mine}/{v}" for mine in SWARMD for v in VARIANTS if v not in SWARMD}
    for key, ratio in loopback["ratios"].items():
        mine, theirs = key.split("/")
        assert ratio == pytest.approx(loopback["samples_per_s"][mine] / loopback["samples_per_s"][theirs])

    reference = loopback["variants"]["gpipe_prepost"]["step_losses"]
    for name, variant in loopback["variants"].items():
        assert variant["step_losses"] == pytest.approx(reference, rel=LOSS_RTOL), name
    diffs = loopback["losses_max_rel_diff_vs_gpipe_prepost"]
    assert set(diffs) == set(VARIANTS) - {"gpipe_prepost"} and all(d <= LOSS_RTOL for d in diffs.values())
