"""scripts/bench_gpipe.py's report, from made-up variant results: ratios, rates against loopback, loss checks,
and a lab scenario that was skipped (no processes, no torch work: the end-to-end run is in tests/system)."""

from __future__ import annotations

from typing import Any

import pytest
from scripts.bench_gpipe import REFERENCE, Settings, report


def _variant(rate: float, losses: list[float]) -> dict[str, Any]:
    return {"samples_per_s": rate, "samples": 32, "window_s": 32 / rate, "step_losses": losses}


def test_ratios_are_swarmd_over_each_gpipe_variant_and_each_rate_over_its_loopback_rate() -> None:
    losses = [5.0, 4.0]
    loopback = {"scenario": "loopback", "rtt_ms": 0.0, "rate": None, "variants": {
        "swarmd": _variant(100.0, losses), "swarmd_p2p": _variant(150.0, losses),
        "pipelining_gpipe": _variant(50.0, losses), REFERENCE: _variant(200.0, [5.0, 4.0 * (1 + 1e-6)])}}
    wan = {"scenario": "rtt100", "rtt_ms": 100.0, "rate": None, "variants": {
        "swarmd": _variant(80.0, losses), "pipelining_gpipe": {"error": "rank 1 exited with 1"},
        REFERENCE: _variant(100.0, losses)}}
    skipped = {"scenario": "rtt50", "rtt_ms": 50.0, "rate": None, "skipped": "the network lab needs root"}
    r = report(Settings(), [loopback, wan, skipped])

    assert r["microbatch_sizes"] == [8, 8, 8, 8]
    assert loopback["ratios"] == {"swarmd/pipelining_gpipe": 2.0, f"swarmd/{REFERENCE}": 0.5,
                                  "swarmd_p2p/pipelining_gpipe": 3.0, f"swarmd_p2p/{REFERENCE}": 0.75}
    assert loopback["vs_loopback"] == {"swarmd": 1.0, "swarmd_p2p": 1.0, "pipelining_gpipe": 1.0, REFERENCE: 1.0}
    assert loopback["losses_max_rel_diff_vs_" + REFERENCE]["swarmd"] == pytest.approx(1e-6, rel=1e-3)
    # a failed variant has no rate, no ratio and no loss check, and spoils nothing else
    assert wan["samples_per_s"]["pipelining_gpipe"] is None and wan["ratios"]["swarmd/pipelining_gpipe"] is None
    assert wan["ratios"][f"swarmd/{REFERENCE}"] == 0.8
    assert wan["vs_loopback"] == {"swarmd": 0.8, "pipelining_gpipe": None, REFERENCE: 0.5}
    assert wan["losses_max_rel_diff_vs_" + REFERENCE] == {"swarmd": 0.0, "pipelining_gpipe": None}
    assert skipped == {"scenario": "rtt50", "rtt_ms": 50.0, "rate": None, "skipped": "the network lab needs root"}
