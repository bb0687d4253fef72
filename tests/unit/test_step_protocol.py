"""The step protocol: the step rule, the sample accounting of a round, and what readers see of it.

The rule and the accounting are plain Python and are tested here without tensors; the gradient
accumulator and the executor's published snapshot need torch and come last.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import Busy, PeerBehind, RequestError, StaleStep
from swarmd.pipeline.stage.executor import ProgressSnapshot, StageExecutor
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.pipeline.stage.step_protocol import GradientAccumulator, StepProtocol, Taken, Verdict, judge_backward

TINY = PRESETS["tiny"]

# ---- the step rule as a pure function ----------------------------------------------------------

# (stage step, forward step, averaging, delayed) -> verdict: the rule spelled out case by case
RULE_TABLE = [
    (0, None, False, False, Verdict.ACCEPT),
    (3, None, False, True, Verdict.ACCEPT),
    (3, 3, False, False, Verdict.ACCEPT),
    (3, 3, True, True, Verdict.ACCEPT),  # delayed: the stage keeps serving during its round
    (3, 3, True, False, Verdict.BUSY),
    (3, None, True, False, Verdict.BUSY),  # Busy comes first, even unchecked
    (3, 2, True, False, Verdict.BUSY),
    (3, 4, True, False, Verdict.BUSY),
    (3, 2, False, False, Verdict.STALE),
    (3, 2, False, True, Verdict.ACCEPT_STALE),
    (3, 2, True, True, Verdict.ACCEPT_STALE),
    (3, 1, False, True, Verdict.STALE),  # two steps old is refused even when delayed
    (3, 0, False, False, Verdict.STALE),
    (3, 4, False, False, Verdict.BEHIND),
    (3, 4, False, True, Verdict.BEHIND),
    (0, 1, False, True, Verdict.BEHIND),
]


@pytest.mark.parametrize(("stage_step", "forward_step", "averaging", "delayed", "verdict"), RULE_TABLE)
def test_the_rule_case_by_case(
    stage_step: int, forward_step: int | None, averaging: bool, delayed: bool, verdict: Verdict
) -> None:
    assert judge_backward(stage_step, forward_step, averaging=averaging, delayed=delayed) is verdict


def test_the_rule_over_every_small_case() -> None:
    seen: set[Verdict] = set()
    for stage_step, forward_step, averaging, delayed in itertools.product(
        range(5), [None, *range(7)], (False, True), (False, True)
    ):
        verdict = judge_backward(stage_step, forward_step, averaging=averaging, delayed=delayed)
        seen.add(verdict)
        # refused while the gradients are out, exactly when updates are not delayed
        assert (verdict is Verdict.BUSY) == (averaging and not delayed)
        if verdict is Verdict.BUSY:
            continue
        if forward_step is None:
            assert verdict is Verdict.ACCEPT
            continue
        age = stage_step - forward_step
        # a gradient is only ever mixed into the update of its own parameters, or (delayed) one later
        accepted = verdict in (Verdict.ACCEPT, Verdict.ACCEPT_STALE)
        assert accepted == (age == 0 or (delayed and age == 1))
        assert (verdict is Verdict.ACCEPT_STALE) == (delayed and age == 1)
        assert (verdict is Verdict.STALE) == (age > 1 or (age == 1 and not delayed))
        assert (verdict is Verdict.BEHIND) == (age < 0)
    assert seen == set(Verdict)


# ---- StepProtocol: applying the rule, counting ---------------------------------------------------


def protocol_at(step: int, *, delayed: bool = False) -> StepProtocol:
    steps = StepProtocol(2, delay_updates=delayed)
    steps.adopt(step)
    return steps


def test_admit_raises_the_rules_errors_and_counts() -> None:
    steps = protocol_at(5)
    assert steps.admit(5) == 5 and steps.admit(None) == 5
    with pytest.raises(StaleStep, match="ran forward at step 4 but stage 2 is at step 5") as stale:
        steps.admit(4)
    assert stale.value.http_status == 409
    with pytest.raises(PeerBehind, match="at step 5, behind step 6"):
        steps.admit(6)
    assert (steps.stale_dropped, steps.stale_applied) == (1, 0)  # only a stale gradient counts
    steps.take()
    with pytest.raises(Busy) as busy:
        steps.admit(5)
    assert busy.value.http_status == 503
    assert steps.stale_dropped == 1


def test_delayed_updates_admit_one_step_old_and_serve_during_the_round() -> None:
    steps = protocol_at(5, delayed=True)
    steps.accumulated(4)
    assert steps.take() == Taken(step=5, samples=4)
    assert steps.admit(5) == 5  # the round runs; backwards go into the next update
    steps.accumulated(3)
    steps.begin_update(5)
    steps.finish_update()
    assert (steps.step, steps.grad_samples, steps.averaging) == (6, 3, False)  # kept for update 6
    assert steps.admit(5) == 6 and steps.stale_applied == 1  # staleness exactly 1
    with pytest.raises(StaleStep):
        steps.admit(4)
    assert steps.stale_dropped == 1


def test_a_round_moves_samples_out_and_back() -> None:
    steps = protocol_at(1)
    steps.accumulated(8)
    steps.accumulated(2)
    assert steps.take() == Taken(step=1, samples=10)
    assert (steps.grad_samples, steps.out_samples, steps.held_samples, steps.averaging) == (0, 10, 10, True)
    with pytest.raises(Busy, match="already out"):
        steps.take()
    assert steps.restore(1, 10) is True  # the round failed: the gradients go back
    assert (steps.grad_samples, steps.out_samples, steps.averaging) == (10, 0, False)
    assert steps.take() == Taken(step=1, samples=10)
    steps.begin_update(1)
    steps.finish_update()
    assert (steps.step, steps.grad_samples, steps.out_samples, steps.averaging) == (2, 0, 0, False)


def test_an_empty_take_still_joins_the_round() -> None:
    steps = protocol_at(0)
    assert steps.take() == Taken(step=0, samples=0)
    assert steps.averaging and steps.held_samples == 0
    assert steps.restore(0, 0) is True and not steps.averaging


def test_gradients_of_an_old_step_do_not_come_back() -> None:
    steps = protocol_at(1)
    steps.accumulated(6)
    taken = steps.take()
    steps.adopt(4)  # a stage-mate's state arrived meanwhile
    assert steps.restore(taken.step, taken.samples) is False
    assert (steps.step, steps.grad_samples, steps.averaging) == (4, 0, False)


def test_an_average_for_another_step_is_refused_and_settles() -> None:
    steps = protocol_at(3)
    steps.accumulated(5)
    steps.take()
    with pytest.raises(StaleStep, match="an average for step 2 reached stage 2 at step 3"):
        steps.begin_update(2)
    assert (steps.step, steps.averaging, steps.out_samples) == (3, False, 0)


def test_adopting_a_state_drops_and_counts_the_accumulated_samples() -> None:
    steps = protocol_at(0)
    steps.accumulated(7)
    steps.adopt(9)
    steps.accumulated(1)
    steps.adopt(10)
    assert (steps.step, steps.grad_samples, steps.dropped_samples) == (10, 0, 8)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("backward"), st.integers(-2, 1), st.integers(1, 9)),
        st.tuples(st.just("take"), st.just(0), st.just(0)),
        st.tuples(st.just("restore"), st.just(0), st.just(0)),
        st.tuples(st.just("apply"), st.integers(-1, 0), st.just(0)),
        st.tuples(st.just("adopt"), st.integers(0, 3), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, delayed=st.booleans())
def test_no_sample_is_lost_or_counted_twice(ops: list[tuple[str, int, int]], delayed: bool) -> None:
    """Every accepted sample is held, went out with a round, or was dropped by an adoption, exactly once."""
    steps = StepProtocol(0, delay_updates=delayed)
    accepted = gone = 0  # gone: out with a round that was applied or refused
    out: Taken | None = None
    for op, arg, samples in ops:
        if op == "backward":
            try:
                steps.admit(steps.step + arg)
            except (Busy, StaleStep, PeerBehind):
                continue
            steps.accumulated(samples)
            accepted += samples
        elif op == "take" and not steps.averaging:
            out = steps.take()
        elif op == "restore" and out is not None and steps.averaging:
            steps.restore(out.step, out.samples)
            out = None
        elif op == "apply" and out is not None and steps.averaging:
            try:
                steps.begin_update(out.step + arg)
            except StaleStep:  # refused (settled): the round's gradients are not applied here
                gone += out.samples
            else:
                steps.finish_update()
                gone += out.samples
            out = None
        elif op == "adopt" and not steps.averaging:
            steps.adopt(steps.step + arg)
        assert steps.grad_samples >= 0 and steps.out_samples >= 0
        assert steps.averaging == (out is not None)
        assert steps.out_samples == (out.samples if out is not None else 0)
        assert accepted == steps.held_samples + gone + steps.dropped_samples
        if steps.averaging and not delayed:
            with pytest.raises(Busy):
                steps.admit(steps.step)


# ---- the gradient accumulator ----------------------------------------------------------------------


def grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def two_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]


def test_the_accumulator_adds_sums_and_takes_them_out_flat() -> None:
    params = two_params()
    acc = GradientAccumulator(params)
    assert acc.numel == 10
    acc.add(lambda: (params[0].sum() * 2).backward())
    acc.add(lambda: (params[0].sum() + params[1].sum() * 3).backward())
    assert torch.equal(grad(params[0]), torch.full((2, 3), 3.0))
    flat = acc.take()
    assert torch.equal(flat, torch.tensor([3.0] * 6 + [3.0] * 4))
    assert all(p.grad is None for p in params)
    acc.put(flat)
    acc.put(flat, accumulate=True)
    assert torch.equal(grad(params[1]), torch.full((4,), 6.0))
    with pytest.raises(ValueError, match="expected 10 gradient values, got 3"):
        acc.put(torch.zeros(3))


def test_an_overflowing_backward_leaves_the_accumulator_as_it_was() -> None:
    params = two_params()
    acc = GradientAccumulator(params)
    acc.add(lambda: (params[0].sum() * 3e38).backward())
    before = grad(params[0]).clone()
    with pytest.raises(RequestError, match="overflow"):
        acc.add(lambda: (params[0].sum() * 3e38).backward())  # finite alone, Inf when summed
    assert torch.equal(grad(params[0]), before) and params[1].grad is None


def test_held_gradients_are_set_aside_and_reinstated() -> None:
    params = two_params()
    acc = GradientAccumulator(params)
    acc.add(lambda: params[1].sum().backward())
    held = acc.hold()
    assert all(p.grad is None for p in params)
    acc.reinstate(held)
    assert params[0].grad is None and torch.equal(grad(params[1]), torch.ones(4))


def _summed(parts: tuple[tuple[int | None, torch.Tensor], ...] | list[tuple[int | None, torch.Tensor]]) -> torch.Tensor:
    return torch.stack([t for _, t in parts]).sum(0)


def test_kept_parts_follow_the_sums_through_take_put_hold_and_a_refusal() -> None:
    """``keep_parts`` (contribution_proofs): every addend apart, keyed by microbatch, always summing to the
    held gradients, whatever happens to them: what an honest opening rests on."""
    params = two_params()
    acc = GradientAccumulator(params, keep_parts=True)
    acc.add(lambda: (params[0].sum() * 2).backward(), mb=7)
    acc.add(lambda: (params[0].sum() + params[1].sum() * 3).backward(), mb=8)
    with pytest.raises(RequestError, match="overflow"):  # refused: no part
        acc.add(lambda: (params[0].sum() * 3e38 + params[0].sum() * 3e38).backward(), mb=9)
    assert [mb for mb, _ in acc.parts] == [7, 8]
    assert torch.equal(acc.parts[0][1], torch.tensor([2.0] * 6 + [0.0] * 4))  # the addend, not the running sum
    acc.put(torch.ones(10), accumulate=True)  # handed-in gradients: a part no microbatch explains
    held = acc.hold()  # an update in between (apply_average) touches neither the sums nor the parts
    assert acc.parts == []
    acc.put(torch.full((10,), 5.0))
    acc.reinstate(held)
    assert [mb for mb, _ in acc.parts] == [7, 8, None]
    parts = acc.take_parts()
    flat = acc.take()
    assert acc.parts == [] and torch.equal(_summed(parts), flat)
    acc.add(lambda: params[1].sum().backward(), mb=10)  # served while the contribution is out
    acc.put(flat, accumulate=True, parts=parts)  # the round aborted: the contribution comes back, parts and all
    assert [mb for mb, _ in acc.parts] == [10, 7, 8, None]
    assert torch.equal(_summed(acc.parts), acc.take())
    acc.add(lambda: params[1].sum().backward(), mb=11)
    acc.clear()
    assert acc.parts == []
    plain = GradientAccumulator(params)  # without keep_parts nothing is kept
    plain.add(lambda: params[1].sum().backward(), mb=1)
    assert plain.parts == [] and plain.take_parts() == ()


# ---- what readers see: the executor's published snapshot -------------------------------------------


@pytest.fixture
async def executor():
    ex = StageExecutor(TINY, 0, training=TrainingSpec(target_batch_size=8))
    try:
        yield ex
    finally:
        await ex.close()


async def test_the_snapshot_is_frozen_and_the_attributes_read_it(executor: StageExecutor) -> None:
    await executor.add_gradients(torch.ones(executor.grad_numel), 5)
    snap = executor.progress_snapshot
    assert isinstance(snap, ProgressSnapshot)
    with pytest.raises(AttributeError):
        snap.step = 3  # type: ignore[misc]
    assert (executor.step, executor.grad_samples, executor.out_samples, executor.averaging) == (0, 5, 0, False)
    assert (snap.grad_samples, snap.held_samples, snap.digest) == (5, 5, executor.digest)
    assert executor.cache_stats() == snap.cache.to_dict()
    contribution = await executor.take_contribution()
    assert contribution.grads is not None
    assert contribution.samples == 5 and torch.equal(contribution.grads, torch.ones(executor.grad_numel))
    after = executor.progress_snapshot
    assert (after.grad_samples, after.out_samples, after.held_samples, after.averaging) == (0, 5, 5, True)
    assert snap.grad_samples == 5  # an earlier snapshot never changes
    with pytest.raises(Busy):
        await executor.add_gradients(torch.ones(executor.grad_numel), 1)
    await executor.apply_average(contribution.grads / 5, 0)
    assert (executor.step, executor.progress_snapshot.held_samples) == (1, 0)
    assert executor.digest != snap.digest


async def test_loop_code_never_sees_a_job_half_way(executor: StageExecutor) -> None:
    """The race the split fixed: a take zeroes grad_samples and sets out_samples on the worker
    while the averager's progress() adds the two on the loop. The loop's view moves only when it
    collects a job, so within one stretch of loop code every read agrees."""
    await executor.add_gradients(torch.ones(executor.grad_numel), 6)
    before = executor.progress_snapshot
    taking = asyncio.create_task(executor.take_contribution())
    await asyncio.sleep(0)  # the job is submitted
    deadline = time.monotonic() + 30
    while executor._published is before:  # no await: the worker finishes the take meanwhile
        assert time.monotonic() < deadline, "the worker never published the take"
    assert executor._published.out_samples == 6  # the worker's state has moved on ...
    assert executor.progress_snapshot is before  # ... the loop's view has not, as a whole
    assert (executor.grad_samples, executor.out_samples, executor.averaging) == (6, 0, False)
    await taking
    assert (executor.grad_samples, executor.out_samples, executor.averaging) == (0, 6, True)


async def test_a_job_whose_caller_was_cancelled_is_still_seen(executor: StageExecutor) -> None:
    started, release = threading.Event(), threading.Event()

    def slow_add() -> None:
        started.set()
        release.wait(30)
        executor._add_gradients_sync(torch.ones(executor.grad_numel), 4)

    job = asyncio.create_task(executor._run(slow_add))
    assert await asyncio.to_thread(started.wait, 30)
    job.cancel()  # the caller goes away; the worker cannot be interrupted
    with pytest.raises(asyncio.CancelledError):
        await job
    release.set()
    assert await executor.wait_progress(30, samples=4)  # adopted when the job ended, and waiters woken
    assert executor.grad_samples == 4


async def test_wait_progress_with_no_condition_wakes_on_a_change_only(executor: StageExecutor) -> None:
    waiting = asyncio.create_task(executor.wait_progress(30))
    await asyncio.sleep(0)
    await executor.params_digest()  # a job that changes no progress
    await asyncio.sleep(0)
    assert not waiting.done()
    await executor.add_gradients(torch.ones(executor.grad_numel), 1)
    assert await waiting


async def test_a_refused_state_changes_nothing(executor: StageExecutor) -> None:
    meta, tensors = await executor.snapshot_state()
    await executor.add_gradients(torch.ones(executor.grad_numel), 2)
    name = next(k for k in tensors if k.startswith("param."))
    wrong = {**tensors, name: torch.zeros(1)}
    digest = await executor.params_digest()
    with pytest.raises(ValueError, match="has shape"):
        await executor.load_state({**meta, "step": 7}, wrong)
    with pytest.raises(ValueError, match="non-negative integer"):
        await executor.load_state({**meta, "step": -1}, tensors)
    bad_opt = {**meta, "step": 7, "optimizer": {**meta["optimizer"], "format": "other"}}
    with pytest.raises(ValueError, match="format"):
        await executor.load_state(bad_opt, {k: v * 2 for k, v in tensors.items()})
    assert (executor.step, executor.grad_samples) == (0, 2)
    assert await executor.params_digest() == digest  # no parameter was overwritten
    await executor.load_state({**meta, "step": 7}, tensors)
    assert (executor.step, executor.grad_samples, executor.dropped_samples) == (7, 0, 2)
