"""The spot checks' pure bookkeeping (swarmd.train.verify): the ledger of what checks concluded of each
peer, and whose word about exclusions a trainer takes. (The comparison rule and arbitration are tested
with the checks themselves, in tests/adversarial/test_spot_checks.py.)"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from swarmd.pipeline.routing import StageRouter
from swarmd.train.pairing import Pairing
from swarmd.train.timing import Timing
from swarmd.train.verify import (
    FIRST_CHECKS,
    FIRST_FORWARD_CHECKS,
    SIZE_MIN,
    SIZE_OWN_MIN,
    SIZE_STEPS,
    SUSPECT_BELOW,
    SUSPECT_FACTOR,
    SUSPICION_CHECKS,
    UNSETTLED_LIMIT,
    Answer,
    AnswerSizes,
    CheckLedger,
    Outlier,
    SpotChecker,
    VerifyStats,
    answer_size,
    descent_probe,
    excluded_by_majority,
)
from tests.support.routing import FixedStages, listed


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
    ledger.credit([Answer("a", 0, t)], "backward")
    assert ledger.wants_first_check("a", "backward")
    ledger.credit([Answer("a", 0, t)], "backward")
    assert not ledger.wants_first_check("a", "backward")


def test_a_peers_first_forwards_are_checked_three_times_and_only_the_first_pairs_microbatches() -> None:
    """A liar on one forward in three meets a single first check one time in three: a peer's forwards are
    checked until FIRST_FORWARD_CHECKS are confirmed; it is introduced (microbatches stop running paired for
    it) after the first, as for any kind."""
    ledger, t = CheckLedger(), torch.ones(2)
    assert FIRST_FORWARD_CHECKS == 3
    for n in range(FIRST_FORWARD_CHECKS):
        assert ledger.wants_first_check("a", "forward") and ledger.introduced("a", "forward") == (n >= 1)
        ledger.credit([Answer("a", n, t)], "forward")
    assert not ledger.wants_first_check("a", "forward") and ledger.introduced("a", "forward")
    ledger.credit([Answer("a", 0, t)], "backward")
    assert not ledger.wants_first_check("a", "backward") and ledger.introduced("a", "backward")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_accused_once_is_checked_until_a_few_more_answers_are_confirmed_and_rearmed_once_a_window() -> None:
    clock, t = Clock(), torch.ones(2)
    ledger = CheckLedger(suspicion_checks=3, rearm_s=600.0, clock=clock)
    ledger.credit([Answer("a", 0, t)], "forward")  # answers confirmed before the accusation do not count
    assert not ledger.wants_suspicion_check("a", "forward")  # nobody accused it
    ledger.watch(["a"])
    for _ in range(3):
        assert ledger.wants_suspicion_check("a", "forward") and ledger.wants_suspicion_check("a", "backward")
        ledger.credit([Answer("a", 1, t)], "forward")
    assert not ledger.wants_suspicion_check("a", "forward") and ledger.wants_suspicion_check("a", "backward")
    clock.now += 599  # named again and again within the window (a daemon listing everybody): not armed again
    ledger.watch(["a"])
    assert not ledger.wants_suspicion_check("a", "forward")
    clock.now += 2  # a new window: a new accusation arms it again
    ledger.watch(["a"])
    assert ledger.wants_suspicion_check("a", "forward")
    assert ledger.give_up("a", "forward") and not ledger.wants_suspicion_check("a", "forward")  # a given-up pair


def _pairing(stages: FixedStages, ledger: CheckLedger) -> Pairing:
    calls = SimpleNamespace(stages=stages)
    return Pairing(calls, stats=VerifyStats(), ledger=ledger, fraction=1e-9,  # type: ignore[arg-type]
                   timing=Timing(), rng=random.Random(0), patience=None)  # type: ignore[arg-type]


def test_a_suspected_usable_peer_gets_its_microbatches_paired_until_confirmed_whatever_the_draw() -> None:
    routers = []
    for k in range(2):
        router = StageRouter(k, rng=random.Random(k), timeout_ceiling_s=60.0)
        router.update_peers(listed({f"{k}a": "h:1", f"{k}b": "h:2"}, stage=k))
        routers.append(router)
    stages, ledger, t = FixedStages(routers), CheckLedger(), torch.ones(2)
    for peer_id, kinds in (("0a", ("forward", "backward")), ("0b", ("forward", "backward")), ("1a", ("backward",)),
                           ("1b", ("backward",))):
        for kind in kinds:
            ledger.credit([Answer(peer_id, 0, t)], kind)  # first checks done
    pairing = _pairing(stages, ledger)
    assert not any(pairing.pairs() for _ in range(100))  # fraction ~0: nothing paired
    stages.suspected = frozenset({"1b", "someone-unlisted"})
    assert pairing.pairs() and pairing.stats.suspicion_checks == 1
    for _ in range(SUSPICION_CHECKS):
        ledger.credit([Answer("1b", 1, t)], "backward")  # the last stage's calls: fused, all "backward"
    assert not pairing.pairs()  # confirmed enough: back to the drawn fraction
    assert pairing.stats.suspicion_checks == 1


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


def test_a_mismatch_nobody_settled_counts_against_the_peer_that_disagrees_with_two_that_agree() -> None:
    """Answers of different steps cannot be compared, verdicts can: a liar whose mismatches keep
    meeting no third answer of their step is convicted once it has disagreed with two peers that
    agreed with each other; the honest peers it disagreed with never are."""
    ledger = CheckLedger()
    assert ledger.against("x", "b", "backward") is None  # one mismatch: nothing decided, but counted
    ledger.agreed("x", "c", "backward")  # the liar answered honestly when it was looked at again: still counted
    assert ledger.against("x", "c", "backward") is None  # b and c never agreed yet
    ledger.agreed("b", "c", "forward")  # another kind of answer says nothing of this one
    assert ledger.against("b", "x", "backward") is None
    ledger.agreed("c", "b", "backward")
    assert ledger.against("c", "x", "backward") == "x"
    # an honest peer that disagreed with one liar only is never the odd one out
    ledger = CheckLedger()
    ledger.agreed("b", "c", "forward")
    for _ in range(5):
        assert ledger.against("x", "b", "forward") is None
    # two that each disagree with two agreeing pairs (colluding liars agreeing with each other): nobody
    ledger = CheckLedger()
    ledger.agreed("x", "y", "forward")
    ledger.agreed("b", "c", "forward")
    for liar, honest in (("x", "b"), ("x", "c"), ("y", "b"), ("y", "c")):
        ledger.against(liar, honest, "forward")
    assert ledger.against("b", "y", "forward") is None


def _sized(peer: str, size: float, step: int = 5) -> Answer:
    return Answer(peer, step, torch.full((4, 8), size))


def test_an_answer_far_from_its_stage_mates_recent_sizes_is_suspicious() -> None:
    sizes = AnswerSizes()
    assert answer_size(_sized("a", 2.0)) == pytest.approx(2.0)
    assert answer_size(Answer("a", 0, torch.tensor(3.0))) is None and answer_size(Answer("a", 0, None)) is None
    assert answer_size(Answer("a", 0, torch.tensor([1.0, float("nan")]))) == float("inf")
    assert sizes.outlier(1, "backward", _sized("x", 100.0)) is not Outlier.FIRM  # nothing to hold it against yet
    for k in range(SIZE_MIN):
        sizes.observe(1, "backward", _sized("abc"[k % 3], 1.0 + 0.1 * k))
    assert (SUSPECT_FACTOR, SUSPECT_BELOW) == (2.0, 3.0)
    assert sizes.outlier(1, "backward", _sized("x", 1.9)) is not Outlier.FIRM
    assert sizes.outlier(1, "backward", _sized("x", 3.0)) is Outlier.FIRM  # a tripled gradient
    assert sizes.outlier(1, "backward", _sized("x", 0.4)) is not Outlier.FIRM  # one shrunk, within the band below
    assert sizes.outlier(1, "backward", _sized("x", 0.3)) is Outlier.FIRM  # ... one shrunk beyond it
    assert sizes.outlier(1, "backward", _sized("x", 0.0)) is Outlier.FIRM  # ... or a zero answer
    assert sizes.outlier(1, "backward", Answer("x", 5, torch.tensor([1.0, float("inf")]))) is Outlier.FIRM
    assert sizes.outlier(1, "forward", _sized("x", 3.0)) is not Outlier.FIRM  # per kind
    assert sizes.outlier(0, "backward", _sized("x", 3.0)) is not Outlier.FIRM  # and per stage
    # answers of steps far apart are not held against each other (sizes move fast while warming up)
    assert sizes.outlier(1, "backward", _sized("x", 3.0, step=5 + SIZE_STEPS + 1)) is not Outlier.FIRM
    # a peer is held against its mates only: its own answers never make its reference
    own = AnswerSizes()
    for _ in range(10):
        own.observe(1, "backward", _sized("x", 3.0))
    own.observe(1, "backward", _sized("b", 1.0, step=4))
    assert own.outlier(1, "backward", _sized("x", 3.0)) is not Outlier.FIRM  # one mate's answer of another step: too few
    own.observe(1, "backward", _sized("c", 1.0, step=4))
    assert own.outlier(1, "backward", _sized("x", 3.0)) is Outlier.FIRM
    with pytest.raises(ValueError):
        AnswerSizes(factor=1.0)
    with pytest.raises(ValueError):
        AnswerSizes(below=0.5)


def test_an_answer_is_held_to_its_own_step_first_and_to_the_steps_around_it_without_one() -> None:
    """An honest stage's sizes jump from one step to the next (3.7x seen in tiny's first steps) and are alike
    within one: its own step's answers are the reference once there is one (SIZE_OWN_MIN), else SIZE_MIN of
    the steps around it."""
    assert SIZE_STEPS == 1 and SIZE_MIN == 2 and SIZE_OWN_MIN == 1
    sizes = AnswerSizes()
    for peer in "ab":
        sizes.observe(1, "backward", _sized(peer, 1.0, step=4))
    assert sizes.outlier(1, "backward", _sized("x", 1.9, step=5)) is not Outlier.FIRM  # only the step before: held to it
    assert sizes.outlier(1, "backward", _sized("x", 3.0, step=5)) is Outlier.FIRM
    sizes.observe(1, "backward", _sized("a", 3.0, step=5))  # the stage's sizes tripled at step 5
    assert sizes.outlier(1, "backward", _sized("x", 3.5, step=5)) is not Outlier.FIRM  # one answer of its own step: held to it
    assert sizes.outlier(1, "backward", _sized("x", 9.0, step=5)) is Outlier.FIRM  # a tripled answer at that step
    assert sizes.outlier(1, "backward", _sized("x", 0.9, step=5)) is Outlier.FIRM  # the step before's size is not this one's
    assert sizes.outlier(1, "backward", _sized("x", 1.1, step=5)) is not Outlier.FIRM  # ... though within the band below


def test_one_stage_mates_answer_of_a_step_around_it_is_a_thin_reference() -> None:
    """Its own step's answers (one is enough) or SIZE_MIN of the steps around it make a firm reference; a single
    answer of a step around it a thin one, whose outliers the caller probes rather than opines on."""
    sizes = AnswerSizes()
    assert sizes.outlier(1, "backward", _sized("x", 3.0, step=5)) is Outlier.NO  # nothing to hold it to
    sizes.observe(1, "backward", _sized("a", 1.0, step=4))
    assert sizes.outlier(1, "backward", _sized("x", 3.0, step=5)) is Outlier.THIN
    assert sizes.outlier(1, "backward", _sized("x", 1.5, step=5)) is Outlier.NO  # within the band
    assert sizes.outlier(1, "backward", _sized("a", 3.0, step=5)) is Outlier.NO  # never held to its own
    sizes.observe(1, "backward", _sized("b", 1.0, step=6))
    assert sizes.outlier(1, "backward", _sized("x", 3.0, step=5)) is Outlier.FIRM  # two of the steps around it
    sizes.observe(1, "backward", _sized("c", 3.0, step=5))
    assert sizes.outlier(1, "backward", _sized("x", 3.0, step=5)) is Outlier.NO  # its own step's come first
    assert sizes.outlier(1, "backward", _sized("x", 9.0, step=5)) is Outlier.FIRM
    assert sizes.outlier(1, "backward", _sized("x", 9.0, step=8)) is Outlier.NO  # nothing of a step around it


def test_a_direction_probe_moves_the_inputs_downhill_for_a_true_gradient_and_uphill_for_a_negated_one() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x, target = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        x.requires_grad_(True)
        loss = torch.nn.functional.mse_loss(x, target)
        (grad,) = torch.autograd.grad(loss, x)
        x, loss = x.detach(), loss.detach()

        def at(inputs: torch.Tensor) -> float:
            return float(torch.nn.functional.mse_loss(inputs, target))

        honest, negated = descent_probe(x, grad, float(loss)), descent_probe(x, -grad, float(loss))
        assert honest is not None and negated is not None
        assert at(honest) < float(loss) < at(negated)
        # the move is the first-order drop asked for: 5 % of the loss along the gradient
        assert float(((x - honest) * grad).sum()) == pytest.approx(0.05 * float(loss), rel=1e-4)
    assert descent_probe(x, torch.zeros_like(x), 1.0) is None  # nothing to probe
    assert descent_probe(x, grad, float("nan")) is None and descent_probe(x, grad, 0.0) is None
    assert descent_probe(x, torch.full_like(x, float("inf")), 1.0) is None


def test_the_checker_draws_which_validation_batch_runs_paired_from_its_rng() -> None:
    import random

    checker = SpotChecker(0.02, random.Random(1))
    drawn = {checker.choice(4) for _ in range(100)}
    assert drawn == {0, 1, 2, 3}
    assert not any(checker.draw(0.0) for _ in range(100)) and all(checker.draw(1.0) for _ in range(100))


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
