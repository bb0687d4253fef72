"""What a trainer tells its observers: typed events, one listener.

Benchmarks, progress bars and tests watch a :class:`~swarmd.train.trainer.Trainer` through
these instead of overriding its methods, so the trainer's internals stay free to change.
``Trainer(config, events=listener)`` calls ``listener(event)`` synchronously on the trainer's
event loop, at the moment the event happens: a listener must be quick, must not block, and
its exceptions propagate into the trainer (a broken observer is a bug to see, not to hide).

Times are ``time.perf_counter()`` values, comparable with each other within the process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CallDone", "StepDone", "StepWait", "TrainerEvent", "TrainerListener"]


@dataclass(frozen=True)
class CallDone:
    """One call to a stage succeeded: ``kind`` ``forward`` or ``backward`` (the last stage's
    fused forward + backward is a ``backward``), from the first attempt to the answer, retries
    on other peers and waits for a usable peer included."""

    stage: int
    kind: Literal["forward", "backward"]
    samples: int
    peer_id: str  # the peer that answered
    attempts: int  # 1 unless the call was retried
    started: float
    ended: float


@dataclass(frozen=True)
class StepWait:
    """In sync mode: every microbatch of the step was done, and the trainer waited from
    ``started`` to ``ended`` until every peer of every stage had reached ``step``."""

    step: int
    started: float
    ended: float


@dataclass(frozen=True)
class StepDone:
    """The swarm took its ``done``-th step of this run (the step index ``step``); ``loss`` is the
    mean training loss of the samples computed at that step (None when none was), ``progress``
    the trainer's counters (``Trainer.progress()``)."""

    done: int
    step: int
    loss: float | None
    progress: dict[str, Any]
    at: float


TrainerEvent = CallDone | StepWait | StepDone
TrainerListener = Callable[[TrainerEvent], None]
