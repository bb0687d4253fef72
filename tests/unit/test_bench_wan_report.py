"""scripts/bench_wan.py's reports, from made-up results: the held-out loss compared at equal samples
(issue 28 item 3) and a daemon's averaging rounds in short (no lab, no processes: the runs need root)."""

from __future__ import annotations

from typing import Any

import pytest
from scripts.bench_wan import SCENARIOS, BenchError, _averaging_view, compare_loss, host_stages, val_loss_at


def _result(mode: str, curve: list[tuple[int, int, float]]) -> dict[str, Any]:
    return {"settings": {"sync": mode == "sync"}, "mode": mode,
            "scenarios": [{"scenario": "lan", "val_curve": [list(p) for p in curve]}]}


def test_the_held_out_loss_is_interpolated_between_validations_and_unknown_outside_them() -> None:
    curve = [(5, 160, 4.0), (10, 320, 3.0), (15, 480, 2.5)]
    assert val_loss_at(curve, 160) == 4.0
    assert val_loss_at(curve, 240) == pytest.approx(3.5)
    assert val_loss_at(curve, 400) == pytest.approx(2.75)
    assert val_loss_at(curve, 100) is None and val_loss_at(curve, 500) is None


def test_two_runs_are_compared_at_the_reference_s_validations_the_other_curve_spans() -> None:
    sync = _result("sync", [(5, 160, 4.0), (10, 320, 3.0), (15, 480, 2.4)])
    # the overlapped run's steps average more samples: its validations fall elsewhere
    overlapped = _result("async", [(5, 200, 3.9), (10, 400, 2.8), (12, 460, 2.6)])
    r = compare_loss(sync, overlapped, "lan")
    assert [p["samples"] for p in r["points"]] == [320]  # 160 and 480 lie outside 200..460
    assert r["points"][0]["other_val_loss"] == pytest.approx(3.24)
    assert r["last"]["rel_diff"] == pytest.approx(0.24 / 3.0)
    assert r["max_abs_rel_diff"] == pytest.approx(0.24 / 3.0)
    with pytest.raises(BenchError, match="--val-every"):
        compare_loss(sync, {**overlapped, "scenarios": [{"scenario": "lan"}]}, "lan")


def test_a_daemon_s_rounds_in_short_name_the_leader_and_the_missing_by_prefix() -> None:
    status = {"averaging": {"rounds_ok": 2, "rounds_aborted": 1, "silent_contributors": 0, "rounds_refused": 0,
                            "excluded": {}, "recent": [
                                {"step": 4, "status": "ok", "leader": "abcdef0123", "contributors": 1,
                                 "missing": [], "duration_s": 0.1},
                                {"step": 5, "status": "aborted", "leader": "abcdef0123", "contributors": 1,
                                 "missing": ["99887766554433"], "duration_s": 3.0}]}}
    view = _averaging_view(status)
    assert view is not None and view["rounds_ok"] == 2
    assert view["recent"] == [[4, "ok", "abcdef01", 1, [], 0.1], [5, "aborted", "abcdef01", 1, ["99887766"], 3.0]]
    assert _averaging_view({}) is None


def test_hosts_are_dealt_to_stages_round_robin_with_the_founder_on_stage_0() -> None:
    assert host_stages(2, 2) == [0, 1, 0, 1]
    assert host_stages(3, 1) == [0, 1, 2]
    eight = host_stages(2, 2, stage0_peers=8)  # wan100x8: 8 peers average in stage 0
    assert eight == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0] and eight.count(0) == 8


def test_the_8_peer_scenario_is_compared_with_its_own_lan_run() -> None:
    assert SCENARIOS["wan100x8"].stage0_peers == SCENARIOS["lan8"].stage0_peers == 8
    assert SCENARIOS["wan100x8"].baseline == "lan8" and SCENARIOS["wan100"].baseline == "lan"
    assert (SCENARIOS["wan100x8"].rtt_ms, SCENARIOS["wan100x8"].rate) == (SCENARIOS["wan100"].rtt_ms,
                                                                          SCENARIOS["wan100"].rate)
