"""Delayed parameter updates (DPU): a stage keeps computing while its averaging round is on the wire.

SWARM overlaps communication with compute by delaying parameter updates (the paper's list of
techniques: "delayed parameter updates for overlapping compute and communication"; the idea is
ZeRO-Offload's, Ren et al. 2021): the update computed from step ``s``'s batch is applied while the
stage already serves step ``s + 1``'s microbatches with the parameters of ``s``. The price is
staleness: a gradient may be computed on parameters one update older than the ones it is applied
to. ``TrainingSpec.delay_updates`` turns it on for a whole swarm (in the swarm record, so every
peer follows the same rule; ``--sync`` trainers keep the exact, undelayed semantics only when it
is off).

The rules, here once, used by the step protocol (``swarmd.pipeline.stage.step_protocol``) and by the
trainers' pacing (``swarmd.train.pacing``):

- :func:`serves_during_round`: without delayed updates a stage refuses backwards (``Busy``) while
  its gradients are out for averaging, so no gradient of step ``s`` can land after the update to
  ``s + 1``; with them it keeps accepting, and what it accumulates meanwhile joins the next update.
- :func:`accepts_stale`: a backward whose forward ran at most :data:`MAX_STALENESS` steps before
  the stage's step is accepted (counted in ``stale_applied``); older ones are refused
  (``StaleStep``), as without delayed updates.
- :func:`needs_pacing`: trainers need not hold microbatches back at a step's end (the stage
  accepts the next step's work while it averages), so nothing paces them to the batch size.
"""

from __future__ import annotations

__all__ = ["MAX_STALENESS", "accepts_stale", "needs_pacing", "serves_during_round"]

#: How many updates older than the stage's parameters a gradient may be computed on.
MAX_STALENESS = 1


def serves_during_round(delayed: bool) -> bool:
    """Whether a stage accepts backwards while its gradients are out for averaging."""
    return delayed


def accepts_stale(stage_step: int, forward_step: int, *, delayed: bool) -> bool:
    """Whether a backward whose forward ran at ``forward_step``, behind the stage's ``stage_step``,
    still joins the stage's sum (into the next update)."""
    return delayed and 0 < stage_step - forward_step <= MAX_STALENESS


def needs_pacing(delayed: bool) -> bool:
    """Whether a trainer must stop starting microbatches once the stage holds a full batch."""
    return not delayed
