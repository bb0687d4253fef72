"""The trainer's window (swarmd.train.window): Little's law by hand, the measurements it rests on, the smoothing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.cli.train import build_parser, config_from_args
from swarmd.errors import ConfigError
from swarmd.pipeline.schedule import StageCalls, sync_step
from swarmd.train.config import TrainerConfig
from swarmd.train.window import HEADROOM, MOST, START, CallCosts, StageCost, WindowSizer, in_flight_for


def test_littles_law_by_hand() -> None:
    # no round trips, two equal stages: one microbatch on each keeps both busy
    assert in_flight_for([StageCost(1.0, 0.0), StageCost(1.0, 0.0)]) == pytest.approx(2.0)
    # 0.5 s of round trips per stage: a microbatch's trip is 3 s, the slowest stage takes 1 s per microbatch
    assert in_flight_for([StageCost(1.0, 0.5), StageCost(1.0, 0.5)]) == pytest.approx(3.0)
    # a slow stage of two peers is as fast as one peer of half its compute: the bottleneck is 1 s, not 2
    assert in_flight_for([StageCost(1.0, 0.0), StageCost(2.0, 0.0, peers=2)]) == pytest.approx(3.0)
    # the bottleneck decides: a fast stage with a slow one needs barely more than one in flight
    assert in_flight_for([StageCost(0.1, 0.0), StageCost(1.0, 0.0)]) == pytest.approx(1.1)


def test_nothing_to_say_without_stages_or_compute() -> None:
    assert in_flight_for([]) is None
    assert in_flight_for([StageCost(0.0, 0.1), StageCost(0.0, 0.1)]) is None


@given(st.lists(st.tuples(st.floats(0.001, 10.0), st.floats(0.0, 1.0), st.integers(1, 8)), min_size=1, max_size=6),
       st.floats(0.001, 1.0))
def test_a_longer_link_or_a_deeper_pipeline_never_asks_for_less(
        stages: list[tuple[float, float, int]], more: float) -> None:
    costs = [StageCost(c, r, p) for c, r, p in stages]
    need = in_flight_for(costs)
    assert need is not None and need >= 1.0 - 1e-9  # at least the bottleneck's own microbatch
    longer = [StageCost(s.compute_s, s.latency_s + more, s.peers) for s in costs]
    assert (in_flight_for(longer) or 0.0) > need
    deeper = [*costs, StageCost(min(s.compute_s / s.peers for s in costs), 0.0)]  # a stage no slower than the others
    assert (in_flight_for(deeper) or 0.0) > need


def test_the_window_keeps_the_modelled_pipeline_busy_where_littles_bound_alone_does_not() -> None:
    """In the sync step's replay (swarmd.pipeline.schedule), every message a hop each way: the sizer's
    window (HEADROOM over Little's bound) runs a long step about as fast as an unlimited window, the bound
    rounded up does not (a stage's worker takes forwards and backwards in arrival order)."""
    hop, per_sample, sizes = 0.05, 0.01, [8] * 32
    flat = {8: per_sample * 8}
    stages = [StageCalls(forward=flat, backward=flat, fused={}), StageCalls(forward={}, backward={}, fused=flat)]
    # stage 0: a forward and a backward (2 x 0.08 s), two round trips; stage 1: the fused call, one round trip
    costs = [StageCost(0.16, 2 * 2 * hop), StageCost(0.08, 2 * hop)]
    need = in_flight_for(costs)
    assert need == pytest.approx(0.54 / 0.16)
    window = WindowSizer(start=2).update(costs, len(sizes))
    assert window == math.ceil(HEADROOM * need) == 6
    unlimited = sync_step(sizes, stages, window=len(sizes), chained=False, hop=hop).step_s
    assert sync_step(sizes, stages, window=window, chained=False, hop=hop).step_s <= unlimited * 1.03
    assert sync_step(sizes, stages, window=math.ceil(need), chained=False, hop=hop).step_s > unlimited * 1.05


def test_call_costs_take_the_fastest_call_not_the_queued_ones() -> None:
    costs = CallCosts()
    for seconds in (0.8, 0.2, 0.6, 0.4):  # the same forward, queued behind 0-3 others
        costs.call(0, "forward", 8, seconds)
    costs.call(0, "backward", 8, 0.4)
    costs.call(1, "backward", 4, 0.2)  # seconds per sample: a microbatch of 8 would take 0.4
    stages = costs.stages(2, 8, [1, 1])
    assert stages == [StageCost(pytest.approx(0.6), 0.0), StageCost(pytest.approx(0.4), 0.0)]


def test_call_costs_take_each_calls_round_trip_out_of_its_stage_compute() -> None:
    costs = CallCosts()
    costs.call(0, "forward", 8, 0.15)
    costs.call(0, "backward", 8, 0.25)
    costs.call(1, "backward", 8, 0.5)
    for seconds in (0.3, 0.1, 2.0):  # a long-poll that waited for the step is not a round trip
        costs.poll(1, "a" * 40, seconds)
    costs.poll(1, "b" * 40, 0.2)
    costs.poll(1, "c" * 40, 0.12)  # the stage's round trip: the median of its peers' fastest (0.1, 0.12, 0.2)
    stages = costs.stages(2, 8, [1, 3])
    assert stages is not None
    assert stages[0] == StageCost(pytest.approx(0.4), 0.0, 1)  # polled never: all of it counts as compute
    assert stages[1] == StageCost(pytest.approx(0.5 - 0.12), pytest.approx(0.12), 3)


def test_call_costs_take_compute_from_what_the_peers_announce() -> None:
    costs = CallCosts()
    costs.call(0, "forward", 8, 0.3)
    costs.call(0, "backward", 8, 0.5)  # stage 0's trip: 0.8 s for a microbatch of 8
    costs.call(1, "backward", 8, 0.6)
    costs.poll(1, "a" * 40, 0.5)  # not asked: the announcement says what is compute
    stages = costs.stages(2, 8, [1, 3], [[40.0], [20.0, 10.0, 30.0]])
    # stage 0: 8 / 40 = 0.2 s of compute, the rest of its trip latency; stage 1: 8 / 20 (the median peer's)
    assert stages == [StageCost(pytest.approx(0.2), pytest.approx(0.6), 1),
                      StageCost(pytest.approx(0.4), pytest.approx(0.2), 3)]
    # an announcement slower than the trip itself (stale, or a lie) counts as the trip; none usable: the polls
    slow = costs.stages(2, 8, [1, 1], [[1.0], [0.0, float("nan"), -5.0]])
    assert slow == [StageCost(pytest.approx(0.8), pytest.approx(0.0), 1),
                    StageCost(pytest.approx(0.1), pytest.approx(0.5), 1)]


def test_call_costs_say_nothing_until_every_stage_was_measured() -> None:
    costs = CallCosts()
    costs.call(0, "forward", 8, 0.1)
    costs.call(1, "backward", 8, 0.1)
    assert costs.stages(2, 8, [1, 1]) is None  # stage 0's backward never came back
    costs.call(0, "backward", 8, 0.1)
    assert costs.stages(2, 8, [1, 1]) is not None
    assert costs.stages(3, 8, [1, 1, 1]) is None
    costs.call(0, "forward", 0, 0.1)  # nothing to learn from: no samples, or a time that is not one
    costs.call(0, "forward", 8, float("nan"))
    costs.poll(0, "a" * 40, -1.0)
    assert costs.rtt(0) == 0.0


def test_call_costs_forget_what_is_older_than_they_keep() -> None:
    costs = CallCosts(keep=3)
    costs.call(0, "backward", 1, 0.1)
    for _ in range(3):
        costs.call(0, "backward", 1, 0.5)  # the link got slower: the old fast call no longer counts
    assert costs.stages(1, 1, [1]) == [StageCost(pytest.approx(0.5), 0.0, 1)]


def _stages(need: float) -> list[StageCost]:
    """Two stages whose Little's-law need is ``need`` (the bottleneck's 1 s, the rest round trips)."""
    return [StageCost(1.0, need - 2.0), StageCost(1.0, 0.0)]


def test_the_sizer_starts_at_the_fixed_default_until_measured() -> None:
    sizer = WindowSizer()
    assert sizer.update(None, 32) == START == 8
    assert sizer.estimate is None
    assert sizer.update(None, 4) == 4  # never more than the step's microbatches


def test_the_sizer_grows_at_once_and_shrinks_only_when_clearly_below() -> None:
    sizer = WindowSizer(start=2, alpha=1.0, headroom=1.0)
    assert sizer.update(_stages(5.2), 32) == 6  # rounded up: 5 in flight would idle the bottleneck a little
    assert sizer.update(_stages(4.8), 32) == 6  # 5 would do, but within the band: no flapping
    assert sizer.update(_stages(4.4), 32) == 5  # more than 1.5 below: shrink
    assert sizer.update(_stages(9.0), 8) == 8  # the step has 8 microbatches
    assert sizer.update(None, 32) == 9  # nothing new: as it was


def test_the_sizer_smooths_one_odd_measurement() -> None:
    sizer = WindowSizer(start=2, alpha=0.3, headroom=1.0)
    for _ in range(20):
        sizer.update(_stages(4.0), 64)
    assert sizer.window(64) == 4
    assert sizer.update(_stages(40.0), 64) < 20  # one call that took ten times as long moves it, not to 40
    for _ in range(30):
        window = sizer.update(_stages(4.0), 64)
    assert window in (4, 5)  # and it comes back (within the band it shrinks by: no flapping)


def test_the_sizer_keeps_to_its_bounds() -> None:
    assert WindowSizer(start=8, alpha=1.0).update(_stages(2.0), 32) == 3  # HEADROOM over the need, rounded up
    fast_first = [StageCost(0.1, 0.0), StageCost(1.0, 0.0)]  # a need of 1.1: 1.65 with the headroom
    assert WindowSizer(start=8, alpha=1.0).update(fast_first, 32) == 2  # never below 2
    sizer = WindowSizer(start=8, alpha=1.0)
    assert sizer.update(_stages(1000.0), 10_000) == MOST
    assert sizer.update(_stages(1000.0), 1) == 1
    with pytest.raises(ValueError):
        WindowSizer(start=0)
    with pytest.raises(ValueError):
        WindowSizer(alpha=0.0)
    with pytest.raises(ValueError):
        WindowSizer(headroom=0.9)


def test_window_is_auto_by_default_and_a_number_is_honoured() -> None:
    assert TrainerConfig(api="http://unused").window is None
    assert TrainerConfig(api="http://unused").start_window == START
    assert TrainerConfig(api="http://unused", window=3).start_window == 3
    with pytest.raises(ConfigError, match="--window"):
        TrainerConfig(api="http://unused", window=0)
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--api", "http://x"])).window is None
    assert config_from_args(parser.parse_args(["--api", "http://x", "--window", "auto"])).window is None
    assert config_from_args(parser.parse_args(["--api", "http://x", "--window", "12"])).window == 12
    for bad in ("0", "many", "-3"):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["--api", "http://x", "--window", bad])
        assert exited.value.code == 2
