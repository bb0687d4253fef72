"""One microbatch's trip through the stages, and a validation pass.

SWARM's trainers hold no parameters (paper, section 3.2): a microbatch goes forward through stages
``0..S-2``, a fused forward and backward on the last stage (loss and input gradients in one round
trip), then backward through ``S-2..0``, each call to one peer picked by stochastic wiring
(``swarmd.train.stage_calls``). Each attempt carries a random 64-bit id (``meta.mb``), and its
backward on a stage goes to the peer that ran its forward while that peer is usable, where the
activations are still cached (``swarmd.pipeline.executor``), so the forward is not recomputed and,
when that peer said it kept them, the stage inputs are not sent again (issue #30: 2 tensors per
microbatch at each boundary, not 3; a peer that lost them asks for them, typed, and gets them); any
other peer serves it statelessly, from the inputs sent along.

A microbatch is never lost: one whose backward a stage refused as stale (it stepped since the
forward), or whose first answer a spot check could not settle, is redone whole under a new id
(``stage_calls.Redo``), so ``microbatches_issued == microbatches_completed`` at the end and no
gradient is mixed into the wrong step.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence

import torch

from swarmd.train.spot_checks import SpotChecks, Unsettled
from swarmd.train.stage_calls import Redo, StageCalls
from swarmd.train.summary import StepLedger, TrainSummary
from swarmd.train.swarm_client import TrainerError
from swarmd.train.timing import Timing

__all__ = ["Microbatches"]


class Microbatches:
    """Runs microbatches (and validation batches) through a model of ``n_stages`` stages."""

    def __init__(self, calls: StageCalls, checks: SpotChecks, *, n_stages: int, summary: TrainSummary,
                 ledger: StepLedger, timing: Timing) -> None:
        self.calls = calls
        self.checks = checks
        self.last = n_stages - 1  # the last stage's index
        self.summary = summary
        self.ledger = ledger
        self.timing = timing

    async def run(self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Callable[[], None] | None = None,
                  lease_step: int | None = None) -> None:
        """Forward and backward through every stage, redone until it went through; booked in the
        step ledger.

        ``on_forward`` is called once the first stage's forward is back (or the microbatch fails).
        ``lease_step``: the step its reservation is for; a stage that answers a forward at an
        earlier step is finishing that step's round, so the forward is sent again once it has
        stepped (for at most ``Timing.stage_catch_up_s``), instead of being redone as stale later.
        """
        s, calls, checks, last = self.summary, self.calls, self.checks, self.last
        s.microbatches_issued += 1
        if last == 0 and on_forward is not None:  # one stage: no forward before the fused call
            on_forward()
            on_forward = None
        while True:
            # a fresh id per attempt: the peers keep each forward's activations under it, and
            # the backward goes back to the peer that ran the forward (when it is still usable)
            mb = secrets.randbits(64)
            acts, steps, served_by = [x], [], []
            kept_at: list[str | None] = []  # per stage: where the forward's peer kept its inputs (else None)
            try:
                for stage in range(last):
                    catch_up = time.monotonic() + self.timing.stage_catch_up_s
                    while True:
                        try:
                            forward = await calls.forward(stage, acts[-1], mb=mb)
                        finally:
                            if on_forward is not None:
                                on_forward()
                                on_forward = None
                        if lease_step is None or forward.reply.step >= lease_step or time.monotonic() > catch_up:
                            break
                        await asyncio.sleep(self.timing.tick_s)
                    reply = await checks.forward(stage, acts[-1], forward)
                    acts.append(reply.outputs)
                    steps.append(reply.step)
                    served_by.append(forward.peer_id)
                    kept_at.append(forward.addr if forward.reply.kept else None)
                fused = await calls.backward(last, acts[-1], targets=y, mb=mb)
                backward = await checks.backward(last, acts[-1], None, y, None, mb, fused)
                if backward.loss is None:
                    raise TrainerError(f"stage {last} answered a backward with targets without its loss")
                loss, loss_step = backward.loss, backward.step
                grad = backward.grad_inputs
                duplicates = int(backward.duplicate)
                for stage in range(last - 1, -1, -1):
                    served = await calls.backward(stage, acts[stage], grad_outputs=grad, step=steps[stage], mb=mb,
                                                  prefer=served_by[stage], kept_at=kept_at[stage])
                    backward = await checks.backward(stage, acts[stage], grad, None, steps[stage], mb, served)
                    grad = backward.grad_inputs
                    duplicates += int(backward.duplicate)
            except Unsettled:  # a first spot check found the answer wrong and could not say whose
                checks.stats.redone += 1
                continue
            except Redo:  # a stage stepped since the forward
                s.stale_redos += 1
                continue
            break
        s.microbatches_completed += 1
        s.samples += x.shape[0]
        s.duplicates += duplicates
        # the first stage's step (the last backward's): where the microbatch counts, in the lease book's terms
        self.ledger.book(loss=loss, loss_step=loss_step, count_step=backward.step, samples=x.shape[0])

    async def validate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """The mean loss of ``batches`` (forwards only: nothing accumulates); None without any."""
        total, count = 0.0, 0
        for x, y in batches:
            acts = x
            for stage in range(self.last):
                acts = (await self.calls.forward(stage, acts)).reply.outputs
            reply = (await self.calls.forward(self.last, acts, targets=y)).reply
            if reply.loss is None:
                raise TrainerError(f"stage {self.last} answered a forward with targets without its loss")
            total += reply.loss * x.shape[0]
            count += x.shape[0]
        return total / count if count else None
