"""One microbatch's trip through the stages, and a validation pass.

SWARM's trainers hold no parameters (paper, section 3.2): a microbatch goes forward through stages
``0..S-2``, a fused forward and backward on the last stage (loss and input gradients in one round
trip), then backward through ``S-2..0``, each call to one peer picked by stochastic wiring
(``swarmd.train.stage_calls``). Each attempt carries a random 64-bit id (``meta.mb``), and its
backward on a stage goes to the peer that ran its forward while that peer is usable, where the
activations are still cached (``swarmd.pipeline.stage.executor``), so the forward is not recomputed; any
other peer serves it statelessly.

Peer to peer (``p2p``, issue #31): an unpaired microbatch's forward to stage 0 names the peers of
stages ``1..S-2`` the trainer picked, so the activations go from peer to peer and only stage S-2's
come back (``StageCalls.forward``); each later stage's step, peer and ``kept`` come back with them, so
the backwards are routed as without it. Where a hop failed, the chain ends there and the trainer goes
on from the next stage itself. The trainer never sees the hops' inputs: a backward to a hop omits them
(the hop kept them), and should they be needed after all (that peer lost them or is gone), they are
computed again through the earlier stages at the same steps (:meth:`Microbatches._recovery`).
When the chain ends in the last stage's fused call, the backwards go back through the same peers (the
backward chain: ``reply.backs``), and the trainer sends only those a chain did not run, after settling
(a claim) each one a broken chain may have counted. Spot-checked pairs go through the trainer, every
stage, as without it. A sync step's chain is not held at the trainer for the stages' gates: each
stage's peer runs it only once it took the step (``ForwardRequest.min_step``), the first one's too, and
the step's wait starts as it goes out. Without peer to peer, a microbatch's first call likewise waits
at the first stage's peer, the later ones at their gates. A first stage whose peers do not take the
step in time refuse it, and the trainer sends it again from behind that stage's gate.

A microbatch is never lost: one whose backward a stage refused as stale (it stepped since the
forward), or whose first answer a spot check could not settle, is redone whole under a new id
(``stage_calls.Redo``), so ``microbatches_issued == microbatches_completed`` at the end and no
gradient is mixed into the wrong step.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import torch

from swarmd.net.messages import BackwardReply, ForwardReply
from swarmd.train.spot_checks import SpotChecks, Unsettled
from swarmd.train.stage_calls import How, Redo, Served, StageBehind, StageCalls, StepMoved
from swarmd.train.summary import StepLedger, TrainSummary
from swarmd.train.swarm_client import TrainerError
from swarmd.train.timing import Timing

__all__ = ["Gates", "Microbatches"]


class Gates(Protocol):
    """Which stages a microbatch may call yet (``Microbatches.run``; a sync step's
    ``swarmd.train.sync_steps.StageGates``): each once it took ``step``."""

    @property
    def step(self) -> int: ...

    async def wait(self, stage: int) -> None:
        """Until a call may go to ``stage``."""


class Microbatches:
    """Runs microbatches (and validation batches) through a model of ``n_stages`` stages."""

    def __init__(self, calls: StageCalls, checks: SpotChecks, *, n_stages: int, summary: TrainSummary,
                 ledger: StepLedger, timing: Timing, p2p: bool = False) -> None:
        self.p2p = p2p  # unpaired microbatches' forwards go peer to peer (issue #31)
        self.calls = calls
        self.checks = checks
        self.last = n_stages - 1  # the last stage's index
        self.summary = summary
        self.ledger = ledger
        self.timing = timing

    def pairs(self) -> bool:
        """Whether the next microbatch runs paired (a spot check: ``SpotChecks.pairs``). A caller that
        books samples (a lease, a sync step's slot) asks first and gives it two slots."""
        return self.checks.pairs()

    async def run(self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Callable[[], None] | None = None,
                  lease_step: int | None = None, paired: bool | None = None, gates: Gates | None = None,
                  on_last_stage: Callable[[], None] | None = None) -> None:
        """Forward and backward through every stage, redone until it went through; booked in the
        step ledger.

        ``on_forward`` is called once the first stage's forward is back (or the microbatch fails).
        ``lease_step``: the step its reservation is for; a stage that answers a forward at an
        earlier step is finishing that step's round, so the forward is sent again once it has
        stepped (for at most ``Timing.stage_catch_up_s``), instead of being redone as stale later.
        ``paired``: whether it runs paired, every attempt (the caller gave it two slots, or one);
        None: drawn for each attempt. ``gates``: a call to a stage waits at that stage's (a sync step's
        next batch waits there for a stage still finishing the step before:
        ``swarmd.train.sync_steps.StageGates``), except an unpaired first call and every stage of a chain:
        their peers wait until they took ``gates.step`` (``ForwardRequest.min_step``); a hop that does not
        in time ends the chain there, a first stage's peers that do not have it sent again from behind
        its gate.
        ``on_last_stage``: called when the last stage answered it, or, where a chain to the last stage's
        fused call was sent, then (its answer comes back only with the whole backward chain); once an
        attempt, again when it is redone whole.
        """
        s, checks, last = self.summary, self.checks, self.last
        s.microbatches_issued += 1
        if last == 0 and on_forward is not None:  # one stage: no forward before the fused call
            on_forward()
            on_forward = None
        while True:
            # a fresh id per attempt: the peers keep each forward's activations under it, and
            # the backward goes back to the peer that ran the forward (when it is still usable)
            pair = checks.pairs() if paired is None else paired  # a check: the same sample through other peers too
            try:
                loss, loss_step, duplicates, count_steps = await self._attempt(x, y, pair, on_forward, lease_step,
                                                                               gates, on_last_stage)
            except Unsettled:  # a check found an answer wrong (or of another step) and could not say whose
                continue
            except Redo as redo:  # a stage stepped since the forward, or none of its peers is at that step
                s.stale_redos += 1
                s.behind_redos += int(isinstance(redo, StageBehind))
                continue
            finally:
                on_forward = None  # called once, by the first attempt
            break
        s.microbatches_completed += 1
        s.samples += x.shape[0] * len(count_steps)
        s.duplicates += duplicates
        # the first stage's step (the last backward's): where the microbatch counts, in the lease book's terms;
        # a paired microbatch's pair is counted by the stages too (the sample weighs twice in its step)
        for count_step in count_steps:
            self.ledger.book(loss=loss, loss_step=loss_step, count_step=count_step, samples=x.shape[0])

    async def _attempt(self, x: torch.Tensor, y: torch.Tensor, paired: bool, on_forward: Callable[[], None] | None,
                       lease_step: int | None, gates: Gates | None,
                       on_last_stage: Callable[[], None] | None) -> tuple[float, int, int, list[int]]:
        """One attempt at a microbatch (``paired``: with its pair, each call sent twice at once): its
        loss, the last stage's step, the duplicates, and the first stage's step of each half (where
        the stages counted it)."""
        checks, last = self.checks, self.last
        mb, pair_mb = secrets.randbits(64), secrets.randbits(64)
        # acts[k]: stage k's inputs, None where they went from peer to peer and the trainer never saw them
        acts: list[torch.Tensor | None] = [x]
        steps: list[int] = []
        pair_steps: list[int | None] = []
        served_by: list[str] = []
        pair_by: list[str | None] = []
        kept: list[str | None] = []  # per stage: where each half's forward peer kept its inputs (else None)
        at: list[str] = []  # per stage: where its forward's peer was dialled
        pair_kept: list[str | None] = []
        # peer to peer, unpaired: up to the last stage's fused call, unless a forward may be sent again to catch
        # up with the lease's step (the fused call counts: it is never sent twice)
        chain_to = None if not self.p2p or paired else last if lease_step is None else last - 1
        fused_served: Served[BackwardReply] | None = None
        chained: dict[int, BackwardReply] = {}  # the backward chain's answers, by stage (their peers ran them)
        lost_at: dict[int, list[str]] = {}  # per stage: where chains' backwards went and their answers were lost
        prefer: str | None = None  # the peer a chain stopped before (relayed, on probation): asked next
        stage = 0
        while stage < last:
            inputs = acts[stage]
            assert inputs is not None  # a stage's forward starts where the trainer holds the inputs
            reach = stage if chain_to is None else chain_to  # the last stage this call may reach
            # a microbatch's first call waits for the step at its first stage's peer (min_step), and so does every
            # stage of a chain: it is there to run the moment that stage steps; the trainer's own later calls (it
            # holds their inputs only once the stage before answered) and a spot check's pairs wait at the gates
            gated = gates is not None and reach == stage and (paired or stage > 0)
            if gated and gates is not None:
                await gates.wait(stage)
            fused_end = reach == last
            catch_up = time.monotonic() + self.timing.stage_catch_up_s
            while True:
                if reach > stage and on_forward is not None:
                    on_forward()  # a chain answers after every stage: the next microbatch need not wait for it
                    on_forward = None
                if fused_end and on_last_stage is not None:
                    on_last_stage()  # its answer comes back with the whole backward chain: not worth waiting for
                    on_last_stage = None
                try:
                    forward, pair = await self._forward(stage, inputs, None, mb, pair_mb, paired, reach,
                                                        y if fused_end else None, prefer, back=fused_end,
                                                        min_step=None if gates is None else gates.step)
                except StageBehind:
                    if gated or gates is None:
                        raise
                    await gates.wait(stage)  # its peers did not take the step in time: from behind its gate
                    gated = True
                    continue
                finally:
                    if on_forward is not None:
                        on_forward()
                        on_forward = None
                behind = min([forward.reply.step, *(r.step for r in forward.reply.chain)])
                if lease_step is None or behind >= lease_step or time.monotonic() > catch_up:
                    break
                await asyncio.sleep(self.timing.tick_s)
            reply = await checks.forward(stage, inputs, None, forward, pair)
            steps.append(reply.step)
            served_by.append(forward.peer_id)
            pair_steps.append(pair.reply.step if pair is not None else None)
            pair_by.append(pair.peer_id if pair is not None else None)
            kept.append(forward.addr if forward.reply.kept else None)
            at.append(forward.addr)
            pair_kept.append(pair.addr if pair is not None and pair.reply.kept else None)
            # the stages its outputs went on to, peer to peer (as many hops as answered: Served.hops)
            answered = forward.hops[:len(reply.chain)]
            for hop, result in zip(answered, reply.chain, strict=True):
                if hop.deadline_ms is not None:  # the last stage's fused call: its answer is reply.fused
                    continue
                acts.append(None)
                steps.append(result.step)
                served_by.append(hop.peer_id)
                kept.append(hop.addr if result.kept else None)
                at.append(hop.addr)
                pair_steps.append(None)
                pair_by.append(None)
                pair_kept.append(None)
            for lost_stage, addr in forward.unsettled:  # earlier attempts at this forward whose chain named a fused end
                lost_at.setdefault(lost_stage, []).append(addr)
            if reply.fused is not None:
                fused_served = Served(reply.fused, answered[-1].peer_id, 1, answered[-1].addr)
                chained = {b.stage: b for b in reply.backs}  # the stages whose peers ran their backward
                if reply.back_error is not None:
                    # the backward chain stopped at the stage below those: its peer's own attempt (0) failed, said
                    # it; settled all the same (a claim) before the trainer sends that backward itself
                    stopped_stage = min(chained, default=last) - 1
                    if stopped_stage >= 0:
                        lost_at.setdefault(stopped_stage, []).append(at[stopped_stage])
                break
            broken = forward.hops[len(reply.chain):]
            prefer = forward.stopped_at if not broken else None
            if broken and broken[-1].deadline_ms is not None:
                # the chain broke before its fused end answered, which may have counted all the same (a hop that
                # timed out while the stages after it went on), and with the backward chain so may every hop from
                # the broken one on: the trainer sends those backwards itself, after a claim at each
                for hop in (broken if fused_end else broken[-1:]):
                    lost_at.setdefault(hop.stage, []).append(hop.addr)
            if lost_at:
                chain_to = last - 1
            acts.append(reply.outputs)
            stage = len(acts) - 1
        mbs = (mb, pair_mb if paired else None)
        if fused_served is not None:  # the chain ended in the last stage's fused call
            top, fused, fused_pair = _NOT_SEEN, fused_served, None
        else:
            held_top = acts[last]
            assert held_top is not None  # without a fused end, the last forward's outputs come back to the trainer
            top = held_top
            if gates is not None:
                await gates.wait(last)
            fused, fused_pair = await self._backward(last, top, None, y, (None, None), mbs, (prefer, None),
                                                     (None, None), lost_at=lost_at.get(last, ()))
        backward = await checks.backward(last, top, None, y, fused, fused_pair)
        if on_last_stage is not None:
            on_last_stage()
        if backward.loss is None:
            raise TrainerError(f"stage {last} answered a backward with targets without its loss")
        loss, loss_step = backward.loss, backward.step
        grad = backward.grad_inputs
        duplicates = int(backward.duplicate)
        pair_reply = fused_pair.reply if fused_pair is not None else None
        for stage in range(last - 1, -1, -1):
            if stage in chained:  # run by its forward's peer in the backward chain: nothing to send
                served, pair_served = Served(chained[stage], served_by[stage], 1, at[stage]), None
            else:
                try:
                    served, pair_served = await self._backward(stage, acts[stage], grad, None,
                                                               (steps[stage], pair_steps[stage]), mbs,
                                                               (served_by[stage], pair_by[stage]),
                                                               (kept[stage], pair_kept[stage]),
                                                               recover=self._recovery(acts, steps, stage),
                                                               lost_at=lost_at.get(stage, ()))
                except StageBehind:
                    # nobody is at the step this stage's forward named: a peer that stepped alone, or one that
                    # named a step it never reached (its own poll then says so: convicted, as a pair's would be)
                    request = tuple(t for t in (acts[stage],) if t is not None)
                    for peer_id, step in ((served_by[stage], steps[stage]), (pair_by[stage], pair_steps[stage])):
                        if peer_id is not None and step is not None:
                            await checks.held_to_step(stage, peer_id, step, acts[stage + 1], request)
                    raise
            held = acts[stage]
            backward = await checks.backward(stage, held if held is not None else _NOT_SEEN, grad, None, served,
                                             pair_served)
            pair_reply = pair_served.reply if pair_served is not None else None
            grad = backward.grad_inputs
            duplicates += int(backward.duplicate)
        return loss, loss_step, duplicates, [backward.step] + ([pair_reply.step] if pair_reply is not None else [])

    def _recovery(self, acts: list[torch.Tensor | None], steps: list[int],
                  stage: int) -> Callable[[], Awaitable[torch.Tensor]] | None:
        """For a backward whose inputs went peer to peer (``acts[stage]`` None) and are needed after all
        (the peer that kept them is gone, or lost them): they are computed again by forwards from the
        nearest stage whose inputs the trainer holds, each of which must answer at the step its stage
        first did (the same parameters, so the same inputs); one that stepped since is a :class:`StepMoved`,
        as the backward itself would have been. Recomputed inputs are kept for the stages before."""
        if acts[stage] is not None:
            return None

        async def recover() -> torch.Tensor:
            start = max(k for k in range(stage + 1) if acts[k] is not None)
            for k in range(start, stage):
                inputs = acts[k]
                assert inputs is not None
                served = await self.calls.forward(k, inputs)  # no id: nothing kept, nothing counted
                if served.reply.step != steps[k]:
                    raise StepMoved(k)
                acts[k + 1] = served.reply.outputs
            recovered = acts[stage]
            assert recovered is not None
            return recovered

        return recover

    async def _forward(
        self, stage: int, inputs: torch.Tensor, targets: torch.Tensor | None, mb: int | None, pair_mb: int | None,
        paired: bool = True, chain_to: int | None = None, fused_targets: torch.Tensor | None = None,
        prefer: str | None = None, *, back: bool = False, min_step: int | None = None,
    ) -> tuple[Served[ForwardReply], Served[ForwardReply] | None]:
        """A forward, and its pair's when ``paired`` (sent at once under ``pair_mb``, to another peer where
        there is one; a validation forward's pair, like any validation forward, carries no id). Unpaired,
        ``chain_to``: its outputs may go on peer to peer up to that stage (``StageCalls.forward``), ending
        in the last stage's fused call with ``fused_targets`` (and ``back``: the backward chain after it), each
        hop run once its peer took ``min_step``."""
        calls = self.calls
        if not paired:
            return await calls.forward(stage, inputs, targets, mb=mb, chain_to=chain_to, fused_targets=fused_targets,
                                       prefer=prefer, back=back, min_step=min_step), None

        def call(how: How | None) -> Awaitable[Served[ForwardReply]]:  # (min_step: the same fields as any call's)
            return calls.forward(stage, inputs, targets, mb=mb if how is not None and how.tally is None else pair_mb,
                                 how=how, min_step=min_step)

        return await self.checks.paired(stage, call, _nbytes(inputs, targets))

    async def _backward(
        self, stage: int, inputs: torch.Tensor | None, grad: torch.Tensor | None, targets: torch.Tensor | None,
        steps: tuple[int | None, int | None], mbs: tuple[int, int | None], by: tuple[str | None, str | None],
        kept: tuple[str | None, str | None], recover: Callable[[], Awaitable[torch.Tensor]] | None = None,
        lost_at: Sequence[str] = (),
    ) -> tuple[Served[BackwardReply], Served[BackwardReply] | None]:
        """A backward, and its pair's when ``mbs[1]`` (sent at once, each to the peer that ran its forward;
        the last stage's fused one, with no forward before it, to another peer where there is one).
        ``kept``: where each half's forward peer kept its inputs, so a backward going there leaves them out
        (issue 30: no resend of kept inputs)."""
        calls = self.calls
        if mbs[1] is None:
            return await calls.backward(stage, inputs, grad_outputs=grad, targets=targets, step=steps[0], mb=mbs[0],
                                        prefer=by[0], kept_at=kept[0], recover=recover, lost_at=lost_at), None
        assert inputs is not None  # a paired microbatch went through the trainer: it holds every stage's inputs
        if stage == self.last:
            def call(how: How | None) -> Awaitable[Served[BackwardReply]]:
                primary = how is not None and how.tally is None
                return calls.backward(stage, inputs, grad_outputs=grad, targets=targets,
                                      mb=mbs[0] if primary else mbs[1], how=how)

            return await self.checks.paired(stage, call, _nbytes(inputs, grad, targets))
        how = self.checks.pair_tally(_nbytes(inputs, grad, targets))
        first, second = await asyncio.gather(
            calls.backward(stage, inputs, grad_outputs=grad, step=steps[0], mb=mbs[0], prefer=by[0], kept_at=kept[0]),
            calls.backward(stage, inputs, grad_outputs=grad, step=steps[1], mb=mbs[1], prefer=by[1], how=how,
                           kept_at=kept[1]),
            return_exceptions=True)  # both end before either's error goes on: no call left running
        for result in (first, second):
            if isinstance(result, BaseException):
                raise result
        assert not isinstance(first, BaseException) and not isinstance(second, BaseException)
        return first, second

    async def validate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """The mean loss of ``batches`` (forwards only: nothing accumulates); None without any. Spot
        checked as microbatches are, and one batch a pass at least (``SpotChecks.validation_pairs``): a
        paired batch's forwards are each sent twice at once."""
        total, count = 0.0, 0
        forced = self.checks.validation_pair(len(batches))
        for index, (x, y) in enumerate(batches):
            while True:
                try:
                    loss = await self._validation_forward(x, y, self.checks.pairs(force=index == forced))
                except Unsettled:
                    continue
                break
            total += loss * x.shape[0]
            count += x.shape[0]
        return total / count if count else None

    async def _validation_forward(self, x: torch.Tensor, y: torch.Tensor, paired: bool) -> float:
        checks, acts = self.checks, x
        for stage in range(self.last + 1):
            targets = y if stage == self.last else None
            served, pair = await self._forward(stage, acts, targets, None, None, paired)
            reply = await checks.forward(stage, acts, targets, served, pair, validation=True)
            acts = reply.outputs
        if reply.loss is None:
            raise TrainerError(f"stage {self.last} answered a forward with targets without its loss")
        return reply.loss


#: What a spot check's evidence holds for a backward's inputs that the trainer never saw (peer to peer).
_NOT_SEEN = torch.empty(0)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
