"""The step ledger (swarmd.train.summary): which step each finished microbatch fed, closed step by step."""

from __future__ import annotations

import math

import pytest

from swarmd.train.summary import ClosedStep, StepLedger


def test_a_step_closes_with_the_sample_weighted_loss_of_what_was_computed_at_it() -> None:
    ledger = StepLedger()
    ledger.book(loss=2.0, loss_step=0, count_step=0, samples=4)
    ledger.book(loss=5.0, loss_step=0, count_step=0, samples=2)
    ledger.book(loss=1.0, loss_step=1, count_step=1, samples=4)  # already the next step's
    assert ledger.close(0) == ClosedStep(loss=pytest.approx(3.0), samples=6)
    assert ledger.close(0) == ClosedStep(loss=None, samples=0)  # closed: nothing left at it
    assert ledger.close(1) == ClosedStep(loss=1.0, samples=4)


def test_steps_closed_together_take_all_that_is_booked_up_to_them_and_loss_and_count_may_differ() -> None:
    """The last stage computed the loss at one step, the first stage counted the samples at another
    (its last backward's): each is booked where it belongs. The swarm may take two steps between two
    polls: closing the later one takes what was booked at both."""
    ledger = StepLedger()
    ledger.book(loss=2.0, loss_step=1, count_step=1, samples=8)
    ledger.book(loss=4.0, loss_step=2, count_step=3, samples=8)
    assert ledger.close(2) == ClosedStep(loss=pytest.approx(3.0), samples=8)  # steps 1 and 2 together
    assert ledger.close(3) == ClosedStep(loss=None, samples=8)  # a step none of its losses was computed at


def test_a_step_without_samples_has_no_loss_not_nan() -> None:
    closed = StepLedger().close(7)
    assert closed.loss is None and closed.samples == 0
    ledger = StepLedger()
    ledger.book(loss=math.nan, loss_step=0, count_step=0, samples=1)  # what the peers said, kept as it is
    assert math.isnan(ledger.close(0).loss or 0.0)
