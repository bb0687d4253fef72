"""Every wait of a trainer in one frozen object (swarmd.train.timing.Timing)."""

from __future__ import annotations

import dataclasses

import pytest

from swarmd.train.config import TrainerConfig
from swarmd.train.timing import Timing


def test_a_backward_waits_longer_than_a_forward_and_no_floor_exceeds_the_configured_ceiling() -> None:
    t = Timing()
    assert t.backward_timeout_floor_s == 2 * t.backward_slack_s  # its deadline leaves the peer time to compute
    assert t.timeout_floor("forward", 60.0) == t.timeout_floor_s
    assert t.timeout_floor("backward", 60.0) == t.backward_timeout_floor_s > t.timeout_floor_s
    assert t.timeout_floor("backward", 3.0) == t.timeout_floor("forward", 1.5) * 2 == 3.0  # capped


@pytest.mark.parametrize("timeout_s", [0.5, 5.0, 10.0, 20.0, 60.0, 600.0])
def test_a_backward_deadline_leaves_the_answer_time_to_come_back(timeout_s: float) -> None:
    t = Timing()
    deadline_s = t.backward_deadline_ms(timeout_s) / 1000
    assert 0.0 <= deadline_s <= timeout_s * t.deadline_share
    assert deadline_s <= max(0.0, timeout_s - t.backward_slack_s)


def test_every_wait_is_positive_and_a_test_shortens_one_through_the_config() -> None:
    for f in dataclasses.fields(Timing):
        with pytest.raises(ValueError, match=f.name):
            Timing(**{f.name: 0.0})
    with pytest.raises(ValueError, match="deadline_share"):
        Timing(deadline_share=1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Timing().stuck_grace_s = 1.0  # type: ignore[misc]
    config = TrainerConfig(api="http://unused", timing=Timing(stuck_grace_s=0.2))
    assert config.timing.stuck_grace_s == 0.2 and TrainerConfig(api="http://unused").timing == Timing()
