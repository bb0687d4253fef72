"""Recomputing a sampled microbatch (``averaging.trust.recomputation``): the last stage keeps what each counted
backward ran on, a contribution carries it, and a recomputation on the same parameters gives the very part
the backward kept, without touching the gradients held."""

from __future__ import annotations

import collections

import pytest
import torch

from swarmd.errors import RequestError
from swarmd.pipeline.averaging.trust.contribution_proofs import gap, sketch
from swarmd.pipeline.averaging.trust.recomputation import (
    PAST_PARAMS,
    RECOMPUTE_TOLERANCE,
    KeptInputs,
    PastParams,
    draws,
    inputs_digest,
    recheck,
    sample,
)
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.pipeline.stage.executor import StageExecutor

TINY = PRESETS["tiny"]


def _microbatch(seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, TINY.boundary_width, generator=g)
    y = torch.randint(0, TINY.vocab_size, (batch, 16), generator=g)
    return x, y


@pytest.fixture
async def last() -> StageExecutor:
    ex = StageExecutor(TINY, TINY.n_stages - 1, training=TrainingSpec(target_batch_size=8))
    try:
        yield ex
    finally:
        await ex.close()


async def test_a_recomputed_microbatch_is_the_part_its_backward_kept(last: StageExecutor) -> None:
    for mb in (11, 12):
        x, y = _microbatch(mb)
        await last.backward(x, targets=y, mb=mb)
    contribution = await last.take_contribution()
    assert [mb for mb, _ in contribution.parts] == [11, 12]
    assert [i.mb for i in contribution.inputs] == [11, 12]  # what each backward ran on, in the same order
    for (mb, part), shipped in zip(contribution.parts, contribution.inputs, strict=True):
        assert torch.equal(shipped.inputs, _microbatch(mb)[0]) and torch.equal(shipped.targets, _microbatch(mb)[1])
        again = await last.recompute(shipped.inputs, shipped.targets, "fp32", contribution.step)
        assert again is not None
        # the same float32 computation on the same thread: equal, or within rounding of another reduction order
        assert torch.allclose(again, part, rtol=1e-5, atol=1e-7)
        rows = sketch([part, again, -part], seed=mb, numel=last.grad_numel)
        assert gap(rows[0].tolist(), [0.0] * 16, rows[1].tolist()) < 1e-5
        assert gap(rows[2].tolist(), [0.0] * 16, rows[1].tolist()) > 1 - 1e-6  # a flipped part: gap 1
        assert RECOMPUTE_TOLERANCE < 0.1
    # nothing held changed: the contribution goes back and sums as before
    await last.restore_contribution(contribution)
    again_taken = await last.take_contribution()
    assert again_taken.grads is not None and contribution.grads is not None
    assert torch.equal(again_taken.grads, contribution.grads)
    assert [i.mb for i in again_taken.inputs] == [11, 12]  # a restored contribution ships its inputs again
    await last.apply_average(again_taken.grads / again_taken.samples, again_taken.step)
    # on the next step's parameters a recomputation of the old step is refused (None), and the inputs are kept
    # for one step more only (delayed updates are not recomputed: a peer keeps none then)
    assert await last.recompute(*_microbatch(11), "fp32", again_taken.step) is None


async def test_inputs_that_do_not_fit_the_stage_are_refused(last: StageExecutor) -> None:
    x, y = _microbatch(1)
    with pytest.raises(RequestError):
        await last.recompute(x[:, :, :3], y, "fp32", 0)
    with pytest.raises(RequestError):
        await last.recompute(x, y.clamp(max=0) + TINY.vocab_size, "fp32", 0)


async def test_only_the_last_stage_without_delayed_updates_keeps_inputs() -> None:
    first = StageExecutor(TINY, 0, training=TrainingSpec(target_batch_size=8))
    delayed = StageExecutor(TINY, TINY.n_stages - 1, training=TrainingSpec(target_batch_size=8, delay_updates=True))
    try:
        x, y = _microbatch(3)
        await delayed.backward(x, targets=y, mb=3)
        assert (await delayed.take_contribution()).inputs == ()
        tokens = torch.randint(0, TINY.vocab_size, (2, 16))
        await first.backward(tokens, grad_outputs=torch.randn(2, 16, TINY.boundary_width), mb=4)
        assert (await first.take_contribution()).inputs == ()
    finally:
        await first.close()
        await delayed.close()


def test_kept_inputs_by_step_pruned_and_bounded() -> None:
    kept = KeptInputs(max_entries=3)
    x, y = _microbatch(0)
    kept.keep(5, 1, x, y)
    kept.keep(5, 2, x, y)
    assert [i.mb for i in kept.of(5, [2, 1]) or ()] == [2, 1]
    assert kept.of(5, [1, 9]) is None and kept.of(4, [1]) is None  # one missing, or of another step
    kept.keep(6, 3, x, y)
    kept.prune(7)  # the step before stays (delayed updates would count it)
    assert len(kept) == 1 and kept.of(6, [3]) is not None
    for mb in range(10, 15):
        kept.keep(7, mb, x, y)
    assert len(kept) == 3 and kept.of(7, [12, 13, 14]) is not None  # the oldest went first
    kept.clear()
    assert len(kept) == 0


def test_sample_draws_every_microbatch() -> None:
    counts = collections.Counter(sample("abc") for _ in range(600))
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 100


def test_draws_is_a_probability() -> None:
    assert not any(draws(0.0) for _ in range(200)) and all(draws(1.0) for _ in range(200))
    assert 100 < sum(draws(0.25) for _ in range(800)) < 300


async def test_a_stage_mate_recomputes_a_past_step_on_the_parameters_it_kept(last: StageExecutor) -> None:
    """``recompute_past``: the current parameters while they are those of the digest, then the copy kept from
    before each of the last ``PAST_PARAMS`` updates (recomputation, "Seconded"); the very gradient the
    backward kept, whatever the parameters now; None once no copy of that digest is left."""
    x, y = _microbatch(21)
    await last.backward(x, targets=y, mb=21)
    step, digest = last.step, last.digest
    taken = await last.take_contribution()
    (_, part), = taken.parts
    now = await last.recompute_past(x, y, "fp32", step, digest)
    assert now is not None and torch.allclose(now, part, rtol=1e-5, atol=1e-7)
    assert taken.grads is not None
    for k in range(PAST_PARAMS):
        await last.apply_average(torch.ones_like(taken.grads) * (k + 1), step + k)
        assert last.digest != digest
        assert await last.recompute(x, y, "fp32", step) is None  # the live parameters moved on
        again = await last.recompute_past(x, y, "fp32", step, digest)
        assert again is not None and torch.equal(again, now)  # the same computation on the kept copy
        assert last.past_params_bytes == 4 * last.grad_numel * (k + 1)
    assert await last.recompute_past(x, y, "fp32", step, "00" * 32) is None  # a digest it never held
    assert await last.recompute_past(x, y, "fp32", step + 1, digest) is None  # that digest, at another step
    await last.apply_average(torch.ones_like(taken.grads), step + PAST_PARAMS)
    assert await last.recompute_past(x, y, "fp32", step, digest) is None  # its copy is gone
    assert last.past_params_bytes == 4 * last.grad_numel * PAST_PARAMS  # bounded


def test_past_params_keep_the_last_ones_by_digest() -> None:
    past = PastParams(keep=2)
    params = [torch.ones(3), torch.zeros(2)]
    past.keep_copy(4, "a" * 64, params)
    params[0].add_(1.0)  # a copy: the kept values do not move with the parameters
    kept = past.at(4, "a" * 64)
    assert kept is not None and torch.equal(kept[0], torch.ones(3))
    assert past.at(5, "a" * 64) is None and past.at(4, "b" * 64) is None
    past.keep_copy(5, "b" * 64, params)
    past.keep_copy(6, "c" * 64, params)
    assert past.at(4, "a" * 64) is None and past.at(6, "c" * 64) is not None and past.nbytes == 2 * 5 * 4
    past.clear()
    assert past.nbytes == 0


def test_inputs_digest_covers_the_id_the_shapes_and_every_bit() -> None:
    x, y = _microbatch(5)
    d = inputs_digest(5, x, y)
    assert d == inputs_digest(5, x.clone(), y.clone()) and len(d) == 64
    assert inputs_digest(6, x, y) != d
    assert inputs_digest(5, x.reshape(1, -1, x.shape[-1]), y.reshape(1, -1)) != d
    bumped = x.clone()
    bumped.view(-1)[7] = torch.nextafter(bumped.view(-1)[7], torch.tensor(float("inf")))  # one ulp
    assert inputs_digest(5, bumped, y) != d
    negzero = torch.zeros_like(x)
    assert inputs_digest(5, negzero, y) != inputs_digest(5, -negzero, y)  # bits, not values
    assert inputs_digest(5, x, y.roll(1)) != d


def test_recheck_is_the_gap_of_a_part_from_its_recomputed_sketch() -> None:
    part = [1.0] * 16
    assert recheck(part, part) == 0.0
    assert recheck(part, [-1.0] * 16) == 1.0
    assert not recheck(part, [float("nan")] * 16) <= RECOMPUTE_TOLERANCE  # NaN never holds
