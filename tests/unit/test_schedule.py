"""The sync step's schedule model (swarmd.pipeline.schedule): hand-worked cases and invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.schedule import StageCalls, sync_step, unimodal_splits


def _flat(forward: float, backward: float, fused: float, update: float = 0.0, sizes: range = range(1, 9)) -> StageCalls:
    """Costs proportional to the microbatch size."""
    return StageCalls(forward={n: forward * n for n in sizes}, backward={n: backward * n for n in sizes},
                      fused={n: fused * n for n in sizes}, update=update)


def test_one_stage_runs_its_fused_calls_back_to_back_then_updates() -> None:
    s = sync_step([2, 3], [_flat(0, 0, 1.0, update=0.5)], window=4, hop=0.25)
    # the first arrives after a hop; the second is sent once the first is back (chained), so it waits two hops
    assert s.step_s == pytest.approx(0.25 + 2 + 0.5 + 3 + 0.5 + 0.25)
    assert [c[1] for c in s.calls] == ["fused", "fused", "update"]
    assert s.busy_s == pytest.approx((5.5,))


def test_two_stages_by_hand() -> None:
    stages = [_flat(1.0, 2.0, 0), _flat(0, 0, 3.0)]
    # mb0: F 0-1 on stage 0, fused 1-4 on stage 1, B 4-6; mb1 (sent at 1): F 1-2, fused 4-7, B 7-9
    s = sync_step([1, 1], stages, window=2)
    assert s.step_s == pytest.approx(9.0)
    assert s.busy_s == pytest.approx((6.0, 6.0))
    assert s.idle_s == pytest.approx((3.0, 3.0))
    # a window of one: each microbatch goes all the way through before the next starts
    assert sync_step([1, 1], stages, window=1).step_s == pytest.approx(12.0)


def test_unchained_microbatches_all_wait_for_the_first_forward_only() -> None:
    stages = [_flat(1.0, 0.5, 0), _flat(0, 0, 0.1)]
    chained = sync_step([1, 1, 1], stages, window=3, chained=True, hop=1.0)
    unchained = sync_step([1, 1, 1], stages, window=3, chained=False, hop=1.0)
    # chained, the third forward waits for the second's answer (two more hops); unchained it is queued at once
    assert unchained.step_s < chained.step_s
    starts = [c[3] for c in unchained.calls if c[1] == "forward"]
    # the first arrives at 1 and is back at 3; the other two are sent then, arrive at 4 and queue
    assert starts == pytest.approx([1.0, 4.0, 5.0])


def test_a_stage_without_a_cost_for_a_size_and_bad_arguments_are_refused() -> None:
    stages = [_flat(1, 1, 0, sizes=range(1, 3)), _flat(0, 0, 1)]
    with pytest.raises(ValueError, match="stage 0 has no forward cost for microbatches of \\[4\\]"):
        sync_step([2, 4], stages, window=2)
    with pytest.raises(ValueError, match="window"):
        sync_step([2], stages, window=0)
    with pytest.raises(ValueError, match="hop"):
        sync_step([2], stages, window=1, hop=-1)
    with pytest.raises(ValueError, match="at least one"):
        sync_step([], stages, window=1)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    n_stages=st.integers(1, 4),
    costs=st.lists(st.tuples(st.floats(0.01, 2), st.floats(0.01, 2), st.floats(0.01, 2), st.floats(0, 1)),
                   min_size=4, max_size=4),
    window=st.integers(1, 8),
    chained=st.booleans(),
    hop=st.floats(0, 0.5),
)
def test_every_schedule_respects_the_pipeline(
    sizes: list[int], n_stages: int, costs: list[tuple[float, float, float, float]], window: int, chained: bool,
    hop: float,
) -> None:
    stages = [_flat(f, b, u, update=up, sizes=range(1, 5)) for f, b, u, up in costs[:n_stages]]
    s = sync_step(sizes, stages, window=window, chained=chained, hop=hop)
    last = n_stages - 1
    # every call ran once: forwards and backwards before the last stage, fused on it, one update per stage
    kinds = [(c[0], c[1]) for c in s.calls]
    for k in range(n_stages):
        expected = {"fused": len(sizes)} if k == last else {"forward": len(sizes), "backward": len(sizes)}
        assert {kind: kinds.count((k, kind)) for kind in expected} == expected
        assert kinds.count((k, "update")) == 1
    # a stage runs one call at a time
    for k in range(n_stages):
        mine = sorted((c[3], c[4]) for c in s.calls if c[0] == k)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(mine, mine[1:], strict=False))
    # a microbatch's calls follow the pipeline, a hop apart at least twice between stages
    at = {(c[0], c[1], c[2]): (c[3], c[4]) for c in s.calls}
    for mb in range(len(sizes)):
        chain = [(k, "forward") for k in range(last)] + [(last, "fused")]
        chain += [(k, "backward") for k in range(last - 1, -1, -1)]
        for before, after in zip(chain, chain[1:], strict=False):
            assert at[(after[0], after[1], mb)][0] >= at[(before[0], before[1], mb)][1] + 2 * hop - 1e-9
    # at most `window` microbatches in flight: the (window+1)-th first call starts after the first's backward
    firsts = sorted(at[(0, "forward" if last else "fused", mb)][0] for mb in range(len(sizes)))
    ends = sorted(at[(0, "backward" if last else "fused", mb)][1] for mb in range(len(sizes)))
    for i in range(window, len(sizes)):
        assert firsts[i] >= ends[i - window] + 2 * hop - 1e-9
    # chained, a microbatch's first call waits for the one before it to be back
    first = "forward" if last else "fused"
    for mb in range(1, len(sizes) if chained else 1):
        assert at[(0, first, mb)][0] >= at[(0, first, mb - 1)][1] + 2 * hop - 1e-9
    assert s.step_s >= max(s.busy_s) - 1e-9
    assert s.step_s == pytest.approx(max(c[4] for c in s.calls) + hop)


def _unimodal_by_brute_force(batch: int, largest: int, max_parts: int) -> set[tuple[int, ...]]:
    found: set[tuple[int, ...]] = set()

    def compose(left: int, parts: tuple[int, ...]) -> None:
        if left == 0:
            peak = parts.index(max(parts))
            if all(a <= b for a, b in zip(parts[:peak], parts[1 : peak + 1], strict=True)) and all(
                a >= b for a, b in zip(parts[peak:], parts[peak + 1 :], strict=False)
            ):
                found.add(parts)
            return
        if len(parts) < max_parts:
            for size in range(1, min(largest, left) + 1):
                compose(left - size, (*parts, size))

    compose(batch, ())
    return found


@pytest.mark.parametrize(("batch", "largest", "max_parts"), [(10, 4, 5), (12, 5, 6), (7, 7, 7), (16, 8, 5), (3, 1, 2)])
def test_unimodal_splits_are_every_rising_then_falling_split_once(batch: int, largest: int, max_parts: int) -> None:
    splits = list(unimodal_splits(batch, largest, max_parts))
    assert len(splits) == len(set(splits))
    assert set(splits) == _unimodal_by_brute_force(batch, largest, max_parts)
    assert (2, 4, 6, 8, 6, 4, 2) in set(unimodal_splits(32, 8, 7))
    with pytest.raises(ValueError):
        list(unimodal_splits(0, 8, 4))
