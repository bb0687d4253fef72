"""Spot checks: a trainer asks a second peer of a stage for the same answer (issue #17, item 1).

The SWARM paper (Ryabinin et al., 2023) assumes honest workers and names security against
malicious nodes as a limitation (section 6). swarmd has a lever for it: the peers of a stage
hold bit-identical parameters (they step together, ``swarmd.pipeline.averaging``), so the same
request to two peers of a stage at the same step must give the same answer: exactly when both
run the same build on the same kind of hardware, within the error of the reply's codec
otherwise. A trainer re-sends a random ``fraction`` of its forward and backward calls to a
second peer and compares; on a mismatch a third peer arbitrates, and the peer that disagrees
with the other two is the liar (banned by this trainer for :data:`LIAR_BAN_S`, and reported:
``swarmd.pipeline.reports``).

The trainer also checks, always, a peer's first answers of each kind (until one check confirmed
it) and waits for that verdict, going on with the majority's answer when the peer is convicted:
a peer that lies from the start is caught at its first answer and that answer is never used.

This module is the pure part: which calls to check (:class:`SpotChecker`, injected rng), how two
answers compare (:func:`tolerance`, :func:`agree`), what a check's answers mean
(:func:`arbitrate`), and the counters a trainer reports (:class:`VerifyStats`). The trainer
(``swarmd.train.trainer``) does the I/O.

The comparison. An answer is the reply's tensor (a forward's outputs, a backward's input
gradients) plus, on the last stage, its loss, and the step it was computed at. Answers at
different steps are *inconclusive*, never a mismatch: the stage stepped in between, and both
may be right. Two answers agree when equal, or when every element differs by at most
``tol x absmax`` (absmax over both tensors), where ``tol`` comes from the codec: both replies were
coded independently, each within the codec's bound of the exact value, so their distance is
within twice that bound, plus :data:`CROSS_BUILD_SLACK` for float rounding on another build
(8-bit: ``2 x EIGHT_BIT_REL_ERROR``, fp16: ``2 x 2**-11``, bf16: ``2 x 2**-8``, none: the slack
alone). A lie smaller than that (an output scaled by 1.01 over 8-bit) goes unnoticed; the
codec's own error is of the same size.

What is not checked: the first stage's backward answers nothing comparable (token ids have no
gradient; its parameter gradients stay on the peer and are the averaging checks' business,
``swarmd.pipeline.round_checks``), so only forwards are checked on stage 0.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from swarmd.net.codecs import EIGHT_BIT_REL_ERROR

__all__ = [
    "CROSS_BUILD_SLACK",
    "LIAR_BAN_S",
    "Answer",
    "SpotChecker",
    "Verdict",
    "VerifyStats",
    "agree",
    "arbitrate",
    "tolerance",
]

#: Relative float rounding two honest builds (other BLAS, other hardware) may differ by.
CROSS_BUILD_SLACK = 1e-4
#: How long a trainer bans a peer it caught lying (the swarm's exclusion comes on top).
LIAR_BAN_S = 3600.0
#: Relative tolerance of two losses (float32 on both sides; exact on the same build).
LOSS_TOLERANCE = 1e-4

_CODEC_ERROR = {
    "none": 0.0,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
    "8bit": EIGHT_BIT_REL_ERROR,
}


def tolerance(codec: str) -> float:
    """The relative (to absmax) per-element distance two honest answers coded with ``codec`` may
    have: twice the codec's bound plus the cross-build slack. Unknown codecs: ValueError."""
    if codec not in _CODEC_ERROR:
        raise ValueError(f"no error bound known for codec {codec!r}")
    return 2.0 * _CODEC_ERROR[codec] + CROSS_BUILD_SLACK


@dataclass(frozen=True)
class Answer:
    """One peer's answer to a checked call: the step it was computed at, its tensor (None when
    the stage answers none), its loss (last stage) and who answered."""

    peer_id: str
    step: int
    tensor: torch.Tensor | None
    loss: float | None = None


def agree(a: Answer, b: Answer, tol: float) -> bool:
    """Whether two answers at the same step are the same up to ``tol`` (see the module
    docstring). Shapes, dtypes and presence must match exactly; a non-finite value never agrees."""
    if (a.loss is None) != (b.loss is None):
        return False
    if a.loss is not None and b.loss is not None:
        if not (math.isfinite(a.loss) and math.isfinite(b.loss)):
            return False
        if abs(a.loss - b.loss) > LOSS_TOLERANCE * max(1.0, abs(a.loss), abs(b.loss)):
            return False
    x, y = a.tensor, b.tensor
    if x is None or y is None:
        return x is None and y is None
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if torch.equal(x, y):
        return True
    if not x.is_floating_point():
        return False
    x, y = x.float(), y.float()
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        return False
    scale = max(float(x.abs().max()), float(y.abs().max())) if x.numel() else 0.0
    return float((x - y).abs().max()) <= tol * scale


class Verdict(enum.Enum):
    """What a check's answers say (see :func:`arbitrate`)."""

    AGREE = "agree"  # the two answers agree
    MISMATCH = "mismatch"  # they disagree: a third peer must arbitrate
    LIAR = "liar"  # the third sided with one of them: the other lied
    INCONCLUSIVE = "inconclusive"  # a step changed in between, or three different answers


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    liar: str | None = None  # with LIAR: the peer that disagreed with the other two


def arbitrate(answers: Sequence[Answer], tol: float) -> Outcome:
    """The verdict of two answers (primary, second) or three (with the arbiter's).

    Answers at different steps are inconclusive. Two that agree: AGREE; two that do not:
    MISMATCH (ask a third). Of three: the one disagreeing with the two that agree is the LIAR;
    if no two agree, INCONCLUSIVE (no peer is blamed on a three-way split: it takes two to
    convict one).
    """
    if len(answers) not in (2, 3):
        raise ValueError("a check compares two answers, or three with an arbiter")
    if len({a.step for a in answers}) > 1:
        return Outcome(Verdict.INCONCLUSIVE)
    if len(answers) == 2:
        return Outcome(Verdict.AGREE if agree(answers[0], answers[1], tol) else Verdict.MISMATCH)
    first, second, third = answers
    if agree(first, second, tol):  # the arbiter was not needed after all (it may still lie): no one is blamed
        return Outcome(Verdict.AGREE)
    with_first, with_second = agree(third, first, tol), agree(third, second, tol)
    if with_first and not with_second:
        return Outcome(Verdict.LIAR, second.peer_id)
    if with_second and not with_first:
        return Outcome(Verdict.LIAR, first.peer_id)
    return Outcome(Verdict.INCONCLUSIVE)


class SpotChecker:
    """Which calls a trainer checks: each with probability ``fraction``, from ``rng``.

    A call is checkable when its answer holds something comparable (a tensor or a loss: not the
    first stage's backward of a multi-stage model) and another peer of the stage could answer it.
    """

    def __init__(self, fraction: float, rng: random.Random | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("the verify fraction must lie in [0, 1]")
        self.fraction = fraction
        self._rng = rng if rng is not None else random.Random()

    def should_check(self, *, comparable: bool, other_peers: int) -> bool:
        if self.fraction == 0.0 or other_peers < 1 or not comparable:
            return False
        return self._rng.random() < self.fraction


@dataclass
class VerifyStats:
    """The cost and the catch of spot checks, for the trainer's summary (``--json``)."""

    calls: int = 0  # forward and backward calls the trainer made (checked or not)
    checks: int = 0  # calls re-sent to a second peer
    first_checks: int = 0  # of which: a peer's first answers, always checked (see the trainer)
    agreements: int = 0
    mismatches: int = 0
    arbitrations: int = 0  # third opinions asked for
    liars: int = 0  # distinct peers caught (banned and reported once each)
    inconclusive: int = 0  # a step changed in between, no third peer, or a three-way split
    failed: int = 0  # checks whose second or third peer did not answer
    skipped: int = 0  # drawn for a check while as many checks as the window were running already
    redone: int = 0  # microbatches redone: a first check's mismatch that no third peer settled
    extra_samples: int = 0  # samples computed again for the checks
    extra_bytes: int = 0  # tensor bytes sent for them
    reports_sent: int = 0  # signed reports peers accepted
    caught: tuple[str, ...] = ()  # the liars' peer ids

    @property
    def fraction(self) -> float:
        """Extra requests per call: the traffic spot checks added."""
        return (self.checks + self.arbitrations) / self.calls if self.calls else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["caught"] = list(self.caught)
        out["traffic_fraction"] = round(self.fraction, 6)
        return out
