"""The spot checks' pure bookkeeping (swarmd.train.verify): the ledger of what checks concluded of each
peer, and whose word about exclusions a trainer takes. (The comparison rule and arbitration are tested
with the checks themselves, in tests/adversarial/test_spot_checks.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from swarmd.train.verify import FIRST_CHECKS, UNSETTLED_LIMIT, Answer, CheckLedger, excluded_by_majority


@dataclass(frozen=True)
class P:
    peer_id: str
    step: int | None
    excluded: tuple[str, ...] = ()
    params_digest: str | None = None


def test_a_peer_is_first_checked_until_confirmed_and_a_flagged_answer_proves_nothing() -> None:
    ledger = CheckLedger()
    assert FIRST_CHECKS == 1 and ledger.wants_first_check("a", "forward")
    t = torch.ones(2)
    ledger.credit([Answer("a", 0, t), Answer("b", 0, t)], "backward", uncredited="a")  # a's recheck was flagged
    assert ledger.confirmed("a", "backward") == 0 and ledger.wants_first_check("a", "backward")
    assert ledger.confirmed("b", "backward") == 1 and not ledger.wants_first_check("b", "backward")
    assert ledger.wants_first_check("b", "forward")  # per kind of answer
    ledger = CheckLedger(first_checks=2)
    ledger.credit([Answer("a", 0, t)], "forward")
    assert ledger.wants_first_check("a", "forward")
    ledger.credit([Answer("a", 0, t)], "forward")
    assert not ledger.wants_first_check("a", "forward")


def test_disputes_last_until_a_conviction_clears_the_honest_ones() -> None:
    ledger = CheckLedger()
    ledger.dispute(["a", "b"])
    assert ledger.disputed("a") and ledger.disputed("b") and not ledger.disputed("c")
    ledger.clear(["a"])  # a agreed with the arbiter: b was the liar
    assert not ledger.disputed("a") and ledger.disputed("b")


def test_a_pair_that_keeps_disagreeing_is_given_up_only_when_alone_in_its_stage() -> None:
    ledger = CheckLedger()
    for _ in range(UNSETTLED_LIMIT + 2):  # a third peer could settle it: never given up
        assert not ledger.unsettled("a", "b", "backward", pair_only=False)
    ledger = CheckLedger()
    outcomes = [ledger.unsettled("a", "b", "backward", pair_only=True) for _ in range(UNSETTLED_LIMIT)]
    assert outcomes == [False] * (UNSETTLED_LIMIT - 1) + [True]
    assert ledger.gave_up("a", "backward") and ledger.gave_up("b", "backward")
    assert not ledger.wants_first_check("a", "backward") and ledger.wants_first_check("a", "forward")
    # both must have reached the limit: a newcomer paired with a peer that gave up many times starts afresh
    assert not ledger.unsettled("a", "c", "backward", pair_only=True)


def test_giving_up_on_a_peer_says_whether_it_is_new() -> None:
    ledger = CheckLedger()
    assert ledger.give_up("a", "forward") and not ledger.give_up("a", "forward")
    assert ledger.gave_up("a", "forward") and not ledger.gave_up("a", "backward")


@pytest.mark.parametrize(("answers", "excluded"), [
    ([P("a", 1, ("x",)), P("b", 1, ("x",)), P("c", 1)], {"x"}),  # two of three
    ([P("a", 1, ("x",)), P("b", 1), P("c", 1), P("d", 1, ("x",))], set()),  # two of four is no majority
    ([P("a", 1, ("x",))], set()),  # one liar alone never excludes: at least two
    ([P("a", 1, ("x", "x")), P("b", 1), P("c", 1)], set()),  # a repeated name counts once
    ([P("a", 1, ("x", "y")), P("b", 1, ("y", "x")), P("c", 1, ("y",))], {"x", "y"}),
    ([], set()),
])
def test_the_swarm_excludes_what_a_majority_of_the_answers_name(answers: list[P], excluded: set[str]) -> None:
    assert excluded_by_majority(answers) == excluded
