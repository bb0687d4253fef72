"""The step protocol: which optimizer step a stage's gradients belong to, and how they add up.

SWARM (Ryabinin et al., 2023, section 3.2) steps every peer of a stage together: the peers
accumulate gradients until they hold ``target_batch_size`` samples between them, average them
(``swarmd.pipeline.averaging.averager``) and all apply the same update. This module is one peer's side
of that protocol, the bookkeeping the averaging rounds and the backwards meet on.

The step rule. Every reply says which optimizer step the stage's parameters were at. A
backward names the step its forward ran at; a backward for an older step is refused with
``StaleStep`` and counted (its gradient would mix two versions of the parameters), one for a
newer step with ``PeerBehind`` (this peer is behind its stage-mates). While the stage's
gradients are out for averaging, backwards are refused with ``Busy`` (retry shortly), so no
gradient computed at step ``s`` can land after the update to ``s + 1``.

Delayed parameter updates (``TrainingSpec.delay_updates``, :mod:`swarmd.pipeline.stage.delayed_updates`
has the rules): the stage keeps serving with the previous parameters while its round runs,
backwards accumulate into the *next* update, and a backward whose forward ran one step ago is
accepted (staleness exactly 1, counted in ``stale_applied``); two or more steps old is still refused.

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

Exactly once. A trainer retries a backward that failed, on the same peer or another one, and
the first attempt may still have counted (its answer lost: a connection reset, a relay gone, a
peer frozen after adding it, a reply that did not decode): counted twice, the microbatch would
weigh double in the step. The rules, each microbatch id (``meta.mb``) per stage:

- *Same peer*: a stage counts a microbatch id once per step (:meth:`StepProtocol.first_count`).
  A backward of an id it already counted is a *duplicate* (counted in ``duplicates``): its
  gradients are computed and answered, so the trainer can go on, but not accumulated again.
- *Deadline*: a backward names how long its sender waits (``deadline_ms``); the peer applies
  the gradient only within that time of receiving it, checked right before the gradient joins
  the sum (refused as ``RequestTimeout``, counted in ``late_refused``). A trainer whose call
  *timed out* has waited longer, so the slow attempt is dropped, not added.
- *Ask before retrying elsewhere* (``POST /v1/claim``): each attempt carries its number
  (``meta.attempt``). When an attempt failed in a way that leaves its outcome unknown
  (:func:`may_have_counted`: no answer, a 5xx, an unreadable reply), the trainer asks that peer,
  before the next attempt, whether it counted the id (:meth:`StepProtocol.claim`, short
  timeout). The peer answers from its books and, if it had not counted it, *fences* the id:
  attempts numbered below the claim's never count there any more (checked at the same point as
  the deadline, under the same lock, so "not counted" stays true). "Counted": the trainer's
  remaining attempts only compute (``verify: true``: input gradients, nothing accumulated).
  "Not counted": the retry accumulates wherever it lands. :class:`BackwardAttempts` is the
  trainer's side of this rule.
- *Detected when it cannot be prevented*: if the peer cannot be asked (dead, frozen,
  unreachable), the retry accumulates anyway (a sample lost is worse than one counted twice, and
  a dead peer's copy dies with it). Contributions carry the ids they hold (``mbs``), and a
  round's leader counts every id found in two contributions, or in one and in the round it led
  the step before (the last stage checks no step, so the copies may straddle a step):
  :func:`repeated_microbatches`, ``/status`` → ``averaging.duplicate_microbatches``.

Guaranteed: a microbatch is never counted twice on a stage when every peer whose attempt at it
failed either answers the claim or never rejoins the stage's rounds with its copy. Not
guaranteed (counted twice, then *detected* in ``duplicate_microbatches``, not corrected): a peer
that counted the microbatch, could not be asked within the claim timeout (frozen, partitioned),
and then contributed to the same step's round. Nor is a copy handed over by a leaving peer
(``receive`` carries no ids), nor are peers that lie about their books (issue #17's ground).
A fence holds only for attempts sent from the claimant's own address (``request.remote``: a
trainer asks from where it sent them), so a member that saw a microbatch id (the trainer sends
one id to every stage) cannot fence it on other peers from its own host. What remains: a sender
sharing the trainer's address (the same NAT, the same relay) could still fence its attempts,
and a trainer whose address changes between an attempt and its claim fences nothing (its lost
attempt is then only detected, as above).

Sample reservations (several trainers pacing to one step) are the lease book's, next door:
``swarmd.pipeline.reservations``.

:func:`judge_backward` is the rule as a pure function; :class:`StepProtocol` applies it and
keeps the counts (plain Python, no tensors); :class:`GradientAccumulator` holds the gradient
sums themselves in the parameters' ``.grad``. Both classes belong to the stage's worker thread
(``swarmd.pipeline.stage.executor``), which publishes what other threads may read; the one exception
is :meth:`StepProtocol.claim`, answered on the event loop at once (a claim must not queue
behind the very backward it asks about), which shares the microbatch books with the worker
under a lock.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from swarmd.errors import Busy, NonFinite, PeerBehind, PeerError, RequestTimeout, StaleStep
from swarmd.finite import all_finite
from swarmd.pipeline.stage.delayed_updates import accepts_stale, serves_during_round

__all__ = [
    "BackwardAttempts",
    "GradientAccumulator",
    "Part",
    "StepProtocol",
    "Taken",
    "Verdict",
    "judge_backward",
    "may_have_counted",
    "repeated_microbatches",
]


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
    if averaging and not serves_during_round(delayed):
        return Verdict.BUSY
    if forward_step is None or forward_step == stage_step:
        return Verdict.ACCEPT
    if accepts_stale(stage_step, forward_step, delayed=delayed):
        return Verdict.ACCEPT_STALE
    return Verdict.STALE if forward_step < stage_step else Verdict.BEHIND


def may_have_counted(error: PeerError) -> bool:
    """Whether a backward that failed with ``error`` may still have been counted by its peer.

    A refusal the peer itself sent (4xx; 503 Busy, Draining, ...) is raised before the gradient
    joins the sum: not counted. No answer (status 0: a reset, a timeout, a relay gone), another
    5xx (the peer failed after the compute, or a relay did), or a 200 whose reply did not decode
    leave the outcome unknown.
    """
    return error.status in (0, 200) or (error.status >= 500 and error.status != 503)


def repeated_microbatches(groups: Iterable[Collection[int]]) -> set[int]:
    """The microbatch ids found in two or more of ``groups`` (the contributions of a round, and
    what the leader's previous round held): counted twice."""
    seen: set[int] = set()
    repeated: set[int] = set()
    for group in groups:
        ids = set(group)
        repeated |= ids & seen
        seen |= ids
    return repeated


@dataclass
class BackwardAttempts:
    """A trainer's record of one microbatch's backward on one stage, for the exactly-once rule.

    Attempts are numbered from 0 (``meta.attempt``). ``lost`` maps each peer address whose
    attempt :func:`may_have_counted` to the claim's fence: the number of attempts sent so far,
    so a claim there fences every attempt already made. Pure: the trainer does the I/O.
    """

    mb: int | None
    sent: int = 0  # attempts sent so far
    lost: dict[str, int] = field(default_factory=dict)
    counted_by: str | None = None  # a peer that said it counted the microbatch: the rest only compute
    unsettled: int = 0  # lost attempts whose peer could not be asked: the retry accumulated anyway

    @property
    def compute_only(self) -> bool:
        return self.counted_by is not None

    def next_attempt(self) -> int:
        """The number of the attempt about to be sent."""
        self.sent += 1
        return self.sent - 1

    def failed(self, addr: str, error: PeerError) -> None:
        """The attempt just sent to ``addr`` failed with ``error``."""
        if self.mb is not None and not self.compute_only and may_have_counted(error):
            self.lost[addr] = self.sent

    def to_settle(self) -> list[tuple[str, int]]:
        """The (address, fence) claims to make before the next attempt."""
        return [] if self.compute_only else sorted(self.lost.items())

    def settled(self, addr: str, counted: bool | None) -> None:
        """The claim at ``addr`` answered ``counted`` (None: it could not be asked)."""
        self.lost.pop(addr, None)
        if counted:
            self.counted_by = addr
            self.lost.clear()
        elif counted is None:
            self.unsettled += 1


@dataclass(frozen=True)
class Taken:
    """What a round took out of the accumulator: the step its gradients were computed at, how
    many samples, and the microbatch ids they hold."""

    step: int
    samples: int
    mbs: tuple[int, ...] = ()


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
        self.fenced_refused = 0  # attempts a claim fenced off (their sender asked, then retried): not added
        self.claims = 0  # claims answered (POST /v1/claim)
        self.claims_counted = 0  # ... that found the microbatch counted here
        # The microbatch books: the worker thread writes them, claim() (event loop) reads and fences.
        self._books = threading.Lock()
        self._counted: dict[int, set[int]] = {}  # step -> microbatch ids counted at it (this and the last)
        # step fenced at -> {(claimant's source, mb): attempts below this never count}: a claim fences only the
        # attempts that come from where it came from, so a stranger who saw a microbatch id cannot fence it
        self._fenced: dict[int, dict[tuple[str, int], int]] = {}
        self._pending_mbs: list[int] = []  # ids accumulated since the last take
        self._out_mbs: tuple[int, ...] = ()  # ids of the contribution out for averaging

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
        towards ``step``; marked already when it passed :meth:`commit`)."""
        self.grad_samples += samples
        if mb is not None:
            with self._books:
                self._mark(mb, self.step if step is None else step)

    def first_count(self, mb: int | None, step: int) -> bool:
        """Whether microbatch ``mb`` has yet to be counted towards ``step`` here (None: unnamed,
        always counted); a repeat is counted as a duplicate."""
        with self._books:
            if mb is None or mb not in self._counted.get(step, ()):
                return True
        self.duplicates += 1
        return False

    def commit(self, mb: int | None, step: int, attempt: int = 0, source: str = "") -> None:
        """Attempt ``attempt`` of microbatch ``mb``, sent from ``source`` (the sender's IP), is about
        to join the sum of ``step``: mark it counted, or raise ``RequestTimeout`` (counted in
        ``fenced_refused``) if a claim from that source fenced that attempt off. Atomic with
        :meth:`claim`."""
        if mb is None:
            return
        with self._books:
            if any(fences.get((source, mb), 0) > attempt for fences in self._fenced.values()):
                self.fenced_refused += 1
                raise RequestTimeout("its sender gave this attempt up and asked whether it counted (it had not); "
                                     "not applied: the sender retries it")
            self._mark(mb, step)

    def claim(self, mb: int, attempt: int, source: str = "") -> bool:
        """Whether microbatch ``mb`` is counted here (at this step or the last); if not, fence it:
        attempts numbered below ``attempt`` sent from ``source`` (the claimant's IP: a trainer asks
        from where it sent them) never count here. Thread-safe (the event loop's)."""
        with self._books:
            self.claims += 1
            if any(mb in ids for ids in self._counted.values()):
                self.claims_counted += 1
                return True
            fences = self._fenced.setdefault(self.step, {})
            fences[(source, mb)] = max(fences.get((source, mb), 0), attempt)
            return False

    def _mark(self, mb: int, step: int) -> None:
        ids = self._counted.setdefault(step, set())
        if mb not in ids:
            ids.add(mb)
            self._pending_mbs.append(mb)

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
        with self._books:
            taken = Taken(step=self.step, samples=self.grad_samples, mbs=tuple(self._pending_mbs))
            self._pending_mbs = []
        self.averaging = True
        self.out_samples = self.grad_samples
        self._out_mbs = taken.mbs
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
            with self._books:
                self._pending_mbs[:0] = self._out_mbs
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
        with self._books:
            self._counted.clear()
            self._fenced.clear()
            self._pending_mbs = []
        self._settle()

    def _prune(self) -> None:
        """Keep the ids of this step and the last (delayed updates accept one step old)."""
        with self._books:
            for book in (self._counted, self._fenced):
                for step in [s for s in book if s < self.step - 1]:
                    del book[step]

    def _settle(self) -> None:
        self.averaging = False
        self.out_samples = 0
        self._out_mbs = ()


#: One addend of a stage's gradient sums, kept apart (``GradientAccumulator.keep_parts``): the microbatch
#: id whose backward made it (None: gradients put in whole, as handed-in ones), and its flat float32 values.
Part = tuple[int | None, torch.Tensor]


class GradientAccumulator:
    """A stage's gradient sums, held in its parameters' ``.grad`` (``params`` in name order).

    With ``keep_parts`` it also keeps every addend apart (``parts``: one flat float32 copy per
    backward, keyed by its microbatch), so that a contribution can be opened after the round
    (``swarmd.pipeline.averaging.trust.contribution_proofs``); the parts follow the sums through take, put and hold."""

    def __init__(self, params: Sequence[nn.Parameter], *, keep_parts: bool = False) -> None:
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.keep_parts = keep_parts
        self.parts: list[Part] = []
        self._held_parts: list[list[Part]] = []  # hold()'s, for reinstate()

    def _flat(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to("cpu", torch.float32)
                          for p, g in zip(self.params, grads, strict=True)])

    def add(self, backward: Callable[[], None], *, commit: Callable[[], None] | None = None,
            mb: int | None = None) -> None:
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
        part = self._flat(fresh) if self.keep_parts else None  # before the sums below overwrite it
        summed = [new if old is None or new is None else new.add_(old) for old, new in zip(held, fresh, strict=True)]
        for total in summed:
            if total is not None and not all_finite(total):
                raise NonFinite("the request's gradients overflow to Inf or NaN; refused and not applied")
        if commit is not None:
            commit()
        for p, total in zip(self.params, summed, strict=True):
            if total is not None:
                p.grad = total
        if part is not None:
            self.parts.append((mb, part))

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

    def take_parts(self) -> tuple[Part, ...]:
        """The held parts (empty without ``keep_parts``), handed out: call right before :meth:`take`."""
        parts, self.parts = tuple(self.parts), []
        return parts

    def put(self, flat: torch.Tensor, *, accumulate: bool = False, parts: Sequence[Part] | None = None) -> None:
        """Set the gradients from a flat tensor, or add it to the held ones (``accumulate``). With
        ``keep_parts`` the tensor is one part of its own, or ``parts`` (a taken contribution's, put back)."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected {self.numel} gradient values, got {flat.numel()}")
        if self.keep_parts:
            added: list[Part] = list(parts) if parts is not None else [(None, flat.detach().to("cpu", torch.float32))]
            self.parts = [*self.parts, *added] if accumulate else added
        offset = 0
        for p in self.params:
            chunk = flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
            if accumulate and p.grad is not None:
                p.grad.add_(chunk)
            else:
                p.grad = chunk.clone()

    def hold(self) -> list[torch.Tensor | None]:
        """Set the held gradients (and parts) aside (each ``.grad`` becomes None), for :meth:`reinstate`."""
        held = [p.grad for p in self.params]
        self._held_parts.append(self.parts)
        self.clear()
        return held

    def reinstate(self, held: list[torch.Tensor | None]) -> None:
        for p, grad in zip(self.params, held, strict=True):
            p.grad = grad
        self.parts = self._held_parts.pop()

    def clear(self) -> None:
        for p in self.params:
            p.grad = None
        self.parts = []
