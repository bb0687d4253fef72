"""swarmd.pipeline.stage.delayed_updates: the rules of delayed parameter updates (pure)."""

from __future__ import annotations

from swarmd.pipeline.stage.delayed_updates import MAX_STALENESS, accepts_stale, needs_pacing, serves_during_round
from swarmd.pipeline.stage.step_protocol import Verdict, judge_backward


def test_a_delayed_stage_serves_through_its_round_and_takes_gradients_one_step_old() -> None:
    assert serves_during_round(True) and not serves_during_round(False)
    assert MAX_STALENESS == 1
    assert accepts_stale(5, 4, delayed=True)
    assert not accepts_stale(5, 3, delayed=True)  # two updates old: refused, delayed or not
    assert not accepts_stale(5, 4, delayed=False)
    assert not accepts_stale(5, 5, delayed=True) and not accepts_stale(5, 6, delayed=True)  # not stale at all
    assert needs_pacing(False) and not needs_pacing(True)


def test_the_step_protocol_follows_the_rules() -> None:
    assert judge_backward(5, 5, averaging=True, delayed=False) is Verdict.BUSY
    assert judge_backward(5, 5, averaging=True, delayed=True) is Verdict.ACCEPT
    assert judge_backward(5, 4, averaging=True, delayed=True) is Verdict.ACCEPT_STALE
    assert judge_backward(5, 3, averaging=False, delayed=True) is Verdict.STALE
    assert judge_backward(5, 4, averaging=False, delayed=False) is Verdict.STALE
    assert judge_backward(5, 6, averaging=False, delayed=True) is Verdict.BEHIND
