"""Error feedback of compressed contributions: what the codec dropped reaches the leader later."""

from __future__ import annotations

import math

import pytest
import torch

from swarmd.net.wire import decode_frame, encode_frame
from swarmd.pipeline.averaging.error_feedback import FED_CODECS, RESIDUAL_CAP, ErrorFeedback, needs_feedback
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.spec import PRESETS, TrainingSpec


def _through(codec: str, grads: torch.Tensor) -> torch.Tensor:
    """``grads`` as a leader decodes them from a frame sent with ``codec``."""
    return decode_frame(encode_frame("grads", {}, {"grads": grads}, codec)).tensors["grads"]


def _received_sum(codec: str, rounds: list[torch.Tensor], feedback: ErrorFeedback) -> torch.Tensor:
    total = torch.zeros_like(rounds[0])
    for g in rounds:
        sent = feedback.compensate(g.clone())
        decoded = _through(codec, sent)
        feedback.keep(sent, decoded)
        total += decoded
    return total


@pytest.mark.parametrize("codec", sorted(FED_CODECS))
def test_the_received_sum_tracks_the_true_sum(codec: str) -> None:
    """A small steady component (a bias that rounds the same way every time) is lost without
    feedback and kept with it: the received sum differs from the true one by the last residual."""
    gen = torch.Generator().manual_seed(0)
    big = torch.zeros(4096)
    big[::64] = 1.0  # one large value per block sets its scale
    rounds = [big * (1 + 0.01 * torch.randn(4096, generator=gen)) + 1e-3 for _ in range(60)]
    truth = torch.stack(rounds).sum(0)
    plain = _received_sum(codec, rounds, ErrorFeedback(enabled=False))
    fed_feedback = ErrorFeedback(enabled=True)
    fed = _received_sum(codec, rounds, fed_feedback)
    plain_err = float(torch.linalg.vector_norm(plain - truth))
    fed_err = float(torch.linalg.vector_norm(fed - truth))
    assert fed_feedback.residual is not None
    # exactly the last residual (up to float32 rounding of 60 sums)
    assert fed_err <= float(torch.linalg.vector_norm(fed_feedback.residual)) * 1.01 + 1e-3
    assert fed_err < plain_err / 5, (fed_err, plain_err)  # and the gap grows with the rounds
    assert fed_feedback.rounds_kept == 60
    assert fed_feedback.rounds_trimmed == 0  # steady gradients: the cap never binds


@pytest.mark.parametrize("codec", ["5level", "3bit"])
def test_after_a_spike_the_residual_is_capped(codec: str) -> None:
    """As in small's seed 1: one step's gradients 200x the next's. The spike's residual would make
    the next contribution tens of times its fresh gradients (a stage-mate's leader refuses 64x);
    capped, it is at most 1 + RESIDUAL_CAP times them, in the residual's direction."""
    gen = torch.Generator().manual_seed(1)
    spike, after = torch.randn(8192, generator=gen) * 200.0, torch.randn(8192, generator=gen)
    fb = ErrorFeedback(enabled=True)
    sent = fb.compensate(spike.clone())
    fb.keep(sent, _through(codec, sent))
    assert fb.residual is not None
    residual = fb.residual.clone()
    uncapped = float(torch.linalg.vector_norm(after + residual))
    assert uncapped > 20 * float(torch.linalg.vector_norm(after))  # what the leader would have seen
    got = fb.compensate(after.clone())
    assert fb.rounds_trimmed == 1
    added = got - after
    after_norm = float(torch.linalg.vector_norm(after))
    assert float(torch.linalg.vector_norm(added)) == pytest.approx(RESIDUAL_CAP * after_norm, rel=1e-4)
    assert float(torch.nn.functional.cosine_similarity(added, residual, dim=0)) > 0.9999  # its direction kept
    assert float(torch.linalg.vector_norm(got)) <= (1 + RESIDUAL_CAP) * after_norm * 1.0001


def test_a_residual_under_the_cap_is_added_whole() -> None:
    fb = ErrorFeedback(enabled=True)
    fb.keep(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0]))  # residual of norm 5
    assert torch.equal(fb.compensate(torch.tensor([3.0, 0.0])), torch.tensor([6.0, 4.0]))  # 5 <= 2 * 3: whole
    assert fb.rounds_trimmed == 0
    fb.keep(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0]))
    assert torch.equal(fb.compensate(torch.zeros(2)), torch.zeros(2))  # no fresh gradients: nothing carried
    assert fb.rounds_trimmed == 1


def test_compensate_hands_the_residual_over_once() -> None:
    fb = ErrorFeedback(enabled=True)
    fb.keep(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.5]))
    assert torch.equal(fb.residual, torch.tensor([0.5, -0.5]))
    # taken out with a contribution: if the round fails, the stage accumulates the compensated
    # gradients again, residual included; it must not be added a second time
    assert torch.equal(fb.compensate(torch.tensor([10.0, 10.0])), torch.tensor([10.5, 9.5]))
    assert fb.residual is None
    assert torch.equal(fb.compensate(torch.tensor([10.0, 10.0])), torch.tensor([10.0, 10.0]))


def test_disabled_feedback_changes_nothing() -> None:
    fb = ErrorFeedback(enabled=False)
    fb.keep(torch.tensor([1.0]), torch.tensor([0.0]))
    assert fb.residual is None and fb.rounds_kept == 0
    g = torch.tensor([3.0])
    assert fb.compensate(g) is g and torch.equal(g, torch.tensor([3.0]))


def test_lossless_rounds_and_bad_residuals_leave_nothing() -> None:
    fb = ErrorFeedback(enabled=True)
    g = torch.tensor([1.0, 2.0])
    fb.keep(g, g)  # codec none: the leader decoded the very tensor
    fb.keep(None, None)  # no samples, nothing sent
    assert fb.residual is None
    fb.keep(torch.tensor([math.inf]), torch.tensor([0.0]))
    assert fb.residual is None  # never carried forward
    fb.keep(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert torch.equal(fb.compensate(torch.zeros(3)), torch.zeros(3))  # another size: dropped
    with pytest.raises(ValueError, match="shape"):
        fb.keep(torch.zeros(2), torch.zeros(3))
    fb.keep(torch.tensor([1.0]), torch.tensor([0.0]))
    fb.reset()
    assert fb.residual is None


def test_which_codecs_are_fed() -> None:
    assert [c for c in ("none", "fp16", "bf16", "8bit", "4bit") if needs_feedback(c)] == ["8bit", "4bit"]
    assert needs_feedback("5level") and needs_feedback("3bit") and needs_feedback("2bit")


async def test_the_executor_adds_the_residual_to_its_next_contribution() -> None:
    spec = PRESETS["tiny"]
    ex = StageExecutor(spec, 1, training=TrainingSpec(grad_codec="4bit", target_batch_size=2))
    try:
        tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        hidden = torch.randn(2, 16, spec.d_model, generator=torch.Generator().manual_seed(1))
        await ex.backward(hidden, targets=tokens, step=0)
        first = await ex.take_contribution()
        assert first.grads is not None
        decoded = _through("4bit", first.grads)
        await ex.apply_average(decoded / first.samples, first.step)
        await ex.keep_residual(first.grads, decoded)
        await ex.backward(hidden, targets=tokens, step=1)
        second = await ex.take_contribution()
        assert second.grads is not None
        # what the stage accumulated, plus what 4bit dropped last round
        await ex.restore_contribution(second)
        again = await ex.take_contribution()  # restored: the residual is in, and not added twice
        assert again.grads is not None and torch.equal(again.grads, second.grads)
        residual = first.grads - decoded
        assert float(torch.linalg.vector_norm(residual)) > 0
        plain = StageExecutor(spec, 1, training=TrainingSpec(grad_codec="none", target_batch_size=2))
        try:
            await plain.load_state(*(await ex.snapshot_state()))
            await plain.backward(hidden, targets=tokens, step=1)
            own = await plain.take_contribution()
            assert own.grads is not None
            assert torch.allclose(second.grads, own.grads + residual, atol=1e-6)
        finally:
            await plain.close()
    finally:
        await ex.close()
