"""What a trainer reports: its summary, and the books of which step each finished microbatch fed.

A stage steps whenever the swarm accumulated ``target_batch_size`` samples (SWARM, section 3.2),
so a trainer learns only afterwards at which step its microbatches counted. :class:`StepLedger`
keeps each finished microbatch's loss under the step its last stage computed it at and its samples
under the first stage's step (where the lease book counts them), and closes a step once the swarm
took it: its mean loss (None when none of this trainer's samples were computed at it) and this
trainer's share. :class:`TrainSummary` is what ``swarmd train --json`` prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from swarmd.finite import strict_json

__all__ = ["ClosedStep", "StepLedger", "TrainSummary"]


@dataclass
class TrainSummary:
    steps: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float = 0.0
    retries: int = 0
    bans: int = 0
    timeouts: int = 0  # calls this trainer gave up waiting for (its per-peer timeout)
    probation_calls: int = 0  # calls sent to peers that had never answered (on probation)
    stale_redos: int = 0  # microbatches redone whole: a stage stepped since their forward, or ...
    behind_redos: int = 0  # ... every usable peer of a stage was behind their forward's step (counted in both)
    topup_microbatches: int = 0
    microbatches_issued: int = 0
    microbatches_completed: int = 0
    samples: int = 0
    duplicates: int = 0  # backwards a stage had counted already (a retry after a lost answer): not added twice
    claims: int = 0  # backwards whose answer was lost: the peer was asked whether it had counted them
    claims_counted: int = 0  # ... and it had: the retry only computed (exactly once, step_protocol)
    claims_unanswered: int = 0  # ... the peer could not be asked: the retry counted (perhaps twice; detected)
    inputs_omitted: int = 0  # backwards sent without their inputs, to the peer that kept its forward's
    inputs_resent: int = 0  # ... that peer had lost them (InputsNotCached): sent again with them
    p2p_hops: int = 0  # forwards a peer sent straight on to the next stage's peer (issue #31: peer to peer)
    p2p_fallbacks: int = 0  # ... next hops that failed: the trainer went on from that stage itself
    p2p_backwards: int = 0  # backwards a peer ran in a backward chain (issue #31): the trainer sent none of them
    wire_bytes: int = 0  # request and reply bodies of its microbatches' and validations' calls (checks' apart)
    inputs_recovered: int = 0  # backwards whose inputs (never seen: a hop's) were recomputed by the trainer
    leases: int = 0  # sample reservations granted to this trainer
    full_waits: int = 0  # times the step was fully reserved and the trainer waited for it
    shard: int | None = None  # the shard of the training split it started on (None: the whole split at once)
    window: int = 0  # microbatches in flight at the end (swarmd.train.window; --window N: N)
    window_need: float | None = None  # ... the smoothed estimate of what keeps the slowest stage busy (auto's basis)
    elapsed_s: float = 0.0
    step_losses: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)  # its share of each step: samples counted at it
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    verify: dict[str, Any] = field(default_factory=dict)  # spot checks: swarmd.train.verify.VerifyStats

    def to_json(self) -> dict[str, Any]:
        """The summary as strict JSON values: a loss that is undefined (NaN: a step none of this
        trainer's samples were computed at) or infinite is None, so ``json.dumps(...,
        allow_nan=False)`` accepts it and other languages' parsers do too."""
        return strict_json(asdict(self))


@dataclass(frozen=True)
class ClosedStep:
    """One step the swarm took, as this trainer saw it."""

    loss: float | None  # the mean loss of its samples computed at the step (None: none was)
    samples: int  # its samples the first stage counted at the step


class StepLedger:
    """Finished microbatches, booked by step until the swarm takes it (see the module docstring)."""

    def __init__(self) -> None:
        self._losses: dict[int, list[tuple[float, int]]] = {}  # last stage's step -> (loss, samples)
        self._samples: dict[int, int] = {}  # first stage's step -> samples counted at it

    def book(self, *, loss: float, loss_step: int, count_step: int, samples: int) -> None:
        """A finished microbatch of ``samples``: its ``loss`` was computed at ``loss_step`` (the last
        stage's), and the first stage counted it at ``count_step`` (its last backward's)."""
        self._losses.setdefault(loss_step, []).append((loss, samples))
        self._samples[count_step] = self._samples.get(count_step, 0) + samples

    def close(self, step: int) -> ClosedStep:
        """Step ``step`` is taken: what was booked at it, or before it and not closed yet (a
        microbatch computed at an earlier step that finished late), leaves the ledger."""
        losses = [entry for at in sorted(k for k in self._losses if k <= step) for entry in self._losses.pop(at)]
        total = sum(n for _, n in losses)
        samples = sum(self._samples.pop(at) for at in [k for k in self._samples if k <= step])
        return ClosedStep(sum(value * n for value, n in losses) / total if total else None, samples)
