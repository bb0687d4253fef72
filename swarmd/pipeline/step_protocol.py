"""The step protocol: which optimizer step a stage's gradients belong to, and how they add up.

SWARM (Ryabinin et al., 2023, section 3.2) steps every peer of a stage together: the peers
accumulate gradients until they hold ``target_batch_size`` samples between them, average them
(``swarmd.pipeline.averaging``) and all apply the same update. This module is one peer's side
of that protocol, the bookkeeping the averaging rounds and the backwards meet on.

The step rule. Every reply says which optimizer step the stage's parameters were at. A
backward names the step its forward ran at; a backward for an older step is refused with
``StaleStep`` and counted (its gradient would mix two versions of the parameters), one for a
newer step with ``PeerBehind`` (this peer is behind its stage-mates). While the stage's
gradients are out for averaging, backwards are refused with ``Busy`` (retry shortly), so no
gradient computed at step ``s`` can land after the update to ``s + 1``.

Delayed parameter updates (``TrainingSpec.delay_updates``, paper section 3.3): the stage keeps
serving with the previous parameters while its round runs, backwards accumulate into the
*next* update, and a backward whose forward ran one step ago is accepted (staleness exactly 1,
counted in ``stale_applied``); two or more steps old is still refused.

Gradient accounting. The last stage backpropagates ``loss * batch_size``, the sum of
per-sample mean losses, so every stage accumulates gradient *sums* over samples together with
a sample count, and ``grad / samples`` is the gradient of the mean loss over everything
accumulated, however the batch was split into microbatches. A round *takes* the sum out
(backwards are refused meanwhile, unless updates are delayed), and either applies the
stage-wide mean as the update of that step or, when the round fails, *restores* the sum.
Adopting a stage-mate's state drops whatever was accumulated (counted in ``dropped_samples``).
A stage-mate that leaves gracefully hands its accumulated sum over instead of dropping it
(:meth:`StepProtocol.receive`): accepted only for the very step this peer is at and while its
gradients are not out for averaging, so a handed-over gradient obeys the step rule too
(counted in ``handed_in_samples``).

Exactly once. A trainer retries a backward that timed out, on the same peer or another one, and
the first attempt may still complete (a frozen peer waking up, an answer lost on the way back):
counted twice, the microbatch would weigh double in the step. Two rules keep each microbatch's
gradient counted once per step on a stage:

- *Same peer*: a stage counts a microbatch id (``meta.mb``) once per step
  (:meth:`StepProtocol.first_count`). A backward of an id it already counted at that step is a
  *duplicate* (counted in ``duplicates``): its gradients are computed and answered, so the
  trainer can go on, but not accumulated again.
- *Another peer*: a backward names how long its sender waits (``deadline_ms``); the peer
  applies the gradient only within that time of receiving it, checked after the compute and
  right before the gradient joins the sum (refused as ``RequestTimeout``, counted in
  ``late_refused``). The trainer gives up, and retries elsewhere, only after waiting longer, so
  a late first attempt is dropped, not added. Residual case: a peer that adds the gradient in
  time and *then* freezes before its answer leaves, and wakes before its stage steps, counts it
  next to the retry's copy; the deadline margin (a quarter of the trainer's timeout) makes that
  need a freeze between two lines of code.

Sample reservations (several trainers pacing to one step) are the lease book's, next door:
``swarmd.pipeline.reservations``.

:func:`judge_backward` is the rule as a pure function; :class:`StepProtocol` applies it and
keeps the counts (plain Python, no tensors); :class:`GradientAccumulator` holds the gradient
sums themselves in the parameters' ``.grad``. Both classes belong to the stage's worker thread
(``swarmd.pipeline.executor``), which publishes what other threads may read.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from swarmd.errors import Busy, PeerBehind, RequestError, StaleStep
from swarmd.finite import all_finite

__all__ = ["GradientAccumulator", "StepProtocol", "Taken", "Verdict", "judge_backward"]


class Verdict(enum.Enum):
    """What the step rule says about one backward."""

    ACCEPT = "accept"  # computed at the current step (or not checked): accumulate
    ACCEPT_STALE = "accept_stale"  # delayed updates: one step old, accumulate into the next update
    BUSY = "busy"  # the gradients are out for averaging: retry shortly
    STALE = "stale"  # computed at an older step: dropped, redo the microbatch
    BEHIND = "behind"  # computed at a newer step: this peer is behind its stage-mates


def judge_backward(stage_step: int, forward_step: int | None, *, averaging: bool, delayed: bool) -> Verdict:
    """The step rule for a backward whose forward ran at ``forward_step`` on a stage at ``stage_step``.

    ``forward_step`` None means "not checked" (the last stage's fused forward + backward). The
    ``Busy`` check comes first: without delayed updates nothing is accepted while the stage's
    gradients are out, whatever step it names.
    """
    if averaging and not delayed:
        return Verdict.BUSY
    if forward_step is None or forward_step == stage_step:
        return Verdict.ACCEPT
    if delayed and forward_step == stage_step - 1:
        return Verdict.ACCEPT_STALE
    return Verdict.STALE if forward_step < stage_step else Verdict.BEHIND


@dataclass(frozen=True)
class Taken:
    """What a round took out of the accumulator: the step its gradients were computed at, and how many samples."""

    step: int
    samples: int


class StepProtocol:
    """One peer's step counter and sample accounting for its stage (see the module docstring)."""

    def __init__(self, stage: int, *, delay_updates: bool = False) -> None:
        self.stage = stage
        self.delay_updates = delay_updates
        self.step = 0  # the optimizer step the parameters are at
        self.grad_samples = 0  # samples whose gradients are accumulated since the last take
        self.averaging = False  # a contribution is out for averaging
        self.out_samples = 0  # samples of the contribution out for averaging
        self.stale_dropped = 0  # backwards refused because they were computed at an older step
        self.stale_applied = 0  # delayed updates: backwards one step old, accumulated into the next update
        self.dropped_samples = 0  # accumulated samples discarded by adopting a stage-mate's state
        self.handed_in_samples = 0  # samples whose gradients a leaving stage-mate handed to this peer
        self.duplicates = 0  # backwards of a microbatch already counted at that step: answered, not added
        self.late_refused = 0  # backwards past their sender's deadline: not added (it retried elsewhere)
        self._counted: dict[int, set[int]] = {}  # step -> microbatch ids counted at it (this and the last)

    @property
    def held_samples(self) -> int:
        """Samples this peer holds gradients of, whether accumulating or out for averaging."""
        return self.grad_samples + self.out_samples

    def admit(self, forward_step: int | None) -> int:
        """Apply the step rule to a backward; the step its gradient will count towards.

        Raises ``Busy``, ``StaleStep`` (counted) or ``PeerBehind``; a backward one step old under
        delayed updates is counted as applied here, before it runs.
        """
        verdict = judge_backward(self.step, forward_step, averaging=self.averaging, delayed=self.delay_updates)
        if verdict is Verdict.BUSY:
            raise Busy(f"stage {self.stage} is averaging the gradients of step {self.step}; retry shortly")
        if verdict is Verdict.ACCEPT_STALE:
            self.stale_applied += 1
        elif verdict is Verdict.STALE:
            self.stale_dropped += 1
            raise StaleStep(
                f"this microbatch ran forward at step {forward_step} but stage {self.stage} is at step {self.step}; "
                "its gradient is dropped: redo the microbatch"
            )
        elif verdict is Verdict.BEHIND:
            raise PeerBehind(f"stage {self.stage} on this peer is at step {self.step}, behind step {forward_step}")
        return self.step

    def accumulated(self, samples: int, mb: int | None = None, step: int | None = None) -> None:
        """A backward of ``samples`` samples added its gradient sum (of microbatch ``mb``, counted
        towards ``step``)."""
        self.grad_samples += samples
        if mb is not None:
            self._counted.setdefault(self.step if step is None else step, set()).add(mb)

    def first_count(self, mb: int | None, step: int) -> bool:
        """Whether microbatch ``mb`` has yet to be counted towards ``step`` here (None: unnamed,
        always counted); a repeat is counted as a duplicate."""
        if mb is None or mb not in self._counted.get(step, ()):
            return True
        self.duplicates += 1
        return False

    def late(self) -> None:
        """A backward came back past its sender's deadline: not added."""
        self.late_refused += 1

    def receive(self, step: int, samples: int) -> None:
        """A leaving stage-mate hands over a gradient sum of ``samples`` samples computed at ``step``.

        Raises ``Busy`` while this peer's gradients are out for averaging (the leaver tries another
        stage-mate), ``StaleStep`` or ``PeerBehind`` when the steps differ: a gradient of another
        version of the parameters is never mixed in.
        """
        if self.averaging:
            raise Busy(f"stage {self.stage} is averaging the gradients of step {self.step}; hand them to another peer")
        if step < self.step:
            raise StaleStep(f"handed-over gradients of step {step} reached stage {self.stage} at step {self.step}")
        if step > self.step:
            raise PeerBehind(f"stage {self.stage} on this peer is at step {self.step}, behind step {step}")
        self.grad_samples += samples
        self.handed_in_samples += samples

    def take(self) -> Taken:
        """A round takes the accumulated gradients out; backwards are refused until it settles."""
        if self.averaging:
            raise Busy(f"the gradients of stage {self.stage} are already out for averaging")
        taken = Taken(step=self.step, samples=self.grad_samples)
        self.averaging = True
        self.out_samples = self.grad_samples
        self.grad_samples = 0
        return taken

    def restore(self, step: int, samples: int) -> bool:
        """The round failed; True when its gradients go back into the accumulator.

        They go back only if they were taken at the current step (a state adopted meanwhile
        moved the parameters on: they are dropped). Either way the stage accepts backwards again.
        """
        back = step == self.step
        if back:
            self.grad_samples += samples
        self._settle()
        return back

    def begin_update(self, step: int) -> None:
        """Check that a stage-wide mean for ``step`` can be applied here; if not, settle and refuse."""
        if step != self.step:
            self._settle()
            raise StaleStep(f"an average for step {step} reached stage {self.stage} at step {self.step}")

    def finish_update(self) -> None:
        """The update from ``step`` to ``step + 1`` is applied."""
        self.step += 1
        self._prune()
        self._settle()

    def adopt(self, step: int) -> None:
        """A stage-mate's state (parameters at ``step``) replaced this peer's: local gradients are dropped."""
        self.step = step
        self.dropped_samples += self.grad_samples
        self.grad_samples = 0
        self._counted.clear()
        self._settle()

    def _prune(self) -> None:
        """Keep the ids of this step and the last (delayed updates accept one step old)."""
        for step in [s for s in self._counted if s < self.step - 1]:
            del self._counted[step]

    def _settle(self) -> None:
        self.averaging = False
        self.out_samples = 0


class GradientAccumulator:
    """A stage's gradient sums, held in its parameters' ``.grad`` (``params`` in name order)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)

    def add(self, backward: Callable[[], None], *, commit: Callable[[], None] | None = None) -> None:
        """Run ``backward`` into fresh gradients; add them to the held ones only if the sum is finite
        everywhere, else refuse the request and leave the accumulator as it was. ``commit`` is
        called right before the sums replace the held gradients: raising refuses the request
        (the sender's deadline passed while it computed) and changes nothing.

        Inputs and ``grad_outputs`` are checked for NaN/Inf, but finite ones can still overflow
        (``grad_outputs`` of 3e38 give parameter gradients of Inf), and one Inf would poison the
        stage's next update. ``old + new`` is the very addition autograd's accumulation does, so
        accepted gradients are bit-identical to letting it accumulate; the sums replace the held
        gradients only once all of them are known to be finite. They are summed into the fresh
        gradients, which this backward's autograd owns (no second 4-bytes-per-parameter buffer
        per backward), and checked with :func:`~swarmd.finite.all_finite`.
        """
        held = self.hold()
        try:
            backward()
            fresh = [p.grad for p in self.params]
        finally:
            self.reinstate(held)
        summed = [new if old is None or new is None else new.add_(old) for old, new in zip(held, fresh, strict=True)]
        for total in summed:
            if total is not None and not all_finite(total):
                raise RequestError("the request's gradients overflow to Inf or NaN; refused and not applied")
        if commit is not None:
            commit()
        for p, total in zip(self.params, summed, strict=True):
            if total is not None:
                p.grad = total

    def discard(self, backward: Callable[[], None]) -> None:
        """Run ``backward`` (for its input gradients) and drop the parameter gradients it made:
        a duplicate's, already counted once."""
        held = self.hold()
        try:
            backward()
        finally:
            self.reinstate(held)

    def take(self) -> torch.Tensor:
        """The held sums as one flat float32 tensor (zeros where none), and clear them."""
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to("cpu", torch.float32)
                for p in self.params
            ]
        )
        self.clear()
        return flat

    def put(self, flat: torch.Tensor, *, accumulate: bool = False) -> None:
        """Set the gradients from a flat tensor, or add it to the held ones (``accumulate``)."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected {self.numel} gradient values, got {flat.numel()}")
        offset = 0
        for p in self.params:
            chunk = flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
            if accumulate and p.grad is not None:
                p.grad.add_(chunk)
            else:
                p.grad = chunk.clone()

    def hold(self) -> list[torch.Tensor | None]:
        """Set the held gradients aside (each ``.grad`` becomes None), for :meth:`reinstate`."""
        held = [p.grad for p in self.params]
        self.clear()
        return held

    def reinstate(self, held: list[torch.Tensor | None]) -> None:
        for p, grad in zip(self.params, held, strict=True):
            p.grad = grad

    def clear(self) -> None:
        for p in self.params:
            p.grad = None
