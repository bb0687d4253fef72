"""The pipeline of one sync step as a schedule of calls: how long a step must take, given what
each call costs.

In sync mode (SWARM, Ryabinin et al. 2023, section 3.2, with one global batch per step) a step
is a GPipe step: the trainer sends the batch's microbatches forward through stages
``0 .. S-2``, the last stage runs a fused forward and backward with the loss, the backwards go
back through ``S-2 .. 0``, and each stage updates its parameters once its share of the batch
is in. The pipeline fills at the step's start (only stage 0 works until the first forward is
back) and drains at its end (only stage 0 works after the last stage's last call, then it
updates, and the next step's first forward must wait for that update).

:func:`sync_step` replays that schedule as the swarm runs it, one peer per stage:

- every stage is one worker that runs its calls one at a time, in the order they arrive (the
  daemon's single stage worker thread, :mod:`swarmd.pipeline.stage.executor`);
- the trainer (:meth:`swarmd.train.trainer.Trainer._run_sync`) sends microbatch ``i``'s first
  forward once microbatch ``i - 1``'s (``chained``) or microbatch 0's first forward is back, and
  keeps at most ``window`` microbatches in flight (one leaves when stage 0's backward is back);
- every message between the trainer and a stage takes ``hop`` seconds each way (a stage's
  output reaches the next stage through the trainer: two hops);
- a stage updates (``update`` seconds) after its last backward of the step; the step ends when
  every stage has updated and the trainer has heard (one more hop).

With the call costs measured on one thread in one process and ``hop = 0``, the result is the
step no transport, protocol or event-loop change could beat for that batch split: the
*ceiling* that ``scripts/bench_pipeline.py`` reports beside its measurement, so that a gap to
single-process training can be split into what the pipeline's shape costs and what the swarm's
machinery adds. A pure function of numbers (no torch, no clock): deterministic, ties broken by
arrival order (at one instant: calls finishing, then calls arriving, then the trainer acting,
each in the order they arose).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCalls:
    """What one stage's calls cost, in seconds, by microbatch size.

    ``forward`` and ``backward`` for every stage but the last; ``fused`` (forward, loss and
    backward in one call) for the last. ``update``: the stage's optimizer step at the step's end.
    """

    forward: Mapping[int, float]
    backward: Mapping[int, float]
    fused: Mapping[int, float]
    update: float = 0.0


@dataclass(frozen=True)
class StepSchedule:
    """One modelled sync step.

    ``step_s``: from the first request to the trainer hearing that every stage has updated.
    ``busy_s``: per stage, the seconds its worker computed (calls and update). ``idle_s``: per
    stage, ``step_s - busy_s``. ``calls``: every call as ``(stage, kind, microbatch, start, end)``
    in start order (``kind`` is ``forward``, ``backward``, ``fused`` or ``update``, whose microbatch
    is -1).
    """

    step_s: float
    busy_s: tuple[float, ...]
    calls: tuple[tuple[int, str, int, float, float], ...]

    @property
    def idle_s(self) -> tuple[float, ...]:
        return tuple(self.step_s - busy for busy in self.busy_s)


def sync_step(
    sizes: Sequence[int],
    stages: Sequence[StageCalls],
    *,
    window: int,
    chained: bool = True,
    hop: float = 0.0,
) -> StepSchedule:
    """Replay one sync step of microbatches ``sizes`` through ``stages`` (see the module docstring).

    Raises ``ValueError`` for an empty batch or pipeline, a window below 1, a negative hop, or
    a size some stage has no cost for.
    """
    if not sizes or not stages:
        raise ValueError("a step needs at least one microbatch and one stage")
    if window < 1:
        raise ValueError(f"the window must be at least 1, got {window}")
    if hop < 0:
        raise ValueError(f"the hop must not be negative, got {hop}")
    last = len(stages) - 1
    for k, calls in enumerate(stages):
        table = {"fused": calls.fused} if k == last else {"forward": calls.forward, "backward": calls.backward}
        for kind, costs in table.items():
            missing = sorted({n for n in sizes if n not in costs})
            if missing:
                raise ValueError(f"stage {k} has no {kind} cost for microbatches of {missing}")
    return _Replay(sizes, stages, window, chained, hop).run()


def unimodal_splits(batch: int, largest: int, max_parts: int) -> Iterator[tuple[int, ...]]:
    """Every split of ``batch`` samples into at most ``max_parts`` microbatches of 1 to ``largest``
    samples whose sizes rise, then fall (``2 4 6 8 6 4 2``, ``8 8 8 8``, ``1 7 8 8 8``): the shapes a
    sync step's batch split takes (a dip in the middle only adds a call), for searching the
    best one with :func:`sync_step`. Each split once, in no promised order."""
    if batch < 1 or largest < 1 or max_parts < 1:
        raise ValueError("batch, largest and max_parts must each be at least 1")

    def splits(left: int, last: int, falling: bool, parts: int) -> Iterator[tuple[int, ...]]:
        if left == 0:
            yield ()
            return
        cap = min(last if falling else largest, left)
        if parts == 0 or left > cap * parts:  # cannot be filled with what is allowed from here
            return
        for size in range(1, cap + 1):  # a part below the one before it starts the falling side
            for rest in splits(left - size, size, falling or size < last, parts - 1):
                yield (size, *rest)

    yield from splits(batch, 0, False, max_parts)


class _Replay:
    """The discrete-event replay behind :func:`sync_step`."""

    def __init__(self, sizes: Sequence[int], stages: Sequence[StageCalls], window: int, chained: bool,
                 hop: float) -> None:
        self.sizes, self.stages, self.window, self.chained, self.hop = list(sizes), list(stages), window, chained, hop
        self.last = len(stages) - 1
        self.events: list[tuple[float, int, int, str, int, int]] = []  # (time, what, order, kind, stage, mb)
        self.order = 0
        self.queues: list[list[tuple[float, int, str, int]]] = [[] for _ in stages]  # (arrived, order, kind, mb)
        self.running = [False] * len(stages)  # a stage starts its next call when one ends or arrives while idle
        self.busy = [0.0] * len(stages)
        self.backwards_left = [len(sizes)] * len(stages)
        self.updated_at = [0.0] * len(stages)
        self.calls: list[tuple[int, str, int, float, float]] = []
        self.sent = 0  # microbatches whose first request has gone out
        self.in_flight = 0
        self.led: list[float | None] = [None] * len(sizes)  # when the trainer had microbatch i's first forward back

    _ARRIVE, _DONE, _TRAINER = 1, 0, 2  # at one instant: finish, then arrive, then let the trainer act

    def push(self, at: float, what: int, kind: str, stage: int, mb: int) -> None:
        heapq.heappush(self.events, (at, what, self.order, kind, stage, mb))
        self.order += 1

    def cost(self, stage: int, kind: str, mb: int) -> float:
        calls = self.stages[stage]
        if kind == "update":
            return calls.update
        table = {"forward": calls.forward, "backward": calls.backward, "fused": calls.fused}[kind]
        return table[self.sizes[mb]]

    def first_kind(self) -> str:
        return "fused" if self.last == 0 else "forward"

    def send_more(self, now: float) -> None:
        """The trainer sends every microbatch it may send now."""
        while self.sent < len(self.sizes) and self.in_flight < self.window:
            i = self.sent
            gate = None if i == 0 else self.led[i - 1 if self.chained else 0]
            if i and gate is None:
                return
            self.sent += 1
            self.in_flight += 1
            self.push(max(now, gate or 0.0) + self.hop, self._ARRIVE, self.first_kind(), 0, i)

    def start_next(self, stage: int, now: float) -> None:
        queue = self.queues[stage]
        if self.running[stage] or not queue:
            return
        _, _, kind, mb = heapq.heappop(queue)
        ended = now + self.cost(stage, kind, mb)
        self.running[stage] = True
        self.busy[stage] += ended - now
        self.calls.append((stage, kind, mb, now, ended))
        self.push(ended, self._DONE, kind, stage, mb)

    def done(self, now: float, kind: str, stage: int, mb: int) -> None:
        self.running[stage] = False
        back = now + self.hop  # the answer reaches the trainer
        if kind == "update":
            self.updated_at[stage] = now
        elif kind == "forward":
            if stage == 0 and self.led[mb] is None:
                self.led[mb] = back
                self.push(back, self._TRAINER, "led", 0, mb)
            nxt = "fused" if stage + 1 == self.last else "forward"
            self.push(back + self.hop, self._ARRIVE, nxt, stage + 1, mb)
        else:  # a backward, or the last stage's fused call: the gradient goes one stage back
            if stage == 0:  # the microbatch leaves the window once the trainer has the answer
                self.push(back, self._TRAINER, "freed", 0, mb)
            else:
                self.push(back + self.hop, self._ARRIVE, "backward", stage - 1, mb)
            if kind == "fused" and stage == 0 and self.led[mb] is None:  # one stage: no forward before it
                self.led[mb] = back
            self.backwards_left[stage] -= 1
            if self.backwards_left[stage] == 0:
                self.push(now, self._ARRIVE, "update", stage, -1)
        self.start_next(stage, now)

    def run(self) -> StepSchedule:
        self.send_more(0.0)
        while self.events:
            now, what, _, kind, stage, mb = heapq.heappop(self.events)
            if what == self._DONE:
                self.done(now, kind, stage, mb)
            elif what == self._ARRIVE:
                heapq.heappush(self.queues[stage], (now, self.order, kind, mb))
                self.order += 1
                self.start_next(stage, now)
            else:
                self.in_flight -= int(kind == "freed")
                self.send_more(now)
        step = max(self.updated_at) + self.hop
        return StepSchedule(step_s=step, busy_s=tuple(self.busy), calls=tuple(sorted(self.calls, key=lambda c: c[3])))
