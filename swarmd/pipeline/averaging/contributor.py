"""The contributor's side of a stage's averaging round (``swarmd.pipeline.averaging.averager`` has the protocol).

A contributor takes its gradients out of the stage, signs and sends them to the round's leader,
checks the leader's answer against what it sent (``round_checks.check_answer``) and applies it,
or keeps its gradients for the next round; a leader that keeps aborting while this peer's view
holds the batch is accused of stalling (``round_checks.StallWatch``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import torch

from swarmd.errors import PeerError
from swarmd.net.messages import AverageRequest
from swarmd.net.wire import WireTensor
from swarmd.pipeline.averaging.trust.round_checks import (
    Used,
    check_answer,
    per_sample_norm,
)
from swarmd.pipeline.stage.executor import Contribution

if TYPE_CHECKING:
    pass

from swarmd.pipeline.averaging import round as shared
from swarmd.pipeline.averaging.round import RoundResult, _encoded_once, _wire_codec
from swarmd.pipeline.averaging.trust.accusations import contribution_message
from swarmd.pipeline.averaging.trust.openings import RoundOpenings

# one logger for the whole protocol, whichever module of it speaks
log = logging.getLogger("swarmd.pipeline.averaging.averager")


class RoundContributor(RoundOpenings):
    """Contributing to a stage-mate's round: send, check the answer, apply or keep."""


    async def _contribute_to(self, leader: str, addr: str) -> None:
        started = time.monotonic()
        own = await self.executor.take_contribution()
        try:
            mine, decoded, result = await self._post(addr, own, leader)
        except PeerError as exc:
            log.warning("averaging with leader %s failed (%s); keeping the gradients", leader[:12], exc)
            self._suspects[leader] = time.monotonic() + 5.0
            await self.executor.restore_contribution(own)
            return
        except BaseException:
            await asyncio.shield(self.executor.restore_contribution(own))
            raise
        why = None
        if result.status == "ok" and result.mean_grads is not None:
            why = await asyncio.to_thread(self._check_answer, result, mine, decoded, leader)
        if why is not None:
            await self.executor.restore_contribution(own)  # kept, samples and all, for the next round
            self.rounds_refused += 1
            self.leaders_refused[leader] += 1
            period = self.suspicions.accuse(leader, why)
            if self.prover is not None:
                self.prover.table.forget(leader)
            self._warn(leader, "leader", "stage %d step %d: refused the answer of leader %s (%s); keeping the "
                       "gradients, and not averaging with it for %.0fs", self.executor.stage, own.step, leader[:12],
                       why, period)
            self._record(RoundResult("aborted", own.step, result.samples, result.contributors, None), leader,
                         missing=[], status="refused", reason=why, started=started)
            return
        mean = result.mean_grads if result.status == "ok" else None
        applied = mean is not None
        if mean is not None:
            await self.executor.apply_average(mean, own.step)
            await self.executor.keep_residual(own.grads, decoded)  # error feedback (lossy grad codecs)
            self.rounds_ok += 1
            self.stalls.answered(leader)
        else:
            await self.executor.restore_contribution(own)
            self.rounds_aborted += 1
            self._aborted_by(leader, own.step)
        self._record(result, leader, missing=[], reason=result.reason, started=started)
        if applied:
            # open the contribution, now that the answer fixed the projection (openings); after the
            # round is counted and recorded, so the step and its record are not held apart by the projection
            self._opened(leader, await asyncio.to_thread(self._open_contribution, leader, own, decoded, result,
                                                         self._sent_codec))

    def _aborted_by(self, leader: str, step: int) -> None:
        """``leader`` aborted this peer's round at ``step`` (or turned it away) while this peer's view
        held the batch: past twice the averaging timeout of that, it is accused of stalling the stage
        (``round_checks.StallWatch``)."""
        if leader == self.peer_id:
            return
        stalled = self.stalls.aborted(leader, step, 2 * self.timeout_s)
        if stalled is None:
            return
        self.leaders_stalling[leader] += 1
        period = self.suspicions.accuse(leader, f"stalling: every round aborted at step {step} for {stalled:.0f}s")
        self._warn(leader, "stalling", "stage %d step %d: leader %s aborted or turned away every round for %.0fs "
                   "while this peer's view held the batch; not averaging with it for %.0fs", self.executor.stage,
                   step, leader[:12], stalled, period)

    def _check_answer(self, result: RoundResult, mine: Used, decoded: torch.Tensor | None, leader: str) -> str | None:
        """Why this contributor refuses the leader's ``ok`` answer (off the loop: a thread)."""
        assert result.mean_grads is not None  # only called on "ok"
        if result.samples < self.target:
            return f"the round's {result.samples} samples are below the target {self.target}"
        if result.used is None:
            return "the answer does not say which contributions it used"
        return check_answer(own=mine, own_grads=decoded, mean=result.mean_grads, used=result.used,
                            total=result.samples, leader=leader, codec=self.executor.training.grad_codec)

    async def _post(self, addr: str, own: Contribution, leader: str) -> tuple[Used, torch.Tensor | None, RoundResult]:
        """Send our contribution to ``leader`` at ``addr``; our entry as it should list it, our
        gradients as it decodes them, and the round's outcome (PeerError when the leader refused, did
        not answer in time, or answered something unreadable). Tests wrap it to send something else."""
        ex = self.executor
        codec = "none" if own.grads is None else _wire_codec(own.grads, ex.training.grad_codec, self.client.links, addr)
        if own.grads is not None:
            self.codecs_sent[codec] += 1
        self._sent_codec = codec
        def encoded() -> tuple[torch.Tensor | None, str, WireTensor | None, float]:
            decoded, digest, wire = _encoded_once(own.grads, codec)
            return decoded, digest, wire, per_sample_norm(decoded, own.samples)

        decoded, digest, wire, norm = await asyncio.to_thread(encoded)  # (torch and codec work: off the loop)
        mine = Used(self.peer_id, own.samples, digest, norm)
        key = sig = None
        if self.identity is not None:
            key = self.identity.public_key_bytes
            sig = self.identity.sign(contribution_message(ex.stage, own.step, own.samples, digest, self.peer_id,
                                                          leader, mine.norm))
        self.own_norms.note(own.step, leader, mine.norm, own.samples)  # to check a leader's accusations with
        # its microbatches' inputs, for the leader to recompute one (swarmd.pipeline.averaging.trust.recomputation)
        ship = self._recomputes() and own.grads is not None
        inputs = tuple((i.mb, i.inputs, i.targets) for i in own.inputs) if ship else ()
        self.opening_costs["input_bytes"] += sum(i.nbytes for i in own.inputs) if inputs else 0
        if inputs:  # what its opening will sign they ran at (openings)
            self._shipped_at.pop(own.step, None)
            self._shipped_at[own.step] = (ex.digest, ex.precision)
            while len(self._shipped_at) > 4:
                self._shipped_at.pop(next(iter(self._shipped_at)))
        request = AverageRequest(stage=ex.stage, peer_id=self.peer_id, step=own.step, samples=own.samples,
                                 grads=own.grads, codec=codec, public_key=key, signature=sig, digest=digest,
                                 mbs=own.mbs, norm=mine.norm, opening=self._opening_for(leader), inputs=inputs,
                                 inputs_params=ex.digest if inputs else None,
                                 inputs_precision=ex.precision if inputs else None, wire=wire)
        answer = await self.client.average(addr, request, grad_numel=ex.grad_numel,
                                           timeout_s=self.timeout_s + shared.REPLY_SLACK_S)
        try:
            used = tuple(Used.from_wire(list(u)) for u in answer.used) if answer.used is not None else None
        except ValueError as exc:
            raise PeerError(200, "BadReply", f"{addr} sent an average answer this peer cannot read: {exc}") from exc
        return mine, decoded, RoundResult(status=answer.status, step=own.step, samples=answer.samples,
                                          contributors=answer.contributors, mean_grads=answer.grads, used=used,
                                          reason=answer.reason)

